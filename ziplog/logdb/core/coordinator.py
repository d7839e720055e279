"""The coordinator's core (sans-I/O): a :class:`Validator` replaying the log, and the
clients' requests that wait until the replay is far enough to answer them.

Events: a record of the log (:meth:`on_record`), the subscription's position
(:meth:`on_position`: nothing can appear at or below it any more), a request frame from
a client route (:meth:`on_request`), the clock (:meth:`on_tick`). Each returns the
answers to send as messages (:mod:`ziplog.cores.effects`): ``(route, answer)``, the
answer a LogDB frame the driver encodes. Every coordinator replica runs this same core over
the same log, so any of them gives the same answers; the elected leader is only the one
clients ask first (and the one that collects garbage).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

from ziplog.cores.effects import Messages
from ziplog.logdb.core import frames as f
from ziplog.logdb.core.records import NO_RID
from ziplog.logdb.core.validator import Validator

#: requests waiting for the replay to reach their position; more are refused (BUSY)
MAX_WAITING = 100_000
#: a request still waiting after this long is answered with a timeout (a request for a
#: position the log will not reach soon, or a replica far behind: the client asks
#: another replica)
WAIT_LIMIT_NS = 20_000_000_000



def collection_point(positions: dict[str, int], kv_shards: int | None) -> int:
    """Where the log may be trimmed: below the smallest position a replayer (``kv-<i>``,
    ``coordinator-<id>``) published a durable snapshot at, once all ``kv_shards`` KV
    shards published one (0 until then: a shard that never did replays from the start)."""
    if kv_shards is None or any(f"kv-{i}" not in positions for i in range(kv_shards)):
        return 0
    return min(positions.values())


class CoordinatorCore:
    def __init__(self, validator: Validator | None = None, max_waiting: int = MAX_WAITING) -> None:
        self.validator = validator or Validator()
        self.max_waiting = max_waiting
        #: (position needed, order, arrival ns, route, request), smallest position first
        self._waiting: list[tuple[int, int, int, Any, f.Request]] = []
        self._order = itertools.count()
        self.now = 0

    @property
    def position(self) -> int:
        return self.validator.position

    # -- the log ----------------------------------------------------------------------------------
    def on_record(self, gsn: int, shard: int, data: bytes) -> Messages:
        self.validator.on_record(gsn, shard, data)
        return self._release()

    def on_position(self, gsn: int) -> Messages:
        self.validator.advance(gsn)
        return self._release()

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
            d = v.decided.get(req.txn)
            if d is None:
                return f.Failed(req=req.req, code=f.UNKNOWN_TXN,
                                message=f"no decision for transaction {req.txn} up to gsn {v.position}")
            return f.OutcomeIs(req=req.req, committed=d.committed, reason=d.reason, gsn=d.gsn, shard=d.shard)
        assert type(req) is f.Validate
        for key, rid in req.reads.items():
            now = v.latest.get(key, NO_RID)
            if now != rid:
                return f.Valid(req=req.req, ok=False, position=v.position,
                               reason=f"read-write conflict on key {key!r}: read {rid}, now {now}")
        return f.Valid(req=req.req, ok=True, reason="", position=v.position)
