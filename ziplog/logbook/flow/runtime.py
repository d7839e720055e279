"""BokiFlow's function runtime: functions registered by name, run by worker processes
that take workflows from a BokiQueue, called from clients.

* A **call** (:class:`FlowClient`) records the workflow's intent (first-wins per id: a
  duplicate call of an id is the same workflow; a call of it as another function is
  refused, ``WorkflowIdTaken``), pushes the id to the queue, and waits
  for the workflow's done record; while it has none after ``retry_after`` seconds the id
  is pushed again (a worker may have died with it: BokiQueue hands an element to one
  pop only).
* A **worker** (:class:`Worker`; ``python -m ziplog.logbook.flow.worker``) pops ids and
  runs each workflow to its end (:func:`~ziplog.logbook.flow.env.run_workflow`). A
  workflow run twice, at once or after a crash, takes the first run's outcome of every
  step, so a retry costs time, never a second effect.
* A **pool** (:class:`WorkerPool`) keeps N worker processes running, starting one again
  when it dies, and sweeps: an intent with no done record after ``retry_after`` is
  pushed again, so a workflow whose caller died too still ends.

Nested calls (``env.invoke``) run in the caller's worker, as a workflow of their own,
under an id in the calls' own namespace (``flow_records.callee_of``: it begins with
``"@"``, which a caller's id may not, ``ReservedWorkflowId``).
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

from ziplog.logbook import book_io
from ziplog.logbook.client import LogBook
from ziplog.logbook.core import flow as fc
from ziplog.logbook.core import flow_records as fr
from ziplog.logbook.core.flow_sweep import SweepState
from ziplog.logbook.flow.env import FlowBook, Function, pauses, run_workflow
from ziplog.logbook.queue import BokiQueue
from ziplog.protocol.errors import TrimmedError

__all__ = ["Functions", "FlowClient", "Worker", "WorkerPool", "QUEUE"]

#: the queue workers take workflow ids from, unless told otherwise
QUEUE = "flow"
#: a call pushes its workflow again after this long without a done record
RETRY_AFTER_S = 2.0
#: the longest pause between two looks at an empty queue or a missing done record
MAX_POLL_S = 0.02


class Functions:
    """A registry of functions by name::

        functions = Functions()

        @functions.register
        def reserve(env, input): ...
    """

    def __init__(self) -> None:
        self._by_name: dict[str, Function] = {}

    def register(self, fn: Function | None = None, *, name: str | None = None) -> Any:
        def add(f: Function) -> Function:
            key = fr.check_name("function name", name or f.__name__)
            if key in self._by_name:
                raise ValueError(f"function {key!r} is registered already")
            self._by_name[key] = f
            return f
        return add if fn is None else add(fn)

    def get(self, name: str) -> Function | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return sorted(self._by_name)


def load_functions(spec: str) -> Functions:
    """``module:attribute`` -> the Functions it names (how worker processes find them)."""
    module, _, attr = spec.partition(":")
    found = getattr(importlib.import_module(module), attr or "functions")
    if not isinstance(found, Functions):
        raise TypeError(f"{spec} is not a Functions registry")
    return found


class QueueLink:
    """The queue of workflow ids, in its own book (``lb``'s book + ``QUEUE_BOOK_OFFSET``:
    the workflows' book is trimmed by the collection, and a queue's replay needs its whole
    history), its session's position kept level with ``lb``'s."""

    def __init__(self, lb: LogBook, queue: str) -> None:
        self.lb = lb
        self.queue = BokiQueue(lb.on_book(lb.book_id + fr.QUEUE_BOOK_OFFSET), queue)

    def push(self, workflow: str) -> None:
        """Push after everything ``lb`` saw (the intent): a pop of it reads at cuts above."""
        with book_io.level(self.queue.lb, self.lb):
            self.queue.push(workflow.encode())

    def pop(self) -> str | None:
        """A workflow id, or None; ``lb`` then reads at cuts above its push, so above its intent."""
        with book_io.level(self.queue.lb, self.lb):
            data = self.queue.pop()
        return None if data is None else data.decode()


class FlowClient:
    """Calls workflows through ``queue`` of ``lb``'s book."""

    def __init__(self, lb: LogBook, queue: str = QUEUE, *, retry_after: float = RETRY_AFTER_S) -> None:
        self.lb = lb
        self.queue = QueueLink(lb, queue)
        self.retry_after = retry_after

    def _drive(self, steps: fc.Steps) -> Any:
        return book_io.drive_on(self.lb, steps)

    def start(self, function: str, input: Any = None, workflow: str | None = None) -> str:
        """Call ``function(input)`` as ``workflow`` (a fresh id if None) without waiting;
        the workflow's id. A call of an id called before is that workflow, with the first
        call's input (TrimmedError if it ended so long ago that its records were
        collected; ``WorkflowIdTaken`` if it was called as another function). An id may
        not begin with ``"@"`` (``ReservedWorkflowId``: those are the calls workflows make)."""
        workflow = fr.check_workflow_id(workflow or uuid.uuid4().hex)
        self._drive(fc.intent(workflow, fr.check_name("function name", function), fc.pack(input)))
        self.queue.push(workflow)
        return workflow

    def result(self, workflow: str, timeout: float | None = 60.0) -> Any:
        """Wait for ``workflow``'s return value (``WorkflowFailed`` if it raised;
        TimeoutError after ``timeout`` seconds), pushing it again while nobody ends it."""
        pushed = time.monotonic()
        for _ in pauses(timeout, most=MAX_POLL_S):
            done = self._drive(fc.read_done(workflow))
            if done is not None:
                return fc.unpack_outcome(done)
            if time.monotonic() - pushed >= self.retry_after:
                self.queue.push(workflow)
                pushed = time.monotonic()
        raise TimeoutError(f"workflow {workflow!r} did not end within {timeout} s")

    def call(self, function: str, input: Any = None, workflow: str | None = None,
             timeout: float | None = 60.0) -> Any:
        return self.result(self.start(function, input, workflow), timeout)


class Worker:
    """Runs the workflows popped from ``queue`` with ``functions``."""

    def __init__(self, flow: FlowBook, functions: Functions, queue: str = QUEUE) -> None:
        self.flow = flow
        self.functions = functions
        self.queue = QueueLink(flow.lb, queue)
        flow.call = self._call
        self.ran = 0
        self.collected = 0
        #: runs that gave the worker back mid-way (``fc.Suspended``)
        self.suspended = 0

    def _call(self, function: str, workflow: str, input: bytes) -> bytes:
        """A nested call: the callee's intent (``WorkflowIdTaken`` if the callee's id was
        called as another function: never its outcome), then its run, here."""
        self.flow.drive(fc.intent(workflow, function, input))
        return run_workflow(self.flow, workflow, self.functions.get)

    def run_one(self) -> bool:
        """Pop one workflow id and run it; False if the queue was empty."""
        workflow = self.queue.pop()
        if workflow is None:
            return False
        try:
            run_workflow(self.flow, workflow, self.functions.get)
        except TrimmedError:
            # a duplicate of a workflow that ended and was collected: nothing to run
            self.collected += 1
            return True
        except fc.Suspended:
            # it gave the worker back (a lock wait): the sweeper pushes it again
            self.suspended += 1
            return True
        self.ran += 1
        return True

    def serve(self, stop: threading.Event) -> None:
        while not stop.is_set():
            for _ in pauses(None, most=MAX_POLL_S):
                if stop.is_set() or self.run_one():
                    break


class Sweeper:
    """Pushes again the workflows nobody ended, and collects the records of those that
    ended (``collect_after`` seconds after it saw them end; None: never): the decisions
    are :class:`~ziplog.logbook.core.flow_sweep.SweepState`'s (where the trim point's
    argument is), this reads the log and acts on them."""

    def __init__(self, lb: LogBook, queue: str = QUEUE, *, retry_after: float = RETRY_AFTER_S,
                 collect_after: float | None = None, limit: int = 100_000) -> None:
        self.lb = lb
        self.queue = QueueLink(lb, queue)
        self.state = SweepState(int(retry_after * 1e9), None if collect_after is None else int(collect_after * 1e9),
                                limit)
        self.pushed = 0

    @property
    def cursor(self) -> int:
        """The seqnum of the last intent read."""
        return self.state.cursor

    @property
    def trimmed_to(self) -> int:
        """The workflows' book is trimmed below this."""
        return self.state.trimmed_to

    def sweep(self) -> None:
        state = self.state
        now = time.monotonic_ns()
        while (rec := self.lb.read_next(state.cursor + 1, tag=fr.INTENTS)) is not None:
            state.on_intent(rec.seqnum, rec.data, now)
        for workflow in state.due(now):
            if book_io.drive_on(self.lb, fc.read_done(workflow)) is not None:
                state.ended_at(workflow, now)
            else:
                self.queue.push(workflow)
                state.pushed(workflow, now)
                self.pushed += 1
        point = state.trim_point(now)
        if point is not None:
            self.lb.trim(point)
            state.trimmed(point)


class WorkerPool:
    """``n`` worker processes (``python -m ziplog.logbook.flow.worker``) on ``functions``
    (a ``module:attribute`` spec), started again when they die, and a sweeper.
    ``collect_after``: the sweeper trims an ended workflow's records this many seconds
    after it saw it end (None: never); ``audit``: the workers keep the database's audit
    of applied writes; ``log``: a file the workers' output is appended to (default: this
    process's)."""

    def __init__(self, zk_hosts: str, book: int, functions: str, db_path: str, n: int = 2, *,
                 queue: str = QUEUE, retry_after: float = RETRY_AFTER_S, key_file: str | None = None,
                 collect_after: float | None = None, audit: bool = False,
                 env: dict[str, str] | None = None, log: str | None = None) -> None:
        self.args = [sys.executable, "-m", "ziplog.logbook.flow.worker", "--zk", zk_hosts, "--book", str(book),
                     "--functions", functions, "--db", db_path, "--queue", queue]
        if key_file:
            self.args += ["--key-file", key_file]
        if audit:
            self.args.append("--audit")
        self.env = {**os.environ, **(env or {})}
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        #: workers started in place of dead ones (notified on :attr:`_restarted`)
        self.restarts = 0
        self._restarted = threading.Condition()
        self.log = log
        #: the exit codes of the workers that died, in order
        self.exits: list[int] = []
        # the sweeper's engine is made and used in the supervisor's thread (an engine is
        # not thread-safe: one thread uses it)
        self._make_sweeper = lambda: Sweeper(LogBook(zk_hosts, book, key_file=key_file), queue,
                                             retry_after=retry_after, collect_after=collect_after)
        self.sweeper: Sweeper | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name="flow-pool", daemon=True)

    def start(self) -> "WorkerPool":
        for i in range(len(self.procs)):
            self._spawn(i)
        self._thread.start()
        return self

    def _spawn(self, i: int) -> None:
        if self.log is None:
            self.procs[i] = subprocess.Popen(self.args, env=self.env, stdin=subprocess.DEVNULL)
            return
        with open(self.log, "ab") as out:
            self.procs[i] = subprocess.Popen(self.args, env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                                             stderr=subprocess.STDOUT)

    def kill(self, i: int) -> int | None:
        """SIGKILL worker ``i`` (the supervisor starts another); its pid, or None if it
        was not running. Returns once it is gone, so that killing the same worker again
        before its successor starts is no second kill."""
        proc = self.procs[i]
        if proc is None or proc.poll() is not None:
            return None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return proc.pid

    def wait_restarts(self, n: int, timeout: float) -> bool:
        """Wait until the pool started ``n`` workers in place of dead ones (True), or
        ``timeout`` seconds passed (False)."""
        with self._restarted:
            return self._restarted.wait_for(lambda: self.restarts >= n, timeout)

    def _supervise(self) -> None:
        sweeper = self.sweeper = self._make_sweeper()
        try:
            while not self._stop.wait(0.05):
                for i, proc in enumerate(self.procs):
                    if proc is not None and proc.poll() is not None and not self._stop.is_set():
                        self.exits.append(proc.returncode)
                        self._spawn(i)
                        with self._restarted:
                            self.restarts += 1
                            self._restarted.notify_all()
                try:
                    sweeper.sweep()
                except Exception as exc:  # a sweep that failed is tried at the next round
                    print(f"flow pool: sweep failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        finally:
            sweeper.lb.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            if proc is not None:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def __enter__(self) -> "WorkerPool":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()
