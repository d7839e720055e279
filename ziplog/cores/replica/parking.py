"""Requests a replica cannot answer yet: an InsertAfter whose rid lies in an epoch that
has not begun here, a read of a gsn not decided yet. They wait, bounded in number and in
time, in arrival order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

from ziplog.protocol.frames import Insert, Read

Waiting = Union[Insert, Read]

#: the per-route counts are recounted (asserted) only while so few wait: it is cheap then
RECOUNT_BELOW = 64


@dataclass(slots=True)
class Parked:
    route: bytes
    msg: Waiting
    deadline_ns: int
    need_epoch: int = 0  # an insert waits until this epoch is current ...
    need_frontier: int = 0  # ... a read until the frontier reaches this
    arrived_ns: int = 0  # when it was parked (how long it waited, once released)


class Parking:
    def __init__(self, limit: int, per_connection: int) -> None:
        self.limit = limit
        self.per_connection = per_connection
        self.waiting: list[Parked] = []
        #: requests waiting per route (only routes with some: bounded by ``limit``)
        self.by_route: dict[bytes, int] = {}
        #: told of each request released because what it waited for came (not of those
        #: that expired or were refused): a driver times them with its own clock
        self.on_release: Callable[[Parked], None] | None = None

    def __len__(self) -> int:
        return len(self.waiting)

    def park(self, p: Parked) -> bool:
        """False when the limit, or the connection's share of it, is reached: the caller
        refuses the request instead."""
        held = self.by_route.get(p.route, 0)
        if len(self.waiting) >= self.limit or held >= self.per_connection:
            return False
        self.waiting.append(p)
        self.by_route[p.route] = held + 1
        return True

    def _take(self, pred: Callable[[Parked], bool]) -> list[Parked]:
        taken = [p for p in self.waiting if pred(p)]
        if taken:
            self.waiting = [p for p in self.waiting if not pred(p)]
            by_route = self.by_route
            for p in taken:
                n = by_route[p.route] - 1
                if n:
                    by_route[p.route] = n
                else:
                    del by_route[p.route]
            assert len(self.waiting) > RECOUNT_BELOW or sum(by_route.values()) == len(self.waiting)
        return taken

    def inserts_for(self, epoch: int) -> list[Parked]:
        """Inserts whose epoch has begun (``epoch`` is current), in arrival order."""
        if not self.waiting:
            return []
        return self._released(self._take(lambda p: type(p.msg) is Insert and p.need_epoch <= epoch))

    def reads_upto(self, frontier: int) -> list[Parked]:
        """Reads of gsns now decided (at or below ``frontier``), in arrival order."""
        if not self.waiting:
            return []
        return self._released(self._take(lambda p: type(p.msg) is Read and p.need_frontier <= frontier))

    def _released(self, taken: list[Parked]) -> list[Parked]:
        if taken and self.on_release is not None:
            for p in taken:
                self.on_release(p)
        return taken

    def all_inserts(self) -> list[Parked]:
        return self._take(lambda p: type(p.msg) is Insert)

    def expired(self, now: int) -> list[Parked]:
        if not self.waiting:
            return []
        return self._take(lambda p: p.deadline_ns <= now)

    def next_deadline(self) -> int | None:
        return min((p.deadline_ns for p in self.waiting), default=None)
