"""A workflow's environment: BokiFlow's operations (:mod:`ziplog.logbook.core.flow`)
performed on a LogBook and a database.

    def reserve(env: Env, req: dict) -> bool:
        with env.transaction() as t:
            rooms = t.read("hotels", req["hotel"], 0)
            if rooms == 0:
                return False
            t.write("hotels", req["hotel"], rooms - 1)
            t.write("bookings", req["trip"], req["hotel"])
        return t.committed

A function is deterministic given what its environment returns: anything else it
needs (a random number, the time) it asks of ``env.remember``. Each call numbers one
step; run again, or twice at once, the function takes the first run's outcome of every
step, so each database write and each call happens once.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any, Callable, Iterator

from ziplog.cores.app_session import drive
from ziplog.logbook import book_io
from ziplog.logbook.client import LogBook
from ziplog.logbook.core import flow as fc
from ziplog.logbook.core.book_ops import BookOp
from ziplog.logbook.core.flow_lock import LockChain
from ziplog.logbook.core.flow_records import LOCKS_BOOK_OFFSET, holder_of
from ziplog.logbook.flow.db import Database
from ziplog.protocol.errors import ZiplogError

__all__ = ["FlowBook", "Env", "Transaction", "TransactionAborted", "run_workflow"]

#: called with (op, phase) around every operation a run performs ("before", "after"):
#: the tests' crash points
Hook = Callable[[Any, str], None]
#: a registered function: called with its environment and its input
Function = Callable[["Env", Any], Any]
#: how long env.lock waits for a lock held elsewhere before it gives up, by default
LOCK_WAIT_S = 10.0
#: how long one run waits for a lock held elsewhere before it gives its worker back
#: (``fc.Suspended``): a worker pool is bounded, and the holder may need a worker to end
#: (a holder killed mid-run holds the lock until its run again)
RUN_LOCK_WAIT_S = 1.0


def pauses(timeout: float | None, first: float = 0.001, most: float = 0.02) -> Iterator[None]:
    """A poller's tries: yields, then sleeps ``first`` seconds, doubling up to ``most``,
    until ``timeout`` seconds have passed (None: for ever); one try at least."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = first
    while True:
        yield None  # one try at least
        if deadline is not None and time.monotonic() >= deadline:
            return
        time.sleep(pause)
        pause = min(pause * 2, most)


class TransactionAborted(Exception):
    """A transaction's lock was held by another (raised inside ``with env.transaction()``
    and swallowed at its end: the transaction is aborted, ``committed`` is False)."""


class FlowBook:
    """What a workflow runs on: its book (step records), the locks' book, a database, and
    the function registry for calls (set by the runtime)."""

    def __init__(self, lb: LogBook, db: Database, *, locks_book: int | None = None) -> None:
        self.lb = lb
        self.locks = lb.on_book(lb.book_id + LOCKS_BOOK_OFFSET if locks_book is None else locks_book)
        self.db = db
        self.call: Callable[[str, str, bytes], bytes] | None = None
        #: the lock chains replayed so far (each keeps its cursor); a bounded cache
        self._chains: dict[str, LockChain] = {}
        self.hook: Hook | None = None

    def chain(self, name: str) -> LockChain:
        chain = self._chains.pop(name, None)
        if chain is None:
            chain = LockChain(name)
            if len(self._chains) >= 4096:
                del self._chains[next(iter(self._chains))]
        self._chains[name] = chain
        return chain

    def drive(self, steps: fc.Steps) -> Any:
        return drive(steps, self.perform)

    def perform(self, op: Any) -> Any:
        hook = self.hook
        if hook is not None:
            hook(op, "before")
        result = self._perform(op)
        if hook is not None:
            hook(op, "after")
        return result

    def _perform(self, op: Any) -> Any:
        t = type(op)
        if t is fc.OnLocks:
            with book_io.level(self.locks, self.lb) as locks:  # one position across the two books
                return book_io.perform(locks, op.op)
        if t is fc.DbWrite:
            return self.db.write(op.table, op.key, op.value, op.version)
        if t is fc.DbRead:
            return self.db.read(op.table, op.key)
        if t is fc.Call:
            if self.call is None:
                raise RuntimeError("this flow book runs no calls: give it a runtime's functions")
            return self.call(op.function, op.workflow, op.input)
        book_op: BookOp = op
        return book_io.perform(self.lb, book_op)


class Env:
    """The environment of one run of workflow ``workflow``."""

    def __init__(self, flow: FlowBook, workflow: str) -> None:
        self.flow = flow
        self.workflow = workflow
        self.step = 0
        #: lock name -> the holder (the step that took it) this run holds it as
        self.held: dict[str, str] = {}

    def _next(self) -> int:
        self.step += 1
        return self.step

    def write(self, table: str, key: str, value: Any) -> None:
        """Write ``value`` (anything msgpack holds) at ``table``/``key``, once."""
        self.flow.drive(fc.write(self.workflow, self._next(), table, key, fc.pack(value)))

    def read(self, table: str, key: str, default: Any = None) -> Any:
        """The value at ``table``/``key`` (``default`` if none), as the first run read it."""
        data = self.flow.drive(fc.read(self.workflow, self._next(), table, key))
        return default if data is None else fc.unpack(data)

    def remember(self, make: Callable[[], Any]) -> Any:
        """``make()``'s value in the first run (a random choice, a time, an id)."""
        return fc.unpack(self.flow.drive(fc.remember(self.workflow, self._next(), lambda: fc.pack(make()))))

    def invoke(self, function: str, input: Any = None) -> Any:
        """Call ``function(input)`` as a workflow of its own; its return value (its
        exception, ``WorkflowFailed``, is raised here; ``WorkflowIdTaken`` if the call's
        id was called as another function: never that one's return value)."""
        outcome = self.flow.drive(fc.invoke(self.workflow, self._next(), function, fc.pack(input)))
        return fc.unpack_outcome(outcome)

    def try_lock(self, name: str) -> bool:
        """Take lock ``name`` if nobody holds it (one step, no waiting)."""
        step = self._next()
        taken = bool(self.flow.drive(fc.lock(self.workflow, step, self.flow.chain(name))))
        if taken:
            self.held[name] = holder_of(self.workflow, step)
        return taken

    def lock(self, name: str, timeout: float = LOCK_WAIT_S, run_wait: float = RUN_LOCK_WAIT_S) -> bool:
        """Take lock ``name``, trying again while another holds it, for up to ``timeout``
        seconds; False if it could not. Each try is a step, and so is each decision to try
        again (remembered): a re-run takes the first run's path whatever its own clock
        says (one on an engine behind may run out of time sooner, where the first run's
        next try took the lock that no later step would give back then).

        The deadline is a remembered step too (wall-clock time), so it holds across runs:
        after ``run_wait`` seconds of trying, a run that decided to try again gives its
        worker back (``fc.Suspended``, after the decision's record) and a later run goes
        on from there, to the same deadline, replaying the earlier runs' tries without
        their pauses. A waiter never holds a worker of a bounded pool for long, so the
        holder's run finds one."""
        deadline = self.remember(lambda: time.time() + timeout)
        run_until = time.monotonic() + run_wait
        pause = 0.002
        live = [False]

        def decide() -> bool:
            live[0] = True  # made here, not read back from an earlier run's record
            return time.time() < deadline

        while not self.try_lock(name):
            live[0] = False
            if not self.remember(decide):
                return False
            if live[0]:  # an earlier run's tries are replayed without their pauses
                if time.monotonic() >= run_until:
                    raise fc.Suspended(f"workflow {self.workflow!r} waits for lock {name!r}: it runs again later")
                time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return True

    def unlock(self, name: str) -> None:
        holder = self.held.pop(name, None)
        if holder is None:
            raise ValueError(f"this workflow does not hold lock {name!r}")
        self.flow.drive(fc.unlock(self.workflow, self._next(), self.flow.chain(name), holder))

    def transaction(self) -> "Transaction":
        return Transaction(self)


def lock_name(table: str, key: str) -> str:
    return f"{table}/{key}"


class Transaction:
    """Beldi's transaction: ``with env.transaction() as t:``; ``t.committed`` after."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.writes: dict[tuple[str, str], bytes] = {}
        self.values: dict[tuple[str, str], Any] = {}
        self.locked: list[str] = []
        self.committed = False

    def _lock(self, table: str, key: str) -> None:
        name = lock_name(table, key)
        if name not in self.locked:
            if not self.env.try_lock(name):
                raise TransactionAborted(f"{name} is locked by another transaction")
            self.locked.append(name)

    def read(self, table: str, key: str, default: Any = None) -> Any:
        """The value at ``table``/``key`` in this transaction (its own write first)."""
        self._lock(table, key)
        k = (table, key)
        if k in self.writes:
            return fc.unpack(self.writes[k])
        if k not in self.values:
            self.values[k] = self.env.read(table, key)
        value = self.values[k]
        return default if value is None else value

    def write(self, table: str, key: str, value: Any) -> None:
        self._lock(table, key)
        self.writes[(table, key)] = fc.pack(value)

    def __enter__(self) -> "Transaction":
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        if kind is not None and (not issubclass(kind, Exception) or _is_infrastructure(exc)):
            # the run is dying (or cannot reach the log): it records nothing more, and a
            # run after it takes the transaction on from its last recorded step, locks held
            return False
        commit = kind is None
        writes = [[t, k, v] for (t, k), v in self.writes.items()] if commit else []
        env = self.env
        _, self.committed, _ = env.flow.drive(fc.decide(env.workflow, env._next(), commit, writes))
        for name in reversed(self.locked):
            env.unlock(name)
        return kind is TransactionAborted  # an abort ends the block; any other exception goes on


def run_workflow(flow: FlowBook, workflow: str, lookup: Callable[[str], Function | None]) -> bytes:
    """Run ``workflow`` (its intent says which function, found by ``lookup``, and which
    input) to its end unless it has one: its outcome (``fc.pack_outcome`` bytes, the
    first one recorded)."""
    done = flow.drive(fc.read_done(workflow))
    if done is not None:
        return bytes(done)
    found = flow.drive(fc.read_intent(workflow))
    if found is None:
        raise LookupError(f"workflow {workflow!r} was never called")
    intent = found[1]
    function = lookup(intent.function)
    if function is None:
        outcome = fc.pack_outcome(False, f"no function {intent.function!r} is registered")
    else:
        try:
            outcome = fc.pack_outcome(True, function(Env(flow, workflow), fc.unpack(intent.input)))
        except fc.WorkflowFailed as exc:
            outcome = fc.pack_outcome(False, str(exc))
        except fc.NondeterministicWorkflow:
            raise  # recorded as nothing: the function must be mended
        except fc.Suspended:
            raise  # recorded as nothing: it runs again from its records
        except Exception as exc:  # the function's own failure is its outcome, recorded once
            if _is_infrastructure(exc):
                raise
            outcome = fc.pack_outcome(False, f"{type(exc).__name__}: {exc}")
    return bytes(flow.drive(fc.finish(workflow, outcome)))


def _is_infrastructure(exc: Exception) -> bool:
    """A failure of the log or the database (the run stops and is run again later),
    rather than of the function (its outcome)."""
    return isinstance(exc, (ZiplogError, sqlite3.OperationalError, OSError, AssertionError))


def iter_steps(lb: LogBook, workflow: str, limit: int = 10_000) -> Iterator[tuple[int, int, str, Any]]:
    """The workflow's recorded steps so far, read through ``lb`` (its book):
    (step, seqnum, operation, outcome), in step order."""
    for step in range(1, limit + 1):
        found = book_io.drive_on(lb, fc.first_step(workflow, step, None))
        if found is None:
            return
        yield step, found[0], found[1].op, fc.unpack(found[1].value)


def describe(lb: LogBook, workflow: str) -> tuple[Any, Any]:
    """The workflow's intent ``(function, input)`` (None: never called) and its outcome
    (``(ok, value)``; None while it has none)."""
    intent = book_io.drive_on(lb, fc.read_intent(workflow))
    done = book_io.drive_on(lb, fc.read_done(workflow))
    return (None if intent is None else (intent[1].function, fc.unpack(intent[1].input)),
            None if done is None else tuple(fc.unpack(done)))
