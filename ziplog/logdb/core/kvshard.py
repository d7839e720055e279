"""A KV shard's core (sans-I/O): LogPlayer's target contract on a subscription of its own.

The shard replays the whole log through its own :class:`Validator` (the decisions are a
pure function of the log prefix, so it reaches the coordinator's without hearing from
it) and applies the committed writes of the keys it owns, in gsn order, exactly once:

* each :class:`ApplyBatch` is stored in **one atomic write** with the position it
  reaches (``applied``: every record up to it is applied), so data and position never
  part, whatever the crash;
* decisions at or below ``applied`` are never applied again: after a restart the shard
  replays from its validator snapshot (at or below ``applied``) only to rebuild the
  validation state;
* an idle shard still stores its position as the log moves (``IDLE_STORE_NS``), so a
  restart does not rescan what it already passed;
* a snapshot of the validator goes into the same atomic write every ``SNAPSHOT_NS``;
  once durable, its position is where this shard could replay from, the most it lets
  the log be trimmed (:attr:`ApplyBatch.snapshot`).

Which keys a shard owns: :func:`owner` (CRC-32 of the key modulo the shard count: the
same in every process and language, unlike Python's ``hash``).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ziplog.cores.effects import Ready
from ziplog.logdb.core.validator import Decision, Validator

#: an idle shard stores its position this often (so a restart does not rescan)
IDLE_STORE_NS = 1_000_000_000
#: a validator snapshot goes with the next atomic write this often
SNAPSHOT_NS = 5_000_000_000


def owner(key: bytes, shards: int) -> int:
    """The KV shard (of ``shards``) that owns ``key``."""
    return zlib.crc32(key) % shards


@dataclass(frozen=True, slots=True)
class Applied:
    """One committed transaction's writes to this shard's keys."""
    gsn: int
    txn: int
    #: (key, write rid, value: None for a delete)
    writes: tuple[tuple[bytes, tuple[int, int], bytes | None], ...]


@dataclass(slots=True)
class ApplyBatch:
    """What one atomic write stores: the writes of the committed transactions in gsn
    order, the position they bring ``applied`` to, and maybe a validator snapshot taken
    at that same position."""
    position: int
    applied: list[Applied] = field(default_factory=list)
    snapshot: bytes | None = None


@dataclass(frozen=True, slots=True)
class Stored:
    """What a shard's store holds when it opens."""
    applied: int
    #: the validator snapshot, at or below ``applied`` (None: replay from the genesis)
    snapshot: bytes | None


_snap_encoder = msgspec.msgpack.Encoder()


def encode_snapshot(v: Validator) -> bytes:
    return _snap_encoder.encode(v.snapshot())


def decode_snapshot(data: bytes) -> Validator:
    snap: dict[str, Any] = msgspec.msgpack.decode(data)
    return Validator.restore(snap)


class KvShardCore:
    def __init__(self, index: int, shards: int, stored: Stored, now: int = 0, snapshot_ns: int = SNAPSHOT_NS,
                 idle_store_ns: int = IDLE_STORE_NS) -> None:
        assert 0 <= index < shards, (index, shards)
        self.snapshot_ns = snapshot_ns
        self.idle_store_ns = idle_store_ns
        self.index = index
        self.shards = shards
        self.validator = decode_snapshot(stored.snapshot) if stored.snapshot is not None else Validator()
        #: every committed write up to here is in the store (with the data, atomically)
        self.applied = stored.applied
        assert self.validator.position <= self.applied, ("a snapshot beyond the applied position",
                                                         self.validator.position, self.applied)
        #: the position of the durable snapshot (where a restart replays from)
        self.snapshot_position = self.validator.position
        self._pending: list[Applied] = []
        self._stored_at = now
        self._snapshot_at = now

    @property
    def replay_from(self) -> int:
        """The first gsn this shard must read."""
        return self.validator.position + 1

    @property
    def position(self) -> int:
        return self.validator.position

    def owns(self, key: bytes) -> bool:
        return owner(key, self.shards) == self.index

    # -- the log ----------------------------------------------------------------------------------
    def on_record(self, gsn: int, shard: int, data: bytes) -> Decision | None:
        d = self.validator.on_record(gsn, shard, data)
        if d is None or not d.committed or d.duplicate:
            return d
        if gsn <= self.applied:
            return d  # applied before the restart: replaying it only rebuilt the validation state
        mine = tuple(w for w in d.writes if self.owns(w[0]))
        if mine:
            assert not self._pending or self._pending[-1].gsn < gsn
            self._pending.append(Applied(gsn, d.txn, mine))
        return d

    def on_position(self, gsn: int) -> None:
        self.validator.advance(gsn)

    # -- the store --------------------------------------------------------------------------------
    def due(self, now: int) -> Ready:
        """The next atomic write, if one is due, as the one persist effect of a ``Ready``:
        committed writes to store, or (idle) a position that moved a while ago, and a
        snapshot when its interval passed. Answer with :meth:`on_stored`."""
        position = self.validator.position
        if position <= self.applied and not self._pending:
            return Ready()
        snapshot_due = now - self._snapshot_at >= self.snapshot_ns and position > self.snapshot_position
        if not self._pending and not snapshot_due and now - self._stored_at < self.idle_store_ns:
            return Ready()
        batch = ApplyBatch(position, self._pending, encode_snapshot(self.validator) if snapshot_due else None)
        self._pending = []
        return Ready(persist=[batch])

    def on_stored(self, batch: ApplyBatch, now: int) -> None:
        """The store holds ``batch`` (durably, when it carried a snapshot)."""
        assert batch.position >= self.applied
        self.applied = batch.position
        self._stored_at = now
        if batch.snapshot is not None:
            self.snapshot_position = batch.position
            self._snapshot_at = now
