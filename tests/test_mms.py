"""Membership service: epochs are in ZooKeeper before they are broadcast, and a new
leader continues the sequence without contradicting the old one."""

from __future__ import annotations

import time
from typing import Any, Iterator

import pytest
import zmq

import ziplog
from ziplog import discovery, procs, wire
from ziplog.gsna import EpochConfig

from mms.planner import EpochPlanner, PlannerSettings


@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=2, replicas=2) as c:
        yield c


class Listener:
    """A SUB socket on every MMS replica's PUB, recording every broadcast."""

    def __init__(self, cluster: ziplog.LocalCluster) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        for info in cluster.topology.mms.values():
            self.sub.connect(info["pub"])
        self.seen: dict[int, tuple[Any, Any]] = {}
        self.order: list[int] = []

    def pump(self, until: float) -> None:
        while time.monotonic() < until:
            if self.sub.poll(50):
                msg = wire.unpack(self.sub.recv())
                assert msg[1] == wire.EPOCH
                e, cfg = msg[2], (tuple(msg[3]), tuple(msg[4]))
                assert self.seen.setdefault(e, cfg) == cfg, f"epoch {e} broadcast with two configs"
                self.order.append(e)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def leader_id(cluster: ziplog.LocalCluster) -> int:
    zk = cluster._zkc
    contenders = zk.Election(discovery.MMS_ELECTION).contenders()
    assert contenders
    return int(contenders[0])


def test_broadcast_epochs_are_committed_first(cluster: ziplog.LocalCluster) -> None:
    lis = Listener(cluster)
    try:
        lis.pump(time.monotonic() + 1.0)
        assert len(lis.order) > 10
        data, _ = cluster._zkc.get(discovery.EPOCH_PATH)
        block = discovery.dec(data)
        # every broadcast epoch so far is at or below the committed block's end
        assert max(lis.order) <= block["last"]
        assert all(b > a for a, b in zip(lis.order, lis.order[1:])), "epochs strictly increase"
    finally:
        lis.close()


def test_new_leader_continues_without_contradiction(cluster: ziplog.LocalCluster) -> None:
    lis = Listener(cluster)
    try:
        lis.pump(time.monotonic() + 0.5)
        old = leader_id(cluster)
        before = max(lis.order)
        procs.kill(cluster.mms[old])  # SIGKILL the leader
        with cluster.client() as c:
            rid = c.insert_after(b"during failover")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (not lis.order or max(lis.order) < before + 20):
                lis.pump(time.monotonic() + 0.2)
            assert max(lis.order) >= before + 20, "epochs did not continue after the leader died"
            assert leader_id(cluster) != old
            after = c.insert_after(b"after failover", rid)
            assert after.gsn > rid.gsn
            assert c.read_record(after) == b"after failover"
        # restart the killed replica as an operator would; it joins as a follower
        cluster._spawn_mms(old)
    finally:
        lis.close()


def test_planner_uses_reported_rates() -> None:
    p = EpochPlanner(PlannerSettings(default_rate=1000, min_rate=10, smoothing_num=1, smoothing_den=1))
    cfg, hist = p.plan([0, 1])
    assert cfg.epoch == 0 and cfg.shards == (0, 1) and cfg.rates == (1000, 1000) and hist == [[0, [0, 1]]]
    p.committed(cfg, hist)
    p.on_rate(0, 0, 50, 10_000_000)  # 50 records in 10 ms: 5000/s
    cfg, hist = p.plan([0, 1])
    assert cfg.epoch == 1 and cfg.rates == (5000, 1000) and hist is None
    p.committed(cfg, hist)
    p.remove(1)
    # A removed shard drains first: the lowest rate for drain_epochs, then it leaves.
    for e in range(2, 2 + p.settings.drain_epochs):
        cfg, hist = p.plan([0, 1])
        assert cfg.epoch == e and cfg.shards == (0, 1) and cfg.rates[1] == 1 and hist is None
        p.committed(cfg, hist)
    cfg, hist = p.plan([0, 1])
    e = 2 + p.settings.drain_epochs
    assert cfg.shards == (0,) and hist == [[0, [0, 1]], [e, [0]]]
    assert isinstance(cfg, EpochConfig)
