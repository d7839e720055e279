"""Partitions on loopback, with firewall rules (``tests/firewall.py``: nftables in a table
of the test's own, removed in ``finally``), against a real cluster under load:

* a storage replica cut from ZooKeeper past its session timeout registers again once it
  can, and its shard takes new inserts and serves a new subscription from genesis;
* a cut between a backup and its primary only (both still reach ZooKeeper and the
  failure handler): writes move on within the suspicion timeout plus a second, and
  nothing is lost when it heals;
* a fully isolated primary: the same, and subscribers keep going from the backup.

Every run ends with the load's check: every acknowledged record delivered exactly once
to both subscribers, in one order, gsns strictly increasing (no two records at one gsn).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterator

import pytest

import ziplog
from tests import firewall
from tests.load import (
    Load,
    RegistrationWatch,
    next_recovery_gen,
    pinned_inserts_then_read_all,
    wait_recovery,
)
from ziplog.protocol import layout
from ziplog.protocol.types import Policy

log = logging.getLogger(__name__)

why = firewall.unavailable()
if why is not None:  # pragma: no cover - depends on the machine
    pytest.skip(f"no firewall for partitions here: {why}", allow_module_level=True)

SUSPECT_S = 0.5
#: the storage replicas' ZooKeeper session timeout (``io.zk.connect``)
SESSION_S = 10.0
#: how long a cut between replicas lasts (well under the session timeout)
CUT_S = 3.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=2, replicas=2, data_dir=tmp_path_factory.mktemp("partitions"),
                              own_zookeeper=True) as c:  # cuts a replica from its ZooKeeper nodes' ports
        yield c


def _port(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


def _keep_loaded(load: Load, until: float) -> None:
    while time.monotonic() < until:
        load.wait_acked(20)


def test_a_replica_cut_from_zookeeper_past_its_session_timeout_registers_again(cluster: ziplog.LocalCluster) -> None:
    shard, replica = 1, 1
    node = f"{layout.SHARDS}/{shard}/{replica}"
    pid = cluster.servers[(shard, replica)].pid
    zk_ports = [cluster.zk.client_port(i) for i in range(3)]
    with firewall.Firewall() as fw:
        fw.cut(pid, zk_ports)
        registration = RegistrationWatch(cluster._zkc, node)
        assert registration.gone.wait(SESSION_S + 20), "the cut replica's session did not expire"
    assert registration.back.wait(60), "the replica did not register again after the partition healed"
    assert cluster.servers[(shard, replica)].poll() is None and not [
        r for r in cluster.restarts if r[1:] == (shard, replica)], "it was restarted, not renewed"
    with cluster.client(timeout=60, policy=Policy.fixed(shard)) as pinned:
        assert pinned.topology.wait(lambda: shard in pinned.live_shards(), 60)
        pinned_inserts_then_read_all(pinned, shard, "after the heal ", {},
                                     "a new subscription from genesis stalled")


def _partitioned_under_load(cluster: ziplog.LocalCluster, shard: int,
                            cut: Callable[[firewall.Firewall, int], None]) -> tuple[Load, float, float, int]:
    """Writers and two subscribers run; ``cut(fw, primary_port)`` partitions the shard
    until a recovery acquired its state and CUT_S passed; then it heals. Returns the
    load, when the cut began and ended, and the recovery's generation."""
    load = Load(cluster)
    load.wait_acked(200)
    gen = next_recovery_gen(cluster, shard)
    with cluster.client() as c:
        primary_port = _port(c.topology.replica_addrs(shard)[0])  # type: ignore[index]
    t_cut = time.monotonic()
    with firewall.Firewall() as fw:
        cut(fw, primary_port)
        wait_recovery(cluster, shard, "acquired", min_gen=gen, timeout=30)  # somebody suspected
        _keep_loaded(load, t_cut + CUT_S)
        t_heal = time.monotonic()
    return load, t_cut, t_heal, gen


def _healed(cluster: ziplog.LocalCluster, load: Load, shard: int, gen: int) -> None:
    wait_recovery(cluster, shard, "done", min_gen=gen, timeout=60)
    load.wait_acked(200)
    load.finish()


def test_a_cut_between_backup_and_primary(cluster: ziplog.LocalCluster) -> None:
    shard = 0
    backup_pid = cluster.servers[(shard, 1)].pid
    load, t_cut, t_heal, gen = _partitioned_under_load(
        cluster, shard, lambda fw, primary_port: fw.cut(backup_pid, [primary_port]))
    stall = load.longest_write_stall(t_cut, t_heal)
    log.warning("backup-primary cut for %.1f s: longest write stall %.2f s", t_heal - t_cut, stall)
    assert stall < SUSPECT_S + 1.0 + 1.0, f"writes stalled {stall:.2f} s"
    _healed(cluster, load, shard, gen)


def test_a_fully_isolated_primary(cluster: ziplog.LocalCluster) -> None:
    shard = 0
    pid = cluster.servers[(shard, 0)].pid
    load, t_cut, t_heal, gen = _partitioned_under_load(
        cluster, shard, lambda fw, router: fw.isolate(pid, [router]))
    writes = load.longest_write_stall(t_cut, t_heal)
    reads = load.longest_stall(t_cut, t_heal)
    log.warning("primary isolated for %.1f s: longest write stall %.2f s, subscriber stall %.2f s",
                t_heal - t_cut, writes, reads)
    assert writes < SUSPECT_S + 1.0 + 1.0, f"writes stalled {writes:.2f} s"
    assert reads < SUSPECT_S + 1.0 + 1.0 + 1.0, f"subscribers stalled {reads:.2f} s"
    _healed(cluster, load, shard, gen)
