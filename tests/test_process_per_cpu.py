"""Replicas of several shards in one storage process (``ziplog.server --serve``): a
machine hosting more replicas than CPUs runs a process per CPU. Each replica keeps its
own port, registration, data directory and core; the process shares only its loop."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import ziplog
from ziplog import RID_GENESIS, Policy
from ziplog.protocol import layout
from ziplog.server.process import hosted_replicas, main, parse_hosted
from tests.load import delivered_until, running_cluster_up, stop_cluster_up, storage_cmdlines, wait_status


def test_hosted_replicas_come_from_one_form_and_never_put_two_of_a_shard_together() -> None:
    assert parse_hosted("0:0, 1:1") == [(0, 0), (1, 1)]
    assert hosted_replicas(3, 1, None, 2) == [(3, 1)]
    assert hosted_replicas(None, None, [(0, 0), (1, 1)], 2) == [(0, 0), (1, 1)]
    for bad in ("0", "0:x", "0:0,", "-1:0", ":1"):
        with pytest.raises(ValueError, match="SHARD:REPLICA"):
            parse_hosted(bad)
    with pytest.raises(ValueError, match="two replicas of one shard"):
        hosted_replicas(None, None, [(0, 0), (0, 1)], 2)
    with pytest.raises(ValueError, match="not both"):
        hosted_replicas(0, 0, [(1, 1)], 2)
    with pytest.raises(ValueError, match="--shard and --replica"):
        hosted_replicas(0, None, None, 2)
    with pytest.raises(ValueError, match="replicas 0..1"):
        hosted_replicas(None, None, [(0, 2)], 2)


@pytest.mark.parametrize("argv, why", [
    (["--serve", "0:0,0:1"], "two replicas of one shard"),
    (["--serve", "0:0,1:1", "--port", "5555"], "--port names one replica's port"),
    (["--serve", "0:0,1:1", "--advertise", "10.0.0.1:5555"], "takes a host only"),
    (["--shard", "0", "--replica", "0", "--serve", "1:1"], "not both"),
])
def test_a_process_refuses_a_bad_list_before_it_connects_or_binds(argv: list[str], why: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--zk", "127.0.0.1:1", *argv])  # an unreachable ZooKeeper: nothing may get that far
    assert exit_.value.code == 2
    assert why in capsys.readouterr().err


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a process per CPU needs at least two CPUs")
def test_a_process_per_cpu_serves_both_shards_and_is_taken_over_or_restarted_with_every_replica_in_it() -> None:
    with ziplog.local_cluster(shards=2, replicas=2, process_per_cpu=True) as cluster:
        servers = cluster.servers
        # Each CPU's process serves one replica of each shard, never two of one shard.
        assert servers[(0, 0)] is servers[(1, 1)] and servers[(0, 1)] is servers[(1, 0)]
        assert servers[(0, 0)] is not servers[(0, 1)]
        for (shard, replica), proc in servers.items():
            info = layout.dec(cluster._zkc.get(f"{layout.SHARDS}/{shard}/{replica}")[0])
            assert info["pid"] == proc.pid, (shard, replica, info)
        # Each replica's lines name it: its own logger, under the process's name.
        text = (cluster.logs / "storage-shard0-replica0-shard1-replica1.log").read_text()
        for shard, replica in ((0, 0), (1, 1)):
            assert f" storage0.0+1.1 INFO ziplog.server.{shard}.{replica} shard {shard} replica {replica} serving on " \
                in text, text[-2000:]
        with cluster.client() as c, cluster.client() as reader:
            sub = reader.subscribe(RID_GENESIS)
            acked: list[ziplog.RecordId] = []
            data: dict[ziplog.RecordId, bytes] = {}

            def write(tag: str) -> None:
                rid = acked[-1] if acked else RID_GENESIS
                for i in range(60):
                    c.set_policy(Policy.fixed(i % 2))
                    record = b"%s-%d" % (tag.encode(), i)
                    rid = c.insert_after(record, rid)
                    acked.append(rid)
                    data[rid] = record

            write("before")
            assert {r.shard for r in acked} == {0, 1}
            # A restart replaces the process with every replica it serves: the new one
            # starts beside it, stops it (each primary in it vouches for its log), and
            # serves both replicas on their data directories.
            old = servers[(0, 0)]
            cluster.restart_replica(0, 0)
            assert old.poll() is not None
            new = servers[(0, 0)]
            assert new is servers[(1, 1)] and new.pid != old.pid and new.poll() is None
            cluster.wait_ready([0, 1])
            write("after")
            for r in acked:
                assert c.read_record(r) == data[r]
            for rec in delivered_until(sub, acked):
                assert rec.rid not in data or rec.data == data[rec.rid]
            wait_status(c, [0, 1], until=lambda st: all(
                r["frontier"] >= max((a.gsn for a in acked if a.shard == s), default=0)
                for s in (0, 1) for r in st[s]))
            sub.close()
            # The other process SIGKILLed: the supervisor starts it again once, with both
            # of its replicas, and each registers again under the new process.
            victim = servers[(0, 1)]
            with cluster._lock:
                restarts = len(cluster.restarts)
            cluster.kill_replica(0, 1)
            victim.wait(30)
            deadline = time.monotonic() + 60
            while True:
                with cluster._lock:
                    new, count = servers[(0, 1)], len(cluster.restarts)
                if new is not victim:
                    break
                assert time.monotonic() < deadline, "the supervisor did not start the process again"
                time.sleep(0.05)
            assert servers[(1, 0)] is new and count == restarts + 1
            wait_status(c, [0, 1])
            for shard, replica in ((0, 1), (1, 0)):
                info = layout.dec(cluster._zkc.get(f"{layout.SHARDS}/{shard}/{replica}")[0])
                assert info["pid"] == new.pid and new.poll() is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a process per CPU needs at least two CPUs")
def test_a_notice_goes_once_to_each_process_which_hands_it_to_every_replica_it_serves() -> None:
    """Four shards on two processes (each serves one replica of every shard), records on
    shard 0 alone: its primary's NOTICE reaches the three replicas of other shards in a
    process through one frame, and the replica it reached hands it to the other two. The
    idle shards' primaries pass their slots on those notices (each heard some only
    through a replica of its process), and a subscriber gets every record in order."""
    with ziplog.local_cluster(shards=4, replicas=2, process_per_cpu=True) as cluster:
        servers = cluster.servers
        assert len({id(p) for p in servers.values()}) == 2
        with cluster.client() as c, cluster.client() as reader:
            sub = reader.subscribe(RID_GENESIS)
            c.set_policy(Policy.fixed(0))
            acked: list[ziplog.RecordId] = []
            rid = RID_GENESIS
            for i in range(80):
                rid = c.insert_after(b"r%d" % i, rid)
                acked.append(rid)
            delivered_until(sub, acked)
            sub.close()
            status = wait_status(c, [0, 1, 2, 3])
        replicas = [r for s in range(4) for r in status[s]]
        received = sum(r.get("received_notice", 0) for r in replicas)
        handed_on = sum(r.get("notices_handed_on", 0) for r in replicas)
        sent = sum(r.get("sent_notice", 0) for r in replicas if r.get("primary"))
        assert received > 0 and sent >= received, (sent, received)
        # each frame reached one of the three replicas of other shards in its process
        assert handed_on == 2 * received, (handed_on, received)
        idle = [r for r in replicas if r.get("primary") and r["shard"] != 0]
        assert all(r.get("passed_on_notice", 0) > 0 for r in idle), idle


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a process per CPU needs at least two CPUs")
def test_a_rolling_restart_restarts_each_storage_process_once_with_every_replica_in_it() -> None:
    with ziplog.local_cluster(shards=2, replicas=2, process_per_cpu=True) as cluster:
        old = set(cluster.servers.values())
        with cluster.client() as c:
            data = {c.insert_after(b"before-%d" % i): b"before-%d" % i for i in range(20)}
            done = cluster.rolling_restart()
            # shard 0's backup first (its process also serves shard 1's primary), then
            # shard 0's primary (with shard 1's backup); shard 1 has nothing left
            assert [r.name for r in done if r.kind == "storage"] == [
                "shard0-replica1+shard1-replica0", "shard0-replica0+shard1-replica1"]
            assert all(p.poll() is not None for p in old)
            assert cluster.servers[(0, 0)] is cluster.servers[(1, 1)] not in old
            assert cluster.servers[(0, 1)] is cluster.servers[(1, 0)] not in old
            data.update({c.insert_after(b"after-%d" % i): b"after-%d" % i for i in range(20)})
            assert {r.shard for r in data} == {0, 1}
            for rid, record in data.items():
                assert c.read_record(rid) == record


def test_cluster_up_runs_a_process_per_cpu(tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a process per CPU needs at least two CPUs")
    with running_cluster_up(tmp_path / "data", "--shards", "2", "--process-per-cpu") as (proc, text):
        assert "press Ctrl-C" in text, text
        storage = storage_cmdlines(proc)
        assert sorted(cmd[cmd.index("--serve") + 1] for cmd in storage) == ["0:0,1:1", "0:1,1:0"]
        stop_cluster_up(proc)
