"""A storage replica lost for good (its machine is gone: nobody restarts it) while
writers and two subscribers run. Subscribers keep delivering while it is gone: once the
failure handler has committed the survivor's state and installed it there, the survivor
serves the shard's positions up to the end of its last epoch, and later epochs go on
without the shard. Writers move to the other shard. Then it is replaced by a new process
on an empty disk, which recovery fills from the survivor; the shard is whole again and
takes inserts. Nothing acknowledged is lost or duplicated."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Iterator

import pytest

import ziplog
from tests.load import Load, recovery_record, wait_recovery, wait_status
from ziplog.protocol.types import Policy

log = logging.getLogger(__name__)

#: the storage servers' suspicion timeout (``--suspect-timeout-ms`` default)
SUSPECT_S = 0.5
#: how long the lost replica stays gone before it is replaced
GONE_S = 4.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ziplog.LocalCluster]:
    # no supervisor: a killed replica stays dead until it is replaced
    with ziplog.local_cluster(shards=2, replicas=2, supervise=False,
                              data_dir=tmp_path_factory.mktemp("replace")) as c:
        yield c


@pytest.mark.parametrize("shard,replica", [(0, 1), (1, 0)], ids=["backup", "primary"])
def test_a_replica_lost_for_good_is_replaced_on_an_empty_disk(cluster: ziplog.LocalCluster, shard: int,
                                                             replica: int) -> None:
    """A lost primary also stops the subscribers reading from it: they move to the
    survivor once it is silent for a second (its registration lasts until its ZooKeeper
    session expires, 10 s)."""
    load = Load(cluster)
    load.wait_acked(200)
    with load.cond:
        held_before = sum(1 for rid, _ in load.acked if rid.shard == shard)
    rec = recovery_record(cluster, shard)
    gen = int(rec["gen"]) + 1 if rec else 0
    t_kill = time.monotonic()
    cluster.kill_replica(shard, replica)
    wait_recovery(cluster, shard, "acquired", min_gen=gen)
    while time.monotonic() - t_kill < GONE_S:  # it stays gone a while, under load
        load.wait_acked(50)
    t_replace = time.monotonic()
    stall = load.longest_stall(t_kill, t_replace)
    log.warning("replica gone for %.1f s: subscribers' longest stall %.2f s", t_replace - t_kill, stall)
    # the floor is the suspicion timeout plus a second; the rest is slack for a loaded machine
    assert stall < SUSPECT_S + 1.0 + 1.0, f"subscribers stopped for {stall:.2f} s while the replica was gone"

    cluster.replace_replica(shard, replica)  # a new process on an empty directory
    wait_recovery(cluster, shard, "done", min_gen=gen)
    with cluster.client(timeout=30, policy=Policy.fixed(shard)) as pinned:
        assert pinned.topology.wait(lambda: shard in pinned.live_shards(), 30), "the shard is not whole again"
        rid = pinned.insert_after(b"on the whole shard again")
        assert rid.shard == shard
        status = wait_status(pinned, [shard])[shard]
    assert [st["frozen"] for st in status] == [False, False]
    assert status[replica]["records"] >= held_before, "the replacement did not get the shard's state"
    load.wait_acked(200)
    load.finish()
    assert any(cluster.replica_dir(shard, replica).glob("seg-*.log")), "the replacement wrote nothing"


def test_replace_refuses_a_replica_that_still_answers_or_a_used_directory(cluster: ziplog.LocalCluster,
                                                                        tmp_path: Path) -> None:
    from ziplog.tools.cli import main

    common = ["--zk", cluster.zk_hosts, "--cluster-key-file", str(cluster.key_file)]
    assert main(["replica", "replace", "0", "0", "--data-dir", str(tmp_path / "new"), *common]) == 2  # alive
    used = tmp_path / "used" / "shard0-replica0"
    used.mkdir(parents=True)
    (used / "seg-00000001.log").write_bytes(b"x")
    assert main(["replica", "replace", "0", "0", "--data-dir", str(tmp_path / "used"), *common]) == 2
    assert main(["replica", "replace", "99", "0", "--data-dir", str(tmp_path / "new"), *common]) == 2
    assert main(["replica", "replace", "0", "5", "--data-dir", str(tmp_path / "new"), *common]) == 2
