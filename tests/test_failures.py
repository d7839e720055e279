"""Faults under load, with real processes: SIGKILL of a primary, a backup, the MMS
leader, the failure handler's leader mid-recovery and a ZooKeeper node, and adding and
removing shards, while writers insert and two subscribers read. Afterwards every
acknowledged record is in both subscriptions exactly once, in one shared order."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterator

import pytest

import ziplog
from tests.load import Load, recovery_record, wait_recovery, wait_status
from ziplog.protocol import layout

log = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=3, replicas=2, own_zookeeper=True) as c:  # kills a ZooKeeper node
        # Restart killed replicas only after the suspicion timeout (500 ms), so that every
        # kill here goes through failure recovery (a quick restart of a replica that lost
        # nothing needs none).
        c.restart_delay_s = 1.0
        yield c


def _gen(cluster: ziplog.LocalCluster, shard: int) -> int:
    rec = recovery_record(cluster, shard)
    return int(rec["gen"]) + 1 if rec else 0


@pytest.mark.parametrize("replica", [0, 1], ids=["primary", "backup"])
def test_replica_sigkill_is_recovered(cluster: ziplog.LocalCluster, replica: int) -> None:
    load = Load(cluster)
    load.wait_acked(200)
    gen = _gen(cluster, 0)
    cluster.kill_replica(0, replica)  # the supervisor starts it again, as an operator would
    wait_recovery(cluster, 0, "done", min_gen=gen)
    load.wait_acked(300)
    load.finish()
    assert any(s == 0 and r == replica for _, s, r in cluster.restarts)
    with cluster.client() as c:
        # every replica of the shard answers, out of recovery (the restarted one may still be starting)
        wait_status(c, [0], until=lambda st: all(r["recovery_gen"] >= gen and not r["frozen"] for r in st[0]))


def test_failure_handler_leader_killed_mid_recovery(cluster: ziplog.LocalCluster) -> None:
    load = Load(cluster)
    load.wait_acked(200)
    gen = _gen(cluster, 1)
    cluster.kill_replica(1, 0)
    wait_recovery(cluster, 1, "acquired", min_gen=gen, timeout=30)  # the replica is still down
    cluster.kill_fh_leader()  # the next leader continues from the durable record
    wait_recovery(cluster, 1, "done", min_gen=gen)
    load.wait_acked(300)
    load.finish()


def leader_after(cluster: ziplog.LocalCluster, election: str, kill: Callable[[], int], timeout: float = 30.0
                 ) -> tuple[int, float]:
    """Run ``kill`` (it kills the leader and returns its id); the seconds until another
    replica leads, seen through a watch on the election's contenders."""
    zk = cluster._zkc
    changed = threading.Event()
    killed: list[int] = []

    def watch(children: list[str]) -> bool:
        if killed:
            leaders = zk.Election(election).contenders()[:1]
            if leaders and int(leaders[0]) != killed[0]:
                changed.set()
                return False
        return True

    t0 = time.monotonic()
    killed.append(kill())
    zk.ChildrenWatch(election, watch)
    assert changed.wait(timeout), f"no new leader at {election} in {timeout} s"
    return killed[0], time.monotonic() - t0


@pytest.mark.parametrize("which", ["failure_handler", "mms"])
def test_a_new_leader_within_a_second_and_a_replica_killed_meanwhile(cluster: ziplog.LocalCluster,
                                                                     which: str) -> None:
    """Leaders are deposed when their process dies (the next in line's death watch) or
    falls silent, not when their ZooKeeper session expires (10 s): a killed leader is
    replaced at once, and a replica killed in that window is recovered by the new one."""
    load = Load(cluster)
    load.wait_acked(200)
    shard = 2
    gen = _gen(cluster, shard)
    election = layout.fh_election_path(0) if which == "failure_handler" else layout.MMS_ELECTION

    def kill() -> int:
        old = cluster.kill_fh_leader() if which == "failure_handler" else cluster.kill_mms_leader()
        cluster.kill_replica(shard, 0)  # while nobody leads
        return old

    old, took = leader_after(cluster, election, kill)
    log.warning("%s leader %d killed: a new leader after %.2f s", which, old, took)
    assert took < 3.0, f"a new {which} leader took {took:.2f} s (wanted about 1 s)"
    wait_recovery(cluster, shard, "done", min_gen=gen)
    load.wait_acked(300)
    load.finish()


def test_mms_leader_sigkill_under_load(cluster: ziplog.LocalCluster) -> None:
    load = Load(cluster)
    load.wait_acked(200)
    cluster.kill_mms_leader()
    load.wait_acked(300)
    load.finish()


def test_zookeeper_node_sigkill_under_load(cluster: ziplog.LocalCluster) -> None:
    load = Load(cluster)
    load.wait_acked(200)
    victim = cluster.zk.leader()
    assert victim is not None
    cluster.zk.kill_node(victim)
    try:
        load.wait_acked(300)
        # The log keeps its control plane: a recovery still completes with two nodes.
        gen = _gen(cluster, 2)
        cluster.kill_replica(2, 1)
        wait_recovery(cluster, 2, "done", min_gen=gen)
        load.wait_acked(200)
    finally:
        cluster.zk.start_node(victim)
    load.finish()


def test_add_and_remove_shard_under_load(cluster: ziplog.LocalCluster) -> None:
    load = Load(cluster, writers=3)
    load.wait_acked(200)
    new = cluster.add_shard()
    load.wait_acked(300)
    with load.cond:
        assert any(rid.shard == new for rid, _ in load.acked), "no record reached the new shard"
    cluster.remove_shard(new)
    load.wait_acked(300)
    load.finish()
    assert not load.errors, load.errors[:3]
    with cluster.client() as c:
        got = [rid for rid, _ in load.acked if rid.shard == new]
        assert c.read_record(got[-1]), "a removed shard stays readable"


def test_recovery_record_is_chunked_when_large(cluster: ziplog.LocalCluster) -> None:
    from ziplog.io.zk_recovery import CHUNK_BYTES, read_record, write_record
    from ziplog.protocol import layout
    zk = cluster._zkc
    shard = 990  # a shard id no replica uses
    zk.create(f"{layout.SHARDS}/{shard}", layout.enc({"replicas": 0}), makepath=True)
    big = {"gen": 3, "phase": "acquired", "records": [[i, 1, i, bytes(4096)] for i in range(400)]}
    v = write_record(zk, cluster.key, shard, big, True, -1)
    assert len(zk.get_children(f"{layout.RECOVERY}/{shard}")) >= 1600_000 // CHUNK_BYTES
    assert read_record(zk, cluster.key, shard) == (big, v)
    assert layout.dec(zk.get(f"{layout.SHARDS}/{shard}")[0])["recovering"] == 3
    small = {"gen": 3, "phase": "done"}
    v = write_record(zk, cluster.key, shard, small, False, v)
    assert read_record(zk, cluster.key, shard) == (small, v)
    assert zk.get_children(f"{layout.RECOVERY}/{shard}") == []  # old chunks gone
    assert "recovering" not in layout.dec(zk.get(f"{layout.SHARDS}/{shard}")[0])


def test_no_node_is_writable_by_anyone_but_members(cluster: ziplog.LocalCluster) -> None:
    """After the recoveries above: every node of the cluster's ZooKeeper (its root,
    ZooKeeper's own nodes, every node a process or the failure handler made) takes
    writes and new children from members only, and the recovery records and the client
    key registry are not even read by anyone else."""
    from kazoo.exceptions import NoAuthError

    from tests.zookeeper import open_nodes
    from ziplog.io import zk as discovery

    assert open_nodes(cluster._zkc, cluster.key.zk_digest_id) == []
    outsider = discovery.connect(cluster.zk_hosts)
    try:
        with pytest.raises(NoAuthError):
            outsider.create("/junk", b"")
        for shard in [None] + cluster._zkc.get_children(layout.RECOVERY):
            with pytest.raises(NoAuthError):
                outsider.get(layout.RECOVERY if shard is None else f"{layout.RECOVERY}/{shard}")
    finally:
        discovery.stop(outsider)
