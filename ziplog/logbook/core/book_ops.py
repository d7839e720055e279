"""The operations a library on LogBook (BokiQueue, BokiFlow) asks of its book, as the
steps of its sans-I/O protocol yield them (:mod:`ziplog.cores.app_session`): each is
performed through a LogBook session, so at a cut at or above the session's position,
which every append and read moves up (:func:`ziplog.logbook.book_io.perform`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReadTail:
    """The seqnum of the last record tagged ``tag`` at a cut at or above the session's
    position (None: none) is sent back."""
    tag: str


@dataclass(frozen=True, slots=True)
class ReadNext:
    """The first record tagged ``tag`` with seqnum at or above ``seqnum``, at a cut at or
    above the session's position: ``(seqnum, data)`` or None is sent back. A replay
    (``gapless``) is refused with ``TrimmedError`` where a trim took a record it needs."""
    tag: str
    seqnum: int
    gapless: bool = True


@dataclass(frozen=True, slots=True)
class Append:
    """Append ``data`` tagged ``tag`` (and ``also``) after the session's position; its
    seqnum is sent back."""
    data: bytes
    tag: str
    also: tuple[str, ...] = ()


BookOp = ReadTail | ReadNext | Append
