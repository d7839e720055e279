"""The core log end to end on real processes: ZooKeeper x3, MMS x3, 2 shards x 2 replicas."""

from __future__ import annotations

import random
import threading
from typing import Iterator

import pytest

import ziplog
from ziplog import RID_GENESIS, Policy, RecordId
from tests.load import wait_status


@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=2, replicas=2) as c:
        yield c


def collect(sub: ziplog.Subscription, until: "set[RecordId]", timeout: float = 60.0) -> list[ziplog.Record]:
    """Read ``sub`` until every rid in ``until`` has been seen."""
    got: list[ziplog.Record] = []
    missing = set(until)
    while missing:
        rec = sub.next(timeout=timeout)
        assert rec is not None, f"subscription stalled with {len(missing)} records missing"
        got.append(rec)
        missing.discard(rec.rid)
    return got


def test_concurrent_writers_two_subscribers_agree(cluster: ziplog.LocalCluster) -> None:
    writers, per_writer = 4, 150
    written: dict[RecordId, tuple[bytes, RecordId]] = {}
    pool: list[RecordId] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    with cluster.client() as c1, cluster.client() as c2:
        sub1, sub2 = c1.subscribe(RID_GENESIS), c2.subscribe(RID_GENESIS)

        def writer(w: int) -> None:
            rng = random.Random(w)
            try:
                with cluster.client() as c:
                    after = RID_GENESIS
                    for i in range(per_writer):
                        # InsertAfter chains: mostly after our own last record, sometimes after
                        # another writer's (a causal dependency across clients and shards).
                        if rng.random() < 0.2:
                            with lock:
                                if pool:
                                    after = rng.choice(pool)
                        data = f"w{w}-{i}".encode() * rng.randint(1, 50)
                        rid = c.insert_after(data, after)
                        assert rid.gsn > after.gsn
                        with lock:
                            written[rid] = (data, after)
                            pool.append(rid)
                        after = rid
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert len(written) == writers * per_writer
        assert len({rid.gsn for rid in written}) == len(written), "two records share a gsn"
        assert {rid.shard for rid in written} == {0, 1}, "the random policy spreads over both shards"

        got1 = collect(sub1, set(written))
        got2 = collect(sub2, set(written))
        sub1.close()
        sub2.close()
    for got in (got1, got2):
        gsns = [r.rid.gsn for r in got]
        assert gsns == sorted(set(gsns)), "gsns strictly increasing"
        ours = [r for r in got if r.rid in written]
        assert len(ours) == len(written), "every acknowledged record exactly once"
        for r in ours:
            assert r.data == written[r.rid][0]
        position = {r.rid: i for i, r in enumerate(got)}
        for rid, (_, after) in written.items():
            if after != RID_GENESIS:
                assert position[after] < position[rid], "InsertAfter order kept in the log"
    # the two subscribers agree record for record over the common prefix
    n = min(len(got1), len(got2))
    assert [(r.rid, r.data) for r in got1[:n]] == [(r.rid, r.data) for r in got2[:n]]


def test_read_recent_and_stable_records(cluster: ziplog.LocalCluster) -> None:
    with cluster.client() as c:
        rids = [c.insert_after(f"r{i}".encode() * 100) for i in range(20)]
        # recent: read right after the insert (all replicas asked)
        assert c.read_record(rids[-1]) == b"r19" * 100
        # once a subscriber delivered them they are stable: one replica answers
        with c.subscribe(min(rids)) as sub:  # without InsertAfter chaining, order is free
            collect(sub, set(rids))
        assert c.read_record(rids[-1]) == b"r19" * 100  # teaches the client the stable watermark

        def reads_served() -> int:
            return sum(r["reads"] for reps in wait_status(c).values() for r in reps)

        before = reads_served()
        for i, rid in enumerate(rids):
            assert c.read_record(rid) == f"r{i}".encode() * 100
        assert reads_served() - before == len(rids), "a stable record is read from one replica"


def test_subscribe_starts_at_the_given_record(cluster: ziplog.LocalCluster) -> None:
    with cluster.client() as c:
        rids = [c.insert_after(b"s%d" % i) for i in range(10)]
        start = sorted(rids)[4]
        with c.subscribe(start) as sub:
            first = sub.next(timeout=30)
            assert first is not None and first.rid == start
        with c.subscribe(ziplog.RID_RECENT) as sub:
            later = c.insert_after(b"after-recent")
            got = collect(sub, {later})
            assert all(a.rid.gsn < b.rid.gsn for a, b in zip(got, got[1:]))


def test_policies(cluster: ziplog.LocalCluster) -> None:
    with cluster.client() as c:
        c.set_policy(Policy.fixed(1))
        assert {c.insert_after(b"f").shard for _ in range(10)} == {1}
        c.set_policy(Policy.by_key())
        a = {c.insert_after(b"x", key=b"user-42").shard for _ in range(10)}
        assert len(a) == 1
        c.set_policy(Policy.fixed(99))
        with pytest.raises(ziplog.NoShardAvailableError):
            c.insert_after(b"nowhere")


def test_errors_are_typed(cluster: ziplog.LocalCluster) -> None:
    with cluster.client() as c:
        with pytest.raises(ziplog.RecordTooLargeError):
            c.insert_after(b"x" * ((1 << 20) + 1))
        rid = c.insert_after(b"y")
        with pytest.raises(ziplog.NotFoundError):
            # the shard holds no record at the other shard's gsn (or a no-op position)
            c.read_record(RecordId(rid.gsn, 1 - rid.shard))
        with pytest.raises(ziplog.UnknownRecordError):
            c.read_record(RecordId(rid.gsn + (10_000 << 32), rid.shard))
        with pytest.raises(ziplog.UnknownRecordError):
            c.read_record(RecordId(5, 7))  # no such shard
        assert isinstance(ziplog.TrimmedError("x"), ziplog.ZiplogError)


def test_an_identity_reused_after_another_rid_fails_typed_and_the_client_goes_on(cluster: ziplog.LocalCluster) -> None:
    """A client that reuses an earlier client's id (a Spark task run again) sends seq 1
    after a later rid: the replicas answer the duplicate with the gsn it already has,
    below that rid. The insert fails with a typed error naming the record; the client
    stays usable."""
    pinned = Policy.fixed(0)
    with cluster.client(client_id=4242, policy=pinned) as first:
        a = first.insert_after(b"reused-1")
    with cluster.client(policy=pinned) as other:
        b = other.insert_after(b"reused-other", a)
    with cluster.client(client_id=4242, policy=pinned) as again:
        with pytest.raises(ziplog.ReusedIdentityError) as err:
            again.insert_after(b"reused-1", b)
        assert (err.value.rid, err.value.after_gsn, err.value.seq) == (a, b.gsn, 1)
        assert again.insert_after(b"reused-2", b) > b
        assert again.read_record(a) == b"reused-1"


def test_slow_subscriber_memory_is_bounded(cluster: ziplog.LocalCluster) -> None:
    """Flow control: a subscriber that does not read holds at most its byte credit per
    shard, however much is written."""
    from ziplog.cores.client.subscription import SUB_CREDIT_BYTES
    big = b"z" * 65536
    with cluster.client() as c:
        first = c.insert_after(b"start")
        with c.subscribe(first) as sub:
            assert sub.next(timeout=30) is not None
            rids = [c.insert_after(big) for _ in range(600)]  # ~39 MiB, far above the credit
            last = max(rids)
            peak = 0
            seen = 0
            while seen < len(rids):
                # let what the servers are willing to send arrive before each read (a round
                # trip runs the client's I/O)
                c.status()
                peak = max(peak, sub.buffered_bytes)
                rec = sub.next(timeout=30)
                assert rec is not None
                if rec.rid in set(rids):
                    seen += 1
                if rec.rid == last:
                    break
            limit = len(c.topology.shards()) * (SUB_CREDIT_BYTES + len(big) + (1 << 20))
            assert peak <= limit, (peak, limit)


def test_storage_replicas_run_under_sched_batch(cluster: ziplog.LocalCluster) -> None:
    """Every thread of every storage replica (``--sched batch``, the default; see
    ``ziplog.server.process.set_scheduling``): those a library started at import, and
    those started after it (the ZooKeeper session's), which inherit it."""
    import os

    for (shard, replica), proc in cluster.servers.items():
        tids = os.listdir(f"/proc/{proc.pid}/task")
        assert len(tids) > 1, "the replica runs its ZooKeeper session's threads"
        policies = {os.sched_getscheduler(int(tid)) for tid in tids}
        assert policies == {os.SCHED_BATCH}, (shard, replica, policies)


def test_the_local_cluster_gives_each_replica_of_a_shard_a_cpu_of_its_own(cluster: ziplog.LocalCluster) -> None:
    """``--cpus`` holds every thread of a replica (those started after it too) on the
    CPU the local cluster gave it: a shard's replicas on different CPUs, and the
    shards' primaries too (``ziplog.server.process.set_cpus``)."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: nothing to spread the replicas over")
    placed: dict[tuple[int, int], int] = {}
    for (shard, replica), proc in cluster.servers.items():
        affinities = {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{proc.pid}/task")}
        assert len(affinities) == 1, (shard, replica, affinities)
        (only,) = affinities
        assert len(only) == 1, (shard, replica, only)
        placed[(shard, replica)] = next(iter(only))
    for shard in {s for s, _ in placed}:
        mine = [cpu for (s, _), cpu in placed.items() if s == shard]
        assert len(set(mine)) == min(len(mine), len(cpus)), (shard, placed)
    primaries = [cpu for (_, r), cpu in placed.items() if r == 0]
    assert len(set(primaries)) == min(len(primaries), len(cpus)), placed


def test_a_cpu_list_is_parsed_as_taskset_reads_it() -> None:
    from ziplog.server.process import parse_cpu_list

    assert parse_cpu_list("0") == {0}
    assert parse_cpu_list("0,2-4, 7") == {0, 2, 3, 4, 7}
    for bad in ("", "a", "3-1", "-1", "1-", "0,,1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


#: run in a fresh process: whether the setting took, then the page faults of a 10 MiB
#: buffer allocated a second time after the first was freed
_REALLOCATION = """
import resource, sys
from ziplog.server.process import retain_freed_memory
took = retain_freed_memory(int(sys.argv[1]))
faults = []
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf = bytearray(10 << 20)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del buf
print(took, faults[1])
"""


def test_a_storage_process_reuses_the_memory_it_freed() -> None:
    """``retain_freed_memory``: a 10 MiB buffer freed, then allocated again, takes the same
    memory (a few page faults), where glibc left to itself maps the first and grows its
    heap for the second (one fault per page: the reference run shows it)."""
    import subprocess
    import sys

    def second_buffer(trim_mb: int) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", _REALLOCATION, str(trim_mb)], capture_output=True, text=True,
                             check=True).stdout.split()
        return out[0], int(out[1])

    took, faults = second_buffer(64)
    assert took == "True" and faults < 100, (took, faults)
    took, faults = second_buffer(0)  # glibc's own thresholds
    assert took == "False" and faults > 1000, (took, faults)


def test_a_server_refuses_a_negative_malloc_trim(capsys: pytest.CaptureFixture[str]) -> None:
    from ziplog.server.process import main

    with pytest.raises(SystemExit) as exit_:
        main(["--zk", "127.0.0.1:1", "--shard", "0", "--replica", "0", "--malloc-trim-mb", "-1"])
    assert exit_.value.code == 2
    assert "--malloc-trim-mb must be 0 or more" in capsys.readouterr().err


def test_replicas_count_the_frames_they_send_and_receive(cluster: ziplog.LocalCluster) -> None:
    """STATUS counts frames by kind (what ``bench throughput`` divides by the appends):
    both replicas of the written shard took every INSERT, its primary acknowledged each
    and forwarded them, and its NOTICEs reached the other shard's replicas."""
    inserts = 40

    def counts(c: ziplog.Client) -> dict[tuple[int, int], dict[str, int]]:
        return {(r["shard"], r["replica"]): r for rs in c.status().values() for r in rs}

    with cluster.client() as c:
        shard = c.topology.shards()[0]
        other = next(s for s in c.topology.shards() if s != shard)
        c.set_policy(Policy.fixed(shard))
        before = counts(c)
        for i in range(inserts):
            assert c.insert_after(b"counted %d" % i).shard == shard
        after = counts(c)

    def grew(replica: tuple[int, int], key: str) -> int:
        return after[replica].get(key, 0) - before[replica].get(key, 0)

    primary, backup = (shard, 0), (shard, 1)
    assert grew(primary, "received_insert") >= inserts and grew(backup, "received_insert") >= inserts
    assert grew(primary, "sent_ack") + grew(primary, "sent_acks") >= 1
    assert grew(primary, "sent_forward") >= 1 and grew(backup, "received_forward") >= 1
    assert grew(primary, "received_status") >= 1 and grew(primary, "sent_statusok") >= 1
    # the records' gsns cross the other shard's slots: it is told, one message to each replica
    assert grew(primary, "sent_notice") >= 2
    assert grew((other, 0), "received_notice") >= 1 and grew((other, 1), "received_notice") >= 1
    assert all(v >= 0 for r in after.values() for k, v in r.items() if k.startswith(("sent_", "received_")))
