"""BokiFlow on the whole simulated system (``tests/sim/flow_system.py``): workers running
the production flow steps on LogBook sessions over the production log drivers, killed in
the middle of their workflows, some workflows run twice at once, over the log's own
faults. Every seed checks exactly-once database writes, one outcome per workflow, the
bank's total and one lock holder at a time; the checker's own tests tamper with a
settled run to show it notices. And the two bugs the simulation found, as regressions: a
run that reads its lock step at a stale cut must not take the lock again for a holder
that gave it back, and ``Env.lock`` run again takes the first run's tries."""

from __future__ import annotations

import sqlite3
from typing import Any, Callable, Iterator, cast

import pytest

from tests.sim import flow_system
from ziplog.cores.app_session import drive
from ziplog.logbook.core import flow as fc
from ziplog.logbook.core import flow_records as fr
from ziplog.logbook.core.book_ops import Append, ReadNext
from ziplog.logbook.core.flow_lock import LockChain
from ziplog.logbook.flow import env as flow_env


# -- the lock step read at a stale cut (found by the simulation) ----------------------------------------
class ScriptedBook:
    """Records by seqnum, appended in order; each read at the cut a script picks (at or
    above the session's position, as LogBook allows: a stale one too)."""

    def __init__(self) -> None:
        self.records: dict[int, tuple[str, bytes]] = {}

    @property
    def top(self) -> int:
        return max(self.records, default=0)

    def session(self, cut_for: Callable[[str], int]) -> Callable[[Any], Any]:
        """A session's ``perform`` (one position across the workflows' and the locks'
        books, as ``book_io.level`` keeps them) reading ``tag`` at ``cut_for(tag)``."""
        pos = [0]

        def perform(op: Any) -> Any:
            if type(op) is fc.OnLocks:
                op = op.op
            if type(op) is Append:
                seqnum = pos[0] = self.top + 1
                self.records[seqnum] = (op.tag, op.data)
                return seqnum
            assert type(op) is ReadNext, op
            cut = pos[0] = max(pos[0], cut_for(op.tag))
            hits = [s for s, (t, _) in self.records.items() if t == op.tag and op.seqnum <= s <= cut]
            return None if not hits else (min(hits), self.records[min(hits)][1])
        return perform

    def holder(self, lock: str) -> str | None:
        chain = LockChain(lock)
        for seqnum in sorted(self.records):
            chain.apply(seqnum, self.records[seqnum][1])
        return chain.holder


def test_a_lock_step_read_at_a_stale_cut_does_not_take_the_lock_again_for_a_holder_that_gave_it_back() -> None:
    book = ScriptedBook()
    latest = book.session(lambda tag: book.top)
    # the chain has history: another workflow took the lock and gave it back
    assert drive(fc.lock("other", 1, LockChain("L")), latest)
    drive(fc.unlock("other", 2, LockChain("L"), fr.holder_of("other", 1)), latest)
    # the first run of workflow w takes the lock at step 1 and gives it back at step 2
    first = LockChain("L")
    assert drive(fc.lock("w", 1, first), latest)
    drive(fc.unlock("w", 2, first, fr.holder_of("w", 1)), latest)
    assert book.holder("L") is None
    # a second run of w (a duplicate, or a run again on an engine behind) reads step 1 at
    # a cut below its record, and the lock's chain at the latest cut: free
    stale_steps = book.session(lambda tag: 0 if tag == fr.step_tag("w", 1) else book.top)
    second = LockChain("L")
    assert drive(fc.lock("w", 1, second), stale_steps)  # the step's outcome: the first run's
    drive(fc.unlock("w", 2, second, fr.holder_of("w", 1)), stale_steps)  # recorded: nothing to do
    assert book.holder("L") is None, "the lock is held for good by a holder whose unlock step is recorded"
    # and another workflow can take it
    assert drive(fc.lock("next", 1, LockChain("L")), latest)


# -- Env.lock run again (found by the simulation) -------------------------------------------------------
class ScriptedFlow:
    """What ``Env`` asks of a ``FlowBook`` (``drive`` and ``chain``), on a scripted book
    read at its latest cut."""

    def __init__(self, book: ScriptedBook) -> None:
        self.perform = book.session(lambda tag: book.top)
        self.chains: dict[str, LockChain] = {}

    def drive(self, steps: fc.Steps) -> Any:
        return drive(steps, self.perform)

    def chain(self, name: str) -> LockChain:
        return self.chains.setdefault(name, LockChain(name))


class SleepClock:
    """``time`` as ``Env`` sees it: moves only when a run sleeps, or when told."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_env_lock_run_again_takes_the_first_runs_tries_whatever_its_clock_says(
        monkeypatch: pytest.MonkeyPatch) -> None:
    book = ScriptedBook()
    other = ScriptedFlow(book)
    assert flow_env.Env(cast(flow_env.FlowBook, other), "other").try_lock("L")

    class Clock(SleepClock):
        sleeps = 0

        def sleep(self, seconds: float) -> None:
            self.now += seconds
            self.sleeps += 1
            if self.sleeps == 1:  # the holder gives the lock back while the first run waits
                other.drive(fc.unlock("other", 2, other.chain("L"), fr.holder_of("other", 1)))

    monkeypatch.setattr(flow_env, "time", Clock())
    # the first run: its first try finds the lock held, its next takes it (and it dies)
    assert flow_env.Env(cast(flow_env.FlowBook, ScriptedFlow(book)), "w").lock("L", timeout=1.0)
    assert book.holder("L") == fr.holder_of("w", 4)  # deadline, try, decision to try again, try
    # run again on a slower engine: its clock runs out after its first try, and it still
    # takes the first run's path (else it would go on without the lock its step holds,
    # and nobody would give it back)
    again = flow_env.Env(cast(flow_env.FlowBook, ScriptedFlow(book)), "w")
    assert again.lock("L", timeout=0.0)
    assert again.held == {"L": book.holder("L")}


def test_env_lock_gives_the_worker_back_and_a_run_again_waits_on_to_the_same_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A waiter holds no worker for long (a pool is bounded, and a holder killed mid-run
    needs a worker to run again and give the lock back): past ``run_wait`` a run that
    decided to try again stops (``Suspended``, recording nothing more). Its run again
    replays the tries and decisions and goes on trying; the deadline is a remembered
    step, so the runs together wait ``timeout`` at most, not ``timeout`` each."""
    clock = SleepClock()
    monkeypatch.setattr(flow_env, "time", clock)
    book = ScriptedBook()
    other = ScriptedFlow(book)
    assert flow_env.Env(cast(flow_env.FlowBook, other), "other").try_lock("L")
    with pytest.raises(fc.Suspended):
        flow_env.Env(cast(flow_env.FlowBook, ScriptedFlow(book)), "w").lock("L", timeout=10.0, run_wait=0.05)
    assert book.holder("L") == fr.holder_of("other", 1)
    other.drive(fc.unlock("other", 2, other.chain("L"), fr.holder_of("other", 1)))
    again = flow_env.Env(cast(flow_env.FlowBook, ScriptedFlow(book)), "w")
    assert again.lock("L", timeout=10.0, run_wait=0.05)
    assert again.held == {"L": book.holder("L")} and again.step > 4  # past the first run's tries
    # nobody gives it back: a waiter's runs together give up at the first run's deadline
    with pytest.raises(fc.Suspended):
        flow_env.Env(cast(flow_env.FlowBook, ScriptedFlow(book)), "v").lock("L", timeout=1.0, run_wait=0.05)
    clock.now += 1.0
    assert not flow_env.Env(cast(flow_env.FlowBook, ScriptedFlow(book)), "v").lock("L", timeout=1.0, run_wait=0.05)


# -- BokiFlow on the whole simulated system ----------------------------------------------------------
#: seeds and what each is there for (its counters say it happened): workers killed in the
#: middle of workflows, a duplicate run at once with another, transactions aborted, lock
#: tries refused, runs the log failed (run again), lock waiters that gave their workers
#: back, reads answered with records an engine kept, and the log's own faults (replica crashes, the MMS or failure handler leader
#: killed)
SEEDS = {
    37: ("worker_kills", "duplicates_overlapping", "tx_aborts", "lock_refusals", "replica_crashes"),
    4: ("worker_kills", "duplicates_overlapping", "tx_aborts", "replica_crashes", "leader_kills"),
    # (its engines keep the records their subscriptions delivered: reads answered with them)
    10: ("worker_kills", "duplicates_overlapping", "tx_aborts", "lock_refusals", "leader_kills", "kept_reads"),
    304: ("worker_kills", "duplicates_overlapping", "tx_aborts", "lock_refusals", "run_errors"),
    147: ("worker_kills", "duplicates_overlapping", "tx_aborts", "run_errors", "replica_crashes"),
    # lock waiters gave their workers back (Env.lock's Suspended) and ran again
    9: ("worker_kills", "duplicates_overlapping", "lock_refusals", "suspended", "leader_kills"),
    # a run again on a new worker took the counter's lock again for a holder that had
    # given it back, before the lock step read its record again after the chain
    190: ("worker_kills", "duplicates_overlapping", "lock_refusals", "leader_kills"),
    # a run of a lock step that came second took the lock after the step recorded that
    # it failed, and died before giving it back: the next taker gave it back for it
    221: ("worker_kills", "duplicates_overlapping", "lock_refusals", "tx_aborts"),
}


@pytest.mark.parametrize("seed", sorted(SEEDS))
def test_bokiflow_on_the_simulated_system_runs_each_workflow_once(seed: int) -> None:
    """Each seed checks exactly-once writes, one outcome per workflow, the bank and the
    locks (``python -m tests.sim --flow --seeds 1000`` runs more)."""
    counts = flow_system.run(seed).counts()
    counts["replica_crashes"] = counts["crashes_primary"] + counts["crashes_backup"]
    counts["leader_kills"] = counts["crashes_mms"] + counts["crashes_handler"]
    for what in SEEDS[seed]:
        assert counts[what] > 0, f"seed {seed} was to exercise {what}: {counts}"
    assert counts["workflows"] > 5 and counts["moved"] + counts["refused"] > 0, counts


# -- the checker notices -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def settled() -> Iterator[flow_system.FlowSim]:
    """A seed run to its end (checked green), kept for the tampering tests."""
    sim = flow_system.FlowSim(TAMPER_SEED)
    try:
        sim.run()
        yield sim
    finally:
        sim.close()


#: a seed whose lock had three holders, and whose workflows ran more than once
TAMPER_SEED = 301


def _db(sim: flow_system.FlowSim) -> sqlite3.Connection:
    return sqlite3.connect(sim.db_path, isolation_level=None)


def test_the_flow_simulation_sees_a_write_applied_twice_or_one_no_step_record_made(
        settled: flow_system.FlowSim) -> None:
    sim = settled
    sim.check_flow()  # as it ran: green
    db = _db(sim)
    try:
        table, key, version = db.execute("SELECT tbl, key, version FROM flow_applied LIMIT 1").fetchone()
        db.execute("INSERT INTO flow_applied (tbl, key, version) VALUES (?, ?, ?)", (table, key, version))
        with pytest.raises(AssertionError, match="twice"):
            sim.check_flow()
        db.execute("DELETE FROM flow_applied WHERE rowid = (SELECT max(rowid) FROM flow_applied)")
        sim.check_flow()
        bumped = (int.from_bytes(version, "big") + 1).to_bytes(8, "big")
        db.execute("INSERT INTO flow_applied (tbl, key, version) VALUES (?, ?, ?)", (table, key, bumped))
        with pytest.raises(AssertionError, match="no first step record"):
            sim.check_flow()
        db.execute("DELETE FROM flow_applied WHERE rowid = (SELECT max(rowid) FROM flow_applied)")
        sim.check_flow()
        # a write the log recorded and the database never applied
        db.execute("DELETE FROM flow_applied WHERE rowid = (SELECT min(rowid) FROM flow_applied)")
        with pytest.raises(AssertionError, match="never applied"):
            sim.check_flow()
        db.execute("INSERT INTO flow_applied (rowid, tbl, key, version) VALUES (0, ?, ?, ?)", (table, key, version))
        sim.check_flow()
    finally:
        db.close()


def test_the_flow_simulation_sees_a_row_that_is_not_its_latest_write_and_a_bank_that_lost_money(
        settled: flow_system.FlowSim) -> None:
    sim = settled
    db = _db(sim)
    try:
        account = sim.accounts[0]
        (value,) = db.execute("SELECT value FROM flow_rows WHERE tbl = ? AND key = ?",
                              (flow_system.BANK, account)).fetchone()
        db.execute("UPDATE flow_rows SET value = ? WHERE tbl = ? AND key = ?",
                   (fc.pack(fc.unpack(value) - 1), flow_system.BANK, account))
        with pytest.raises(AssertionError, match="latest recorded write"):
            sim.check_flow()
        # the bank's own check, past the row check
        with pytest.raises(AssertionError, match="the bank holds"):
            sim._check_workload(sim.flow_log(), flow_system.FlowDb.read(sim.db_path))
        db.execute("UPDATE flow_rows SET value = ? WHERE tbl = ? AND key = ?", (value, flow_system.BANK, account))
        sim.check_flow()
    finally:
        db.close()


def test_the_flow_simulation_sees_a_run_with_another_outcome(settled: flow_system.FlowSim) -> None:
    sim = settled
    wid = next(w for w, outcomes in sim.outcomes.items() if len(outcomes) > 1)
    sim.outcomes[wid].append(fc.pack_outcome(True, "something else"))
    try:
        with pytest.raises(AssertionError, match="its first done record holds"):
            sim.check_flow()
    finally:
        sim.outcomes[wid].pop()
    sim.check_flow()


def test_the_flow_simulation_sees_two_lock_holders_at_once(settled: flow_system.FlowSim) -> None:
    sim = settled
    holders = sim.beliefs[sim.lock]
    assert len(holders) >= 2, "the seed took the lock only once: pick another"
    spans = sorted((since or 0, h) for h, (since, _) in holders.items())
    (_, first), (second_took, _) = spans[0], spans[1]
    saved = list(holders[first])
    holders[first][1] = second_took + 1  # the first believed it held the lock past the second's take
    try:
        with pytest.raises(AssertionError, match="two holders at once"):
            sim.check_flow()
    finally:
        holders[first][:] = saved
    sim.check_flow()
    # in the log: the first holder's step takes the lock again after all (what the stale
    # lock step did), or a holder never gives it back
    flow = sim.flow_log()
    records = flow.lock_ops[sim.lock]
    chain = LockChain(sim.lock)
    for gsn, data in records:
        chain.apply(gsn, data)
    first_rec = fr.decode(records[0][1])
    assert type(first_rec) is fr.LockOp and first_rec.acquire and chain.holder is None
    end = records[-1][0]
    again = fr.encode(fr.LockOp(lock=sim.lock, prev=chain.tail, holder=first_rec.holder, acquire=True))
    flow.lock_ops[sim.lock] = [*records, (end + 1, again)]
    with pytest.raises(AssertionError, match="took it again"):
        sim._check_locks(flow)
    newcomer = fr.encode(fr.LockOp(lock=sim.lock, prev=chain.tail, holder="99/newcomer", acquire=True))
    flow.lock_ops[sim.lock] = [*records, (end + 1, newcomer)]
    with pytest.raises(AssertionError, match="still held"):
        sim._check_locks(flow)


def test_the_flow_simulation_sees_a_critical_section_step_recorded_outside_its_hold(
        settled: flow_system.FlowSim) -> None:
    sim = settled
    flow = sim.flow_log()
    # a holder's read, recorded after it gave the lock back
    wid, step = next((w, s) for (w, s, p), (_, rec) in flow.steps.items()
                     if rec.op == "lock" and fc.unpack(rec.value) and w.startswith("holder"))
    gsn, rec = flow.steps[(wid, step + 1, 0)]
    flow.steps[(wid, step + 1, 0)] = (10**18, rec)
    with pytest.raises(AssertionError, match="outside its hold"):
        sim._check_locks(flow)
