"""The commit decision as a pure function of the log prefix (dissertation 4.3).

Fed the log's records in gsn order (a subscription delivers exactly that), a
:class:`Validator` decides each LogDB commit record at its gsn, the transaction's
serialization point. The coordinator runs one to answer clients; each KV shard runs
its own and applies the committed writes of its keys: the same prefix gives every one
of them the same decisions, so no decision needs to travel.

A commit of transaction T at gsn g commits when, at g:

* every write it names is a write record of T, of that key, before g, and not older
  than ``WRITE_TTL_EPOCHS`` (a commit naming rids that were never written, or written by
  another transaction, aborts);
* every key it read still has the committed write it read (``NO_RID``: still none):
  no read-write conflict;
* no key it writes has a committed write after the one it names: no write-write
  conflict.

Otherwise it aborts, and its writes stay invisible for good. A second commit record of
a transaction already decided (an application's resend) decides nothing new: it is a
duplicate of the first decision. Anything that is not a LogDB record is skipped.

A resent commit record never applies its writes twice, however late it comes: it names
the same write records as the first, and the first decision used them up (a commit
consumes its writes, an abort drops them), so a second can only fail to commit. What a
late resend can no longer be told is *how* the first one was decided once that decision
is forgotten: a commit of a transaction no decision is remembered for, whose writes are
all older than the remembered decisions, is decided **unknown** (nothing applied; an
earlier commit record of the transaction may have decided it, committed or not, and
nobody here can tell). The rule is exact for a resend: every record naming those writes
comes after the newest of them, so when that one is at or above the forgetting horizon,
so is every earlier copy, and a transaction not remembered has none (the commit is
decided as usual).

Every map is bounded: write records and decided transactions are forgotten once
``WRITE_TTL_EPOCHS`` old (in epochs of the log, so every replayer forgets the same
ones at the same point, and decides the same duplicates and unknowns); ``latest`` holds
one rid per key ever committed. (The coordinator remembers outcomes longer, to answer
clients: ``CoordinatorCore``.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ziplog.logdb.core.records import NO_RID, Commit, Write, decode
from ziplog.protocol.gsna import epoch_of

#: A commit may name a write at most this many epochs older than itself (60 s at the
#: default 10 ms epochs); decided transactions are remembered as long.
WRITE_TTL_EPOCHS = 6_000

Rid = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Decision:
    txn: int
    #: the commit record's rid: its gsn is the transaction's serialization point
    gsn: int
    shard: int
    committed: bool
    #: why it aborted ("" when it committed)
    reason: str = ""
    #: (key, write rid, value: None for a delete) of every write, when it committed
    writes: tuple[tuple[bytes, Rid, bytes | None], ...] = ()
    #: another commit record of a transaction decided before (at ``gsn``): nothing to apply
    duplicate: bool = False
    #: not committed, and whether an earlier, forgotten commit record of the transaction
    #: committed it cannot be known here (its writes are all older than the memory)
    unknown: bool = False


class Validator:
    def __init__(self, ttl_epochs: int = WRITE_TTL_EPOCHS) -> None:
        self.ttl_epochs = ttl_epochs
        #: every gsn up to here has been fed
        self.position = 0
        #: key -> the rid of its latest committed write
        self.latest: dict[bytes, Rid] = {}
        #: write records no commit has used yet, in gsn order: rid -> (txn, key, value)
        self.writes: dict[Rid, tuple[int, bytes, bytes | None]] = {}
        #: decisions by transaction, in gsn order (for duplicates and clients that ask)
        self.decided: dict[int, Decision] = {}
        #: the epoch below which the maps were last pruned
        self._pruned_epoch = -1
        self.skipped = 0  # records that are not LogDB's

    def on_record(self, gsn: int, shard: int, data: bytes) -> Decision | None:
        """The next record of the log (gsns strictly increasing); the decision when it is
        a commit record."""
        assert gsn > self.position, ("records must come in gsn order", gsn, self.position)
        self.position = gsn
        self._prune(gsn)
        rec = decode(data)
        if rec is None:
            self.skipped += 1
            return None
        if type(rec) is Write:
            self.writes[(gsn, shard)] = (rec.txn, rec.key, rec.value)
            return None
        assert type(rec) is Commit
        return self._decide(gsn, shard, rec)

    def advance(self, gsn: int) -> None:
        """Every position up to ``gsn`` has been seen (no record in between): pruning
        follows the log even when LogDB is idle."""
        if gsn > self.position:
            self.position = gsn
            self._prune(gsn)

    def _decide(self, gsn: int, shard: int, c: Commit) -> Decision:
        first = self.decided.get(c.txn)
        if first is not None:
            return Decision(c.txn, first.gsn, first.shard, first.committed, first.reason, (), duplicate=True,
                            unknown=first.unknown)
        # every commit record naming these writes comes after the newest of them: if even
        # that one is older than the remembered decisions, an earlier record may be forgotten
        newest = max(c.writes.values(), default=None)
        forgotten = newest is not None and epoch_of(newest[0]) < self._pruned_epoch
        reason = self._conflict(gsn, c)
        if reason:
            for rid in c.writes.values():
                w = self.writes.get(rid)
                if w is not None and w[0] == c.txn:
                    del self.writes[rid]  # never visible now
            if forgotten:  # a resend of a forgotten decision, or a commit far too late: no telling which
                reason = (f"its writes (the newest {newest}) are older than the decisions remembered (epochs "
                          f"below {self._pruned_epoch} are forgotten): an earlier commit record of this "
                          "transaction may have decided it")
            decision = Decision(c.txn, gsn, shard, False, reason, unknown=forgotten)
        else:
            applied = []
            for key, rid in sorted(c.writes.items()):
                _, _, value = self.writes.pop(rid)
                self.latest[key] = rid
                applied.append((key, rid, value))
            decision = Decision(c.txn, gsn, shard, True, "", tuple(applied))
        self.decided[c.txn] = decision
        return decision

    def _conflict(self, gsn: int, c: Commit) -> str:
        """Why the commit at ``gsn`` aborts, or ""."""
        seen: set[Rid] = set()
        for key, rid in c.writes.items():
            w = self.writes.get(rid)
            if w is None or w[0] != c.txn or w[1] != key or rid[0] >= gsn or rid in seen:
                return f"the write of key {key!r} names {rid}, which is no unused write of this transaction"
            seen.add(rid)
        for key, rid in c.reads.items():
            now = self.latest.get(key, NO_RID)
            if now != rid:
                return f"read-write conflict on key {key!r}: read {rid}, now {now}"
        for key, rid in c.writes.items():
            later = self.latest.get(key)
            if later is not None and later[0] > rid[0]:
                return f"write-write conflict on key {key!r}: wrote {rid}, {later} committed after it"
        return ""

    @property
    def horizon_epoch(self) -> int:
        """Write records and decisions of epochs below this one are forgotten."""
        return self._pruned_epoch

    def _prune(self, gsn: int) -> None:
        horizon = epoch_of(gsn) - self.ttl_epochs
        if horizon <= self._pruned_epoch:
            return
        self._pruned_epoch = horizon
        writes = self.writes
        while writes:
            rid = next(iter(writes))
            if epoch_of(rid[0]) >= horizon:
                break
            del writes[rid]
        decided = self.decided
        while decided:
            txn = next(iter(decided))
            if epoch_of(decided[txn].gsn) >= horizon:
                break
            del decided[txn]

    # -- snapshots --------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Everything a replayer needs to go on from ``position`` (msgpack-able)."""
        return {
            "position": self.position,
            "latest": [[k, list(r)] for k, r in self.latest.items()],
            "writes": [[list(r), t, k, v] for r, (t, k, v) in self.writes.items()],
            "decided": [[d.txn, d.gsn, d.shard, d.committed, d.reason, d.unknown] for d in self.decided.values()],
            "pruned_epoch": self._pruned_epoch,
            "ttl_epochs": self.ttl_epochs,
        }

    @classmethod
    def restore(cls, snap: dict[str, Any]) -> "Validator":
        v = cls(int(snap["ttl_epochs"]))
        v.position = int(snap["position"])
        v.latest = {bytes(k): (int(r[0]), int(r[1])) for k, r in snap["latest"]}
        v.writes = {(int(r[0]), int(r[1])): (int(t), bytes(k), None if val is None else bytes(val))
                    for r, t, k, val in snap["writes"]}
        # an entry without the sixth field (unknown) is from a snapshot written before it existed
        v.decided = {int(e[0]): Decision(int(e[0]), int(e[1]), int(e[2]), bool(e[3]), str(e[4]),
                                         unknown=len(e) > 5 and bool(e[5])) for e in snap["decided"]}
        v._pruned_epoch = int(snap["pruned_epoch"])
        return v
