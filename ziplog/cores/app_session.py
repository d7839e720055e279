"""The log operations of an app's session: one definition for every app on the log.

The protocol cores speak the effect vocabulary of :mod:`ziplog.cores.effects` (a
``Ready`` batch per event). An app's session (a LogDB transaction, a LogBook call,
BokiStore's and BokiQueue's steps) is a sequence of requests each waiting for the one
before, so it is written as a generator instead, with one protocol:

* each step yields an **operation** and is sent its result (``generator.send``), or
  has its error thrown in (``generator.throw``: a ``ZiplogError`` such as
  ``TrimmedError``), and returns its own result (``StopIteration.value``);
* the log's operations are the two below, the same for every app; an app adds its own
  for its own services (LogDB's ``Ask``/``AskKv`` of a coordinator or KV shard,
  LogBook's ``Lookup`` in the index), defined in its core;
* a driver performs each operation its own way (blocking, asyncio, or a runtime's
  callbacks), so the protocol exists once: :func:`drive` is a blocking driver's loop,
  :func:`drive_async` an asyncio one's.

No I/O here, like every core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generator

#: a record id as the apps carry it: (gsn, shard)
Rid = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Insert:
    """InsertAfter: ``data`` into the log at a gsn above ``after``'s (only its gsn
    counts); the new record's (gsn, shard) is sent back."""
    data: bytes
    after: Rid


@dataclass(frozen=True, slots=True)
class ReadRecord:
    """The data of record ``rid`` is sent back."""
    rid: Rid


def drive(steps: Generator[Any, Any, Any], perform: Callable[[Any], Any]) -> Any:
    """Run ``steps`` to their end, sending each operation's result from ``perform``
    (an exception ``perform`` raises ends them too)."""
    value: Any = None
    while True:
        try:
            op = steps.send(value)
        except StopIteration as stop:
            return stop.value
        value = perform(op)


async def drive_async(steps: Generator[Any, Any, Any], perform: Callable[[Any], Awaitable[Any]]) -> Any:
    """:func:`drive` with an awaitable ``perform``."""
    value: Any = None
    while True:
        try:
            op = steps.send(value)
        except StopIteration as stop:
            return stop.value
        value = await perform(op)


def relay(steps: Generator[Any, Any, Any], wrap: Callable[[Any], Any]) -> Generator[Any, Any, Any]:
    """Run ``steps`` inside another session's steps (``yield from relay(...)``), each of
    their operations yielded as ``wrap(op)`` (an app that sends some of its operations
    elsewhere, as BokiFlow sends a lock's to the locks' book)."""
    value: Any = None
    while True:
        try:
            op = steps.send(value)
        except StopIteration as stop:
            return stop.value
        value = yield wrap(op)
