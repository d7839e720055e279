"""The whole system under crashes (``tests/sim/system.py``): storage replicas, the failure
handler leader and the MMS leader are SIGKILLed and come back, shards are added and
removed, while clients insert and two subscribers follow the log, over a lossy,
reordering, duplicating simulated network. After every seed the log is checked: no
acknowledged record lost, moved or duplicated, replicas identical, subscribers agree with
the log, InsertAfter order, one owner per gsn, and the run settles.

A seed that breaks an invariant the way a formerly known protocol bug did (``KNOWN_BUGS``:
found by this simulation, fixed since) fails naming that bug (``ZIPLOG_SIM_STRICT=0`` only
warns). The ``test_known_bug_*`` tests at the end reproduce those bugs on the cores alone
and now pass: they are regression tests.

More seeds: ``python -m tests.sim --system --seeds 10000``; one seed with its trace:
``python -m tests.sim --system --seed S --trace``.
"""

from __future__ import annotations

import os
import warnings

import pytest

from failure_handler.recovery import ACQUIRED
from tests.harness import ShardHarness, request
from tests.sim.system import KnownBug, NetParams, Outcome, SystemSim, corrupt, run
from ziplog.cores.client.waits import InsertWait, Redirect
from ziplog.cores.replica import ReplicaCore, ReplicaSettings
from ziplog.cores.replica.recovery import RecoveryPhase
from ziplog.protocol import frames as wire
from ziplog.protocol.events import EpochEvent, RecordEvent

SEEDS = range(160)
CHUNK = 40
# The known bugs are fixed: a seed that hits one again fails (ZIPLOG_SIM_STRICT=0 relaxes).
STRICT = os.environ.get("ZIPLOG_SIM_STRICT", "1") == "1"

#: seed -> its Outcome, or the known bug it hit (shared by the tests of this module)
_results: dict[int, Outcome | str] = {}


def _seed(seed: int) -> Outcome | str:
    if seed not in _results:
        try:
            _results[seed] = run(seed)  # raises AssertionError naming the seed and the replay command
        except KnownBug as exc:
            if STRICT:
                raise
            warnings.warn(f"{exc}", stacklevel=2)
            _results[seed] = exc.bug
    return _results[seed]


@pytest.mark.parametrize("chunk", range(0, len(SEEDS), CHUNK))
def test_system_survives_crashes(chunk: int) -> None:
    total: dict[str, int] = {}
    for seed in SEEDS[chunk:chunk + CHUNK]:
        out = _seed(seed)
        if isinstance(out, str):
            continue
        assert out.acked > 0 and out.delivered == out.records >= out.acked, (seed, out.counts())
        for k, v in out.counts().items():
            total[k] = total.get(k, 0) + v
    # Every chunk must have exercised the failures, or "nothing broke" means little.
    for what in ("crashes_primary", "crashes_backup", "recoveries", "redirects", "fast", "slow", "resubscribes"):
        assert total.get(what, 0) > 0, (what, total)


def test_every_fault_kind_was_exercised() -> None:
    total: dict[str, int] = {}
    known = 0
    for seed in SEEDS:
        out = _seed(seed)
        if isinstance(out, str):
            known += 1
            continue
        for k, v in out.counts().items():
            total[k] = total.get(k, 0) + v
    assert known <= len(SEEDS) // 50, f"{known} seeds hit known bugs: more than these bugs used to cause"
    for what in ("crashes_primary", "crashes_backup", "crashes_handler", "crashes_mms", "recoveries", "acquired",
                 "suspicions", "blocked", "redirects", "final_acks", "retries", "shards_added", "shards_removed",
                 "resubscribes", "fast", "slow", "disks_filled", "disk_refusals", "logs_filled", "forward_parts", "install_parts",
                 "notices", "killed_after_notice", "stops", "clean_restarts",
                 # the widened world: three-replica shards and control planes, every fsync
                 # policy, power losses (also right after a stop, and of a replica installed
                 # and not resumed), two replicas of a shard at once, restarts at the same
                 # address and what their peers queued meanwhile, PROBEs held back, replicas
                 # back frozen for a recovery that had not resumed them
                 "replicas3", "control3", "fsync_never", "fsync_interval", "fsync_always", "power_losses",
                 "power_lost_bytes", "stop_power_losses", "double_crashes", "same_address_restarts", "requeued",
                 "probes_held", "frozen_restarts",
                 # rate reports, per change, to the leader the broadcasts name (its changes drawn above)
                 "rate_reports",
                 # a block's later epochs broadcast as "same as" its first, and replicas that
                 # missed that base (lost frames, a late start, a new leader) reading the block
                 "epochs_same", "block_reads",
                 # fencing: HELLOs and PREFIXes kept in a DEALER's queue, FORWARDs held back,
                 # clients' INSERTs to a backup delayed, primaries killed as a HELLO left,
                 # stalls, leaders deposed while stalled, and what the fences refused
                 "links_held", "forwards_held", "inserts_held", "killed_on_hello", "stalls", "deposed",
                 "stale_links", "stale_leader_writes"):
        assert total.get(what, 0) > 0, (what, total)
    # Recoveries are the common case, not a fluke: most seeds with a replica crash recover.
    assert total["recoveries"] >= total["crashes_primary"] // 2, total


def test_calm_network_without_faults_takes_the_fast_path() -> None:
    calm = NetParams(min_delay=20_000, max_delay=40_000, reorder=0.0, duplicate=0.0, client_loss=0.0, peer_loss=0.0,
                     epoch_loss=0.0, control_loss=0.0)
    out = SystemSim(11, faults=0, net=calm, add_shard=False, remove_shard=False, clients=3, inserts=20).run()
    assert out.crashes_primary == out.crashes_backup == out.recoveries == out.redirects == out.suspicions == 0, out.counts()
    assert out.acked == 60 and out.delivered == 60
    assert out.fast / out.acked > 0.7, out.counts()


def test_replay_is_deterministic_and_tracing_changes_nothing() -> None:
    for seed in (5, 17):
        a, b, c = run(seed), run(seed), run(seed, trace=True)
        assert a.counts() == b.counts() == c.counts()
        assert a.sim_ms == c.sim_ms
        assert c.trace and not a.trace


def _finished(seed: int) -> SystemSim:
    sim = SystemSim(seed)
    sim.run()
    return sim


def test_the_checker_catches_a_replica_disagreeing() -> None:
    sim = _finished(3)
    core = next(r.core for r in sim.reps.values() if r.idx == 1 and r.core is not None and r.core.log.gsns)
    assert core is not None
    corrupt(core, core.log.gsns[0], b"corrupted")
    with pytest.raises(AssertionError, match="disagree"):
        sim.check()


def test_the_checker_catches_a_lost_acknowledged_record() -> None:
    sim = _finished(4)
    c = next(c for c in sim.clients if c.acked)
    seq, gsn, shard, after, data = c.acked[0]
    for i in range(sim.replicas):
        core = sim.reps[(shard, i)].core
        assert core is not None
        del core.log.records[gsn]
        core.log.gsns.remove(gsn)
    with pytest.raises(AssertionError, match="lost or moved|delivered"):
        sim.check()


def test_the_checker_catches_a_subscriber_out_of_step() -> None:
    sim = _finished(6)
    sub = sim.readers[1]
    sub.delivered[0], sub.delivered[1] = sub.delivered[1], sub.delivered[0]
    with pytest.raises(AssertionError, match="subscriber 1"):
        sim.check()


def test_a_failure_names_the_seed_and_the_replay_command(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: SystemSim) -> None:
        raise AssertionError("injected")

    monkeypatch.setattr(SystemSim, "check", broken)
    with pytest.raises(AssertionError, match=r"seed 8: injected.*\n.*python -m tests.sim --system --seed 8 --trace"):
        run(8)


# ==============================================================================================
# Minimal reproductions on the cores alone of bugs the system simulation found: regression
# tests for the fixed ones, and, for the known bugs, tests of the correct behaviour. Each asserts the correct
# behaviour, so it fails (xfail) while the bug is there and passes (XPASS) once it is fixed,
# or once the cores no longer get into the situation it sets up; then remove the bug from
# KNOWN_BUGS in tests/sim/system.py.

class _Shard(ShardHarness):
    """Shard 0's two replica cores and the failure handler wired by hand (no network, no
    clock), as in tests/test_recovery_core.py."""

    def __init__(self) -> None:
        super().__init__({"noop_timeout_ns": 10**9, "suspect_timeout_ns": 0})

    @staticmethod
    def new(replica: int) -> ReplicaCore:
        return ReplicaCore(ReplicaSettings(0, replica, 2, noop_timeout_ns=10**9, suspect_timeout_ns=0))


def _acked_guess_only_on_the_backup() -> tuple[_Shard, InsertWait]:
    """Record (7, 1) acknowledged on the fast path; the primary crashed before its FORWARD
    left, so the backup's guess is the only copy."""
    h = _Shard()
    h.B.connect_primary(0)
    h.pump()
    h.send_epoch(0, (0,))
    h.pump()
    h.insert(1, b"acked")
    h.pump(lose=("forward",))
    w = InsertWait(1, 2)
    assert any(w.feed(i, m) for i, m in h.client) and w.fast, "the client completed on the fast path"
    return h, w


def test_backup_keeps_an_acknowledged_guess_across_an_epoch() -> None:
    """Formerly bug B1 (found by the system simulation): a backup replaced its guesses at each
    EPOCH broadcast, so a record acknowledged on the fast path whose primary then failed
    before forwarding it was lost by failure recovery."""
    h, w = _acked_guess_only_on_the_backup()
    h.send_epoch(1, (0,), to=(1,))  # the next epoch's broadcast reaches the backup
    h.B.on_request(b"handler", wire.Probe(req_id=1, gen=0), h.now)
    reply = h.B.ready().durable[-1][1]  # a PROBE answer leaves once the freeze is on disk
    assert isinstance(reply, wire.RecoveryOk)
    state = reply.payload
    assert [w.decided, 7, 1, b"acked"] in state["guesses"], "the only copy of an acknowledged record is gone"


def test_source_does_not_disown_a_guess_between_install_parts() -> None:
    """Formerly a duplicate the system simulation found once the failure handler installed in
    parts: the backup holding the only copy of an acknowledged guess was the recovery's
    source; its ACQUIRED, delayed in the network, arrived after the first INSTALL part had
    dropped its guesses and before the part that brought the record back, so it told the
    waiting client the shard would not hold the record. The client placed it on another
    shard, and the recovery put it in this one too."""
    h, w = _acked_guess_only_on_the_backup()
    B, gsn = h.B, w.decided
    assert gsn is not None

    def ask(req: wire.Request) -> wire.Frame:
        request(B, b"handler", req, h.now)
        ready = B.ready()  # (an INSTALL's answer waits for the disk: a durable message)
        return (ready.messages + ready.durable)[-1][1]

    state = ask(wire.Probe(req_id=1, gen=0))
    assert isinstance(state, wire.RecoveryOk) and [gsn, 7, 1, b"acked"] in state.payload["guesses"]
    base = state.payload["frontier"]
    # The first part (the epochs, not yet the record) lands before the delayed ACQUIRED.
    first = ask(wire.Install(req_id=3, gen=0, base=base, trim=0, events=[EpochEvent(first=0, last=0, members=(0,))],
                             end=base))
    assert isinstance(first, wire.RecoveryOk), first
    assert isinstance(ask(wire.Acquired(req_id=2, gen=0)), wire.RecoveryOk)
    again = ask(wire.Insert(req_id=9, client_id=7, seq=1, after=0, data=b"acked"))
    assert not (isinstance(again, wire.Error) and again.code == wire.E_NOT_HELD), \
        "the source disowned a record the recovery is rolling forward"
    rest = ask(wire.Install(req_id=4, gen=0, base=base, trim=0,
                            events=[EpochEvent(first=0, last=0, members=(0,)),
                                    RecordEvent(gsn=gsn, slot=0, client_id=7, seq=1, data=b"acked")], end=gsn))
    assert isinstance(rest, wire.RecoveryOk), rest
    resumed = ask(wire.Resume(req_id=5, gen=0, stable=gsn, refused=[]))
    assert isinstance(resumed, wire.RecoveryOk) and [7, 1] not in resumed.payload["refused"]


def test_a_source_restarted_since_its_probe_answer_does_not_disown_a_guess() -> None:
    """Formerly a duplicate the system simulation found (seed 2013945): the recovery
    acquired the backup's state, with its guess of an acknowledged record; the backup
    lost power (a guess lives in memory only) and came back frozen; a new handler leader
    told it ACQUIRED, and it told the client the shard would not hold the record, which
    the client placed on another shard while the install brought it back here. A
    process that did not report the state itself does not answer for it."""
    h, w = _acked_guess_only_on_the_backup()
    gsn = w.decided
    request(h.B, b"handler", wire.Probe(req_id=1, gen=0), h.now)
    ready = h.B.ready()
    h.disk[1].extend(ready.persist)  # the freeze, on disk before the answer leaves
    state = ready.durable[-1][1]
    assert isinstance(state, wire.RecoveryOk) and [gsn, 7, 1, b"acked"] in state.payload["guesses"]
    h.B = h.new_core(1)  # power lost; restarted from its disk
    h.B.replay(list(h.disk[1]))
    assert h.B.frozen and h.B.recovery.phase is RecoveryPhase.RESTORED

    def answers(req: wire.Request) -> list[wire.Frame]:
        request(h.B, b"handler", req, h.now)
        ready = h.B.ready()
        return [m for _, m in ready.messages + ready.durable]

    told = answers(wire.Acquired(req_id=2, gen=0))
    assert told and isinstance(told[-1], wire.Error) and told[-1].code == wire.E_STALE, told
    again = answers(wire.Insert(req_id=9, client_id=7, seq=1, after=0, data=b"acked"))
    assert not [m for m in again if isinstance(m, wire.Error) and m.code == wire.E_NOT_HELD], \
        "a restarted source disowned a record the acquired state holds"


def test_new_shard_starts_when_its_first_hello_is_lost() -> None:
    """Formerly bug B2 (found by the system simulation): when a new shard's backup guessed
    before its first HELLO reached the primary, the primary blocked for good and recovery
    could not acquire a state (neither replica qualified)."""
    h = _Shard()
    h.handler.on_history([[0, [0]]], 0)
    h.B.connect_primary(0)
    h.pump(lose=("hello",))  # the backup's first HELLO is lost
    h.send_epoch(0, (0,))  # the starting primary keeps it for later
    h.insert(1, b"early")  # the primary parks it; the backup guesses and acks
    h.pump()
    h.now = 20_000_000
    h.B.tick(h.now)  # HELLO again, now with a guess above the primary's frontier
    h.pump()
    if h.P.blocked is None:
        return  # the shard started: nothing to recover
    h.handler.on_suspect(0, 0, h.now)
    h.pump()
    assert any(p.record["phase"] == ACQUIRED for p in h.persisted), "recovery can never acquire a state"


def test_known_bug_B4_frozen_backup_hello_makes_a_doomed_record_stable() -> None:
    h = _Shard()
    h.handler.on_history([[0, [0]]], 0)
    h.B.connect_primary(0)
    h.pump()
    h.send_epoch(0, (0,))
    h.pump()
    h.insert(1, b"one")
    h.pump()
    h.insert(2, b"doomed", to=(0,))  # the backup never hears of it ...
    h.pump(lose=("forward",))  # ... and the primary crashes before forwarding it
    doomed = h.P.log.gsns[-1]
    disk = list(h.disk[0])
    h.P = None  # type: ignore[assignment]
    h.handler.on_suspect(0, 1, h.now)  # the backup suspects; the handler probes it alone
    h.pump()
    assert h.B.frozen and h.B.recovery.authority, "the backup is the recovery's source"
    # The primary restarts from its disk (holding the doomed record) and meets its frozen backup.
    h.P = _Shard.new(0)
    h.P.replay(disk)
    h.B.connect_primary(h.now)
    h.pump()
    # The MMS drops the recovering shard; the handler installs the recovered state on the backup.
    h.send_epoch(1, (), to=(0,))
    h.handler.on_history([[0, [0]], [1, []]], h.now)
    h.pump()
    h.now += 20_000_000
    h.B.tick(h.now)  # the frozen, installed backup says HELLO again
    h.pump()
    h.send_epoch(2, (), to=(0,))
    h.pump()
    # The recovery will put a no-op at `doomed`: the primary must not call it stable.
    assert h.P.stable < doomed, (h.P.stable, doomed)


def test_known_bug_B5_refused_insert_whose_backup_copy_was_lost_settles() -> None:
    h = _Shard()
    h.handler.on_history([[0, [0]]], 0)
    h.B.connect_primary(0)
    h.pump()
    h.send_epoch(0, (0,))
    h.pump()
    h.insert(1, b"one")
    h.pump()
    # The primary restarts with an empty disk: the backup is ahead, so it blocks.
    h.P = _Shard.new(0)
    h.B.connect_primary(h.now)
    h.pump()
    assert h.P.blocked is not None, "a primary that lost everything blocks"
    w = InsertWait(2, 2)
    h.client.clear()
    h.insert(2, b"two", to=(0,))  # the copy to the backup is lost
    h.pump()
    for i, m in h.client:
        assert not w.feed(i, m)
    assert w.refused, "the blocked primary refused the record"
    # Failure recovery reconciles the replicas; the shard comes back.
    h.handler.on_suspect(0, 0, h.now)
    h.pump()
    h.handler.on_history([[0, [0]], [1, []]], h.now)
    h.pump()
    assert h.handler.completed and not h.P.frozen and not h.B.frozen
    h.handler.on_history([[0, [0]], [1, []], [2, [0]]], h.now)
    h.send_epoch(1, ())
    h.send_epoch(2, (0,))
    h.pump()
    # The client resends the same frame (a quarter second later): it must settle somehow,
    # placed on this shard or redirected elsewhere.
    for _ in range(3):
        h.now += 1_100_000_000  # resends go on; the primary's no-op timer (1 s here) fires
        for core in (h.P, h.B):
            core.tick(h.now)
        h.pump()
        h.client.clear()
        h.insert(2, b"two")
        h.pump()
        for i, m in h.client:
            try:
                if w.feed(i, m):
                    return  # placed on this shard
            except Redirect:
                return  # the shard provably holds no copy: the client moves it
    raise AssertionError(f"the insert neither completes nor redirects: {w.latest}, refused={w.refused}")


@pytest.mark.parametrize("seed", [6625])
def test_regression_seeds(seed: int) -> None:
    """Seeds that once broke an invariant. 6625: a restarted primary parked an INSERT
    before the handler froze it and decided it after recovery, while the source had told
    the client the shard would not hold it (the record landed on two shards). Run without
    the graceful stops added since, so that the seed's world is the one that broke."""
    run(seed, stops=0)


@pytest.mark.parametrize("seed", [201030, 203172, 2012375, 2013945, 2069782, 40002477, 40006065, 50015079, 50051893,
                                  50065961, 50067428, 60007781, 90001806])
def test_recovery_regression_seeds(seed: int) -> None:
    """Seeds that broke an invariant in a recovery. 201030: a replica answered an INSTALL
    before the install was on its disk (full, on both replicas), stopped, and came back
    with the record the install had replaced: the shard's replicas disagreed at that gsn
    (tests/test_install_durable.py). 203172: the handler resent a FETCH whose answer was
    on its way and kept both answers' records, so its next INSTALL held one record twice
    and the handler's own check stopped the recovery. 2012375: a replica restarted empty
    was caught up to a stable prefix past a recovery's base, then installed in parts; a
    subscription opened between two parts was shown progress over positions the
    truncation had emptied, and the next part's records came after it (a subscriber
    would have skipped them). 2013945: a source restarted since its PROBE answer
    disowned the guesses that answer had reported (a record stored on two shards).
    2069782: a replica restarted after resuming a generation forgot it, and took that
    generation's INSTALL again from a new handler leader, below positions made stable
    since (the shard's next recovery could never end; tests/test_install_durable.py).
    40002477, 40006065: a failure handler leader whose loop stalled (deposed meanwhile,
    it learns that at its next beat) resumed and loaded a shard's acquired record before
    it took the history its view held: the record's end came from a history that did
    not show the shard, its install's epochs were wrong, and its core's own checks
    stopped it (two leaders then drove one recovery with different ends). 50015079: a
    RESUME the source had not answered when another replica restarted was due and never
    sent again (the recovery was installing that replica anew): the handler's loop spun
    on its deadline without simulated time passing. 50051893: the source told a client a
    record was not held, lost power before RESUME and came back without that promise;
    a copy of the INSERT delayed on its way to another replica was placed after the
    recovery, while the client had placed the record in another shard (50065961,
    50067428: the same with the source SIGKILLed; a record on two shards, and one in the
    log that every shard had called not held). 60007781: a FORWARD held past a recovery
    brought a backup epochs without its shard, which it counted stable; the next
    recovery's install ended below them and left its stable point above its frontier, and
    the recovery after that, from its state, waited for ever for records up to that point
    (tests/test_recovery_core.py). 90001806: a replica handed the source's refusals at
    RESUME kept them in memory only, lost power, and guessed a delayed copy of a refused
    INSERT, which the next recovery rolled forward (a record in two shards;
    tests/test_recovery_core.py)."""
    run(seed)


@pytest.mark.parametrize("seed", [2028715])
def test_same_address_regression_seeds(seed: int) -> None:
    """Seeds that broke an invariant through a restart on the same address. 2028715: a
    primary refused a record (its disk full), lost power and came back on its address;
    it parked the client's resend and decided it later, while the client, taking the
    old incarnation's refusal with the backup's NO_GUESS to the resend, had moved the
    record to another shard (stored twice; tests/test_client_core.py)."""
    run(seed)


@pytest.mark.parametrize("seed", [102616, 108430, 50033508])
def test_a_stop_under_way_keeps_its_peer_from_other_faults(seed: int) -> None:
    """Seeds whose worlds broke the fault model (f = 1), not the system: a graceful stop
    decided for the end of a replica's next turn let a crash take its peer first, so both
    replicas of a shard went down (102616: an acknowledged record, never written on the
    full disks, was lost with both; 108430: neither restarted replica could vouch for the
    shard, and its recovery waited for ever). A stop under way now makes its shard no
    longer whole, as the operator's rule (one replica of a whole shard at a time) says.
    50033508: the same with a kill decided at a NOTICE for the end of a primary's turn,
    which waited out the primary's SIGSTOP (81 ms) while its peer crashed; neither
    restarted replica could vouch for the shard."""
    run(seed)


def test_a_backup_restarted_while_its_primary_was_down_recovers_the_shard() -> None:
    """108430's world as it was, beyond the fault model: the primary crashed (its disk
    without its last records), and the backup, stopped gracefully a moment later, came
    back before it. The backup vouched for its log when it stopped, so the recovery takes
    its state: every invariant holds and the shard serves again (it waited for ever when
    no replica could vouch)."""
    run(108430, stop_guards_peer=False)


# -- the simulated DEALER's queue, as ZeroMQ's ------------------------------------------------------
def test_a_dealers_queue_goes_in_order_and_dies_with_it() -> None:
    """A frame held in a DEALER's queue holds every frame sent after it (the queue is in
    order); whatever is still queued when the DEALER closes is gone (linger 0), and so is
    a frame requeued while its peer was down: none reaches the next process bound at the
    address."""
    from tests.sim.world import MS, SimProcess, World

    world = World(1, NetParams(min_delay=10, max_delay=10, reorder=0.0, duplicate=0.0, client_loss=0.0, peer_loss=0.0))
    server = SimProcess(world, "server", host="h")
    got: list[bytes] = []
    router = server.router(lambda route, frame: got.append(frame), lambda route, n: None)
    client = SimProcess(world, "client")
    dealer = client.dealer(router.addr, lambda frame: None, "primary")
    held = {b"first"}
    world.queue_holds.append(lambda d, frame: 5 * MS if frame in held else 0)
    for frame in (b"first", b"second", b"third"):
        dealer.send(frame)
    while world.step():
        pass
    assert got == [b"first", b"second", b"third"], got
    # held, then the DEALER closes: gone, though a process is bound at the address
    held.add(b"fourth")
    dealer.send(b"fourth")
    dealer.close()
    while world.step():
        pass
    assert got == [b"first", b"second", b"third"]
    # requeued while nothing is bound at the address, then closed: gone too
    world.requeue_unbound = 1.0
    second = client.dealer(router.addr, lambda frame: None, "primary")
    router.close()
    second.send(b"fifth")
    world.step()  # it arrives to no one and waits in the queue
    assert world.requeued == 1
    second.close()
    server.kill()
    again = SimProcess(world, "server#2", host="h")  # the next incarnation, at the same address
    assert again.router(lambda route, frame: got.append(frame), lambda route, n: None).addr == router.addr
    while world.step():
        pass
    assert got == [b"first", b"second", b"third"], got
