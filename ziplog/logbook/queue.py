"""BokiQueue (Boki journal 5.3) on a LogBook: a FIFO queue named by a string, pushed to
and popped from by any number of producers and consumers on any engines; every element
is popped at most once, and exactly once by a consumer that keeps popping (the protocol:
:mod:`ziplog.logbook.core.queue`).

    q = BokiQueue(LogBook(zk_hosts, book_id=1), "jobs")
    q.push(b"job 1")
    data = q.pop()            # None: the queue was empty at the pop's point in the log

A queue object keeps its replay's cursor and the queue's live elements, so a pop replays
only the queue's records since its previous one. Nothing is trimmed: the book keeps the
queue's whole history. A trim of the book that took a record a replay needs makes the
pop raise ``TrimmedError`` (its reads are gapless) rather than hand out a wrong element.
"""

from __future__ import annotations

import random
from typing import Any

from ziplog.logbook import book_io
from ziplog.logbook.client import LogBook
from ziplog.logbook.core import queue as q
from ziplog.logbook.core.session import drive

__all__ = ["BokiQueue"]


class BokiQueue:
    """Queue ``name`` in ``lb``'s book. Not thread-safe (nor is the LogBook): one object
    per thread, each on its own LogBook (a child shares its parent's engine)."""

    def __init__(self, lb: LogBook, name: str, rng: random.Random | None = None) -> None:
        self.lb = lb
        self.name = q.check_name(name)
        self.tag = q.queue_tag(name)
        rng = rng if rng is not None else random.Random()
        #: the consumer's replay; its id marks its pop records (random: no coordination)
        self._consumer = q.Consumer(name, rng.getrandbits(q.CONSUMER_BITS))

    @property
    def consumer(self) -> int:
        """The id this object's pop records carry."""
        return self._consumer.consumer

    def push(self, data: bytes) -> int:
        """Push ``data``; the seqnum of its push record (its place in the queue)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"an element is bytes, not {type(data).__name__}")
        return self.lb.append(q.encode(q.Push(queue=self.name, data=bytes(data))), tags=[self.tag])

    def pop(self) -> bytes | None:
        """The oldest element no other pop took, or None if the queue was empty at the
        pop's point in the log. If it raises, the element its record may have taken is
        returned by this object's next pop."""
        data: bytes | None = drive(self._consumer.pop(), self._perform)
        return data

    def _perform(self, op: q.Op) -> Any:
        """One operation of the replay, through the LogBook (its reads are gapless: a
        push or pop a trim took would otherwise be skipped without a word)."""
        return book_io.perform(self.lb, op)
