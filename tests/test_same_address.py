"""A primary restarted at the address it had (a server with a fixed ``--port``): its
backup's connection carries on to the new incarnation, which waits, STARTING, for every
backup's HELLO. The backup tells the incarnations apart by the ZooKeeper session that
registered the primary, links to the new one and says HELLO: the primary serves again
without a failure recovery. The storage drivers on the simulation's ports."""

from __future__ import annotations

from tests.sim.world import CLUSTER_KEY, MS, NetParams, SimDisk, SimProcess, SimStorageCoordination, World, ZooKeeper
from ziplog.cores.replica import ReplicaSettings
from ziplog.server.storage import StorageDriver


class Pair:
    def __init__(self) -> None:
        self.world = World(3, NetParams(client_loss=0.0, peer_loss=0.0, epoch_loss=0.0, control_loss=0.0,
                                        reorder=0.0, duplicate=0.0))
        self.zk = ZooKeeper(self.world)
        self.disks = [SimDisk(), SimDisk()]
        self.drivers: list[StorageDriver] = []
        self.procs: list[SimProcess] = []
        for i in range(2):
            self.procs.append(SimProcess(self.world, f"rep0.{i}#1", host=f"rep0.{i}"))
            self.drivers.append(self.start(i))

    def start(self, i: int) -> StorageDriver:
        proc = self.procs[i]
        coord = SimStorageCoordination(self.zk, proc, self.zk.session(proc.name))
        # no suspicion: a recovery would make the shard serve again too, and hide the point
        driver = StorageDriver(ReplicaSettings(0, i, 2, suspect_timeout_ns=0), proc, proc, coord, self.disks[i],
                               CLUSTER_KEY)
        proc.run(driver.start)
        return driver

    def restart_primary(self) -> None:
        old = self.procs[0]
        self.drivers[0].close()
        old.kill()
        self.zk.expire(self.zk.replicas[(0, 0)][1])
        self.procs[0] = SimProcess(self.world, "rep0.0#2", host="rep0.0")
        self.drivers[0] = self.start(0)

    def run_for(self, ns: int) -> None:
        until = self.world.now + ns
        while (t := self.world.next_time()) is not None and t <= until:
            self.world.step()
        self.world.now = until


def test_a_primary_restarted_at_its_address_serves_again_once_its_backup_says_hello() -> None:
    pair = Pair()
    pair.run_for(50 * MS)
    assert pair.drivers[0].core.status()["state"] == "serving"
    addr = pair.drivers[0].addr
    pair.restart_primary()
    assert pair.drivers[0].addr == addr  # the same address: the backup's link would carry on
    assert pair.drivers[0].core.status()["state"] == "starting"
    pair.run_for(200 * MS)
    assert pair.drivers[0].core.status()["state"] == "serving", "the backup never said HELLO to the new primary"
    assert pair.drivers[1].core.status()["link"] == "in_step"
