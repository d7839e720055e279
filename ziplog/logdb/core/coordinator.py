"""The coordinator's core (sans-I/O): a :class:`Validator` replaying the log, and the
clients' requests that wait until the replay is far enough to answer them.

Events: a record of the log (:meth:`on_record`), the subscription's position
(:meth:`on_position`: nothing can appear at or below it any more), a request frame from
a client route (:meth:`on_request`), the clock (:meth:`on_tick`). Each returns the
answers to send as messages (:mod:`ziplog.cores.effects`): ``(route, answer)``, the
answer a LogDB frame the driver encodes. Every coordinator replica runs this same core over
the same log, so any of them gives the same answers (but for how long it remembers
outcomes, below); the elected leader is only the one clients ask first (and the one that
collects garbage).

**Outcomes** (``Outcome``) are answered from :attr:`CoordinatorCore.outcomes`, a memory
of decisions longer than the validator's (which decides duplicates, and so must forget
at the same log position in every replayer): a transaction's outcome is kept while its
latest commit record is in the validator's window (``WRITE_TTL_EPOCHS`` of the log) *or*
at or above the **collection point** (:meth:`on_collected`: LogDB has not collected
it, because some replayer has not snapshotted past it yet), at most ``MAX_OUTCOMES``
beyond the window, and it goes into the snapshot (:meth:`snapshot_bytes`), so a
restarted replica answers as before. A client asks late exactly when no coordinator
answered it: one down or behind holds the collection point back, so the outcomes of
everything since are kept; when every replayer keeps up, the window answers for a
minute. An outcome forgotten by both is answered ``FORGOTTEN`` (the client is told it
cannot know), never ``UNKNOWN_TXN``, which says only that the record at the asked gsn is
no commit of the transaction. Replicas forget at different moments (each learns
the collection point on its own): one that answers ``FORGOTTEN`` sends the client on to
the next.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Any, NamedTuple

import msgspec

from ziplog.cores.effects import Messages
from ziplog.logdb.core import frames as f
from ziplog.logdb.core.records import NO_RID
from ziplog.logdb.core.validator import Decision, Validator
from ziplog.protocol.gsna import epoch_of

#: requests waiting for the replay to reach their position; more are refused (BUSY)
MAX_WAITING = 100_000
#: a request still waiting after this long is answered with a timeout (a request for a
#: position the log will not reach soon, or a replica far behind: the client asks
#: another replica)
WAIT_LIMIT_NS = 20_000_000_000
#: outcomes remembered beyond the validator's window (below the collection point they
#: go anyway); at the bound the oldest go first, and asking for one is answered FORGOTTEN
MAX_OUTCOMES = 200_000
#: a remembered outcome keeps this much of an abort's reason
MAX_REASON_CHARS = 200


class Remembered(NamedTuple):
    """A transaction's outcome as the coordinator remembers it: the earliest decision it
    knows of (``unknown``: it cannot tell), and ``seen``, the gsn of the transaction's
    latest commit record (it is forgotten by that)."""
    gsn: int
    shard: int
    committed: bool
    unknown: bool
    reason: str
    seen: int


def collection_point(positions: dict[str, int], kv_shards: int | None) -> int:
    """Where the log may be trimmed: below the smallest position a replayer (``kv-<i>``,
    ``coordinator-<id>``) published a durable snapshot at, once all ``kv_shards`` KV
    shards published one (0 until then: a shard that never did replays from the start)."""
    if kv_shards is None or any(f"kv-{i}" not in positions for i in range(kv_shards)):
        return 0
    return min(positions.values())


_snap_encoder = msgspec.msgpack.Encoder()


class CoordinatorCore:
    def __init__(self, validator: Validator | None = None, max_waiting: int = MAX_WAITING,
                 max_outcomes: int = MAX_OUTCOMES) -> None:
        self.validator = validator or Validator()
        self.max_waiting = max_waiting
        self.max_outcomes = max_outcomes
        #: (position needed, order, arrival ns, route, request), smallest position first
        self._waiting: list[tuple[int, int, int, Any, f.Request]] = []
        self._order = itertools.count()
        self.now = 0
        #: txn -> its outcome, in the order of ``seen`` (a commit record moves it last;
        #: ordered so the oldest goes in O(1))
        self.outcomes: OrderedDict[int, Remembered] = OrderedDict()
        #: (validator horizon, collection point) of the last look for outcomes to forget
        self._looked: tuple[int, int] | None = None
        #: every transaction whose latest commit record is at or above this gsn is in
        #: ``outcomes``; below it, one not there may have been forgotten
        self.forgotten_below = 0
        #: the collection point last learned (:meth:`on_collected`)
        self.collected = 0
        # a validator that replayed without this core (a snapshot without outcomes): what it
        # remembers is known; whatever else came up to its position cannot be told apart
        # from a forgotten decision
        v = self.validator
        for d in v.decided.values():
            self._remember(d, d.gsn)
        if v.position > 0:
            self.forgotten_below = v.position + 1

    @property
    def position(self) -> int:
        return self.validator.position

    # -- the log ----------------------------------------------------------------------------------
    def on_record(self, gsn: int, shard: int, data: bytes) -> Messages:
        d = self.validator.on_record(gsn, shard, data)
        if d is not None:
            self._remember(d, gsn)
        self._forget()
        return self._release()

    def on_position(self, gsn: int) -> Messages:
        self.validator.advance(gsn)
        self._forget()
        return self._release()

    def on_collected(self, point: int) -> None:
        """LogDB's collection point (``collection_point``): every replayer can replay from
        above it, and the log may be trimmed below it."""
        if point > self.collected:
            self.collected = point
            self._forget()

    # -- outcomes ---------------------------------------------------------------------------------
    def _remember(self, d: Decision, at: int) -> None:
        """The decision of the commit record at ``at``: the earliest one known for its
        transaction stays, and ``at`` makes it the latest seen."""
        o = self.outcomes.pop(d.txn, None)
        if o is None:
            o = Remembered(d.gsn, d.shard, d.committed, d.unknown, d.reason[:MAX_REASON_CHARS], at)
        self.outcomes[d.txn] = o._replace(seen=at)

    def _forget(self) -> None:
        """Forget, oldest first, outcomes out of the validator's window that are below the
        collection point or beyond ``max_outcomes``."""
        outcomes = self.outcomes
        horizon = self.validator.horizon_epoch
        if self._looked == (horizon, self.collected) and len(outcomes) <= self.max_outcomes:
            return  # a record only adds the newest: nothing else can go
        self._looked = (horizon, self.collected)
        while outcomes:
            seen = next(iter(outcomes.values())).seen
            if epoch_of(seen) >= horizon or (seen >= self.collected and len(outcomes) <= self.max_outcomes):
                return
            outcomes.popitem(last=False)
            self.forgotten_below = max(self.forgotten_below, seen + 1)

    # -- snapshots --------------------------------------------------------------------------------
    def snapshot_bytes(self) -> bytes:
        """The validator's snapshot and the outcomes (a restart answers as before)."""
        snap = self.validator.snapshot()
        snap["outcomes"] = [[t, *o] for t, o in self.outcomes.items()]
        snap["forgotten_below"] = self.forgotten_below
        return _snap_encoder.encode(snap)

    @classmethod
    def from_snapshot(cls, data: bytes | None, **kw: Any) -> "CoordinatorCore":
        """A core from :meth:`snapshot_bytes` (or a validator snapshot alone, as older
        coordinators and KV shards write it; None: from the genesis)."""
        if data is None:
            return cls(**kw)
        snap: dict[str, Any] = msgspec.msgpack.decode(data)
        core = cls(Validator.restore(snap), **kw)
        if "outcomes" in snap:
            core.outcomes = OrderedDict((int(t), Remembered(int(g), int(s), bool(c), bool(u), str(why), int(seen)))
                                        for t, g, s, c, u, why, seen in snap["outcomes"])
            core.forgotten_below = int(snap["forgotten_below"])
        return core

    # -- clients ----------------------------------------------------------------------------------
    def on_request(self, route: Any, data: bytes) -> Messages:
        try:
            req = f.decode_request(data)
        except f.BadFrame as exc:
            return [(route, f.Failed(req=0, code=f.BAD_REQUEST, message=f"malformed request: {exc}"))]
        if type(req) is f.KvGet:
            return [(route, f.Failed(req=req.req, code=f.BAD_REQUEST,
                                     message="a coordinator serves no values: ask the key's KV shard"))]
        need = req.commit_gsn if type(req) is f.Outcome else req.min_gsn  # type: ignore[union-attr]
        if need <= self.validator.position:
            return [(route, self._answer(req))]
        if len(self._waiting) >= self.max_waiting:
            return [(route, f.Failed(req=req.req, code=f.BUSY, message="too many requests wait here"))]
        heapq.heappush(self._waiting, (need, next(self._order), self.now, route, req))
        return []

    def on_tick(self, now: int) -> Messages:
        """The clock: requests waiting longer than ``WAIT_LIMIT_NS`` are answered BUSY."""
        self.now = now
        if not self._waiting:
            return []
        old = [w for w in self._waiting if now - w[2] > WAIT_LIMIT_NS]
        if not old:
            return []
        self._waiting = [w for w in self._waiting if now - w[2] <= WAIT_LIMIT_NS]
        heapq.heapify(self._waiting)
        return [(w[3], f.Failed(req=w[4].req, code=f.BUSY, message=f"this coordinator has not reached gsn {w[0]} yet"))
                for w in old]

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _release(self) -> Messages:
        waiting = self._waiting
        if not waiting or waiting[0][0] > self.validator.position:
            return []
        out: Messages = []
        while waiting and waiting[0][0] <= self.validator.position:
            _, _, _, route, req = heapq.heappop(waiting)
            out.append((route, self._answer(req)))
        return out

    def _answer(self, req: f.Request) -> f.Answer:
        v = self.validator
        assert v.position >= (req.commit_gsn if type(req) is f.Outcome else req.min_gsn)  # type: ignore[union-attr]
        if type(req) is f.Latest:
            gsn, shard = v.latest.get(req.key, NO_RID)
            return f.LatestIs(req=req.req, gsn=gsn, shard=shard, position=v.position)
        if type(req) is f.Outcome:
            o = self.outcomes.get(req.txn)
            if o is not None and o.gsn > req.commit_gsn:
                o = None  # decided after the record asked about: that one is not this one
            if o is None and req.commit_gsn < self.forgotten_below:
                return f.Failed(req=req.req, code=f.FORGOTTEN, message=(
                    f"transaction {req.txn}: outcomes below gsn {self.forgotten_below} are forgotten here: "
                    "whether it committed cannot be known"))
            if o is None:
                return f.Failed(req=req.req, code=f.UNKNOWN_TXN,
                                message=f"gsn {req.commit_gsn} holds no commit record of transaction {req.txn}")
            if o.unknown:
                return f.Failed(req=req.req, code=f.FORGOTTEN, message=(
                    f"transaction {req.txn}: its commit record at gsn {o.gsn} came after its decision was "
                    f"forgotten: whether it committed cannot be known ({o.reason})"))
            return f.OutcomeIs(req=req.req, committed=o.committed, reason=o.reason, gsn=o.gsn, shard=o.shard)
        assert type(req) is f.Validate
        for key, rid in req.reads.items():
            now = v.latest.get(key, NO_RID)
            if now != rid:
                return f.Valid(req=req.req, ok=False, position=v.position,
                               reason=f"read-write conflict on key {key!r}: read {rid}, now {now}")
        return f.Valid(req=req.req, ok=True, reason="", position=v.position)
