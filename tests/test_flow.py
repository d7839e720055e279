"""BokiFlow on a real cluster (ziplog/logbook/flow): a workflow killed at every one of its
operations and run again, two runs of one workflow at once, and worker processes
SIGKILLed under a bank of transfers and a counter behind a lock, while a log replica,
the membership service's leader and the failure handler's are killed too. Each database write
happens once (the database's audit counts applied writes), every caller gets the first
run's return value, the bank's total is kept and the counter misses no increment."""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest

import ziplog
from tests import flow_functions as bank
from ziplog.logbook import LogBook
from ziplog.logbook.core import flow as fc
from ziplog.logbook.flow import Env, FlowBook, FlowClient, SqliteDatabase, Worker, WorkerPool, run_workflow
from ziplog.logbook.flow import travel
from ziplog.protocol.errors import TrimmedError
from ziplog.tools import cli

BOOK = 40


@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=2, replicas=2) as c:
        yield c


class Crash(BaseException):  # a process dying is no exception a function could catch
    pass


def _setup(lb: LogBook, db: SqliteDatabase, workflow: str) -> None:
    FlowClient(lb).start("setup", None, workflow)
    fc.unpack_outcome(run_workflow(FlowBook(lb, db), workflow, travel.functions.get))


def test_a_trip_killed_at_every_operation_and_run_again_books_once(cluster: ziplog.LocalCluster,
                                                                    tmp_path: Path) -> None:
    with LogBook(cluster.zk_hosts, BOOK) as lb, LogBook(cluster.zk_hosts, BOOK) as other:
        db = SqliteDatabase(str(tmp_path / "db.sqlite"), audit=True)
        try:
            _setup(lb, db, "setup-crash")
            client = FlowClient(lb)
            # a clean run, counting its operations
            ops: list[Any] = []
            flow = FlowBook(lb, db)
            flow.hook = lambda op, phase: ops.append(op) if phase == "after" else None
            Worker(flow, travel.functions)
            client.start("book_trip", {"prefer": 0}, "clean")
            clean = fc.unpack_outcome(run_workflow(flow, "clean", travel.functions.get))
            assert clean["booked"] and len(ops) > 30
            for k in range(1, len(ops) + 1):
                wf = f"trip-{k}"
                client.start("book_trip", {"prefer": k % 4}, wf)
                seen = [0]

                def crash(op: Any, phase: str) -> None:
                    if phase == "after":  # the k-th operation took effect, then the run dies
                        seen[0] += 1
                        if seen[0] == k:
                            raise Crash(k)

                crashing = FlowBook(lb, db)
                crashing.hook = crash
                Worker(crashing, travel.functions)
                first: Any = None
                try:
                    first = run_workflow(crashing, wf, travel.functions.get)
                except Crash:
                    pass
                other.observe(lb.position)  # as a queue pop past the call's push hands it over
                again_flow = FlowBook(other, db)  # another engine runs it again
                Worker(again_flow, travel.functions)
                again = run_workflow(again_flow, wf, travel.functions.get)
                assert first is None or again == first, k
            bookings = {k: fc.unpack(v) for k, v in db.rows("bookings").items()}
            hotels = {k: fc.unpack(v) for k, v in db.rows("hotels").items()}
            sold = Counter(b[0] for b in bookings.values())
            assert all(hotels[h] + sold[h] == n for h, n in travel.HOTELS.items()), (hotels, sold)
            applied = Counter((t, key) for t, key, _ in db.applied())
            assert all(applied[("bookings", wf)] == 1 for wf in bookings)  # each booking written once
            # each trip's outcome says booked iff its booking row exists
            for k in range(1, len(ops) + 1):
                outcome = fc.unpack_outcome(run_workflow(FlowBook(other, db), f"trip-{k}", travel.functions.get))
                assert outcome["booked"] == (f"trip-{k}" in bookings), k
        finally:
            db.close()


def test_a_lock_waiter_gives_its_worker_back_and_runs_again_after_the_holder(cluster: ziplog.LocalCluster,
                                                                            tmp_path: Path) -> None:
    """A holder killed mid-run keeps its lock until its run again, which needs a free
    worker of a bounded pool: a waiter gives its worker back after ``RUN_LOCK_WAIT_S``
    (``Suspended``: no outcome recorded), and its run again, once the lock is free, takes
    it and counts once."""
    book = BOOK + 40
    with LogBook(cluster.zk_hosts, book) as lb, LogBook(cluster.zk_hosts, book) as other:
        db = SqliteDatabase(str(tmp_path / "db.sqlite"), audit=True)
        try:
            holder = Env(FlowBook(other, db), "holder")  # a run that took the lock, then died
            assert holder.try_lock("counter")
            FlowClient(lb).start("count_under_lock", None, "waiter")
            flow = FlowBook(lb, db)
            worker = Worker(flow, bank.functions)
            assert worker.run_one() and worker.suspended == 1 and worker.ran == 0
            assert flow.drive(fc.read_done("waiter")) is None, "a suspended run recorded an outcome"
            holder.unlock("counter")  # the holder's run again gives the lock back
            other.observe(lb.position)
            again = fc.unpack_outcome(run_workflow(FlowBook(other, db), "waiter", bank.functions.get))
            assert again == 1 and db.rows("counters") and fc.unpack(db.rows("counters")["c"]) == 1
        finally:
            db.close()


def test_two_runs_of_one_workflow_at_once_have_one_effect_and_one_answer(
        cluster: ziplog.LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db_path = str(tmp_path / "db.sqlite")
    with LogBook(cluster.zk_hosts, BOOK + 10) as lb:
        db = SqliteDatabase(db_path, audit=True)
        try:
            _setup(lb, db, "setup-dup")
            client = FlowClient(lb)
            workflows = [f"dup-{i}" for i in range(4)]
            for i, wf in enumerate(workflows):
                client.start("book_trip", {"prefer": i}, wf)
            answers: dict[str, list[Any]] = {wf: [] for wf in workflows}

            def run() -> None:
                with LogBook(cluster.zk_hosts, BOOK + 10) as mine:
                    own_db = SqliteDatabase(db_path, audit=True)
                    try:
                        flow = FlowBook(mine, own_db)
                        Worker(flow, travel.functions)
                        for wf in workflows:
                            answers[wf].append(run_workflow(flow, wf, travel.functions.get))
                    finally:
                        own_db.close()

            threads = [threading.Thread(target=run) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert all(len(a) == 2 and a[0] == a[1] for a in answers.values()), answers
            applied = Counter((t, key) for t, key, _ in db.applied())
            assert all(applied[("bookings", wf)] == 1 for wf in workflows), applied
            booked = sum(fc.unpack_outcome(a[0])["booked"] for a in answers.values())
            hotels = {k: fc.unpack(v) for k, v in db.rows("hotels").items()}
            assert sum(travel.HOTELS.values()) - sum(hotels.values()) == booked == len(workflows)
        finally:
            db.close()
    # what an operator sees of one of them
    assert cli.main(["flow", "steps", "dup-0", "--book", str(BOOK + 10), "--zk", cluster.zk_hosts]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "workflow dup-0: book_trip({'prefer': 0})", out
    assert [line.split("\t")[2] for line in out[1:3]] == ["invoke", "invoke"], out
    assert out[-1].startswith("returned: {") and "'booked': True" in out[-1], out
    assert cli.main(["flow", "steps", "never", "--book", str(BOOK + 10), "--zk", cluster.zk_hosts]) == 1


def test_an_idle_worker_takes_work_pushed_after_it_found_the_queue_empty(cluster: ziplog.LocalCluster,
                                                                        tmp_path: Path) -> None:
    # a worker that only polls appends nothing: its reads must still see later pushes
    with LogBook(cluster.zk_hosts, BOOK + 30) as wlb, LogBook(cluster.zk_hosts, BOOK + 30) as clb:
        db = SqliteDatabase(str(tmp_path / "db.sqlite"))
        try:
            worker = Worker(FlowBook(wlb, db), travel.functions)
            assert not worker.run_one()  # a queue with no record at all
            FlowClient(clb).start("setup", None, "late")
            deadline = time.monotonic() + 30
            while not worker.run_one():
                assert time.monotonic() < deadline, "an idle worker never saw the push"
                time.sleep(0.01)
            assert worker.ran == 1
        finally:
            db.close()


def test_workers_killed_under_transfers_and_a_lock_lose_and_repeat_nothing(cluster: ziplog.LocalCluster,
                                                                            tmp_path: Path) -> None:
    db_path = str(tmp_path / "bank.sqlite")
    SqliteDatabase(db_path, audit=True).close()
    rng = random.Random(7)
    book = BOOK + 20
    env = {"PYTHONPATH": str(Path(__file__).resolve().parent.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # the sweeper collects ended workflows a second after it saw them end, so trims run
    # all along under the live ones
    workers_log = tmp_path / "workers.log"
    pool = WorkerPool(cluster.zk_hosts, book, "tests.flow_functions:functions", db_path, 3, retry_after=1.0,
                      collect_after=1.0, audit=True, env=env, log=str(workers_log))
    pool.start()
    try:
        _bank_under_faults(cluster, pool, book, db_path, rng)
    except BaseException:
        print(f"the workers' exits: {pool.exits}; their output:")
        print(workers_log.read_text(errors="replace")[-20_000:] if workers_log.exists() else "(none)")
        raise
    finally:
        pool.close()


def _bank_under_faults(cluster: ziplog.LocalCluster, pool: WorkerPool, book: int, db_path: str,
                       rng: random.Random) -> None:
    with LogBook(cluster.zk_hosts, book) as lb:
        FlowClient(lb, retry_after=1.0).call("open_accounts", None, "open")
        transfers: list[tuple[str, dict[str, Any]]] = [
            (f"tx-{i}", {"from": rng.choice(bank.ACCOUNTS), "to": rng.choice(bank.ACCOUNTS), "amount": rng.randint(1, 40)})
            for i in range(16)]
        transfers = [(wf, r) for wf, r in transfers if r["from"] != r["to"]]
        counts = [(f"count-{i}", None) for i in range(8)]
        calls = [("transfer", wf, r) for wf, r in transfers] + [("count_under_lock", wf, r) for wf, r in counts]
        rng.shuffle(calls)
        answers: dict[str, Any] = {}
        # the faults and the calls pace each other, so every fault lands mid-run on any
        # machine: a client's k-th call waits for the (k+1)-th fault, the i-th fault for
        # the i-th answer
        progress = threading.Condition()
        drawn = [0]

        def client(mine: list[tuple[str, str, Any]]) -> None:
            with LogBook(cluster.zk_hosts, book) as session:
                fcl = FlowClient(session, retry_after=1.0)
                for k, (fn, wf, req) in enumerate(mine):
                    with progress:
                        # a client's last call waits for them all, so none ends before
                        need = len(faults) if k == len(mine) - 1 else min(k + 1, len(faults))
                        assert progress.wait_for(lambda: drawn[0] >= need, timeout=120)
                    answer = fcl.call(fn, req, wf, timeout=120)
                    again = 0
                    while fn == "count_under_lock" and answer == bank.BUSY:
                        again += 1  # the lock stayed taken: a new call, which counts once
                        answer = fcl.call(fn, req, f"{wf}-again{again}", timeout=120)
                    with progress:
                        answers[wf] = answer
                        progress.notify_all()

        kills = 0

        def kill_worker() -> None:
            nonlocal kills
            kills += pool.kill(rng.randrange(3)) is not None

        # the workers die, and so do a log replica, the membership service's leader and
        # the failure handler's (each started again)
        replica_down = [False]

        def kill_replica() -> None:
            cluster.kill_replica(0, 1)
            replica_down[0] = True

        def restart_replica() -> None:
            cluster.restart_replica(0, 1)
            replica_down[0] = False

        faults = [kill_worker, kill_replica, kill_worker, cluster.kill_mms_leader, kill_worker,
                  cluster.kill_fh_leader, restart_replica, kill_worker]
        threads = [threading.Thread(target=client, args=(calls[i::3],)) for i in range(3)]
        for t in threads:
            t.start()
        try:
            for i, fault in enumerate(faults):
                with progress:
                    assert progress.wait_for(lambda: len(answers) >= i, timeout=120), "no answer came"
                fault()
                with progress:
                    drawn[0] += 1
                    progress.notify_all()
        finally:
            if replica_down[0]:
                cluster.restart_replica(0, 1)
        assert all(t.is_alive() for t in threads), "a client ended before every fault was drawn"
        for t in threads:
            t.join()
        # every workflow ended: the sweeper collects them all, and a duplicate call of
        # one collected is refused rather than run again
        sweeper = pool.sweeper
        assert sweeper is not None
        deadline = time.monotonic() + 60
        while sweeper.trimmed_to <= sweeper.cursor and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sweeper.trimmed_to > sweeper.cursor > 0, (sweeper.trimmed_to, sweeper.cursor)
        lb.observe(sweeper.lb.position)  # a session that has seen the trim
        with pytest.raises(TrimmedError):
            FlowClient(lb).start("open_accounts", None, "open")
    assert kills > 0 and pool.wait_restarts(kills, 60), (kills, pool.restarts)
    db = SqliteDatabase(db_path)
    try:
        accounts = {k: fc.unpack(v) for k, v in db.rows("accounts").items()}
        assert sum(accounts.values()) == START_TOTAL, accounts  # the bank's total is kept
        assert fc.unpack(db.rows("counters")["c"]) == len(counts)  # no increment lost or made twice
        assert sorted(answers[wf] for wf, _ in counts) == list(range(1, len(counts) + 1))
        applied = Counter((t, k, v) for t, k, v in db.applied())
        assert all(n == 1 for n in applied.values())
        # each committed transfer moved its amount once: replaying the answers gives the balances
        expect = dict.fromkeys(bank.ACCOUNTS, bank.START)
        assert all(isinstance(answers[wf], bool) for wf, _ in transfers)
        committed = [r for wf, r in transfers if answers[wf]]
        for r in committed:
            expect[r["from"]] -= r["amount"]
            expect[r["to"]] += r["amount"]
        assert accounts == expect
    finally:
        db.close()


START_TOTAL = bank.START * len(bank.ACCOUNTS)
