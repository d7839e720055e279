"""Seeded simulation of BokiFlow on the whole simulated ziplog system: the production flow
steps (:mod:`ziplog.logbook.core.flow`, :mod:`~ziplog.logbook.core.flow_lock`) over
production LogBook sessions (:mod:`ziplog.logbook.core.session`) and a production engine
index (:class:`ziplog.logbook.client.EngineState`), over the production log drivers, on
the simulated ports.

On top of :class:`~tests.sim.system.SystemSim` (storage replicas, the membership service
and the failure handler, with their faults) run **workers**: each a simulated process
with one :class:`~ziplog.client.driver.ClientDriver`, a subscription from the start of
the log feeding its engine's local index (Boki's engine), and a connection to the
production :class:`~ziplog.logbook.flow.db.SqliteDatabase` in a directory of the seed's
own. A worker runs each workflow it is handed at once, beside the others it runs (as
tasks on one event loop share an engine); nested calls run in the caller's worker, as
``Worker._call`` runs them. A run after the first is handed the position a queue pop
hands a worker (its call's intent), and a new worker's engine starts from the start of
the log: such runs read at cuts far behind what the runs before them did, as Boki allows.

The blocking :class:`~ziplog.logbook.flow.env.Env` cannot wait on simulated time, so the
sim's workflows are generators, and :class:`SimEnv` numbers their steps exactly as
``Env._next`` does (one number per write, read, remember, invoke, lock try, decision to
try a lock again, unlock and transaction decision), :class:`SimTransaction` is
``env.Transaction``, and
:func:`run_workflow_steps` is ``env.run_workflow``, each step performed by the
production step function.

The workload of a seed: a bank (2-4 accounts opened by a setup workflow) with transfers
as BokiFlow transactions (tried again a few times when a lock is held elsewhere) and
audits (a transaction reading every account); trips (read, invoke a callee that writes,
write); lock holders taking and giving back one named lock to add to a counter.

Faults add to the system's: workers killed (SIGKILL) in the middle of their workflows,
each of those run again from the start on a new worker process; some workflows run twice
at once on two workers; a run that the log fails (an insert no shard took) ends there and
the workflow is run again a while later, and so is a run that waited for a lock long
enough to give its worker back (``fc.Suspended``). Once everything settles,
:meth:`FlowSim.check_flow` reads the log one subscriber delivered and checks:

* **exactly once**: the database's audit applied every write of a step's first record (a
  ``write`` step, or a committed ``decide``) once, at that record's seqnum, and nothing
  else; each row holds the value and version of its latest such write;
* **one outcome**: every run of a workflow (re-runs, duplicates, nested calls) ended
  with the outcome the workflow's first ``Done`` record holds, and every invoke called
  its own call's id (``flow_records.callee_of``, no caller's workflow) and recorded
  that callee's return value;
* **the bank**: its total is unchanged, no balance is ever negative, every audit that
  committed saw the total; the counter behind the lock counts every holder once; each
  trip's row is what its workflow returned;
* **one holder**: in every lock's chain, replayed in gsn order, acquires and releases
  alternate, each holder takes the lock once and gives it back, and nobody holds it at
  the end; each holder's step records agree with the chain (a step recorded as taken is
  a holder of the chain, and every step of its critical section was recorded while it
  held the lock); and what the holders believed in simulated time never overlaps.
"""

from __future__ import annotations

import random
import shutil
import sqlite3
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator

from tests.sim import system
from tests.sim.system import CLIENT_TIMEOUT_NS, Outcome, SystemSim
from tests.sim.world import MS, SimProcess, SimTopology
from ziplog.client.driver import ClientDriver
from ziplog.cores.app_session import CallbackRun, Insert, ReadRecord
from ziplog.cores.client.state import ClientState
from ziplog.logbook.client import AUX_ENTRIES, CACHE_ENTRIES, RECORD_BYTES, EngineState
from ziplog.logbook.core import flow as fc
from ziplog.logbook.core import flow_records as fr
from ziplog.logbook.core import records as lr
from ziplog.logbook.core import session as ls
from ziplog.logbook.core.book_ops import Append, ReadNext, ReadTail
from ziplog.logbook.core.flow_lock import LockChain
from ziplog.logbook.core.index import HitRecord
from ziplog.logbook.flow.db import SqliteDatabase
from ziplog.logbook.flow.env import TransactionAborted, _is_infrastructure, lock_name
from ziplog.logdb.driver import ClientLog
from ziplog.protocol.errors import ZiplogError
from ziplog.protocol.types import Policy, RecordId

#: the workflows' book (step, intent and done records); their locks live in the next one
BOOK = 40
LOCKS_BOOK = BOOK + fr.LOCKS_BOOK_OFFSET
#: the production engine's default timeout (the simulation's 10 s limit comes first: an
#: index that never reaches a session's position fails the seed as "did not settle")
ENGINE_TIMEOUT_S = 30.0
#: the workers' client ids (one per worker process: a new incarnation is a new client)
WORKER_CLIENT_BASE = 8000
#: a run the log failed is run again after this long (``FlowClient`` pushes it again)
RETRY_AFTER_NS = 10 * MS
#: ``Env.lock``'s pauses between tries: the first, doubling up to the longest
LOCK_PAUSE_FIRST_NS = 2 * MS
LOCK_PAUSE_MOST_NS = 50 * MS
#: ``Env.lock``'s ``RUN_LOCK_WAIT_S``, scaled to the sim's lock waits (5-150 ms): a run
#: that has tried this long gives its worker back (``fc.Suspended``) and runs again
LOCK_RUN_WAIT_NS = 20 * MS
#: lock chains a run keeps replayed (a FlowBook keeps up to 4096 for its thread)
MAX_CHAINS = 64
#: a worker kill finds no workflow running: it looks again this often, this many times
KILL_RETRY_NS = 2 * MS
KILL_TRIES = 30

Steps = Generator[Any, Any, Any]
#: a workflow's function: a generator given its environment and its input
Function = Callable[["SimEnv", Any], Steps]


@dataclass(frozen=True, slots=True)
class Pause:
    """Wait ``ns`` of simulated time (``Env``'s ``time.sleep`` between lock tries, and a
    workflow's own pause), performed by the worker's step runner."""
    ns: int


# ==============================================================================================
# a LogBook engine on a simulated process
def _client_driver(sim: SystemSim, proc: SimProcess, cid: int) -> ClientDriver:
    """A client driver on ``proc``, as ``logdb_system._client_driver`` makes one."""
    topology = SimTopology(sim.zk, proc)
    state = ClientState(cid, Policy.random(), random.Random(sim.rng.getrandbits(64)), CLIENT_TIMEOUT_NS)
    driver = ClientDriver(proc, proc, topology, state)
    topology.on_change(lambda: proc.call_soon_threadsafe(driver.on_topology))
    return driver


#: how an operation's result comes back: (value, None) or (None, the error)
OnResult = Callable[[Any, BaseException | None], None]


class SimEngine:
    """The engine of a worker (``ziplog.logbook.client.Engine`` in local mode, with
    callbacks): the production :class:`EngineState` fed by a subscription from the start
    of the log, each batch's records then the subscription's position as its watermark
    (what ``Engine.catch_up`` feeds it, through ``EngineState.caught_up``: ``feed`` and
    ``on_watermark``), and lookups answered at the
    watermark once it reached their ``min_cut`` (``Engine.perform``), looked at again on
    each change of the subscription."""

    def __init__(self, proc: SimProcess, client: ClientDriver, record_bytes: int, stats: dict[str, int]) -> None:
        self.proc = proc
        self.state = EngineState(ENGINE_TIMEOUT_S, AUX_ENTRIES, record_bytes)
        #: the sim's counters (reads answered with a record the engine kept: ``kept_reads``)
        self.stats = stats
        # The production engine takes the log's watermark at its start (a status round
        # trip) as its floor; here the floor is 0, so a new worker's engine answers at
        # cuts far behind the log while it catches up: any cut at or above a session's
        # position is one Boki allows, and the stale ones are where runs again and
        # duplicates find what an earlier run did only in part.
        start = self.state.start_at(0, "local", CACHE_ENTRIES)
        self.sub = client.subscribe(RecordId(start, -1))
        self.sub.on_change = self.drain
        #: lookups waiting for the watermark: (the cut they need, the lookup, their callback);
        #: at most one per run in progress on this worker
        self.waiting: list[tuple[int, ls.Lookup, OnResult]] = []

    def drain(self) -> None:
        sub = self.sub
        sub.core.raise_error()  # a failed subscription fails the seed, as logdb_system's replayers do
        for rec in iter(sub.pop, None):
            self.state.feed(rec.rid.gsn, rec.rid.shard, rec.data)
        self.state.on_watermark(sub.core.position)
        if any(need <= self.state.watermark for need, _, _ in self.waiting):
            # answered in a turn of their own: not inside the subscription's callback
            self.proc.call_soon_threadsafe(self._answer_waiting)

    def _answer_waiting(self) -> None:
        mark = self.state.watermark
        ready = [w for w in self.waiting if w[0] <= mark]
        self.waiting = [w for w in self.waiting if w[0] > mark]
        for _, op, on_result in ready:
            on_result(self._answer(op), None)

    def lookup(self, op: ls.Lookup, on_result: OnResult) -> None:
        need = max(op.min_cut, self.state.floor)
        if self.state.watermark >= need:
            on_result(self._answer(op), None)
        else:
            self.waiting.append((need, op, on_result))

    def _answer(self, op: ls.Lookup) -> Any:
        got = self.state.answer(op)
        self.stats["kept_reads"] += got is not None and type(got[1]) is HitRecord
        return got


class StepRun(CallbackRun):
    """One drive of a generator of the log's operations (``Insert``, ``ReadRecord``,
    ``Lookup``) and :class:`Pause`, on the production :class:`CallbackRun` (what LogDB's
    ``TransactionDriver`` drives its runs with). Inserts and reads go through the
    production :class:`ClientLog` on the worker's client driver."""

    def __init__(self, proc: SimProcess, log_port: ClientLog, engine: SimEngine, steps: Steps,
                 on_done: Callable[["StepRun"], None]) -> None:
        super().__init__(steps, StepRun._perform, on_done)
        self.proc = proc
        self.log_port = log_port
        self.engine = engine

    def _perform(self, op: Any) -> None:
        t = type(op)
        if t is Insert:
            # Engine.perform: the new record's (gsn, shard)
            self.log_port.insert(op.data, op.after, lambda rid, e: self.resume(None if e else (rid.gsn, rid.shard), e))
        elif t is ReadRecord:
            self.log_port.read(op.rid, self.resume)
        elif t is ls.Lookup:
            self.engine.lookup(op, self.resume)
        elif t is Pause:
            self.proc.call_at(self.proc.now() + op.ns, lambda: self.resume(None, None))
        else:
            raise AssertionError(f"a run yielded {op!r}, which no engine performs")


# ==============================================================================================
# BokiFlow's operations on a worker's sessions
class FlowSession:
    """What ``FlowBook._perform`` and ``book_io.perform`` do for a run (their blocking
    calls, as the session's production step functions): a book operation through a
    LogBook session on the workflows' book, ``OnLocks`` through one on the locks' book
    kept level with it (``book_io.level``), ``DbWrite``/``DbRead`` on the database at
    once, ``Call`` as ``Worker._call`` (the callee's intent, then its run, here)."""

    def __init__(self, run: "FlowRun") -> None:
        self.run = run
        self.book = ls.Position(0)
        self.locks = ls.Position(0)

    def on_books(self, steps: Steps) -> Steps:
        """Run flow steps, each of their operations performed here; an operation's error
        is raised inside them, where the function performed it (as the blocking drive
        raises it out of ``perform``)."""
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                op = steps.send(value) if error is None else steps.throw(error)
            except StopIteration as stop:
                return stop.value
            try:
                value, error = (yield from self.perform(op)), None
            except Exception as exc:
                value, error = None, exc

    def perform(self, op: Any) -> Steps:
        t = type(op)
        if t is fc.OnLocks:
            self.locks.reached(self.book.gsn)  # book_io.level: one position across the two books
            value = yield from self.book_op(self.locks, LOCKS_BOOK, op.op)
            self.book.reached(self.locks.gsn)
            return value
        if t is fc.DbWrite:
            applied = self.run.worker.db.write(op.table, op.key, op.value, op.version)
            self.run.sim.stats["db_applied" if applied else "db_repeats"] += 1
            return applied
        if t is fc.DbRead:
            return self.run.worker.db.read(op.table, op.key)
        if t is fc.Call:
            return (yield from self.on_books(call_steps(self.run, op.function, op.workflow, op.input)))
        if t is Pause:
            return (yield op)
        return (yield from self.book_op(self.book, BOOK, op))

    @staticmethod
    def book_op(pos: ls.Position, book: int, op: Any) -> Steps:
        """``book_io.perform`` with ``LogBook.read_next``/``check_tail``/``append``."""
        t = type(op)
        if t is ReadNext:
            rec = yield from ls.read(pos, "next", book, op.tag, op.seqnum, op.gapless)
            return None if rec is None else (rec.seqnum, rec.data)
        if t is ReadTail:
            rec = yield from ls.read(pos, "prev", book, op.tag, ls.MAX_SEQNUM)
            return None if rec is None else rec.seqnum
        assert t is Append, op
        return (yield from ls.append(pos, book, op.data, [op.tag, *op.also]))


def call_steps(run: "FlowRun", function: str, workflow: str, input: bytes) -> Steps:
    """A call and its run: the workflow's intent (``FlowClient.start``, and
    ``Worker._call`` for a nested call), then :func:`ran_steps`."""
    found = yield from fc.intent(workflow, function, input)
    run.sim.called(workflow, found[0])
    return (yield from ran_steps(run, workflow))


def ran_steps(run: "FlowRun", workflow: str) -> Steps:
    """:func:`run_workflow_steps`, its outcome kept as one more run's of the workflow
    (for the checks)."""
    outcome = yield from run_workflow_steps(run, workflow)
    run.sim.ran(workflow, outcome)
    return outcome


def run_workflow_steps(run: "FlowRun", workflow: str) -> Steps:
    """``env.run_workflow`` as steps: the workflow's outcome (the first one recorded),
    running its function unless it has one."""
    done = yield from fc.read_done(workflow)
    if done is not None:
        return bytes(done)
    found = yield from fc.read_intent(workflow)
    if found is None:
        raise LookupError(f"workflow {workflow!r} was never called")
    intent = found[1]
    function = FUNCTIONS.get(intent.function)
    if function is None:
        outcome = fc.pack_outcome(False, f"no function {intent.function!r} is registered")
    else:
        try:
            outcome = fc.pack_outcome(True, (yield from function(SimEnv(run, workflow), fc.unpack(intent.input))))
        except fc.WorkflowFailed as exc:
            outcome = fc.pack_outcome(False, str(exc))
        except fc.NondeterministicWorkflow:
            raise
        except fc.Suspended:
            raise  # recorded as nothing: it runs again from its records
        except Exception as exc:  # the function's own failure is its outcome, recorded once
            if _is_infrastructure(exc):
                raise
            outcome = fc.pack_outcome(False, f"{type(exc).__name__}: {exc}")
    return bytes((yield from fc.finish(workflow, outcome)))


class SimEnv:
    """``Env`` as generators: the sim's workflows number their steps as ``Env`` does (each
    operation takes the next number, ``Env._next``), each performed by the production
    step function."""

    def __init__(self, run: "FlowRun", workflow: str) -> None:
        self.run = run
        self.workflow = workflow
        self.step = 0
        self.held: dict[str, str] = {}
        #: what ``remember`` makes up from (called in a run that finds no record)
        self.rng = run.sim.flow_rng

    def _next(self) -> int:
        self.step += 1
        return self.step

    def write(self, table: str, key: str, value: Any) -> Steps:
        yield from fc.write(self.workflow, self._next(), table, key, fc.pack(value))

    def read(self, table: str, key: str, default: Any = None) -> Steps:
        data = yield from fc.read(self.workflow, self._next(), table, key)
        return default if data is None else fc.unpack(data)

    def remember(self, make: Callable[[], Any]) -> Steps:
        return fc.unpack((yield from fc.remember(self.workflow, self._next(), lambda: fc.pack(make()))))

    def invoke(self, function: str, input: Any = None) -> Steps:
        outcome = yield from fc.invoke(self.workflow, self._next(), function, fc.pack(input))
        return fc.unpack_outcome(outcome)

    def try_lock(self, name: str) -> Steps:
        step = self._next()
        taken = bool((yield from fc.lock(self.workflow, step, self.run.chain(name))))
        if taken:
            holder = self.held[name] = fr.holder_of(self.workflow, step)
            self.run.sim.took_lock(name, holder)
        else:
            self.run.sim.stats["lock_refusals"] += 1
        return taken

    def lock(self, name: str, timeout_ns: int) -> Steps:
        """``Env.lock``: remember the deadline (a step), try; while another holds the
        lock, decide (a remembered step) whether it passed, else pause (2 ms, doubling up
        to 50 ms; not when the decision was an earlier run's) and try again; after
        ``LOCK_RUN_WAIT_NS`` of trying, stop after a decision (``fc.Suspended``: the sim
        runs the workflow again, as the sweeper's push does)."""
        deadline = yield from self.remember(lambda: self.run.sim.now + timeout_ns)
        run_until = self.run.sim.now + LOCK_RUN_WAIT_NS
        pause = LOCK_PAUSE_FIRST_NS
        live = [False]

        def decide() -> bool:
            live[0] = True
            return bool(self.run.sim.now < deadline)

        while not (yield from self.try_lock(name)):
            live[0] = False
            if not (yield from self.remember(decide)):
                return False
            if live[0]:  # an earlier run's tries are replayed without their pauses
                if self.run.sim.now >= run_until:
                    raise fc.Suspended(f"workflow {self.workflow!r} waits for lock {name!r}")
                yield Pause(pause)
            pause = min(pause * 2, LOCK_PAUSE_MOST_NS)
        return True

    def unlock(self, name: str) -> Steps:
        holder = self.held.pop(name, None)
        if holder is None:
            raise ValueError(f"this workflow does not hold lock {name!r}")
        self.run.sim.gives_lock(name, holder)  # the holder's critical section ends here
        yield from fc.unlock(self.workflow, self._next(), self.run.chain(name), holder)

    def transaction(self) -> "SimTransaction":
        return SimTransaction(self)


class SimTransaction:
    """``env.Transaction`` as generators (see :func:`atomically` for its ``with``)."""

    def __init__(self, env: SimEnv) -> None:
        self.env = env
        self.writes: dict[tuple[str, str], bytes] = {}
        self.values: dict[tuple[str, str], Any] = {}
        self.locked: list[str] = []
        self.committed = False

    def _lock(self, table: str, key: str) -> Steps:
        name = lock_name(table, key)
        if name not in self.locked:
            if not (yield from self.env.try_lock(name)):
                raise TransactionAborted(f"{name} is locked by another transaction")
            self.locked.append(name)

    def read(self, table: str, key: str, default: Any = None) -> Steps:
        yield from self._lock(table, key)
        k = (table, key)
        if k in self.writes:
            return fc.unpack(self.writes[k])
        if k not in self.values:
            self.values[k] = yield from self.env.read(table, key)
        value = self.values[k]
        return default if value is None else value

    def write(self, table: str, key: str, value: Any) -> Steps:
        yield from self._lock(table, key)
        self.writes[(table, key)] = fc.pack(value)

    def end(self, error: Exception | None) -> Steps:
        """``Transaction.__exit__`` for a body that returned (``error`` None) or raised a
        function's exception: the decision, the locks given back; True if the error ends
        here (an abort)."""
        commit = error is None
        writes = [[t, k, v] for (t, k), v in self.writes.items()] if commit else []
        env = self.env
        _, self.committed, _ = yield from fc.decide(env.workflow, env._next(), commit, writes)
        for name in reversed(self.locked):
            yield from env.unlock(name)
        return isinstance(error, TransactionAborted)


def atomically(env: SimEnv, body: Callable[[SimTransaction], Steps]) -> Steps:
    """``with env.transaction() as t: <body>``: ``(t, what the body returned)``; an abort
    ends it with None, another exception of the function after the decision, and the
    log's or the database's failure at once (nothing more recorded, locks held: a run
    after it takes the transaction on)."""
    t = env.transaction()
    try:
        value = yield from body(t)
    except Exception as exc:
        if _is_infrastructure(exc):
            raise
        if (yield from t.end(exc)):
            return t, None
        raise
    yield from t.end(None)
    return t, value


# ==============================================================================================
# the workload's functions
BANK = "bank"


def open_accounts(env: SimEnv, req: dict[str, Any]) -> Steps:
    for account in req["accounts"]:
        yield from env.write(BANK, account, req["balance"])
    for hotel, rooms in req["hotels"].items():
        yield from env.write("hotels", hotel, rooms)
    return None


def _move(t: SimTransaction, req: dict[str, Any]) -> Steps:
    a = yield from t.read(BANK, req["from"], 0)
    b = yield from t.read(BANK, req["to"], 0)
    if a < req["amount"]:
        return "refused"  # the bank lets no balance go below 0
    yield from t.write(BANK, req["from"], a - req["amount"])
    yield from t.write(BANK, req["to"], b + req["amount"])
    return "moved"


def transfer(env: SimEnv, req: dict[str, Any]) -> Steps:
    """A transaction, tried again after a remembered pause while another holds a lock."""
    for attempt in range(req["tries"]):
        t, result = yield from atomically(env, lambda t: _move(t, req))
        if t.committed:
            return result
        if attempt + 1 < req["tries"]:
            yield Pause((yield from env.remember(lambda: env.rng.randint(1, 8) * MS)))
    return "aborted"


def _sum(t: SimTransaction, accounts: list[str]) -> Steps:
    total = 0
    for account in accounts:
        total += yield from t.read(BANK, account, 0)
    return total


def audit(env: SimEnv, req: dict[str, Any]) -> Steps:
    """The bank's total in one transaction (None: aborted)."""
    t, total = yield from atomically(env, lambda t: _sum(t, req["accounts"]))
    return total if t.committed else None


def reserve(env: SimEnv, req: dict[str, Any]) -> Steps:
    yield from env.write("bookings", req["trip"], req["hotel"])
    return f"{req['hotel']}/{req['trip']}"


def trip(env: SimEnv, req: dict[str, Any]) -> Steps:
    rooms = yield from env.read("hotels", req["hotel"], 0)
    confirmation = yield from env.invoke("reserve", {"trip": env.workflow, "hotel": req["hotel"]})
    yield from env.write("trips", env.workflow, [req["hotel"], rooms, confirmation])
    return [req["hotel"], rooms, confirmation]


def hold_lock(env: SimEnv, req: dict[str, Any]) -> Steps:
    """Take the lock (waiting a while), add 1 to its counter outside any transaction, give it
    back: two holders at once could lose an increment. True if it took the lock."""
    if not (yield from env.lock(req["lock"], req["timeout_ns"])):
        return False
    n = yield from env.read("counter", req["lock"], 0)
    yield Pause(req["hold_ns"])
    yield from env.write("counter", req["lock"], n + 1)
    yield from env.unlock(req["lock"])
    return True


FUNCTIONS: dict[str, Function] = {"open_accounts": open_accounts, "transfer": transfer, "audit": audit,
                                  "reserve": reserve, "trip": trip, "hold_lock": hold_lock}


# ==============================================================================================
# workers and their runs
@dataclass
class Workflow:
    """A workflow the sim calls: its id, function and input, and how its runs went."""
    wid: str
    function: str
    input: Any
    #: some run of it ended (with the outcome every run must get)
    ended: bool = False
    #: start a second run on another worker at once
    duplicate: bool = False
    #: the seqnum of its first intent, once a run learned it (what a queue pop hands a
    #: worker: a position above the call)
    intent_at: int | None = None


class FlowRun:
    """One run of a workflow on a worker: its sessions, its lock chains, its step run."""

    def __init__(self, worker: "FlowWorker", workflow: Workflow, kind: str) -> None:
        self.worker = worker
        self.sim = worker.sim
        self.workflow = workflow
        self.kind = kind
        self.session = FlowSession(self)
        #: the chains this run replayed (a FlowBook keeps them for its thread; a run
        #: here keeps its own, since runs of one worker interleave)
        self.chains: dict[str, LockChain] = {}
        wf = workflow
        if wf.intent_at is None:
            # the call itself (its intent), then its run, in one session
            steps = self.session.on_books(call_steps(self, wf.function, wf.wid, fc.pack(wf.input)))
        else:
            # a run handed over as a queue pop hands it (``Worker.run_one``): at a position
            # above the call, nothing more; its engine may still be far behind the runs
            # before it, and reads at any cut at or above that position
            self.session.book.reached(wf.intent_at)
            self.session.locks.reached(wf.intent_at)
            steps = self.session.on_books(ran_steps(self, wf.wid))
        assert worker.engine is not None, "a worker runs workflows once its engine is up"
        self.steps = StepRun(worker.proc, worker.log_port, worker.engine, steps, self._ended)

    def chain(self, name: str) -> LockChain:
        found = self.chains.pop(name, None)
        if found is None:
            found = LockChain(name)
            if len(self.chains) >= MAX_CHAINS:
                del self.chains[next(iter(self.chains))]
        self.chains[name] = found
        return found

    def _ended(self, steps: StepRun) -> None:
        self.sim.run_ended(self, steps.error)


class FlowWorker:
    """A worker process: a client driver, the engine, a database connection, its runs."""

    def __init__(self, sim: "FlowSim", n: int) -> None:
        self.sim = sim
        self.n = n
        self.proc = SimProcess(sim.world, f"worker{n}")
        cid = WORKER_CLIENT_BASE + n
        sim.other_writers.add(cid)  # its records are the flow's to check
        self.client = _client_driver(sim, self.proc, cid)
        self.log_port = ClientLog(self.client)
        self.db = SqliteDatabase(str(sim.db_path), audit=True)
        self.runs: list[FlowRun] = []
        self.engine: SimEngine | None = None
        self.proc.run(self._begin)

    def _begin(self) -> None:
        self.engine = SimEngine(self.proc, self.client, self.sim.engine_record_bytes, self.sim.stats)

    @property
    def alive(self) -> bool:
        return self.proc.alive

    def start_run(self, workflow: Workflow, kind: str) -> None:
        def begin() -> None:
            run = FlowRun(self, workflow, kind)
            self.runs.append(run)
            run.steps.start()
        self.proc.run(begin)

    def kill(self) -> list[FlowRun]:
        """SIGKILL: nothing more happens here; what SQLite committed stays. The runs it had."""
        self.proc.kill()
        self.db.close()
        runs, self.runs = self.runs, []
        return runs


# ==============================================================================================
class FlowSim(SystemSim):
    def __init__(self, seed: int, trace: bool = False, **kw: Any) -> None:
        knobs = random.Random(seed * 130_363 + 11)
        kw.setdefault("clients", knobs.randint(0, 2))  # the log's own apps: other records in the log
        super().__init__(seed, trace, **kw)
        #: the sim's choices while it runs (which worker, which run to kill, pauses)
        self.flow_rng = random.Random(seed * 130_363 + 12)
        #: the records an engine keeps from its subscription (half the seeds: none, so each
        #: read ends with a ReadRecord as it did before engines kept them)
        self.engine_record_bytes = random.Random(seed * 130_363 + 13).choice([0, RECORD_BYTES])
        # the SQLite file in memory-backed storage where there is one
        shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
        self.tmp = Path(tempfile.mkdtemp(prefix=f"flow-sim-{seed}-", dir=shm))
        self.db_path = self.tmp / "flow.sqlite3"
        self.accounts = [f"acct{i}" for i in range(knobs.randint(2, 4))]
        self.balance = knobs.choice([5, 10, 20])
        hotels = {f"hotel{i}": knobs.randint(1, 3) for i in range(2)}
        self.setup = Workflow("open", "open_accounts", {"accounts": self.accounts, "balance": self.balance,
                                                        "hotels": hotels})
        #: the workload, started once the setup ended: (start offset, workflow)
        self.workload: list[tuple[int, Workflow]] = []
        for i in range(knobs.randint(2, 6)):
            a, b = knobs.sample(self.accounts, 2)
            self.workload.append((knobs.randint(0, 40) * MS, Workflow(
                f"transfer{i}", "transfer", {"from": a, "to": b, "amount": knobs.randint(1, 15),
                                             "tries": knobs.randint(2, 5)})))
        for i in range(knobs.randint(1, 2)):
            self.workload.append((knobs.randint(0, 60) * MS, Workflow(f"audit{i}", "audit",
                                                                      {"accounts": self.accounts})))
        for i in range(knobs.randint(1, 2)):
            self.workload.append((knobs.randint(0, 40) * MS, Workflow(f"trip{i}", "trip",
                                                                      {"hotel": knobs.choice(sorted(hotels))})))
        self.lock = "counter-lock"
        for i in range(knobs.randint(2, 3)):
            self.workload.append((knobs.randint(0, 30) * MS, Workflow(
                f"holder{i}", "hold_lock", {"lock": self.lock, "timeout_ns": knobs.randint(5, 150) * MS,
                                            "hold_ns": knobs.randint(0, 6) * MS})))
        for _, wf in knobs.sample(self.workload, knobs.choice([0, 1, 1, 2])):
            wf.duplicate = True
        #: worker kills, at these offsets from the workload's start
        self.kill_offsets = [knobs.randint(1, 80) * MS for _ in range(knobs.choice([0, 1, 1, 2, 2, 3]))]
        self.initial_workers = knobs.randint(2, 3)
        self.workers: list[FlowWorker] = []
        self.workflows: dict[str, Workflow] = {self.setup.wid: self.setup}
        self.workflows.update((wf.wid, wf) for _, wf in self.workload)
        for wid in self.workflows:
            fr.check_workflow_id(wid)  # a caller's id, as FlowClient.start takes it (none in the calls' namespace)
        #: every outcome a run of a workflow (or a nested call of it) ended with
        self.outcomes: dict[str, list[bytes]] = {}
        #: lock -> holder -> [when one of its runs first believed it held the lock, when one
        #: first began giving it back (None: not yet)], in simulated ns
        self.beliefs: dict[str, dict[str, list[int | None]]] = {}
        self.started = False
        #: runs scheduled to start again (after a failure of the log) and not started yet
        self.retries_pending = 0
        self.stats = {"workflows": len(self.workflows), "runs": 0, "run_errors": 0, "worker_kills": 0, "suspended": 0,
                      "killed_runs": 0, "duplicates": 0, "duplicates_overlapping": 0, "moved": 0, "refused": 0,
                      "aborted": 0, "tx_aborts": 0, "audits": 0, "trips": 0, "lock_taken": 0,
                      "lock_refusals": 0, "holders_gave_up": 0, "db_applied": 0, "db_repeats": 0, "kept_reads": 0,
                      "stale_holders": 0}

    # -- workers and runs -----------------------------------------------------------------------
    def _run(self) -> Outcome:
        for _ in range(self.initial_workers):
            self.at(self.rng.randint(1, 3) * MS, self.add_worker)
        self.at(self.rng.randint(4, 8) * MS, self.dispatch, self.setup, "first")
        return super()._run()

    def new_worker(self) -> FlowWorker:
        worker = FlowWorker(self, len(self.workers))
        self.workers.append(worker)
        self.tr(f"flow: {worker.proc.name} up")
        return worker

    def add_worker(self) -> None:
        self.new_worker()

    def live_workers(self) -> list[FlowWorker]:
        return [w for w in self.workers if w.alive]

    def dispatch(self, wf: Workflow, kind: str, avoid: FlowWorker | None = None) -> None:
        """Start a run of ``wf`` on a live worker (not ``avoid`` if another is live)."""
        live = self.live_workers() or [self.new_worker()]
        others = [w for w in live if w is not avoid]
        worker = self.flow_rng.choice(others or live)
        self.stats["runs"] += 1
        if kind == "duplicate":
            self.stats["duplicates"] += 1
            if any(r.workflow is wf for w in live for r in w.runs):
                self.stats["duplicates_overlapping"] += 1
        self.tr(f"flow: {kind} run of {wf.wid} on {worker.proc.name}")
        worker.start_run(wf, kind)

    def called(self, wid: str, intent_at: int) -> None:
        """A run learned the seqnum of the workflow's intent: a duplicate may start now (a
        call is pushed to the queue after its intent)."""
        wf = self.workflows.get(wid)
        if wf is None or wf.intent_at is not None:
            return
        wf.intent_at = intent_at
        if wf.duplicate:
            here = next((w for w in self.live_workers() if any(r.workflow is wf for r in w.runs)), None)
            self.at(self.now + self.flow_rng.randint(0, 3) * MS, self.dispatch, wf, "duplicate", here)

    def _retry(self, wf: Workflow) -> None:
        self.retries_pending -= 1
        self.dispatch(wf, "retry")

    def run_ended(self, run: FlowRun, error: BaseException | None) -> None:
        worker, wf = run.worker, run.workflow
        worker.runs.remove(run)
        if error is None:  # its outcome is kept already (call_steps)
            self.tr(f"flow: {run.kind} run of {wf.wid} on {worker.proc.name} ended: {fc.unpack(run.steps.value)}")
            if wf is self.setup and not self.started:
                self.started = True
                self.start_workload()
            return
        if isinstance(error, fc.Suspended):
            # it gave its worker back waiting for a lock: pushed again, as the sweeper does
            self.stats["suspended"] += 1
            self.tr(f"flow: {run.kind} run of {wf.wid} on {worker.proc.name} suspended")
            self.retries_pending += 1
            self.at(self.now + RETRY_AFTER_NS, self._retry, wf)
            return
        if not isinstance(error, ZiplogError):
            # a protocol's assertion, a nondeterministic workflow, a bug of the sim: the
            # seed fails, raised from an event of its own (not inside a driver's callback)
            where = traceback.extract_tb(error.__traceback__)[-1]
            self.at(self.now, _raise, AssertionError(
                f"a {run.kind} run of {wf.wid} on {worker.proc.name} failed: {type(error).__name__}: {error} "
                f"(raised at {where.filename.rsplit('/', 1)[-1]}:{where.lineno})"))
            return
        # the log failed the run (no shard took an insert): a crash, which a run again covers
        self.stats["run_errors"] += 1
        self.tr(f"flow: {run.kind} run of {wf.wid} on {worker.proc.name} failed: {error!r}")
        self.retries_pending += 1
        self.at(self.now + RETRY_AFTER_NS, self._retry, wf)

    def ran(self, wid: str, outcome: bytes) -> None:
        self.outcomes.setdefault(wid, []).append(outcome)
        wf = self.workflows.get(wid)
        if wf is not None:
            wf.ended = True

    def start_workload(self) -> None:
        for offset, wf in self.workload:
            self.at(self.now + offset, self.dispatch, wf, "first")
        for offset in self.kill_offsets:
            self.at(self.now + offset, self.kill_worker, KILL_TRIES)

    def kill_worker(self, tries: int) -> None:
        """SIGKILL a worker in the middle of a workflow (one of the workload's); each run it
        had starts again from the start on a new worker process."""
        busy = [w for w in self.live_workers() if any(r.workflow is not self.setup for r in w.runs)]
        if not busy:
            if tries > 1:
                self.at(self.now + KILL_RETRY_NS, self.kill_worker, tries - 1)
            return
        worker = self.flow_rng.choice(busy)
        runs = worker.kill()
        self.stats["worker_kills"] += 1
        self.stats["killed_runs"] += len(runs)
        self.tr(f"CRASH {worker.proc.name} running {[r.workflow.wid for r in runs]}")
        fresh = self.new_worker()
        for run in runs:
            self.stats["runs"] += 1
            self.tr(f"flow: rerun of {run.workflow.wid} on {fresh.proc.name}")
            fresh.start_run(run.workflow, "rerun")

    # -- lock beliefs ---------------------------------------------------------------------------
    def took_lock(self, lock: str, holder: str) -> None:
        self.stats["lock_taken"] += 1
        entry = self.beliefs.setdefault(lock, {}).setdefault(holder, [self.now, None])
        first = entry[0]
        assert first is not None
        entry[0] = min(first, self.now)

    def gives_lock(self, lock: str, holder: str) -> None:
        entry = self.beliefs.setdefault(lock, {}).get(holder)
        assert entry is not None, ("a run gives back a lock its holder never believed it took", lock, holder)
        if entry[1] is None:
            entry[1] = self.now

    # -- settling -------------------------------------------------------------------------------
    def settled(self) -> str | None:
        why = super().settled()
        if why is not None:
            return why
        if not self.started:
            return "the setup workflow has not ended"
        for wf in self.workflows.values():
            if not wf.ended:
                return f"workflow {wf.wid} has not ended"
        for w in self.live_workers():
            if w.runs:
                return f"{w.proc.name} still runs {[r.workflow.wid for r in w.runs]}"
        if self.retries_pending:
            return f"{self.retries_pending} runs to start again"
        return None

    def check(self) -> None:
        super().check()
        self.check_flow()

    # -- the checks -----------------------------------------------------------------------------
    def flow_log(self) -> "FlowLog":
        return FlowLog.read(self.readers[0].delivered)

    def check_flow(self) -> None:
        flow = self.flow_log()
        db = FlowDb.read(self.db_path)
        self._check_outcomes(flow)
        self._check_database(flow, db)
        self._check_workload(flow, db)
        self._check_locks(flow)
        self.outcome.logdb = dict(self.stats)

    def _check_outcomes(self, flow: "FlowLog") -> None:
        for wid in self.workflows:
            assert wid in flow.done, f"workflow {wid} has no done record"
        for wid, outcomes in self.outcomes.items():
            first = flow.done.get(wid)
            assert first is not None, f"workflow {wid} ended a run, and the log holds no done record of it"
            for outcome in outcomes:
                assert outcome == first, (f"a run of workflow {wid} ended with {fc.unpack(outcome)}, its first done "
                                          f"record holds {fc.unpack(first)}")
        for (wid, step, part), (_, rec) in flow.steps.items():
            if rec.op == "invoke" and part == 1:
                callee = fc.unpack(flow.steps[(wid, step, 0)][1].value)
                assert callee == fr.callee_of(wid, step) and callee not in self.workflows, (
                    f"workflow {wid} step {step} called {callee!r}, not its own call's id {fr.callee_of(wid, step)!r}")
                assert rec.value == flow.done.get(callee), (
                    f"workflow {wid} step {step} recorded {fc.unpack(rec.value)} as its call's return value, "
                    f"callee {callee} ended with {flow.done.get(callee) and fc.unpack(flow.done[callee])}")

    def _check_database(self, flow: "FlowLog", db: "FlowDb") -> None:
        """Exactly once: the database applied each first step record's write at most once,
        nothing else, and holds each row's latest."""
        writes = flow.writes()
        seen: set[tuple[str, str, int]] = set()
        for write in db.applied:
            assert write not in seen, f"the database applied the write {write} twice"
            seen.add(write)
            assert write in writes, (f"the database applied the write {write}, which is no first step record's "
                                     f"(a write step or a committed decision at that seqnum)")
        # and at least once: every row's writers here run one after another (a lock's
        # holders, or one workflow), so no write is passed over by a later one
        missing = set(writes) - seen
        assert not missing, f"the database never applied the recorded writes {sorted(missing)}"
        latest = flow.latest()
        for (table, key), (version, value) in latest.items():
            got = db.rows.get((table, key))
            assert got == (version, value), (f"row {table}/{key} holds {got and (got[0], fc.unpack(got[1]))}, its "
                                             f"latest recorded write is {(version, fc.unpack(value))}")
        extra = set(db.rows) - set(latest)
        assert not extra, f"the database holds rows no step record wrote: {sorted(extra)}"

    def _check_workload(self, flow: "FlowLog", db: "FlowDb") -> None:
        total = self.balance * len(self.accounts)
        balances = {k: fc.unpack(v) for (t, k), (_, v) in db.rows.items() if t == BANK}
        assert sorted(balances) == sorted(self.accounts), f"the bank's accounts are {sorted(balances)}"
        assert sum(balances.values()) == total, f"the bank holds {sum(balances.values())}, not {total}: {balances}"
        for (table, key, version), value in flow.writes().items():
            if table == BANK:
                assert fc.unpack(value) >= 0, f"account {key} was set to {fc.unpack(value)} (at gsn {version})"
        counts = dict.fromkeys(("moved", "refused", "aborted", "audits", "trips", "holders_gave_up"), 0)
        holders_took = 0
        for wid, wf in self.workflows.items():
            ok, value = fc.unpack(flow.done[wid])
            assert ok, f"workflow {wid} failed: {value}"
            if wf.function == "transfer":
                assert value in ("moved", "refused", "aborted"), (wid, value)
                counts[value] += 1
            elif wf.function == "audit":
                counts["audits"] += value is not None
                assert value is None or value == total, f"audit {wid} saw a total of {value}, not {total}"
            elif wf.function == "trip":
                counts["trips"] += 1
                row = db.rows.get(("trips", wid))
                assert row is not None and fc.unpack(row[1]) == value, (
                    f"trip {wid} returned {value}, its row holds {row and fc.unpack(row[1])}")
            elif wf.function == "hold_lock":
                holders_took += bool(value)
                counts["holders_gave_up"] += not value
        counter = db.rows.get(("counter", self.lock))
        counted = 0 if counter is None else fc.unpack(counter[1])
        assert counted == holders_took, f"the counter behind the lock counts {counted}, {holders_took} holders took it"
        counts["tx_aborts"] = sum(1 for _, rec in flow.steps.values() if rec.op == "decide" and not fc.unpack(rec.value)[0])
        self.stats.update(counts)

    def _check_locks(self, flow: "FlowLog") -> None:
        # the chains, replayed in gsn order: acquires and releases alternate, each holder
        # takes the lock once and gives it back
        took: dict[str, tuple[str, int]] = {}  # holder -> (lock, gsn of its acquire that joined)
        gave: dict[str, int] = {}  # holder -> gsn of its release that joined
        for lock, records in flow.lock_ops.items():
            chain = LockChain(lock)
            holder: str | None = None
            for gsn, data in records:
                if not chain.apply(gsn, data):
                    continue
                rec = fr.decode(data)
                assert type(rec) is fr.LockOp
                if rec.acquire:
                    assert holder is None, f"lock {lock}: {rec.holder} took it at {gsn} while {holder} held it"
                    assert rec.holder not in took, (f"lock {lock}: holder {rec.holder} took it again at {gsn} (it "
                                                     f"took it at {took[rec.holder][1]})")
                    took[rec.holder] = (lock, gsn)
                    holder = rec.holder
                else:
                    assert holder == rec.holder, f"lock {lock}: {rec.holder} gave it back at {gsn}, {holder} held it"
                    gave[rec.holder] = gsn
                    holder = None
            # a holder may be left only by a run of a step that came second (the step's
            # first record says it failed) and died before giving the lock back: nobody
            # holds it then, and the next step that takes the lock gives it back for it
            if holder is not None:
                named = fr.step_of_holder(holder)
                first = flow.steps.get((*named, 0)) if named is not None else None
                assert first is not None and first[1].op == "lock" and not fc.unpack(first[1].value), (
                    f"lock {lock} is still held by {holder} when every workflow ended")
                self.stats["stale_holders"] += 1
        # the step records agree with the chains: a step recorded as taken is a holder, and
        # its critical section was recorded while it held the lock
        for (wid, step, part), (gsn, rec) in flow.steps.items():
            if rec.op != "lock":
                continue
            holder = fr.holder_of(wid, step)
            if not fc.unpack(rec.value):
                continue  # a run that took it anyway gave it back (checked above: no lock ends held)
            assert holder in took, f"step {step} of {wid} is recorded as taking a lock its chain never gave it"
            lock, acquired = took[holder]
            released = gave[holder]
            assert acquired < gsn < released, (f"{holder}'s step record ({gsn}) lies outside its hold of {lock} "
                                               f"({acquired}..{released})")
            k = step + 1
            while (wid, k, 0) in flow.steps and flow.steps[(wid, k, 0)][1].op != "unlock":
                at = flow.steps[(wid, k, 0)][0]
                assert acquired < at < released, (f"step {k} of {wid} ({at}) was recorded outside its hold of {lock} "
                                                  f"({acquired}..{released})")
                k += 1
        # what the holders believed, in simulated time: no two at once
        for lock, holders in self.beliefs.items():
            spans = []
            for holder, (since, until) in holders.items():
                named = fr.step_of_holder(holder)
                first = flow.steps.get((*named, 0)) if named is not None else None
                assert first is not None and first[1].op == "lock" and fc.unpack(first[1].value), (
                    f"{holder} believed it took {lock}, and its step record does not say so")
                assert since is not None and until is not None, f"{holder} never gave back {lock}"
                spans.append((since, until, holder))
            spans.sort()
            for (s1, u1, h1), (s2, u2, h2) in zip(spans, spans[1:]):
                assert u1 <= s2, (f"{h1} held {lock} from {s1 / MS:.3f} to {u1 / MS:.3f} ms and {h2} from "
                                  f"{s2 / MS:.3f} ms: two holders at once")

    def close(self) -> None:
        for w in self.workers:
            if w.alive:
                w.db.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _raise(error: BaseException) -> None:
    raise error


@dataclass
class FlowLog:
    """BokiFlow's records in the log, as a subscriber delivered it (gsn order)."""
    #: (workflow, step, part) -> (gsn, record) of the step's first record
    steps: dict[tuple[str, int, int], tuple[int, fr.Step]] = field(default_factory=dict)
    #: workflow -> the result its first done record holds
    done: dict[str, bytes] = field(default_factory=dict)
    #: lock -> (gsn, data) of its chain's records, gsn order
    lock_ops: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict)

    @classmethod
    def read(cls, delivered: list[tuple[int, int, bytes]]) -> "FlowLog":
        flow = cls()
        for gsn, _, data in delivered:
            entry = lr.decode(data)
            if type(entry) is not lr.Entry:
                continue
            rec = fr.decode(entry.data)
            # a record counts where its readers find it: under its tag, in its book
            if entry.book == BOOK and type(rec) is fr.Step and lr.tag_of(fr.step_tag(rec.workflow, rec.step)) in entry.tags:
                flow.steps.setdefault((rec.workflow, rec.step, rec.part), (gsn, rec))
            elif entry.book == BOOK and type(rec) is fr.Done and lr.tag_of(fr.done_tag(rec.workflow)) in entry.tags:
                flow.done.setdefault(rec.workflow, rec.result)
            elif entry.book == LOCKS_BOOK and type(rec) is fr.LockOp and lr.tag_of(fr.lock_tag(rec.lock)) in entry.tags:
                flow.lock_ops.setdefault(rec.lock, []).append((gsn, entry.data))
        return flow

    def writes(self) -> dict[tuple[str, str, int], bytes]:
        """Every database write the first step records make: (table, key, version) -> value."""
        out: dict[tuple[str, str, int], bytes] = {}
        for (_, _, _), (gsn, rec) in self.steps.items():
            if rec.op == "write":
                table, key, value = fc.unpack(rec.value)
                out[(table, key, gsn)] = value
            elif rec.op == "decide":
                commit, writes = fc.unpack(rec.value)
                if commit:
                    for table, key, value in writes:
                        out[(table, key, gsn)] = value
        return out

    def latest(self) -> dict[tuple[str, str], tuple[int, bytes]]:
        """Each row's latest recorded write: (table, key) -> (version, value)."""
        latest: dict[tuple[str, str], tuple[int, bytes]] = {}
        for (table, key, version), value in self.writes().items():
            if (table, key) not in latest or latest[(table, key)][0] < version:
                latest[(table, key)] = (version, value)
        return latest


@dataclass
class FlowDb:
    """What the database holds, read apart from the workers' connections."""
    #: (table, key) -> (version, value)
    rows: dict[tuple[str, str], tuple[int, bytes]]
    #: every applied write the audit kept: (table, key, version), in order
    applied: list[tuple[str, str, int]]

    @classmethod
    def read(cls, path: Path) -> "FlowDb":
        db = sqlite3.connect(path)
        try:
            rows = {(t, k): (int.from_bytes(v, "big"), bytes(value))
                    for t, k, value, v in db.execute("SELECT tbl, key, value, version FROM flow_rows")}
            applied = [(t, k, int.from_bytes(v, "big"))
                       for t, k, v in db.execute("SELECT tbl, key, version FROM flow_applied ORDER BY rowid")]
        finally:
            db.close()
        return cls(rows, applied)


REPLAY = "python -m tests.sim --flow --seed {seed} --trace"


def run(seed: int, trace: bool = False, **kw: Any) -> Outcome:
    """One seed; a broken invariant raises AssertionError naming it and its replay."""
    return system.run(seed, trace, sim_class=FlowSim, replay=REPLAY, **kw)
