"""How a library's book operations (:mod:`ziplog.logbook.core.book_ops`) are performed
through a LogBook session: BokiQueue's and BokiFlow's steps drive through this."""

from __future__ import annotations

import contextlib
from typing import Any, Generator, Iterator

from ziplog.cores.app_session import drive
from ziplog.logbook.client import LogBook
from ziplog.logbook.core.book_ops import Append, BookOp, ReadNext, ReadTail


def perform(lb: LogBook, op: BookOp) -> Any:
    """One operation, at cuts at or above ``lb``'s position (which it moves up)."""
    if type(op) is ReadNext:
        rec = lb.read_next(op.seqnum, tag=op.tag, gapless=op.gapless)
        return None if rec is None else (rec.seqnum, rec.data)
    if type(op) is ReadTail:
        rec = lb.check_tail(op.tag)
        return None if rec is None else rec.seqnum
    assert type(op) is Append, op
    return lb.append(op.data, tags=[op.tag, *op.also])


def drive_on(lb: LogBook, steps: Generator[Any, Any, Any]) -> Any:
    """Run a library's steps to their end, each operation performed through ``lb``."""
    return drive(steps, lambda op: perform(lb, op))


@contextlib.contextmanager
def level(session: LogBook, other: LogBook) -> Iterator[LogBook]:
    """Work on ``session`` (one book) at or above ``other``'s position (another book),
    and leave ``other`` at or above ``session``'s after: two books, one position."""
    session.observe(other.position)
    yield session
    other.observe(session.position)
