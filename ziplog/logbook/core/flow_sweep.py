"""BokiFlow's sweep, sans I/O: which workflows to push again, and how far the workflows'
book may be trimmed (the runtime's ``Sweeper`` reads the log and acts on the answers).

It is fed every intent (tag INTENTS) in seqnum order and keeps those not yet seen
ended: ``pending`` (at most ``limit``; past it the oldest is forgotten, and so is the
right to trim past it: ``floor``). A workflow's records all lie at or above its
intent's seqnum (each was appended after a read of the intent, InsertAfter the
session's position), so a trim point at or below the oldest intent not yet collectable
never takes a record a run still needs: the trim point is the lowest of the pending
intents, the ended ones kept (seen ended less than ``collect_after_ns`` ago), the
forgotten ``floor``, and the next intent not yet read. Times are a monotonic clock's
nanoseconds, handed in.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from ziplog.logbook.core import flow_records as fr


class SweepState:
    def __init__(self, retry_after_ns: int, collect_after_ns: int | None, limit: int = 100_000) -> None:
        self.retry_after_ns = retry_after_ns
        self.collect_after_ns = collect_after_ns
        self.limit = limit
        #: the seqnum of the last intent read
        self.cursor = 0
        #: workflow -> (its intent's seqnum, when it was last pushed or first seen)
        self.pending: OrderedDict[str, tuple[int, int]] = OrderedDict()
        #: ended workflows whose records are kept still: (intent seqnum, when seen ended)
        self.ended: deque[tuple[int, int]] = deque()
        self.floor: int | None = None
        self.trimmed_to = 0

    def on_intent(self, seqnum: int, data: bytes, now: int) -> None:
        """The next record of tag INTENTS (anything else under the tag only moves the cursor)."""
        assert seqnum > self.cursor, ("intents are read in increasing seqnum order", seqnum, self.cursor)
        self.cursor = seqnum
        intent = fr.decode(data)
        if type(intent) is fr.Intent and intent.workflow not in self.pending:
            self.pending[intent.workflow] = (seqnum, now)
            while len(self.pending) > self.limit:
                _, (forgotten, _) = self.pending.popitem(last=False)
                self.floor = forgotten if self.floor is None else min(self.floor, forgotten)

    def due(self, now: int) -> list[str]:
        """The pending workflows last pushed (or first seen) ``retry_after_ns`` ago or more:
        each is to be looked at (``ended`` or ``pushed``)."""
        return [w for w, (_, since) in self.pending.items() if now - since >= self.retry_after_ns]

    def ended_at(self, workflow: str, now: int) -> None:
        seqnum, _ = self.pending.pop(workflow)
        self.ended.append((seqnum, now))

    def pushed(self, workflow: str, now: int) -> None:
        self.pending[workflow] = (self.pending[workflow][0], now)

    def trim_point(self, now: int) -> int | None:
        """A point to trim the workflows' book below now, above the last one; None: none."""
        if self.collect_after_ns is None:
            return None
        ended = self.ended
        while ended and now - ended[0][1] >= self.collect_after_ns:
            ended.popleft()
        candidates = [self.cursor + 1, *(seqnum for seqnum, _ in ended), *(s for s, _ in self.pending.values())]
        if self.floor is not None:
            candidates.append(self.floor)
        point = min(candidates)
        return point if point > self.trimmed_to else None

    def trimmed(self, point: int) -> None:
        assert point > self.trimmed_to, ("a trim point went back", point, self.trimmed_to)
        self.trimmed_to = point
