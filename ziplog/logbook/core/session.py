"""A LogBook session as a sans-I/O protocol: each call is a generator that yields the
operations it needs (the log's ``Insert`` and ``ReadRecord``, :mod:`ziplog.cores.app_session`,
and :class:`Lookup` in the index) and is sent their results, as LogDB's transactions
are. Every engine drives the same steps.

Boki's guarantees come from one number, the session's **position** P (Boki's metalog
position of a function), carried from call to call and handed to children:

* an **append** is InsertAfter(P): its seqnum is above everything the session has seen
  (read-your-writes: a later read asks for a cut at or above it), and P moves to it;
* a **read** is computed by the index on one cut C >= P (the lookup waits until the
  index reached P, it never answers below it: monotonic reads), and P moves to C; since
  C is at or below the stable-prefix watermark, no record at or below C can appear
  later, so every answer served at C stays true.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator

from ziplog.cores.app_session import Insert, ReadRecord, drive
from ziplog.logbook.core import records as r
from ziplog.logbook.core.index import HitRecord
from ziplog.protocol.errors import TrimmedError, ZiplogError

#: the largest seqnum (check_tail reads back from it)
MAX_SEQNUM = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Lookup:
    """Ask the index, at a cut at or above ``min_cut``, for the first (``"next"``: seqnum
    at or above ``seqnum``) or last (``"prev"``: at or below) entry of ``book`` with
    ``tag`` (None: any); ``(cut, Hit | None)`` is sent back, or with ``gapless``
    ``(cut, Hit | None, trimmed_top)``: the highest seqnum of an entry of the (book,
    tag) a trim in force at the cut took (0: none). The hit may be a ``HitRecord``: it
    came with its record, which then is not read from the log."""
    how: str
    book: int
    tag: int | None
    seqnum: int
    min_cut: int
    gapless: bool = False


Op = Insert | Lookup | ReadRecord
Steps = Generator[Op, Any, Any]

__all__ = ["Insert", "Lookup", "ReadRecord", "Op", "Steps", "drive", "MAX_SEQNUM", "LogRecord", "Position"]


@dataclass(frozen=True, slots=True)
class LogRecord:
    """A record of a book (Boki's ``LogRecord``): ``tags`` as the index keeps them
    (string tags hashed; ``names`` maps those back to their strings)."""
    seqnum: int
    data: bytes
    tags: tuple[int, ...]
    names: dict[int, str]
    aux_data: bytes | None = None


class Position:
    """The session's position: what it has seen of the log (see the module's docstring)."""

    __slots__ = ("gsn",)

    def __init__(self, gsn: int = 0) -> None:
        self.gsn = gsn

    def reached(self, gsn: int) -> None:
        if gsn > self.gsn:
            self.gsn = gsn


def append(pos: Position, book: int, data: bytes, tags: "list[int | str] | tuple[int | str, ...]" = ()) -> Steps:
    """Append ``data`` to ``book`` with ``tags``; returns its seqnum."""
    record = r.encode(r.entry(book, data, tags))
    gsn, _ = yield Insert(record, (pos.gsn, -1))  # InsertAfter reads only the gsn
    assert gsn > pos.gsn, ("InsertAfter placed an append at or below the session's position", gsn, pos.gsn)
    pos.reached(gsn)
    return gsn


def trim(pos: Position, book: int, seqnum: int) -> Steps:
    """Trim ``book`` below ``seqnum``: a trim record, after the session's position."""
    if not 0 <= seqnum <= MAX_SEQNUM:
        raise ValueError("a seqnum is in 0..2**64-1")
    gsn, _ = yield Insert(r.encode(r.Trim(book=book, seqnum=seqnum)), (pos.gsn, -1))
    pos.reached(gsn)
    return None


def read(pos: Position, how: str, book: int, tag: int | str | None, seqnum: int, gapless: bool = False) -> Steps:
    """``read_next`` (``how="next"``) or ``read_prev`` (``"prev"``): the record, or None.

    ``gapless`` (a ``read_next`` that replays a tag's history, as BokiStore and
    BokiQueue do): ``TrimmedError`` if a trim took a record of the tag at or above
    ``seqnum``, rather than the first record past it: a replay that skipped what the
    trim took would build a wrong state without a word. (A trim that took only records
    below ``seqnum``, or none of the tag's, is no gap.)"""
    if not 0 <= seqnum <= MAX_SEQNUM:
        raise ValueError("a seqnum is in 0..2**64-1")
    key = None if tag is None else r.tag_of(tag)
    gapless = gapless and how == "next"
    if gapless:
        cut, hit, trimmed_top = yield Lookup(how, book, key, seqnum, pos.gsn, True)
    else:
        cut, hit = yield Lookup(how, book, key, seqnum, pos.gsn)
    assert cut >= pos.gsn, ("the index answered below the session's position", cut, pos.gsn)
    pos.reached(cut)
    if gapless and 0 < trimmed_top and trimmed_top >= seqnum:  # 0: the trim took none of the tag
        raise TrimmedError(f"a trim of book {book} took its record at seqnum {trimmed_top}, which a replay from "
                           f"{seqnum} needs: what was built from the records before it cannot be rebuilt")
    if hit is None:
        return None
    if type(hit) is HitRecord:
        data = hit.record
    else:
        data = yield ReadRecord(hit)
    rec = r.decode(data)
    if type(rec) is not r.Entry or rec.book != book:
        # what came over the network contradicts the index: fail the call, loudly (an
        # assert would vanish under python -O)
        raise ZiplogError(f"the index named gsn {hit.gsn} for book {book}, and the log holds no entry of it there")
    return LogRecord(hit.gsn, rec.data, rec.tags, rec.names)
