"""Real power loss on real processes: the segment directories of shard 0's replicas are
each on a disk of their own that keeps only what was fsynced (``tests/lazyfs.py``:
LazyFS, whose cache stands for the page cache). A power cut is the replica's process
SIGKILLed, then its disk's unsynced bytes dropped, then the process started again on
what is left, as the machine would come back. DEPLOY.md's survival table, checked line
by line while writers insert and two subscribers read, with the recorded history
checked at the end (``tests/history.py``):

* up to f machines of a shard lose power, the others stay up: nothing acknowledged lost,
  under each ``--fsync`` policy (f = 1; and f = 2 with two of three at once);
* a replica stopped gracefully, then its machine loses power: it restarts clean.

Segments are small (64 KiB) so that rotations happen between the cuts (the rule that a
segment is synced before the next one is created). Needs a LazyFS binary
(``ZIPLOG_LAZYFS``); skipped without one."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

import ziplog
from tests import lazyfs
from tests.load import Load, next_recovery_gen, wait_recovery, wait_status
from ziplog.io.segments import replica_dir
from ziplog.tools import procs

pytestmark = pytest.mark.skipif(lazyfs.available() is not None, reason=str(lazyfs.available()))

SHARD = 0


class PoweredCluster:
    """A local cluster whose shard-0 replicas each have a machine (a disk) of their own."""

    load: Load

    def __init__(self, tmp: Path, replicas: int, fsync: str) -> None:
        self.disks: dict[int, lazyfs.LazyDisk] = {}
        #: bytes each cut took from the files (what the cuts drew)
        self.lost: list[int] = []
        data = tmp / "cluster"
        try:
            for r in range(replicas):
                seg = replica_dir(data / "segments", SHARD, r)
                self.disks[r] = lazyfs.LazyDisk(seg, tmp / f"disk{r}", tmp / f"lazyfs{r}")
            self.cluster = ziplog.LocalCluster(data, shards=2, replicas=replicas, fsync=fsync, supervise=False,
                                               server_args=["--segment-bytes", "65536"])
            self.cluster.start()
        except BaseException:
            self.close()
            raise

    def power_cut(self, replicas: tuple[int, ...]) -> None:
        """These replicas' machines lose power at once: their processes die, then their
        disks lose every unsynced byte."""
        for r in replicas:
            self.cluster.kill_replica(SHARD, r)
        for r in replicas:
            self.lost.append(self.disks[r].power_loss())

    def stop_then_power_cut(self, replica: int) -> None:
        procs.stop(self.cluster.servers[(SHARD, replica)], timeout=30)
        assert self.disks[replica].power_loss() == 0, "a graceful stop left bytes unsynced"

    def restart(self, replicas: tuple[int, ...]) -> None:
        for r in replicas:
            self.cluster.restart_replica(SHARD, r)

    def clean_restarts(self, replica: int) -> int:
        log = self.cluster.logs / f"shard{SHARD}-replica{replica}.log"
        return log.read_text(errors="replace").count("restarted clean at frontier")

    def close(self) -> None:
        cluster = getattr(self, "cluster", None)
        try:
            if cluster is not None:
                cluster.stop()
        finally:
            for d in self.disks.values():
                d.close()


@pytest.fixture
def powered(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[PoweredCluster]:
    """The cluster, with writers inserting and two subscribers reading (``load``)."""
    replicas, fsync = request.param
    c = PoweredCluster(tmp_path, replicas, fsync)
    try:
        c.load = Load(c.cluster)
        try:
            yield c
        finally:
            c.load.stop_writing.set()
            c.load.stop_reading()
    finally:
        c.close()


def _serving(cluster: ziplog.LocalCluster, gen: int) -> None:
    with cluster.client() as c:
        wait_status(c, [SHARD], until=lambda st: all(
            r.get("answer") == "ok" and not r["frozen"] and r["recovery_gen"] >= gen for r in st[SHARD]))


@pytest.mark.parametrize("powered", [(2, "never"), (2, "interval"), (2, "always")], indirect=True,
                         ids=["never", "interval", "always"])
def test_one_machine_of_a_shard_loses_power_again_and_again_and_nothing_acknowledged_is_lost(
        powered: PoweredCluster) -> None:
    cluster, load = powered.cluster, powered.load
    load.wait_acked(200)
    # the primary's machine, then the backup's, each twice: once back at once (it
    # rejoins with what its disk kept), once only after the failure handler took the
    # survivor's state for the shard's recovery (done once the replica is back)
    for replica, wait_for_recovery in ((0, False), (1, False), (0, True), (1, True)):
        gen = next_recovery_gen(cluster, SHARD)
        powered.power_cut((replica,))
        if wait_for_recovery:
            wait_recovery(cluster, SHARD, "acquired", min_gen=gen)
        powered.restart((replica,))
        _serving(cluster, gen if wait_for_recovery else -1)
        load.wait_acked(200)
    # stopped gracefully, then the power goes: it comes back clean, as it left
    for replica in (1, 0):
        before = powered.clean_restarts(replica)
        powered.stop_then_power_cut(replica)
        powered.restart((replica,))
        _serving(cluster, -1)
        assert powered.clean_restarts(replica) == before + 1, "the clean-close marker did not survive"
        load.wait_acked(200)
    load.finish()
    print(f"fsync {cluster.fsync}: bytes each cut took from the files: {powered.lost}")
    if cluster.fsync != "always":  # (which syncs each batch as it writes it: little to lose)
        assert sum(powered.lost) > 0, f"no cut lost a byte: the test drew no power loss ({powered.lost})"


@pytest.mark.parametrize("powered", [(3, "interval")], indirect=True, ids=["interval"])
def test_two_machines_of_a_three_replica_shard_lose_power_at_once_and_nothing_acknowledged_is_lost(
        powered: PoweredCluster) -> None:
    cluster, load = powered.cluster, powered.load
    load.wait_acked(200)
    for pair in ((0, 1), (1, 2), (0, 2)):
        gen = next_recovery_gen(cluster, SHARD)
        powered.power_cut(pair)
        wait_recovery(cluster, SHARD, "acquired", min_gen=gen)
        powered.restart(pair)
        _serving(cluster, gen)
        load.wait_acked(200)
    load.finish()
    print(f"fsync {cluster.fsync}, two of three: bytes each cut took from the files: {powered.lost}")
