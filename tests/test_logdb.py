"""LogDB end to end on real processes: a local cluster (2 shards x 2 replicas), two
coordinator replicas and three KV shards. Serializability checked against a replay of
the committed transactions; a bank under kill -9 of the coordinator leader, a KV shard
and a log replica; hostile records and frames; idle shards."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import msgspec
import pytest
import zmq

import ziplog
from tests.logdb_checks import check_shards_against, replay_log, wait_applied
from ziplog.logdb import AsyncLogDB, LogDB, TransactionAborted
from ziplog.tools.logdb_local import local_logdb
from ziplog.logdb.core import frames as f
from ziplog.logdb.core.kvshard import decode_snapshot, owner
from ziplog.logdb.core.records import HEADER, Commit, Write, encode
from ziplog.tools.logdb_local import LocalLogDB


@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=2, replicas=2) as c:
        yield c


@pytest.fixture(scope="module")
def ldb(cluster: ziplog.LocalCluster) -> Iterator[LocalLogDB]:
    # no collection here: the checks replay the log from its genesis
    with local_logdb(cluster, coordinators=2, kv_shards=3,
                     coordinator_args=["--no-gc", "--snapshot-every", "1"], kv_args=["--snapshot-every", "1"]) as l:
        yield l


@dataclass
class Done:
    """A committed transaction as its client saw it."""
    txn: int
    at: int  # serialization point
    writer: bool
    reads: dict[bytes, bytes | None]
    writes: dict[bytes, bytes | None]


def check_serializable(done: list[Done]) -> dict[bytes, bytes | None]:
    """Replay the committed writers in commit gsn order from an empty store; every
    transaction's reads must be the store's values at its serialization point (a writer
    sees the commits before its own; a read-only one the commits up to its position)."""
    store: dict[bytes, bytes | None] = {}
    for t in sorted(done, key=lambda t: (t.at, not t.writer)):
        for key, value in t.reads.items():
            assert store.get(key) == value, (f"txn {t.txn} at {t.at} read {key!r}={value!r}, the replay has "
                                             f"{store.get(key)!r}")
        store.update(t.writes)
    return store


def test_concurrent_transactions_are_serializable(ldb: LocalLogDB) -> None:
    # keys no other test writes: the check replays from an empty store
    counters = [b"serial-c%d" % i for i in range(10)]
    accounts = [b"serial-a%d" % i for i in range(4)]
    done: list[Done] = []
    aborts = [0]
    lock = threading.Lock()
    errors: list[BaseException] = []
    #: every transaction this test began (other tests of the module write the same log)
    attempted: set[int] = set()

    def record(t: Any) -> None:
        with lock:
            done.append(Done(t.txn, t.serialized_at, bool(t.writes), t.reads, t.writes))

    def begin(db: Any) -> Any:
        t = db.transaction()
        with lock:
            attempted.add(t.txn)
        return t

    def one(db: LogDB, rng: random.Random) -> None:
        kind = rng.random()
        try:
            with begin(db) as t:
                if kind < 0.5:  # the paper's transaction: read key k, write k + 1
                    k = rng.choice(counters)
                    t.put(k, b"%d" % (int(t.get(k) or b"0") + 1))
                elif kind < 0.8:  # a transfer between two accounts
                    a, b = rng.sample(accounts, 2)
                    va, vb = int(t.get(a) or b"0"), int(t.get(b) or b"0")
                    t.put(a, b"%d" % (va - 1))
                    t.put(b, b"%d" % (vb + 1))
                else:  # read-only over three keys
                    for k in rng.sample(counters + accounts, 3):
                        t.get(k)
            record(t)
        except TransactionAborted:
            with lock:
                aborts[0] += 1

    def worker(w: int) -> None:
        rng = random.Random(w)
        try:
            with LogDB(ldb.zk_hosts) as db:
                for _ in range(40):
                    one(db, rng)
        except BaseException as exc:
            errors.append(exc)

    async def async_workers() -> None:
        async with AsyncLogDB(ldb.zk_hosts) as db:
            async def task(w: int) -> None:
                rng = random.Random(100 + w)
                for _ in range(25):
                    k = rng.choice(counters)
                    try:
                        async with begin(db) as t:
                            t.put(k, b"%d" % (int(await t.get(k) or b"0") + 1))
                        record(t)
                    except TransactionAborted:
                        with lock:
                            aborts[0] += 1
            await asyncio.gather(*(task(w) for w in range(3)))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
    for th in threads:
        th.start()
    try:
        asyncio.run(async_workers())
    finally:
        for th in threads:
            th.join()
    assert not errors, errors
    writers = [t for t in done if t.writer]
    assert len(writers) > 50 and aborts[0] > 0, (len(writers), aborts[0])  # contended: the check is not vacuous
    final = check_serializable(done)
    # the log's own decisions: of this test's transactions, exactly those the clients saw commit
    last = max(t.at for t in writers)
    replay = replay_log(ldb.zk_hosts, last)
    assert {d.txn for d in replay.committed if d.txn in attempted} == {t.txn for t in writers}
    assert {k: v for k, (v, _, _) in replay.state.items() if k in final} == final
    with LogDB(ldb.zk_hosts) as db:
        for key, value in final.items():
            assert db.get(key) == value
    wait_applied(ldb, replay.position)
    check_shards_against(ldb, replay)


def test_bank_under_kills(ldb: LocalLogDB, cluster: ziplog.LocalCluster) -> None:
    accounts = [b"acct%d" % i for i in range(12)]
    with LogDB(ldb.zk_hosts) as db:
        def open_accounts(t: Any) -> None:
            for a in accounts:
                t.put(a, b"1000")
        db.run(open_accounts)
    total = 1000 * len(accounts)
    stop = threading.Event()
    committed = [0]
    cond = threading.Condition()
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        rng = random.Random(w)
        try:
            with LogDB(ldb.zk_hosts) as db:
                while not stop.is_set():
                    a, b = rng.sample(accounts, 2)
                    amount = rng.randint(1, 50)

                    def transfer(t: Any) -> None:
                        va, vb = int(t.get(a)), int(t.get(b))
                        t.put(a, b"%d" % (va - amount))
                        t.put(b, b"%d" % (vb + amount))
                    db.run(transfer, retries=100)
                    with cond:
                        committed[0] += 1
                        cond.notify_all()
        except BaseException as exc:
            errors.append(exc)

    def more_commits(n: int = 15, timeout: float = 60.0) -> None:
        with cond:
            target = committed[0] + n
            assert cond.wait_for(lambda: committed[0] >= target or bool(errors), timeout), "transfers stalled"
        assert not errors, errors

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
    for th in threads:
        th.start()
    try:
        more_commits()
        ldb.kill_coordinator_leader()
        more_commits()
        ldb.kill_kv_shard(1)
        more_commits()
        cluster.kill_replica(0, 0)  # the local cluster's supervisor starts it again
        more_commits()
        ldb.restart_kv_shard(1)
        more_commits()
    finally:
        stop.set()
        for th in threads:
            th.join()
        if ldb.kv[1].poll() is not None:  # stopped between the kill and the restart: the module's other tests need it
            ldb.restart_kv_shard(1)
    assert not errors, errors
    with LogDB(ldb.zk_hosts) as db:
        def read_all(t: Any) -> dict[bytes, int]:
            return {a: int(t.get(a)) for a in accounts}
        balances = db.run(read_all, retries=20)
        assert sum(balances.values()) == total
        position = db.position
        replay = replay_log(ldb.zk_hosts, position)
        for a in accounts:
            assert db.get(a) == replay.state[a][0]
    assert sum(int(replay.state[a][0] or b"0") for a in accounts) == total
    wait_applied(ldb, replay.position)
    check_shards_against(ldb, replay)


def test_other_records_hostile_commits_and_dangling_writes(ldb: LocalLogDB, cluster: ziplog.LocalCluster) -> None:
    with cluster.client() as c, LogDB(ldb.zk_hosts) as db:
        db.run(lambda t: t.put(b"hostile", b"before"))
        c.insert_after(b"another application's record")
        c.insert_after(HEADER + b"\xc1 not msgpack")
        c.insert_after(HEADER + msgspec.msgpack.encode([2, 5, {"str": [1, 1]}, {}]))  # ill-typed commit
        # a client that dies between its write and its commit: the write stays invisible
        c.insert_after(encode(Write(txn=41, key=b"hostile", value=b"ghost")))
        # a commit naming a rid nobody wrote, and one naming another transaction's write
        c.insert_after(encode(Commit(txn=42, reads={}, writes={b"hostile": (3, 0)})))
        theirs = c.insert_after(encode(Write(txn=43, key=b"hostile", value=b"stolen")))
        c.insert_after(encode(Commit(txn=44, reads={}, writes={b"hostile": tuple(theirs)})), theirs)
        # a transaction whose commit record is resent: applied once
        w = c.insert_after(encode(Write(txn=45, key=b"resent", value=b"once")))
        commit = encode(Commit(txn=45, reads={}, writes={b"resent": tuple(w)}))
        first = c.insert_after(commit, w)
        resent = c.insert_after(commit, first)
        db.observe(resent.gsn)  # another client's records: this session reads past them
        assert db.get(b"hostile") == b"before"
        assert db.get(b"resent") == b"once"
        # the decisions, asked by commit rid, as a client would
        replay = replay_log(ldb.zk_hosts, first.gsn)
        by_txn = {d.txn: d for d in replay.decisions if not d.duplicate}
        assert not by_txn[42].committed and not by_txn[44].committed and by_txn[45].committed
        assert [d.duplicate for d in replay.decisions if d.txn == 45] == [False, True]
        position = db.position
    wait_applied(ldb, position)
    owning = ldb.kv_store(owner(b"resent", ldb.kv_shards))
    try:
        assert [t for _, t, _ in owning.journal()].count(45) == 1
        assert owning.get(b"resent") == (b"once", w.gsn, w.shard)
    finally:
        owning.close()
    for p in [*ldb.coordinators.values(), *ldb.kv.values()]:
        assert p.poll() is None, "a LogDB process died of hostile records"


def test_bad_frames_get_typed_errors_and_servers_keep_serving(ldb: LocalLogDB) -> None:
    ldb.wait_ready()  # every address registered is a running process's (another test kills some)
    with LogDB(ldb.zk_hosts) as db:
        db.run(lambda t: t.put(b"framed", b"v"))
        position = db.position
        targets = [(a, "coordinator") for a in db._dir.coordinators()]
        targets += [(db._dir.kv_addr(i), "kv") for i in range(ldb.kv_shards)]
    ctx = zmq.Context()
    try:
        for addr, kind in targets:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, 10_000)
            s.connect(addr)
            try:
                for junk in (b"", b"\xc1", msgspec.msgpack.encode([99, 1]), msgspec.msgpack.encode([1, "x", b"k"]),
                             msgspec.msgpack.encode([1, 1, b"k" * 5000, 0])):
                    s.send(junk)
                    ans = f.decode_answer(s.recv())
                    assert type(ans) is f.Failed and ans.code == f.BAD_REQUEST, (kind, junk, ans)
                if kind == "coordinator":
                    s.send(f.encode(f.Latest(req=7, key=b"framed", min_gsn=position)))
                    ans = f.decode_answer(s.recv())
                    assert type(ans) is f.LatestIs and ans.req == 7 and ans.gsn > 0
                else:
                    s.send(f.encode(f.KvGet(req=8, key=b"framed")))
                    ans = f.decode_answer(s.recv())
                    assert ans.req == 8 and type(ans) in (f.KvValue, f.Failed)
                    if type(ans) is f.Failed:
                        assert ans.code == f.NOT_OWNER
            finally:
                s.close(0)
    finally:
        ctx.term()


def test_cli_put_and_get(ldb: LocalLogDB) -> None:
    import subprocess
    import sys
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ziplog.tools.cli", "logdb", *args, "--zk", ldb.zk_hosts],
                              capture_output=True, text=True, timeout=120)
    put = cli("put", "cli-key", "cli value")
    assert put.returncode == 0 and "committed at gsn" in put.stdout, put.stderr
    got = cli("get", "cli-key")
    assert got.returncode == 0 and got.stdout.strip() == "cli value", got.stderr
    missing = cli("get", "no-such-key")
    assert missing.returncode == 1 and "no value" in missing.stderr


def test_an_idle_kv_shard_keeps_its_position_moving(ldb: LocalLogDB) -> None:
    """A shard none of whose keys are written still stores its position and snapshot as
    the log moves: a restart starts near the head, not where it last applied."""
    idle = 2
    key = next(b"busy%d" % i for i in range(1000) if owner(b"busy%d" % i, ldb.kv_shards) != idle)
    with LogDB(ldb.zk_hosts) as db:
        db.run(lambda t: t.put(key, b"x"))
        wrote_at = db.position
    deadline = time.monotonic() + 30
    while True:
        store = ldb.kv_store(idle)
        try:
            stored = store.load()
        finally:
            store.close()
        snap = decode_snapshot(stored.snapshot) if stored.snapshot is not None else None
        if snap is not None and snap.position > wrote_at and stored.applied > wrote_at:
            break
        assert time.monotonic() < deadline, "the idle shard's position did not follow the log"
        time.sleep(0.1)
    ldb.restart_kv_shard(idle)
    ldb.wait_ready()
