"""BokiFlow's lock: a replicated state machine on a book (Boki journal 5.1), sans I/O.

A lock is the chain of its :class:`~ziplog.logbook.core.flow_records.LockOp` records.
Each record names ``prev``, the seqnum of the chain's tail its writer saw; replaying the
lock's records in seqnum order, a record **joins** the chain iff

* its ``prev`` is the chain's tail at that point (nothing joined since its writer
  looked), and
* it is an acquire while nobody holds the lock, or a release by the holder.

The state after the replay (the tail and the holder) is a function of the records alone,
and no record can appear below a cut once served, so every replayer at every cut agrees
on it. **At most one holder**: a holder changes only by a record that joins, an acquire
joins only while nobody holds, and two acquires that saw the same tail cannot both join
(the first one moves the tail). ``try_acquire`` appends an acquire only when its replay
found the lock free, then replays up to its own record: it holds the lock iff that
record joined.

A replay starts from the chain's first record and keeps its state between calls
(:class:`LockChain`), so each call reads only the records since the last one. The lock's
records live in a book the workflows' collection never trims (``flow_sweep``).
"""

from __future__ import annotations

from typing import Any, Generator

from ziplog.logbook.core import flow_records as fr
from ziplog.logbook.core.book_ops import Append, ReadNext

Steps = Generator[Any, Any, Any]


class LockChain:
    """A lock's state as of ``cursor``: every record of its tag at or below the cursor
    applied, none above."""

    __slots__ = ("lock", "tag", "tail", "holder", "cursor")

    def __init__(self, lock: str) -> None:
        self.lock = fr.check_name("lock name", lock)
        self.tag = fr.lock_tag(lock)
        #: the seqnum of the chain's last record (0: no record joined)
        self.tail = 0
        self.holder: str | None = None
        self.cursor = 0

    def apply(self, seqnum: int, data: bytes) -> bool:
        """Apply the lock's next record (in seqnum order); True if it joined the chain.
        A record that is not this lock's (a colliding tag, garbage) only moves the cursor."""
        assert seqnum > self.cursor, ("lock records are applied in increasing seqnum order", seqnum, self.cursor)
        self.cursor = seqnum
        rec = fr.decode(data)
        if type(rec) is not fr.LockOp or rec.lock != self.lock or rec.prev != self.tail:
            return False
        if rec.acquire == (self.holder is None) and (rec.acquire or rec.holder == self.holder):
            self.tail = seqnum
            self.holder = rec.holder if rec.acquire else None
            return True
        return False

    def replay(self, upto: int | None = None) -> Steps:
        """Apply the lock's records past the cursor: all there are at the read's cut, or
        (``upto``) those at or below ``upto``, which the session has seen (its own
        record), so the reads find every one of them."""
        while upto is None or self.cursor < upto:
            got = yield ReadNext(self.tag, self.cursor + 1)
            if got is None:
                assert upto is None, ("a lock record the session appended is not found", self.lock, upto)
                return
            seqnum, data = got
            if upto is not None and seqnum > upto:
                raise AssertionError(("a lock record the session appended is not found", self.lock, upto))
            self.apply(seqnum, data)

    def try_acquire(self, holder: str) -> Steps:
        """Take the lock for ``holder`` if nobody holds it; True if ``holder`` holds it
        afterwards (also when it held it already: a re-run of the step that took it)."""
        yield from self.replay()
        return (yield from self.acquire(holder))

    def acquire(self, holder: str) -> Steps:
        """:meth:`try_acquire` from the state the last replay left, reading nothing
        before the append (a caller that must look elsewhere at a cut at or above the
        replay's before it appends: BokiFlow's lock step). As safe from an older state:
        the acquire names the tail that state saw, so it joins only if nothing joined
        since."""
        if self.holder is not None:
            return self.holder == holder
        seqnum = yield Append(fr.encode(fr.LockOp(lock=self.lock, prev=self.tail, holder=holder, acquire=True)),
                              self.tag)
        yield from self.replay(seqnum)
        return self.holder == holder

    def release(self, holder: str) -> Steps:
        """Give the lock back if ``holder`` holds it; True if this call gave it back
        (False: ``holder`` did not hold it, as after a re-run of a release)."""
        yield from self.replay()
        if self.holder != holder:
            return False
        seqnum = yield Append(fr.encode(fr.LockOp(lock=self.lock, prev=self.tail, holder=holder, acquire=False)),
                              self.tag)
        yield from self.replay(seqnum)
        # only the holder's release can join at the tail it saw, and nothing else joins
        # while it holds: its own record did
        assert self.holder != holder, ("a holder's release did not join its lock's chain", self.lock, holder)
        return True
