"""Failure recovery between real ReplicaCores and the failure handler's RecoveryCore,
driven step by step (no network, no clock): the protocol of dissertation 4.2.5."""

from __future__ import annotations

from failure_handler.recovery import DONE, RecoveryCore
from tests.harness import MS, ShardHarness
from ziplog.cores.client.waits import InsertWait, Redirect
from ziplog.protocol import frames as wire
from ziplog.protocol.events import DiskEvent, RecordEvent
from ziplog.protocol.gsna import epoch_end

SHARDS = (0, 1)


class Harness(ShardHarness):
    """Shard 0 (of shards 0 and 1) with the failure handler; the MMS drops a recovering
    shard at once unless ``auto_drop`` is off."""

    def __init__(self) -> None:
        super().__init__({"noop_timeout_ns": 1 * MS, "suspect_timeout_ns": 300 * MS}, [[0, list(SHARDS)]])
        self.handler.on_history(self.history, 0)
        self.auto_drop = True
        self.on_persist = lambda a: self.drop() if a.recovering and self.auto_drop else None
        self.B.connect_primary(0)
        self.pump()

    def backup_acquired(self) -> None:
        """The backup hears nothing from its primary for the suspicion timeout and asks
        for recovery; the handler acquires its state (the shard is not dropped yet)."""
        self.now += 400 * MS
        self.B.tick(self.now)
        self.pump()
        self.auto_drop = False
        self.handler.on_suspect(0, 1, self.now)
        self.pump()
        assert self.B.recovery.authority

    def readd(self) -> None:
        """The MMS takes shard 0 back: two epochs with every shard (it decides again)."""
        self.history = self.history + [[self.epoch + 1, list(SHARDS)]]
        self.next_epoch()
        self.next_epoch()

    def drop(self) -> None:
        """The MMS leaves shard 0 out of the next epoch."""
        self.history = self.history + [[self.epoch + 1, [1]]]
        self.handler.on_history(self.history, self.now)


def test_primary_crash_keeps_acknowledged_guesses_and_resumes() -> None:
    h = Harness()
    h.next_epoch()
    # Two records on the fast path, then one the backup guessed and acked while the
    # primary decided it but crashed before forwarding: acknowledged, held only as a guess.
    h.insert(1, b"one")
    h.insert(2, b"two")
    h.pump()
    assert h.B.frontier >= h.P.log.gsns[-1]
    h.insert(3, b"three")
    h.pump(drop_from={0})  # the primary's acks and forwards are lost: it "crashed"
    third_gsn = h.P.log.gsns[-1]
    guess = [m for i, m in h.replies(3) if i == 1 and isinstance(m, wire.Ack)]
    assert guess and guess[-1].gsn == third_gsn, "the backup guessed the primary's gsn (fast path)"
    # The primary restarts from a disk without its last writes.
    lost_disk = [ev for ev in h.disk[0] if not (isinstance(ev, RecordEvent) and ev.gsn == third_gsn)]
    h.P = h.new_core(0)
    h.P.replay(lost_disk)
    # The backup hears nothing for the suspicion timeout: it asks for recovery.
    h.now += 400 * MS
    h.B.tick(h.now)
    h.pump()
    assert h.suspects and h.suspects[-1].shard == 0
    h.auto_drop = False
    h.handler.on_suspect(0, 1, h.now)
    h.pump()
    # Frozen backup, acquired as source: it answers the in-doubt record for good.
    assert h.B.recovery.authority and not h.P.qualified
    h.client.clear()
    h.insert(3, b"three", to=(1,))
    h.insert(4, b"four", to=(1,))
    h.pump()
    answers = {m.req_id: m for _, m in h.client}
    a3, a4 = answers[3], answers[4]
    assert isinstance(a3, wire.Ack) and a3.gsn == third_gsn and a3.final, a3
    assert isinstance(a4, wire.Error) and a4.code == wire.E_NOT_HELD
    w = InsertWait(4, 2)
    try:
        w.feed(1, a4)
        raise AssertionError("NOT_HELD must redirect")
    except Redirect:
        pass
    assert not h.handler.completed, "recovery waits for the MMS to drop the shard"
    h.drop()
    h.pump()
    # Roll forward done: both replicas hold the same log up to the end of the last
    # epoch that included the shard, with the guessed record decided.
    assert h.handler.completed == [(0, 0)], h.handler.completed
    end = epoch_end(0)
    for core in (h.P, h.B):
        assert core.frontier == end and not core.frozen, (core.frontier, core.frozen)
        assert core.log.records[third_gsn].data == b"three"
    assert h.P.log.gsns == h.B.log.gsns
    assert h.P.stable == end
    assert 0 not in h.handler.active
    # The source resumed first (it hands over the records it refused), so its HELLO
    # reached a primary still frozen; it says HELLO again 10 ms later.
    h.tick(20_000_000)
    # The shard comes back: the MMS re-adds it and the primary decides again.
    h.readd()
    h.client.clear()
    h.insert(5, b"five")
    h.pump()
    acks = [(i, m.gsn) for i, m in h.client if isinstance(m, wire.Ack)]
    assert {i for i, _ in acks} == {0, 1} and len({g for _, g in acks}) == 1, acks
    assert h.P.log.gsns == h.B.log.gsns and h.P.stable == h.P.frontier


def test_backup_crash_primary_is_source() -> None:
    h = Harness()
    h.next_epoch()
    h.insert(1, b"one")
    h.pump()
    h.insert(2, b"two")
    h.pump(drop_from={1})  # the backup's acks and prefix are lost: it "crashed"
    decided = list(h.P.log.gsns)
    h.B = h.new_core(1)  # restarted with an empty disk
    h.now += 400 * MS
    h.P.tick(h.now)
    h.pump()
    assert h.suspects, "the primary suspects its silent backup"
    h.handler.on_suspect(0, 0, h.now)
    h.B.connect_primary(h.now)
    h.pump()
    assert h.handler.completed == [(0, 0)]
    assert h.P.log.gsns == h.B.log.gsns == decided
    assert h.B.frontier == h.P.frontier == epoch_end(0)
    assert not h.handler.active and not h.P.frozen and not h.B.frozen
    # A second suspicion right after is ignored (reports may still be in flight).
    h.handler.on_suspect(0, 1, h.now)
    assert not h.handler.active
    assert not h.handler.ready().coordinate
    assert DONE == "done"


def test_a_primary_timeout_does_not_settle_an_insert_a_backup_guessed() -> None:
    """A restarted primary that has not heard its backup yet parks an insert (it decides
    nothing) and, 2 s later, refuses it for good (TIMEOUT); the backup had guessed and
    acknowledged it. If the primary then fails, recovery rolls that guess forward: the
    record is in the log. So the primary's refusal must not end the insert as an error
    (an application that retries would store it twice): the client asks again until the
    recovery's authority answers for good."""
    h = Harness()
    h.next_epoch()
    h.insert(1, b"one")
    h.pump()
    # The primary restarts from its disk and never hears its backup (the HELLOs are lost).
    disk = list(h.disk[0])
    h.P = h.new_core(0)
    h.P.replay(disk)
    h.B.connect_primary(h.now)
    h.pump(lose=("hello",))
    h.client.clear()
    h.insert(2, b"two")  # the primary parks it; the backup guesses it and acknowledges
    h.pump(lose=("hello",))
    w = InsertWait(2, 2)
    for i, m in h.client:
        assert not w.feed(i, m)
    guess = w.latest[1]
    assert guess is not None and guess > 0, "the backup guessed the record"
    h.now += 2100 * MS  # the parked insert times out on the primary
    h.P.tick(h.now)
    h.pump(lose=("hello",))
    timeouts = [m for i, m in h.client if i == 0 and isinstance(m, wire.Error) and m.code == wire.E_TIMEOUT]
    assert timeouts, "the primary refused the record for good"
    assert not w.feed(0, timeouts[-1]) and w.refused is not None and not w.done, \
        "a refusal while a backup holds a guess settles nothing"
    # The primary fails for good; the backup suspects it, recovery acquires the backup's
    # state (the primary never qualified) and the backup answers the resend for good.
    h.P = None
    h.backup_acquired()
    h.client.clear()
    h.insert(2, b"two", to=(1,))
    h.pump()
    assert any(w.feed(i, m) for i, m in h.client), "the authority settles it"
    assert w.final and w.decided == guess


def test_after_a_recovery_a_peer_still_silent_is_suspected_again() -> None:
    """An asymmetric cut (the backup's link to its primary only) let a recovery finish
    while the link stayed down, and then nobody suspected again: suspicion was armed only
    for peers heard since. Every peer took part in the recovery, so each is expected to
    speak after it; one that does not is suspected, again every timeout."""
    from ziplog.cores.effects import Outbox, Peer
    from ziplog.cores.replica.liveness import Liveness

    out = Outbox()
    timeout = 500
    lv = Liveness(shard=3, replica=1, timeout_ns=timeout, out=out)
    lv.reset(1_000, peers=[0])  # RESUME: the primary is expected from now on
    lv.check(1_000 + timeout - 1, None)
    assert not out.ready().messages
    suspects = []
    for t in range(1_000 + timeout, 1_000 + 4 * timeout + 1, 50):
        lv.check(t, None)
        suspects += [m for dest, m in out.ready().messages if dest is Peer.HANDLER]
    assert [(m.shard, m.replica) for m in suspects] == [(3, 1)] * 3 and "[0]" in suspects[0].reason
    lv.hear(0, 3_000)  # the link is back: quiet again
    lv.check(3_100, None)
    assert not out.ready().messages


def _primary_lost_its_tail_while_its_backup_restarted(vouched: bool) -> tuple[Harness, list[int]]:
    """Three records decided and forwarded (the backup in step, no guess outstanding);
    the primary crashes and its disk lost the last one; meanwhile the backup was stopped
    gracefully (vouching for its log when ``vouched``) and restarts on its disk. Then the
    primary restarts on what its disk kept, and hears the backup's HELLO."""
    h = Harness()
    h.next_epoch()
    for seq in (1, 2, 3):
        h.insert(seq, b"r%d" % seq)
        h.pump()
    acked = list(h.P.log.gsns)
    assert len(acked) == 3 and h.B.log.gsns == acked and h.B.qualified
    marker = h.B.clean_close_frontier()
    assert marker == h.B.frontier, "in step, no guess outstanding: the backup may vouch"
    h.disk[1].extend(h.B.flush_marks())  # the stop writes everything (the driver's close)
    primary_disk = [ev for ev in h.disk[0] if not (isinstance(ev, RecordEvent) and ev.gsn == acked[-1])]
    h.B = h.new_core(1)
    h.B.replay(list(h.disk[1]), clean_frontier=marker if vouched else None)
    assert h.B.restarted_clean is vouched and not h.B.qualified, "restarted: in step again only with its primary"
    h.P = h.new_core(0)
    h.P.replay(primary_disk)
    h.auto_drop = False
    h.B.connect_primary(h.now)
    h.pump()
    assert h.P.blocked is not None, "the backup is ahead of the restarted primary"
    h.handler.on_suspect(0, 0, h.now)
    h.pump()
    return h, acked


def test_a_backup_restarted_clean_is_the_source_when_its_primary_lost_its_tail() -> None:
    """The primary crashed while its backup was being restarted: neither replica is in
    step, but the backup vouched for its log when it stopped, so it holds every record it
    acknowledged (all of them: a record is acknowledged by every replica). The recovery
    takes its state, and nothing acknowledged is lost."""
    h, acked = _primary_lost_its_tail_while_its_backup_restarted(vouched=True)
    rec = h.handler.active[0]
    assert rec.acquired is not None and rec.acquired["source"] == 1, "the clean backup is the source"
    h.drop()
    h.pump()
    assert h.handler.completed == [(0, 0)], h.handler.completed
    for core in (h.P, h.B):
        assert [core.log.records[g].data for g in acked] == [b"r1", b"r2", b"r3"]
        assert core.frontier == epoch_end(0) and not core.frozen
    assert h.P.log.gsns == h.B.log.gsns


def test_without_the_backups_marker_no_replica_may_be_the_source() -> None:
    """The same, but the backup did not vouch (a crash, or a stop that could not): the
    primary lost a record the backup may hold only in memory-backed guesses, and the
    backup cannot show it lost nothing. More replicas failed than the shard tolerates:
    the recovery waits rather than lose or invent an acknowledged record."""
    h, _ = _primary_lost_its_tail_while_its_backup_restarted(vouched=False)
    rec = h.handler.active[0]
    assert rec.acquired is None and not h.handler.completed
    h.tick(100 * MS)
    assert h.handler.active[0].acquired is None


def test_a_recovery_without_a_source_says_why_and_probes_again() -> None:
    """No replica may be the source: the handler's core says why (its driver logs it and
    counts it), probes every replica again each ``reprobe_ns``, and acquires as soon as
    one answers that it holds everything it acknowledged (here the backup's next
    incarnation, restarted on a marker that vouches for its disk)."""
    h, acked = _primary_lost_its_tail_while_its_backup_restarted(vouched=False)
    why = h.handler.waiting_for_a_source()
    assert list(why) == [0] and "no replica can vouch" in why[0], why
    every = h.handler.s.reprobe_ns
    assert h.handler.next_deadline() == h.now + every, "the next probe is due then"
    h.B = h.new_core(1)
    h.B.replay(list(h.disk[1]), clean_frontier=_replayed_frontier(h, h.disk[1]))
    assert h.B.restarted_clean
    h.now += every
    h.handler.tick(h.now)
    h.pump()
    rec = h.handler.active[0]
    assert rec.acquired is not None and rec.acquired["source"] == 1, "probed again, the clean backup is the source"
    assert not h.handler.waiting_for_a_source()
    h.drop()
    h.pump()
    assert h.handler.completed == [(0, 0)]
    assert [h.P.log.records[g].data for g in acked] == [b"r1", b"r2", b"r3"]


def _replayed_frontier(h: Harness, disk: list[DiskEvent]) -> int:
    """The frontier a replica replays ``disk`` to (what a marker must name)."""
    probe = h.new_core(1)
    probe.replay(list(disk))
    return probe.frontier


def test_a_holder_that_refuses_a_fetch_is_probed_again_before_anyone_fetches_from_it() -> None:
    """Three replicas (f = 2): replica 2 lags the acquired stable point and needs
    records fetched from a holder. The holder answers the FETCH STALE (it restarted and
    forgot the generation): it is probed again, and no FETCH goes back to it before it
    answers (it used to be asked again at once, for as long as it answered STALE)."""
    from failure_handler.recovery import RecoveryCore
    from ziplog.cores.effects import ReplicaOf

    rc = RecoveryCore()
    rc.load(0, 3, None, 0)
    rc.on_history([[0, [0, 1]]], 0)
    assert rc.on_suspect(0, 0, 0)
    for a in rc.ready().coordinate:
        rc.on_persisted(0, 0, 0)
    probes = {d.replica: m for d, m in rc.ready().messages if isinstance(m, wire.Probe) and isinstance(d, ReplicaOf)}
    assert sorted(probes) == [0, 1, 2]
    x = epoch_end(0) - 10
    state = {"gen": 0, "frozen": True, "trim": 0, "last_epoch": 0, "installed": False, "resumed": False,
             "membership": [[0, 0, [0, 1]]], "records": [], "guesses": []}
    rc.on_reply(0, 1, wire.RecoveryOk(req_id=probes[1].req_id, payload={
        **state, "replica": 1, "qualified": True, "frontier": x, "stable": x}), 0)
    rc.ready()
    rc.on_persisted(0, 0, 0)  # the acquired state is durable
    rc.on_history([[0, [0, 1]], [1, [1]]], 0)  # the MMS dropped the shard
    rc.ready()
    rc.on_reply(0, 2, wire.RecoveryOk(req_id=probes[2].req_id, payload={
        **state, "replica": 2, "qualified": False, "frontier": 5, "stable": 5}), 0)
    fetches = [(d, m) for d, m in rc.ready().messages if isinstance(m, wire.Fetch) and isinstance(d, ReplicaOf)]
    assert [d.replica for d, _ in fetches] == [1], fetches
    now = 1 * MS
    rc.on_reply(0, 1, wire.Error(req_id=fetches[0][1].req_id, code=wire.E_STALE, message="restarted"), now)
    sent = rc.ready().messages
    assert [d for d, m in sent if isinstance(m, wire.Fetch)] == [], "fetched from the refusing holder again at once"
    rc.tick(now + rc.s.retry_ns)
    sent = rc.ready().messages
    assert ReplicaOf(0, 1) in [d for d, m in sent if isinstance(m, wire.Probe)], "the holder is probed again"
    assert not [d for d, m in sent if isinstance(m, wire.Fetch) and d == ReplicaOf(0, 1)], "fetched before it answered"
    probe = next(m for d, m in sent if isinstance(m, wire.Probe) and d == ReplicaOf(0, 1))
    rc.on_reply(0, 1, wire.RecoveryOk(req_id=probe.req_id, payload={
        **state, "replica": 1, "qualified": True, "frontier": x, "stable": x}), now + rc.s.retry_ns)
    assert [d for d, m in rc.ready().messages if isinstance(m, wire.Fetch)] == [ReplicaOf(0, 1)], "fetched once it answered"


def test_a_replica_frozen_for_a_recovery_comes_back_frozen_after_a_restart() -> None:
    """The freeze is a promise that outlives the process: the backup, frozen and
    installed, restarts before the recovery resumes it; it comes back frozen (installed),
    says no HELLO, and so the restarted primary, which the recovery has not reached yet,
    stays STARTING instead of serving its own log beside the recovery's. The recovery
    then ends as usual, and the restarted backup answers it as before its restart."""
    h = Harness()
    h.next_epoch()
    h.insert(1, b"one")
    h.pump()
    # The primary crashes; the backup suspects it and the recovery freezes the backup.
    p_disk = list(h.disk[0]) + h.P.flush_marks()
    h.P = None
    h.now += 400 * MS
    h.B.tick(h.now)
    h.pump()
    h.handler.on_suspect(0, 1, h.now)
    h.pump()
    assert h.B.frozen
    # The backup restarts from its disk (the freeze, fsynced before its PROBE answer).
    h.B = h.new_core(1)
    h.B.replay(list(h.disk[1]))
    assert h.B.frozen and h.B.recovery.gen == 0
    sent = len(h.sent)
    h.B.connect_primary(h.now)
    # The primary comes back too, before the recovery's PROBE reaches it.
    h.P = h.new_core(0)
    h.P.replay(p_disk)
    h.pump()
    assert not [m for i, _, m in h.sent[sent:] if i == 1 and isinstance(m, wire.Hello)], "a frozen replica said HELLO"
    assert h.P.role.state.value == "starting"  # type: ignore[union-attr]
    for _ in range(5):
        h.now += 20 * MS
        h.handler.tick(h.now)  # the PROBE to the primary goes again
        h.tick()
    assert h.handler.completed == [(0, 0)]
    assert not h.P.frozen and not h.B.frozen and h.P.log.gsns == h.B.log.gsns


def _assert_time_passes(core: RecoveryCore, now: int) -> None:
    """Each tick leaves the handler's next deadline in the future: its loop waits."""
    for _ in range(3):
        core.tick(now)
        deadline = core.next_deadline()
        assert deadline is not None and deadline > now, (deadline, now)
        now = deadline


def test_a_fetch_with_no_holder_up_waits_for_one_without_spinning() -> None:
    """Found by the system simulation (a leader's loop resumed after a stall): a replica that
    needs records below the recovery's stable point, whose holder refused the FETCH (it
    restarted) while no other holder has answered, waits for a holder's PROBE answer with
    nothing in flight: its fetch stayed pending with a deadline in the past, and the
    handler's loop spun on it without time passing."""
    from failure_handler.recovery import ACQUIRED, HandlerSettings, RecoveryCore

    core = RecoveryCore(HandlerSettings(retry_ns=20 * MS))
    x = epoch_end(0) + 5
    record = {"gen": 0, "phase": ACQUIRED, "source": 1, "stable": x, "frontier": x + 3, "records": [], "guesses": [],
              "membership": []}
    core.load(0, 2, record, 0)
    core.on_history([[0, [0, 1]], [1, [0, 1]], [2, [1]]], 0)
    rec = core.active[0]

    def answer_probe(replica: int, frontier: int) -> None:
        pending = rec.reps[replica].pending
        assert pending is not None and pending[1] == wire.PROBE
        core.on_reply(0, replica, wire.RecoveryOk(req_id=pending[0], payload={
            "frontier": frontier, "frozen": True, "qualified": replica == 1}), 0)

    answer_probe(1, x + 3)  # the source holds what replica 0 lacks below x
    answer_probe(0, 3)
    fetch = next(m for _, m in core.ready().messages if isinstance(m, wire.Fetch))
    core.on_reply(0, 1, wire.Error(req_id=fetch.req_id, code=wire.E_STALE, message="restarted"), 0)
    _assert_time_passes(core, 30 * MS)


def test_a_request_its_recovery_no_longer_sends_again_waits_its_retry_interval() -> None:
    """Found by the system simulation: a RESUME the source had not answered when another
    replica restarted (forgotten, so the recovery is back to installing it) is not sent
    again until every replica is installed again; its deadline stayed in the past and the
    handler's loop spun without time passing."""
    from failure_handler.recovery import ACQUIRED, HandlerSettings, RecoveryCore

    core = RecoveryCore(HandlerSettings(retry_ns=20 * MS))
    x = epoch_end(0) + 5
    core.load(0, 2, {"gen": 0, "phase": ACQUIRED, "source": 1, "stable": x, "frontier": x, "records": [],
                     "guesses": [], "membership": []}, 0)
    core.on_history([[0, [0, 1]], [1, [0, 1]], [2, [1]]], 0)
    rec = core.active[0]

    def answer(replica: int, op: int, payload: dict[str, object]) -> None:
        pending = rec.reps[replica].pending
        assert pending is not None and pending[1] == op, (replica, pending)
        core.on_reply(0, replica, wire.RecoveryOk(req_id=pending[0], payload=payload), 0)

    for replica in (0, 1):
        answer(replica, wire.PROBE, {"frontier": x, "frozen": True, "qualified": replica == 1})
    for replica in (0, 1):
        answer(replica, wire.INSTALL, {"frontier": rec.end})
    pending = rec.reps[1].pending
    assert pending is not None and pending[1] == wire.RESUME, "the source is told RESUME first"
    core._forget(rec, 0)  # the other replica restarted: installed again before anyone resumes
    _assert_time_passes(core, 30 * MS)


def test_a_source_restarted_before_resume_still_hands_over_what_it_said_the_shard_will_not_hold() -> None:
    """Found by the system simulation (seed 50051893, a record stored in two shards): the
    source told a client NOT_HELD, the client placed the record in another shard, the
    source lost power before RESUME and came back without that promise, so RESUME handed
    nothing over and a copy of the client's INSERT delayed on its way to another replica
    was placed here too. The NOT_HELD leaves once written (a RefusedEvent), a restart
    reads it back, RESUME hands it over, and every replica refuses the delayed copy."""
    from ziplog.protocol.events import RefusedEvent

    h = Harness()
    h.next_epoch()
    h.insert(1, b"one")
    h.pump()
    h.insert(2, b"two")
    h.pump(drop_from={0})  # the primary "crashed" with record two's acks and forwards
    h.P = h.new_core(0)
    h.P.replay(list(h.disk[0]))
    h.backup_acquired()
    # the client's INSERT of record 4 reaches the source (answered NOT_HELD: the client
    # places the record elsewhere); its copy to the primary is delayed in the network
    h.insert(4, b"four", to=(1,))
    h.B.flush(h.now)
    ready = h.B.ready()
    assert [(ev.client_id, ev.seq) for ev in ready.persist if isinstance(ev, RefusedEvent)] == [(7, 4)]
    assert not [m for _, m in ready.messages if isinstance(m, wire.Error)], "the NOT_HELD waits for the disk"
    (_, refused), = [(d, m) for d, m in ready.durable if isinstance(m, wire.Error)]
    assert refused.code == wire.E_NOT_HELD
    assert not ready.coordinate and len(ready.messages) + len(ready.durable) == 1, ready
    h.disk[1].extend(ready.persist)
    # the source loses power: it comes back from what its disk holds
    h.B = h.new_core(1)
    h.B.replay(list(h.disk[1]))
    h.connect(1)
    h.drop()
    h.pump()
    assert h.handler.completed == [(0, 0)], h.handler.completed
    # the delayed copy reaches the primary, and a retry the source: neither holds it
    h.client.clear()
    h.insert(4, b"four", to=(0,))
    h.insert(4, b"four", to=(1,))
    h.pump()
    for core in (h.P, h.B):
        assert (7, 4) not in core.log.dedup
    assert not [m for _, m in h.replies(4) if isinstance(m, wire.Ack)], h.replies(4)


def test_refusals_survive_a_new_segment_and_old_snapshots_still_load() -> None:
    """A segment's snapshot repeats the refusals of its recovery mark's generation (an
    older segment may be gone), and a snapshot written before refusals were kept loads."""
    import msgpack

    from ziplog.cores.effects import Outbox
    from ziplog.cores.replica.log import DecidedLog
    from ziplog.protocol.events import (
        RECOVERY_FROZEN,
        RecoveryEvent,
        RefusedEvent,
        SnapshotEvent,
        decode_events,
        encode_events,
    )

    log = DecidedLog(Outbox())
    log.mark_recovery(RecoveryEvent(2, RECOVERY_FROZEN))
    log.mark_refused(2, (7, 4))
    log.mark_recovery(RecoveryEvent(3, RECOVERY_FROZEN))
    log.mark_refused(3, (7, 5))
    log.mark_refused(3, (8, 1))
    blob = encode_events([log.snapshot()])
    (snap, _), = decode_events(blob)
    assert isinstance(snap, SnapshotEvent) and snap.refused == ((7, 5), (8, 1))
    again = DecidedLog(Outbox())
    again.replay([snap])
    assert again.refused_gen == 3 and list(again.refused) == [(7, 5), (8, 1)]
    # the events themselves, replayed: the newest generation's only
    replayed = DecidedLog(Outbox())
    replayed.replay([ev for ev, _ in decode_events(encode_events(log.out.persist))])
    assert replayed.refused_gen == 3 and list(replayed.refused) == [(7, 5), (8, 1)]
    assert any(isinstance(ev, RefusedEvent) for ev in log.out.persist)
    # a snapshot of the build before (no refusals field) decodes with none
    old = msgpack.packb([5, [], 0, 0, 0, [7, 3, 0, 0]])
    (snap, _), = decode_events(old)
    assert isinstance(snap, SnapshotEvent) and snap.refused == () and snap.recovery == RecoveryEvent(3, 0, 0)


def test_an_install_ending_below_the_stable_point_leaves_stable_within_the_frontier() -> None:
    """Found by the system simulation (seed 60007781, a recovery that never ended): after a
    recovery, a FORWARD its primary sent before the freeze reached the backup and brought
    epochs without the shard (its positions there are no-ops), which the backup, alone
    with its primary, counted stable. The next recovery took the primary's state (it never
    applied them again): its install ended below the backup's stable point, the backup
    kept that point above its frontier, and the recovery after took the backup's state and
    waited for ever for some replica to hold records up to it."""
    h = Harness()
    h.auto_drop = False
    h.next_epoch()  # epoch 0: shards 0 and 1
    h.insert(1, b"one")
    h.pump()
    # The MMS leaves shard 0 out of epochs 1 to 3; the primary's FORWARDs of them to the
    # backup are held back on the way.
    h.history = h.history + [[1, [1]]]
    h.handler.on_history(h.history, h.now)
    sent_before = len(h.sent)
    for e in (1, 2, 3):
        h.epoch = e
        h.send_epoch(e, (1,), to=(0,))
        h.pump(lose=("forward",))
    held = [m for i, dest, m in h.sent[sent_before:] if i == 0 and isinstance(m, wire.Forward)]
    assert held and h.P.frontier > epoch_end(0) >= h.B.frontier
    high = h.P.frontier

    def recover(source: int) -> None:
        """The other replica suspects ``source``'s peer; ``source`` answers PROBE first
        (the other is away for it), so its state is the recovery's."""
        other = 1 - source
        away = h.cores[other]
        h.now += 600 * MS  # past the handler's quiet time after the last recovery
        h.cores[other] = None
        done = len(h.handler.completed)
        assert h.handler.on_suspect(0, source, h.now)
        h.pump()
        h.cores[other] = away
        for _ in range(20):
            if len(h.handler.completed) > done:
                return
            h.now += 20 * MS
            h.handler.tick(h.now)  # resends what went unanswered
            h.tick()
        raise AssertionError(("the recovery did not end", h.handler.waiting_for_a_source(), h.handler.active))

    recover(source=1)  # the backup's state: the primary goes back to the end of epoch 0
    assert h.P.frontier == h.B.frontier == epoch_end(0)
    for m in held:  # now the held FORWARDs arrive
        h.B.on_forward(m, h.now)
    h.pump()
    assert h.B.frontier == h.B.log.stable == high > h.P.frontier
    recover(source=0)  # the primary's state, which ends below the backup's stable point
    for core in (h.P, h.B):
        assert core.frontier == epoch_end(0) and core.log.stable <= core.frontier, (core.frontier, core.log.stable)
    recover(source=1)  # before, this one waited for ever
    assert [g for _, g in h.handler.completed] == [0, 1, 2]


def test_a_source_naming_a_stable_point_above_its_frontier_vouches_only_for_its_frontier() -> None:
    """A replica of a build that kept its stable point above its frontier after such an
    install: the handler takes its frontier as the recovery's stable point (no replica
    holds anything above it to fetch)."""
    core = RecoveryCore()
    core.load(0, 2, None, 0)
    core.on_history([[0, [0, 1]], [1, [1]]], 0)
    assert core.on_suspect(0, 0, 0)
    core.on_persisted(0, 0, 0)
    rec = core.active[0]
    pending = rec.reps[1].pending
    assert pending is not None and pending[1] == wire.PROBE
    frontier = epoch_end(0)
    core.on_reply(0, 1, wire.RecoveryOk(req_id=pending[0], payload={
        "frontier": frontier, "stable": frontier + (3 << 32), "frozen": True, "qualified": True, "records": [],
        "guesses": [], "membership": [[0, 0, [0, 1]]]}), 0)
    assert rec.acquired is not None and rec.acquired["stable"] == frontier


def test_a_replica_that_loses_power_after_resume_still_refuses_what_the_source_refused() -> None:
    """Found by the system simulation (seed 90001806, a record stored in two shards): the
    source told a client NOT_HELD and handed the record over at RESUME; another replica
    kept that in memory only, lost power, came back, and guessed a copy of the client's
    INSERT delayed in the network, which the client had placed in another shard. Every
    replica writes what it is handed before its (durable) RESUME answer."""
    from ziplog.protocol.events import RefusedEvent

    h = Harness()
    h.next_epoch()
    h.insert(1, b"one")
    h.pump()
    h.auto_drop = False
    h.handler.on_suspect(0, 0, h.now)
    h.pump()
    assert h.P.recovery.authority, "the primary's state is the recovery's"
    h.insert(4, b"four", to=(0,))  # the source answers NOT_HELD; the copy to the backup is delayed
    h.pump()
    assert [m.code for _, m in h.replies(4) if isinstance(m, wire.Error)] == [wire.E_NOT_HELD], h.replies(4)
    h.drop()
    h.pump()
    assert h.handler.completed == [(0, 0)], h.handler.completed
    assert any(isinstance(ev, RefusedEvent) and (ev.client_id, ev.seq) == (7, 4) for ev in h.disk[1]), \
        "the backup wrote what RESUME handed it"
    # the backup loses power and comes back from its disk; the MMS takes the shard back
    h.B = h.new_core(1)
    h.B.replay(list(h.disk[1]))
    h.connect(1)
    h.readd()
    h.client.clear()
    h.insert(5, b"five")
    h.pump()
    assert {i for i, m in h.replies(5) if isinstance(m, wire.Ack)} == {0, 1}, h.replies(5)
    # the delayed copy reaches the backup (which guesses what it may), a retry the primary
    h.insert(4, b"four", to=(1,))
    h.pump()
    h.insert(4, b"four", to=(0,))
    h.pump()
    for core in (h.P, h.B):
        assert (7, 4) not in core.log.dedup
    assert not [m for _, m in h.replies(4) if isinstance(m, wire.Ack)], h.replies(4)
