"""A LogDB transaction as a sans-I/O protocol: each step is a generator that yields the
operations it needs (:class:`Ask` a coordinator, :class:`AskKv` a KV shard, and the
log's ``ReadRecord`` and ``Insert``, :mod:`ziplog.cores.app_session`) and is sent their
results (or has their error thrown in). The blocking and the asyncio client drive the same generators,
so the protocol exists once.

The paper's protocol (dissertation 4.3):

* a **read** asks the coordinator for the key's latest committed rid and reads the
  value from the log (or from the key's KV shard once the log is trimmed below it);
  reads are cached (repeatable) and a transaction reads its own writes;
* a **write** is buffered; at commit each becomes a write record in the log, and the
  **commit record** goes *InsertAfter the largest rid read or written* with the read
  set (key -> rid read) and write set (key -> rid written); the coordinator decides it
  at its gsn;
* a **read-only** transaction appends nothing: one read is its own serialization point
  (the coordinator's position when it answered); several are validated together at the
  coordinator's current position (all still latest: it serializes there).

The session (:class:`Session`) carries the highest position this client knows of, and
every request asks for at least that: a client reads its own commits, and its reads
never go back in time (also across coordinator replicas).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Generator

from ziplog.cores.app_session import Insert, ReadRecord, Rid
from ziplog.logdb.core import frames as f
from ziplog.logdb.core.kvshard import owner
from ziplog.logdb.core.records import (
    MAX_KEY_BYTES,
    NO_RID,
    Commit,
    TransactionAborted,
    Write,
    decode,
    encode,
)
from ziplog.protocol.errors import ForbiddenError, TrimmedError, ZiplogError

@dataclass(frozen=True, slots=True)
class Ask:
    """Send ``request`` to a coordinator replica; the answer is sent back."""
    request: f.Request


@dataclass(frozen=True, slots=True)
class AskKv:
    """Send ``request`` to KV shard ``shard``; the answer is sent back."""
    shard: int
    request: f.Request


Op = Ask | AskKv | ReadRecord | Insert
Steps = Generator[Op, Any, Any]


class LogDBError(ZiplogError):
    """A coordinator or KV shard answered with an error."""


class OutcomeUnknownError(LogDBError):
    """Whether the transaction committed cannot be known: its decision is older than any
    coordinator remembers (``FORGOTTEN``). It may have committed: running it again may
    apply it twice. Not a TransactionAborted."""


@dataclass(slots=True)
class Session:
    """What one client carries between transactions."""
    kv_shards: int
    #: draws transaction ids (the client seeds it from the OS; a simulation from its seed)
    rng: random.Random
    #: every commit this client saw decided, and every position it read at, is at or
    #: below this gsn
    position: int = 0
    _req: int = 0

    def next_req(self) -> int:
        self._req += 1
        return self._req


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray)):
        raise TypeError("a key is bytes")
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"a key is at most {MAX_KEY_BYTES} bytes")
    return bytes(key)


def _failed(answer: f.Answer) -> None:
    if type(answer) is f.Failed:
        if answer.code == f.FORBIDDEN:
            raise ForbiddenError(f"{answer.code}: {answer.message}")
        if answer.code == f.FORGOTTEN:
            raise OutcomeUnknownError(f"{answer.code}: {answer.message}")
        raise LogDBError(f"{answer.code}: {answer.message}")


def latest_value(session: Session, key: bytes) -> Steps:
    """(rid, value, position) of ``key``'s latest committed write, as of a position at or
    above the session's."""
    ans = yield Ask(f.Latest(req=session.next_req(), key=key, min_gsn=session.position))
    _failed(ans)
    assert type(ans) is f.LatestIs
    session.position = max(session.position, ans.position)
    rid = (ans.gsn, ans.shard)
    if rid == NO_RID:
        return rid, None, ans.position
    try:
        data = yield ReadRecord(rid)
    except TrimmedError:
        kv = yield AskKv(owner(key, session.kv_shards), f.KvGet(req=session.next_req(), key=key))
        _failed(kv)
        assert type(kv) is f.KvValue
        if (kv.gsn, kv.shard) != rid:
            # the shard applied a later write (our answer is stale) or not this one yet
            return (kv.gsn, kv.shard), kv.value, None
        return rid, kv.value, ans.position
    rec = decode(data)
    if type(rec) is not Write or rec.key != key:
        raise LogDBError(f"record {rid} is not the write of key {key!r} the coordinator named")
    return rid, rec.value, ans.position


def get(session: Session, key: bytes) -> Steps:
    """A single-key read of the latest committed value (None: none or deleted)."""
    key = _check_key(key)
    while True:
        _, value, position = yield from latest_value(session, key)
        if position is not None:
            return value
        # the value came from a KV shard ahead of our answer: ask again (the session moves on)


class Transaction:
    """The state of one transaction: the reads, the buffered writes, the outcome."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.txn = session.rng.getrandbits(64)
        #: key -> the rid read ((0, 0): no value) and the value read
        self.reads: dict[bytes, tuple[Rid, bytes | None]] = {}
        #: key -> value to write (None: delete)
        self.writes: dict[bytes, bytes | None] = {}
        #: the serialization point: the commit record's gsn, or a read-only
        #: transaction's position (set when it committed)
        self.serialized_at: int | None = None
        self.commit_rid: Rid | None = None
        self.done = False
        self._read_at: int | None = None
        #: once a commit began: key -> the rid of its write record, as each insert returns
        self._written: dict[bytes, Rid] | None = None
        #: the commit record and the rid it goes after, once built: a commit called again
        #: sends exactly this one
        self._commit_record: tuple[bytes, Rid] | None = None

    def _check_open(self) -> None:
        if self.done:
            raise ZiplogError("the transaction is over")

    @property
    def committing(self) -> bool:
        """A commit began and did not end (a failed one may be called again)."""
        return self._written is not None and not self.done

    def _check_writable(self) -> None:
        self._check_open()
        if self._written is not None:
            raise ZiplogError("the transaction is committing: its writes are fixed")

    def put(self, key: bytes, value: bytes) -> None:
        self._check_writable()
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError("a value is bytes")
        self.writes[_check_key(key)] = bytes(value)

    def delete(self, key: bytes) -> None:
        self._check_writable()
        self.writes[_check_key(key)] = None

    def get_steps(self, key: bytes) -> Steps:
        self._check_open()
        key = _check_key(key)
        if key in self.writes:
            return self.writes[key]
        if key in self.reads:
            return self.reads[key][1]
        if self._written is not None:
            raise ZiplogError("the transaction is committing: its reads are fixed")
        rid, value, position = yield from latest_value(self.session, key)
        if position is None:
            self._abort(f"key {key!r} changed while it was read")
        self.reads[key] = (rid, value)
        if self._read_at is None:
            self._read_at = position
        return value

    def commit_steps(self) -> Steps:
        """Commit. Called again after it failed (a ``ZiplogError`` such as a timeout: the
        outcome unknown), it goes on where it stopped and never commits twice: write
        records not yet placed are inserted, then the **same** commit record is sent again
        unless one was placed (a resend of an already decided transaction decides nothing:
        it names write records the first decision used up), then the outcome is asked."""
        self._check_open()
        if not self.writes:
            yield from self._commit_read_only()
            return
        rids = self._written
        if rids is None:
            rids = self._written = {}
        for key, value in self.writes.items():
            if key not in rids:
                # after a failed try its record may be in the log too: unused, it expires
                rid = yield Insert(encode(Write(txn=self.txn, key=key, value=value)), NO_RID)
                rids[key] = (rid[0], rid[1])
        if self.commit_rid is None:
            if self._commit_record is None:
                reads = {k: r for k, (r, _) in self.reads.items()}
                after = max([*rids.values(), *reads.values()], key=lambda r: r[0])
                self._commit_record = (encode(Commit(txn=self.txn, reads=reads, writes=rids)), after)
            record, after = self._commit_record
            commit = yield Insert(record, after)
            assert commit[0] > after[0], ("InsertAfter placed the commit record before a rid it names", commit,
                                          after)
            self.commit_rid = (commit[0], commit[1])
        commit = self.commit_rid
        try:
            ans = yield Ask(f.Outcome(req=self.session.next_req(), txn=self.txn, commit_gsn=commit[0]))
            _failed(ans)
        except OutcomeUnknownError:
            self.done = True  # no coordinator will know more later
            raise
        assert type(ans) is f.OutcomeIs
        self.session.position = max(self.session.position, commit[0])
        self.done = True
        if not ans.committed:
            raise TransactionAborted(ans.reason)
        self.serialized_at = ans.gsn

    def _commit_read_only(self) -> Steps:
        if len(self.reads) <= 1:
            self.done = True
            self.serialized_at = self._read_at if self._read_at is not None else self.session.position
            return
        reads = {k: r for k, (r, _) in self.reads.items()}
        ans = yield Ask(f.Validate(req=self.session.next_req(), reads=reads, min_gsn=self.session.position))
        _failed(ans)
        assert type(ans) is f.Valid
        self.session.position = max(self.session.position, ans.position)
        if not ans.ok:
            self._abort(ans.reason)
        self.done = True
        self.serialized_at = ans.position

    def _abort(self, reason: str) -> None:
        self.done = True
        raise TransactionAborted(reason)
