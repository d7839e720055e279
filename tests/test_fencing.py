"""Fencing between a shard's replicas: every message that carries a replica's state names
the incarnation it is meant for, and no replica acts on one meant for another
(docs/ARCHITECTURE.md, Fencing). The scenarios are those a review found: a backup's HELLO
sent before its primary's restart (kept in the backup's DEALER across a same-address
restart) reaching the primary's next incarnation, which served on it, lost a record both
replicas acknowledged or forked the shard; here the new incarnation refuses it, waits for
a HELLO meant for it, and the recovery keeps the record."""

from __future__ import annotations

from typing import Any

import msgspec

from tests.harness import MS, ShardHarness, backup_route
from ziplog.cores.client.waits import InsertWait
from ziplog.protocol import frames as wire
from ziplog.protocol.events import RecordEvent

SHARDS = (0, 1)
#: the client whose records these tests insert, and its route
CLIENT = 7


class Fenced(ShardHarness):
    """Shard 0 of shards 0 and 1, each core its own incarnation, the backup linked to the
    primary's; the membership service drops shard 0 once a recovery flags it."""

    def __init__(self, replicas: int = 2) -> None:
        super().__init__({"noop_timeout_ns": 0, "clock_pass_rate": 0, "suspect_timeout_ns": 300 * MS},
                         [[0, list(SHARDS)]], replicas=replicas, fenced=True)
        self.handler.load(0, replicas, None, 0)
        self.handler.on_history(self.history, 0)
        self.on_persist = lambda a: self.drop() if a.recovering else None
        for i in range(1, replicas):
            self.connect(i)
        self.pump()

    def drop(self) -> None:
        self.history = self.history + [[self.epoch + 1, [1]]]
        self.handler.on_history(self.history, self.now)

    def out(self, i: int) -> list[tuple[Any, wire.Frame]]:
        """What replica ``i`` sends now (its disk takes its writes at once); its answers to
        the client are collected, the rest handed back (to deliver, delay or lose)."""
        core = self.cores[i]
        assert core is not None
        core.flush(self.now)
        ready = core.ready()
        self.disk[i].extend(ready.persist)
        rest = []
        for dest, msg in ready.messages + ready.durable:
            if dest == b"client":
                reply = wire.decode_reply(wire.encode(msg))
                self.client.extend((i, m) for m in (reply.acks if isinstance(reply, wire.Acks) else [reply]))
            else:
                rest.append((dest, msg))
        return rest

    def to_backup(self, msg: wire.Frame) -> None:
        frame = wire.encode(msg)
        self.B.on_forward(wire.decode_from_primary(frame), self.now)

    def to_primary(self, msg: wire.Frame, route: bytes = backup_route(1)) -> None:
        self.P.on_request(route, wire.decode_member_request(wire.encode(msg)), self.now)
        self.P.end_input(self.now)

    def restart_primary(self, lose_gsn: int | None = None) -> None:
        """The primary is SIGKILLed and starts again at the same address, its disk without
        the batch that held ``lose_gsn``."""
        disk = [ev for ev in self.disk[0] if not (isinstance(ev, RecordEvent) and ev.gsn == lose_gsn)]
        self.P = self.new_core(0)
        self.P.replay(disk)
        self.disk[0] = list(disk)

    def recover(self) -> None:
        """The backup suspects the silent primary; the failure handler recovers the shard."""
        self.now += 400 * MS
        self.tick()
        self.handler.on_suspect(0, 1, self.now)
        self.pump()
        assert self.handler.completed, "the recovery finished"


def _acknowledged(h: Fenced, seq: int) -> int:
    wait = InsertWait(seq, h.replicas)
    assert any(wait.feed(i, m) for i, m in h.replies(seq)), "acknowledged by every replica"
    assert wait.decided is not None
    return wait.decided


def test_a_restarted_primary_refuses_a_hello_meant_for_its_predecessor_and_the_record_is_kept() -> None:
    h = Fenced()
    h.next_epoch()
    h.insert(1, b"one")
    h.pump()
    assert h.P.role.deciding and h.B.qualified
    # record two decided; its FORWARD is delayed, the next one overtakes it: a gap, a HELLO
    h.insert(2, b"two")
    delayed = [m for _, m in h.out(0) if isinstance(m, wire.Forward)]
    h.out(1)
    h.now += 200 * MS
    overtaking = [m for _, m in h.out(0) if isinstance(m, wire.Forward)]
    h.to_backup(overtaking[0])
    stale = [m for _, m in h.out(1) if isinstance(m, wire.Hello)][0]
    assert stale.to_inc == h.P.incarnation and stale.inc == h.B.incarnation
    h.to_backup(delayed[0])  # in step again
    h.out(1)
    # record R: both replicas ACK one gsn (the fast path), then the primary dies before its
    # disk took R; its FORWARD of R dies with it
    h.insert(3, b"R")
    h.out(0)
    h.out(1)
    g = _acknowledged(h, 3)
    h.restart_primary(lose_gsn=g)
    h.epoch += 1
    h.send_epoch(h.epoch, SHARDS, to=(0,))
    # the HELLO sent to the incarnation before reaches this one: refused, it stays STARTING
    h.to_primary(stale)
    assert h.P.status()["state"] == "starting" and h.P.stats["stale_links"] == 1
    # the backup links to the new incarnation: its HELLO shows R's guess above the
    # primary's frontier, so the primary blocks and asks for recovery
    h.connect(1)
    h.pump()
    assert h.P.blocked is not None
    h.recover()
    for core in (h.P, h.B):
        assert core.log.records[g].data == b"R", "the acknowledged record is kept"
        assert core.stable >= g
    assert h.P.log.gsns == h.B.log.gsns


def test_a_stale_hello_cannot_fork_the_shard() -> None:
    h = Fenced()
    h.next_epoch()
    h.insert(1, b"one")
    h.pump()
    # R reaches the primary alone (the client's copy to the backup is lost)
    h.insert(2, b"R", to=(0,))
    delayed = [m for _, m in h.out(0) if isinstance(m, wire.Forward)]
    g = h.P.log.gsns[-1]
    h.now += 200 * MS
    overtaking = [m for _, m in h.out(0) if isinstance(m, wire.Forward)]
    h.to_backup(overtaking[0])
    stale = [m for _, m in h.out(1) if isinstance(m, wire.Hello)][0]  # a gap: HELLO, delayed too
    # the primary dies before writing R; the delayed FORWARD reaches the backup, and the
    # client's resend: R acknowledged
    disk = list(h.disk[0])
    h.to_backup(delayed[0])
    h.out(1)
    h.insert(2, b"R", to=(1,))
    h.out(1)
    assert _acknowledged(h, 2) == g
    h.P = h.new_core(0)
    h.P.replay([ev for ev in disk if not (isinstance(ev, RecordEvent) and ev.gsn == g)])
    h.epoch += 2
    h.send_epoch(h.epoch, SHARDS, to=(0,))
    h.to_primary(stale)
    h.pump()
    assert h.P.status()["state"] == "starting", "the stale HELLO is not taken"
    h.connect(1)
    h.pump()
    assert h.P.blocked is not None, "the backup's HELLO meant for it shows R above its frontier"
    h.recover()
    for core in (h.P, h.B):
        assert core.log.records[g].data == b"R"
    assert h.P.log.gsns == h.B.log.gsns


def test_a_guess_for_a_restarted_primary_does_not_agree_with_its_predecessors_decision() -> None:
    """A client's copy of R to the backup is delayed past the primary's restart: the
    primary decided R (and answered) but lost it, the backup links to the new incarnation
    and tells it everything, then guesses R for the new one. The two ACKs name different
    incarnations, so they do not settle R; the resend does, at the new primary's gsn."""
    h = Fenced()
    h.next_epoch()
    h.insert(1, b"one")
    h.pump()
    written = h.disk[0] + h.P.flush_marks()  # the primary's disk, all of it written
    h.insert(2, b"R", to=(0,))  # its copy to the backup is delayed
    h.out(0)
    g = h.P.log.gsns[-1]
    p1 = h.P.incarnation
    # SIGKILLed before its next disk batch (R) and its FORWARD of R left
    h.P = h.new_core(0)
    h.P.replay(written)
    h.connect(1)
    h.pump()
    assert h.P.role.deciding, "no backup is ahead: the new incarnation serves"
    h.insert(2, b"R", to=(1,))  # the delayed copy
    h.pump()
    wait = InsertWait(2, 2)
    settled = [wait.feed(i, m) for i, m in h.replies(2)]
    guess = [m for i, m in h.replies(2) if i == 1 and isinstance(m, wire.Ack)]
    assert guess and guess[0].inc == h.P.incarnation != p1
    assert wait.decided == g and not any(settled), "a guess of another incarnation's decision agrees with nothing"
    # the resend reaches the new primary, which decides R anew in its first epoch; both
    # agree on that
    h.next_epoch()
    h.client.clear()
    h.insert(2, b"R")
    h.pump()
    wait = InsertWait(2, 2)
    assert any(wait.feed(i, m) for i, m in h.replies(2))
    decided = wait.decided
    assert decided is not None and h.P.log.records[decided].data == b"R" == h.B.log.records[decided].data


def test_a_backup_applies_only_forwards_of_the_primary_it_follows_meant_for_itself() -> None:
    h = Fenced()
    h.next_epoch()
    h.insert(1, b"one")
    h.pump()
    h.insert(2, b"two", to=(0,))
    fwd = [m for _, m in h.out(0) if isinstance(m, wire.Forward)][0]
    assert fwd.to_inc == h.B.incarnation and fwd.inc == h.P.incarnation
    frontier = h.B.frontier
    for wrong in (msgspec.structs.replace(fwd, to_inc=h.B.incarnation + 100),  # for the backup's incarnation before
                  msgspec.structs.replace(fwd, inc=h.P.incarnation + 100)):  # from another primary incarnation
        before = h.B.stats["stale_links"]
        h.to_backup(wrong)
        assert h.B.frontier == frontier and h.B.stats["stale_links"] == before + 1
    h.to_backup(fwd)
    assert h.B.frontier > frontier


def test_a_prefix_counts_only_on_the_link_its_hello_made() -> None:
    h = Fenced()
    h.next_epoch()
    h.insert(1, b"one")
    h.pump()
    h.insert(2, b"two", to=(0,))
    h.out(0)  # the FORWARD of record two is lost: the backup does not hold it
    stable = h.P.stable
    assert stable < h.P.frontier
    prefix = wire.Prefix(replica=1, frontier=h.P.frontier, to_inc=h.P.incarnation)
    # the backup's incarnation before its restart, on the connection it had (another route),
    # and a frontier reported to the primary's incarnation before
    h.to_primary(prefix, route=b"old-connection")
    h.to_primary(msgspec.structs.replace(prefix, to_inc=h.P.incarnation + 1))
    assert h.P.stable == stable and h.P.stats["stale_links"] == 2
    h.to_primary(prefix)
    assert h.P.stable == h.P.frontier


def test_the_fences_need_no_field_a_build_before_them_lacks() -> None:
    """Unfenced (a core given no incarnation, as a peer of a build before them): the
    frames hold zeros where the incarnations go, and each side takes the other's."""
    h = ShardHarness({"noop_timeout_ns": 0})
    h.B.connect_primary(0)
    h.pump()
    h.next_epoch()
    h.insert(1, b"one")
    h.pump()
    sent = [m for _, dest, m in h.sent if isinstance(m, (wire.Hello, wire.Forward, wire.Prefix))]
    assert sent and all(m.to_inc == 0 for m in sent)
    wait = InsertWait(1, 2)
    assert any(wait.feed(i, m) for i, m in h.replies(1))
    assert wait.fast and wait.decided_inc == 0


# -- the membership service: a deposed leader whose loop stalled ---------------------------------
def test_a_deposed_membership_leader_gives_no_epoch_a_second_configuration() -> None:
    """The real MembershipDriver on the simulation's ZooKeeper. Leader L1 committed block
    [10, 19] (shards 0, 1, 2) and broadcast up to 13; its loop then stalls 4 s (its
    ZooKeeper session and view alive). The next in line deposes it and leads. Meanwhile
    shard 2 is flagged recovering. L1 resumes and runs its overdue epoch timer before its
    heartbeat's answer tells it it lost: it tries to cut its block short at 14 without
    shard 2, with the versions it read before the stall. Its commit checks its lock node,
    which is gone: refused, it steps down. The new leader broadcast nothing of the
    inherited block and committed its own first; every epoch has one configuration, and
    two storage processes, one of which missed the new leader's first broadcast, agree."""
    import logging

    from mms.planner import PlannerSettings
    from mms.server import MembershipDriver
    from tests.sim.world import (CLUSTER_KEY, US, NetParams, SimElection, SimMembershipCoordination, SimProcess,
                                 World, ZooKeeper)
    from ziplog.cores.effects import ReadHistory
    from ziplog.cores.merge import SubscriberMerge
    from ziplog.cores.replica import ReplicaCore, ReplicaSettings
    from ziplog.protocol import layout
    from ziplog.protocol.epoch_feed import BlockWanted, EpochFeed
    from ziplog.protocol.membership import history_ranges

    world = World(7, NetParams(min_delay=50 * US, max_delay=50 * US, epoch_loss=0.0))
    zk = ZooKeeper(world)
    for s in range(3):
        zk.meta[s] = {"replicas": 2}
        session = zk.session(f"shard{s}")
        for i in range(2):
            zk.replicas[(s, i)] = (f"sim://rep{s}.{i}/router0", session)
    zk.changed("shards registered")

    drivers, procs, elections = [], [], []
    for i in range(2):
        p = SimProcess(world, f"mms{i}")
        session = zk.session(p.name)
        election = SimElection(zk, p, session)
        coord = SimMembershipCoordination(zk, p, session)
        d = MembershipDriver(p, p, coord, election, i, CLUSTER_KEY, 10 * MS, PlannerSettings(default_rate=1000), 10)
        procs.append(p)
        elections.append(election)
        drivers.append(d)
        p.run(d.start)
    heard: dict[str, list[Any]] = {"A": [], "B": []}
    feeds = {"A": EpochFeed(), "B": EpochFeed()}
    cores = {"A": ReplicaCore(ReplicaSettings(0, 0, 1, clock_pass_rate=0, noop_timeout_ns=0)),
             "B": ReplicaCore(ReplicaSettings(1, 0, 1, clock_pass_rate=0, noop_timeout_ns=0))}
    storage = SimProcess(world, "storage")
    missed = {"done": False}

    def on_frame(who: str, frame: bytes) -> None:
        msg = wire.decode_epoch(frame)
        if who == "B" and msg.leader == 1 and not missed["done"]:
            missed["done"] = True  # B misses the new leader's first broadcast
            return
        got = feeds[who].on_message(msg)
        if isinstance(got, BlockWanted):
            got = feeds[who].on_block(got, dict(zk.epoch_block) if zk.epoch_block else None)
        if got is None:
            return
        heard[who].append(got)
        core = cores[who]
        core.on_epoch(got, world.now)
        for req in core.ready().coordinate:
            if isinstance(req, ReadHistory):
                core.on_history(history_ranges(zk.history, req.first, req.last), world.now)
        core.ready()

    for d in drivers:
        for who in ("A", "B"):
            storage.subscriber(d.pub.addr, (lambda w: (lambda fr: on_frame(w, fr)))(who))
    logging.disable(logging.CRITICAL)
    try:
        while world.step() and drivers[0].last_epoch < 13:
            pass
        t = world.now
        procs[0].stall(t + 4000 * MS, threads=False)

        def recovering() -> None:
            zk.meta[2]["recovering"] = 0
            zk.changed("shard 2 recovering")

        world.at(t + 2000 * MS, recovering)
        world.at(t + 4000 * MS - 1, lambda: None if zk.depose(layout.MMS_ELECTION) else None)
        while world.step() and world.now < t + 6000 * MS:
            pass
    finally:
        logging.disable(logging.NOTSET)
    assert not drivers[0].leading and drivers[1].leading
    configs: dict[int, set[Any]] = {}
    for who in ("A", "B"):
        for cfg in heard[who]:
            configs.setdefault(cfg.epoch, set()).add((cfg.shards, cfg.rates))
            for f_, la, members in history_ranges(zk.history, cfg.epoch, cfg.epoch):
                assert tuple(members) == cfg.shards, (who, cfg, zk.history)
    assert all(len(v) == 1 for v in configs.values()), {e: v for e, v in configs.items() if len(v) > 1}
    merge = SubscriberMerge(1)
    for shard, who in ((0, "A"), (1, "B")):
        merge.on_batch(shard, [], [tuple(r) for r in cores[who].log.membership], 0)  # raises MergeError on a fork
    assert cores["A"].log.membership == cores["B"].log.membership
    assert zk.stale_leader_writes >= 1, "the deposed leader's commit was refused by its lock"
