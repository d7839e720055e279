"""A replica answers a failure recovery's INSTALL only once what the install wrote is on
its disk, fsynced.

An install replaces the records above its base; until its events are written, the
replica's disk still holds the records it replaced. A replica that restarted from that
disk (a crash, or a stop while the disk was full) came back with a record the recovery
had replaced, while the handler, answered already, counted the install done: its two
replicas then disagreed at that gsn for good (found by the system simulation, seed
201030: the disk full on both replicas of the shard during its recovery). The storage
driver (``ziplog.server.storage``) on the simulation's ports: a real driver, a disk
that can fill up, and the failure handler's frames sent as the handler does.

Written is not enough: an answer sent once the install reached the OS, before an fsync,
let a machine's power loss bring the replaced records back after the handler counted
the install done. A two-replica shard then forked: its primary, restarted from that
disk, held a record at a gsn where its backup held the recovery's no-op, and both
called the gsn stable."""

from __future__ import annotations

from ziplog.cores.replica import ReplicaSettings
from ziplog.protocol import frames as wire
from ziplog.protocol.events import DiskEvent, EpochEvent, FrontierEvent, RecordEvent, TruncateEvent
from ziplog.server.storage import DISK_RETRY_NS, StorageDriver

from tests.sim.world import (CLUSTER_KEY, MS, NetParams, SimDealer, SimDisk, SimProcess, SimStorageCoordination, World,
                             ZooKeeper)

SHARD = 0


class Rig:
    """Shard 0's backup on its own, a failure handler's connection to it, and time."""

    def __init__(self, disk: SimDisk | None = None) -> None:
        self.world = World(1, NetParams(client_loss=0.0, peer_loss=0.0, epoch_loss=0.0, control_loss=0.0,
                                        reorder=0.0, duplicate=0.0))
        self.zk = ZooKeeper(self.world)
        self.disk = disk or SimDisk()
        self.proc = SimProcess(self.world, "rep0.1")
        self.driver = self.start_driver()
        self.handler = SimProcess(self.world, "fh")
        self.answers: list[wire.Reply] = []
        self.to_replica = self.connect()
        self.zk.records[SHARD] = {"gen": 0, "phase": "acquired"}  # committed before any step, as the handler does

    def start_driver(self) -> StorageDriver:
        coord = SimStorageCoordination(self.zk, self.proc, self.zk.session(self.proc.name))
        driver = StorageDriver(ReplicaSettings(SHARD, 1, 2, suspect_timeout_ns=0), self.proc, self.proc, coord,
                               self.disk, CLUSTER_KEY)
        self.proc.run(driver.start)
        return driver

    def connect(self) -> SimDealer:
        return self.handler.dealer(self.driver.addr, lambda frame: self.answers.append(
            wire.decode_recovery_reply(frame)), "handler")

    def restart(self) -> None:
        """The process ends (its machine lost power, say) and starts again on the disk;
        the handler connects to where it listens now."""
        self.proc.kill()
        self.proc = SimProcess(self.world, "rep0.1#2")
        self.driver = self.start_driver()
        self.to_replica = self.connect()

    def send(self, msg: wire.Request) -> None:
        self.handler.run(self.to_replica.send, wire.seal(CLUSTER_KEY, wire.encode(msg)))

    def run_for(self, ns: int) -> None:
        until = self.world.now + ns
        while (t := self.world.next_time()) is not None and t <= until:
            self.world.step()
        self.world.now = until

    def answer(self, req_id: int) -> wire.Reply | None:
        return next((a for a in self.answers if a.req_id == req_id), None)


def test_an_install_is_answered_once_written_and_not_while_the_disk_is_full() -> None:
    rig = Rig()
    rig.send(wire.Probe(req_id=1, gen=0))
    rig.run_for(5 * MS)
    assert isinstance(rig.answer(1), wire.RecoveryOk), rig.answers
    rig.disk.full = True
    gsn = (1 << 32) + 1
    rig.send(wire.Install(req_id=2, gen=0, base=0, trim=0,
                          events=[EpochEvent(first=0, last=1, members=(0,)),
                                  RecordEvent(gsn=gsn, slot=0, client_id=7, seq=1, data=b"recovered")], end=gsn))
    rig.run_for(3 * DISK_RETRY_NS)
    assert rig.answer(2) is None, "answered while nothing of the install was written"
    assert rig.disk.refused_writes >= 2, "the write is tried again while the disk is full"
    assert rig.driver.core.log.records[gsn].data == b"recovered", "installed in memory meanwhile"
    rig.disk.full = False
    rig.run_for(DISK_RETRY_NS + 5 * MS)
    done = rig.answer(2)
    assert isinstance(done, wire.RecoveryOk) and done.payload["frontier"] == gsn, rig.answers
    written = rig.disk.written
    assert any(isinstance(ev, TruncateEvent) for ev in written)
    assert any(isinstance(ev, RecordEvent) and ev.gsn == gsn and ev.data == b"recovered" for ev in written)


def test_an_install_is_answered_without_waiting_for_the_batch_interval() -> None:
    """The write an answer waits for goes at the end of the install's turn, not at the
    next 5 ms batch."""
    rig = Rig()
    rig.send(wire.Probe(req_id=1, gen=0))
    rig.run_for(5 * MS)
    rig.send(wire.Install(req_id=2, gen=0, base=0, trim=0, events=[EpochEvent(first=0, last=0, members=(0,))],
                          end=5))
    sent_at = rig.world.now
    rig.run_for(2 * MS)
    done = rig.answer(2)
    assert isinstance(done, wire.RecoveryOk), rig.answers
    assert any(isinstance(ev, TruncateEvent) for ev in rig.disk.written)
    assert rig.world.now - sent_at < 5 * MS


def test_an_install_is_answered_only_once_fsynced_so_a_power_loss_keeps_it() -> None:
    """The replica's disk holds records one and two (synced). The recovery keeps one and
    makes gsn two a no-op: once the INSTALL is answered, the disk's synced part holds
    the install, and a power loss that takes everything not synced brings record two
    back nowhere."""
    one, two = (1 << 32) + 1, (1 << 32) + 2
    disk = SimDisk()
    before: list[DiskEvent] = [EpochEvent(first=0, last=1, members=(0,)),
                               RecordEvent(gsn=one, slot=0, client_id=7, seq=1, data=b"one"),
                               RecordEvent(gsn=two, slot=1, client_id=7, seq=2, data=b"two"),
                               FrontierEvent(frontier=two, epoch=1, next_slot=0)]
    disk.written.extend(before)
    disk.sync()
    rig = Rig(disk)
    assert rig.driver.core.log.records[two].data == b"two"
    rig.send(wire.Probe(req_id=1, gen=0))
    rig.run_for(5 * MS)
    rig.send(wire.Install(req_id=2, gen=0, base=one, trim=0, events=[], end=two))
    rig.run_for(5 * MS)
    done = rig.answer(2)
    assert isinstance(done, wire.RecoveryOk) and done.payload["frontier"] == two, rig.answers
    synced = disk.written[:disk.synced]
    assert any(isinstance(ev, TruncateEvent) and ev.base == one for ev in synced), "answered before the fsync"
    disk.lose_tail(len(disk.written))  # the power loss: what was not synced is gone
    rig.restart()
    log = rig.driver.core.log
    assert two not in log.records and log.records[one].data == b"one" and log.frontier == two


def test_a_replica_restarted_after_a_resume_does_not_take_that_recovery_again() -> None:
    """Formerly a stuck shard the system simulation found (seed 2069782): a replica
    resumed generation 0 and went on; the handler's leader died before it wrote "done",
    the replica restarted (cleanly), and the new leader ran generation 0 again. The
    restarted replica had forgotten the generation it resumed: it froze for it again and
    took its INSTALL, rolling its log back below positions made stable since the resume.
    The disk's resume mark keeps the generation: the PROBE hears it installed and
    resumed, and a repeat of its INSTALL is refused, the log untouched."""
    rig = Rig()
    rig.send(wire.Probe(req_id=1, gen=0))
    rig.run_for(5 * MS)
    gsn = (1 << 32) + 1
    rig.send(wire.Install(req_id=2, gen=0, base=0, trim=0,
                          events=[EpochEvent(first=0, last=1, members=(0,)),
                                  RecordEvent(gsn=gsn, slot=0, client_id=7, seq=1, data=b"recovered")], end=gsn))
    rig.run_for(5 * MS)
    rig.send(wire.Resume(req_id=3, gen=0, stable=gsn, refused=[]))
    rig.run_for(5 * MS)
    assert isinstance(rig.answer(3), wire.RecoveryOk), rig.answers
    rig.restart()
    rig.send(wire.Probe(req_id=4, gen=0))
    rig.run_for(5 * MS)
    state = rig.answer(4)
    assert isinstance(state, wire.RecoveryOk), rig.answers
    assert state.payload["installed"] and state.payload["resumed"] and not state.payload["frozen"], state.payload
    rig.send(wire.Install(req_id=5, gen=0, base=0, trim=0, events=[EpochEvent(first=0, last=1, members=(0,))], end=gsn))
    rig.run_for(5 * MS)
    again = rig.answer(5)
    assert isinstance(again, wire.Error) and again.code == wire.E_STALE, again
    assert rig.driver.core.log.records[gsn].data == b"recovered" and not rig.driver.core.frozen
