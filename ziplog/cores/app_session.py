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
  :func:`drive_async` an asyncio one's, :class:`CallbackRun` a runtime's callbacks'.

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


class CallbackRun:
    """One drive of a session's steps on a runtime's callbacks: ``perform(run, op)``
    starts each operation, whose answer comes back through :meth:`resume`, later or
    before ``perform`` returned (then it waits in ``early``: the steps are never entered
    again from inside their own ``send``). ``done`` once they returned or raised, and
    ``on_done(run)`` then."""

    __slots__ = ("steps", "perform", "on_done", "done", "value", "error", "inside", "early")

    def __init__(self, steps: Generator[Any, Any, Any], perform: Callable[[Any, Any], None],
                 on_done: Callable[[Any], None] | None = None) -> None:
        # perform(run, op) and on_done(run) take this run, typed as the subclass it is
        self.steps = steps
        self.perform = perform
        self.on_done = on_done
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None
        #: performing an operation now (its result, if it comes at once, waits in ``early``)
        self.inside = False
        self.early: tuple[Any, BaseException | None] | None = None

    def start(self) -> None:
        self._step(None, None)

    def resume(self, value: Any, error: BaseException | None) -> None:
        """An operation's answer: its value, or the error to throw into the steps."""
        if self.done:
            return
        if self.inside:
            self.early = (value, error)
        else:
            self._step(value, error)

    def result(self) -> Any:
        assert self.done, "the steps are not done"
        if self.error is not None:
            raise self.error
        return self.value

    def _step(self, value: Any, error: BaseException | None) -> None:
        while True:
            try:
                op = self.steps.send(value) if error is None else self.steps.throw(error)
            except StopIteration as stop:
                self._finish(stop.value, None)
                return
            except Exception as exc:  # the steps ended with an error: the run's end
                self._finish(None, exc)
                return
            self.inside = True
            try:
                self.perform(self, op)
            finally:
                self.inside = False
            if self.early is None:
                return  # answered later, through resume
            (value, error), self.early = self.early, None

    def _finish(self, value: Any, error: BaseException | None) -> None:
        self.done, self.value, self.error = True, value, error
        if self.on_done is not None:
            self.on_done(self)


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
