"""BokiStore on LogBook, real processes: the speculative commit of Boki's Figure 9
(a failed transaction's commit is no conflict), snapshot reads, and the counter test of
Boki's 7.5 scaled down: 32 counters, transactions adding 1 to k = 2, 3 or 5 of them
from 8 concurrent instances (each its own engine) until 100 committed; every counter ends at the
number of committed increments, exactly."""

from __future__ import annotations

import random
import threading
from typing import Iterator

import pytest

import ziplog
from ziplog.logbook import LogBook
from ziplog.logbook.store import BokiStore

INSTANCES = 8
COUNTERS = 32
#: the instances run until this many transactions committed in all (a count, not a
#: time: a busy machine takes longer, and commits as many) ...
COMMITTED = 100
#: ... or one made this many attempts (none can spin for ever)
MAX_ATTEMPTS = 200


@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=2, replicas=2) as c:
        yield c


def test_a_failed_transaction_is_no_conflict_and_reads_see_the_snapshot(cluster: ziplog.LocalCluster) -> None:
    with LogBook(cluster.zk_hosts, 100) as lb:
        store = BokiStore(lb)
        store.set("x", "v", 0)
        a, b, c = store.begin(), store.begin(), store.begin()
        store.set("z", "v", 1)  # after every start: no transaction sees it
        assert a.get("z") == {} and store.get("z") == {"v": 1}
        a.set("x", "v", 1)
        assert a.commit()  # nothing wrote x in its window
        b.set("x", "v", 2)
        b.set("y", "v", 2)
        assert not b.commit()  # a's write to x took effect in its window
        c.set("y", "v", 3)
        assert c.commit()  # b wrote y in its window, but b failed (Boki's Fig. 9)
        assert store.get("x") == {"v": 1} and store.get("y") == {"v": 3}
        d = store.begin()
        store.set("y", "v", 4)  # a plain write always takes effect
        d.set("y", "v", 5)
        assert not d.commit() and store.get("y") == {"v": 4}
        ro = store.begin(read_only=True)
        store.set("y", "v", 6)
        assert ro.get("y") == {"v": 4} and ro.commit()
        # another engine decides the same outcomes from the log alone
        with LogBook(cluster.zk_hosts, 100) as other:
            assert BokiStore(other).get("x") == {"v": 1} and BokiStore(other).get("y") == {"v": 6}


def test_counters_end_at_the_committed_increments(cluster: ziplog.LocalCluster) -> None:
    names = [f"counter{i}" for i in range(COUNTERS)]
    committed = [[0] * COUNTERS for _ in range(INSTANCES)]
    attempts = [0] * INSTANCES
    successes = [0] * INSTANCES
    errors: list[BaseException] = []

    def instance(i: int) -> None:
        rng = random.Random(i)
        try:
            with LogBook(cluster.zk_hosts, 200) as lb:
                store = BokiStore(lb, rng)
                while sum(successes) < COMMITTED and attempts[i] < MAX_ATTEMPTS:
                    k = rng.choice([2, 3, 5])
                    picked = rng.sample(range(COUNTERS), k)
                    t = store.begin()
                    for c in picked:
                        t.set(names[c], "n", t.get(names[c]).get("n", 0) + 1)
                    attempts[i] += 1
                    if t.commit():
                        successes[i] += 1
                        for c in picked:
                            committed[i][c] += 1
        except BaseException as exc:  # reported below: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=instance, args=(i,)) for i in range(INSTANCES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    want = [sum(committed[i][c] for i in range(INSTANCES)) for c in range(COUNTERS)]
    with LogBook(cluster.zk_hosts, 200) as lb:
        store = BokiStore(lb)
        got = [store.get(n).get("n", 0) for n in names]
    assert got == want
    print(f"{sum(attempts)} transactions from {INSTANCES} instances; {sum(successes)} committed "
          f"({sum(map(sum, committed))} increments)")
    # not vacuous: many committed, and conflicts made some fail
    assert sum(successes) >= COMMITTED and sum(successes) < sum(attempts), (attempts, successes)


def test_an_update_no_replay_would_read_is_refused_before_it_is_appended() -> None:
    from ziplog.logbook.core import objects as o

    for bad in (o.Write(obj="", field="f", value=1), o.Write(obj="x" * (o.MAX_NAME + 1), field="f", value=1),
                o.TxnCommit(txn=1, start=1, writes=[("ok", "", 1)])):
        with pytest.raises(ValueError):
            o.encode(bad)
    assert o.decode(o.encode(o.Write(obj="x", field="f", value=[1, {"a": None}]))) is not None


def test_a_replay_whose_records_a_trim_took_is_refused_not_rebuilt_wrong(cluster: ziplog.LocalCluster) -> None:
    """A view replays an object's updates from where it last stopped. If a trim took
    one it needs, a view built from what is left would be wrong without a word: the
    read says so (``TrimmedError``). A view the trim took nothing from (it had read
    past it, or the object had no update there) goes on as before."""
    with LogBook(cluster.zk_hosts, 101) as lb:
        store = BokiStore(lb)
        store.set("acct", "balance", 100)
        store.set("acct", "owner", "ann")  # a field only this early update sets
        store.set("other", "v", 1)
        assert store.get("acct") == {"balance": 100, "owner": "ann"}  # this store's view is past both
        keep = store.set("acct", "balance", 90)
        store.set("quiet", "v", 1)  # an object with no update below the trim point ...
        lb.trim(keep)  # ... while the first updates of acct and other are gone
        store.set("acct", "balance", 80)
        assert store.get("acct") == {"balance": 80, "owner": "ann"}  # its view needed nothing the trim took
        with LogBook(cluster.zk_hosts, 101) as other:
            other.observe(lb.position)
            fresh = BokiStore(other)
            with pytest.raises(ziplog.TrimmedError, match="trim"):
                fresh.get("acct")  # a fresh view would miss "owner": refused
            with pytest.raises(ziplog.TrimmedError):
                fresh.get("other")
            with pytest.raises(ziplog.TrimmedError):
                fresh.begin(read_only=True).get("acct")
            assert fresh.get("quiet") == {"v": 1}  # the trim took none of its records
            rec = other.read_next(0)  # a plain read_next (Boki's) skips to the first record past the trim
            assert rec is not None and rec.seqnum >= keep


def test_a_queue_replay_past_a_trim_that_took_its_records_is_refused(cluster: ziplog.LocalCluster) -> None:
    from ziplog.logbook.queue import BokiQueue

    with LogBook(cluster.zk_hosts, 102) as lb:
        q = BokiQueue(lb, "jobs")
        q.push(b"one")
        keep = q.push(b"two")
        lb.trim(keep)  # the push of "one" is gone
        with LogBook(cluster.zk_hosts, 102) as other:
            other.observe(lb.position)  # reads from cuts the trim is in force at (a session at 0 may read below it)
            with pytest.raises(ziplog.TrimmedError):
                BokiQueue(other, "jobs").pop()  # would hand out "two" as the oldest element
