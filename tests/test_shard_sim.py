"""The replication protocol of one shard under a hostile simulated network."""

from __future__ import annotations

import pytest

from tests.sim.shard import NetParams, ShardApp, ShardSim, corrupt, run
from ziplog.cores.client.calls import InsertCall
from tests.harness import request
from ziplog.cores.replica import ReplicaCore, ReplicaSettings
from ziplog.protocol import frames as wire
from ziplog.protocol.errors import NoShardAvailableError, ZiplogTimeoutError
from ziplog.protocol.gsna import EpochConfig, epoch_base

MS = 1_000_000
SEEDS = range(200)


@pytest.mark.parametrize("chunk", range(0, len(SEEDS), 50))
def test_fast_and_slow_paths_converge(chunk: int) -> None:
    fast = slow = 0
    for seed in SEEDS[chunk:chunk + 50]:
        out = run(seed)  # raises AssertionError naming the seed on any broken invariant
        assert out.acked > 0 and out.delivered >= out.acked
        fast += out.fast
        slow += out.slow
    # Both paths must actually be exercised for the convergence claim to mean anything.
    assert fast > 0 and slow > 0


def test_calm_network_takes_the_fast_path() -> None:
    calm = NetParams(min_delay=20_000, max_delay=30_000, reorder=0.0, duplicate=0.0, client_loss=0.0, peer_loss=0.0,
                     epoch_loss=0.0, control_loss=0.0)
    # One writer, a rate the membership service would have measured, epochs reaching
    # the two replicas at different moments: nearly every insert takes two delays.
    out = ShardSim(7, clients=1, inserts=400, net=calm, rates=(4000,), noop_timeout_ns=1_000_000).run()
    assert out.fast / (out.fast + out.slow) > 0.95


def test_a_broken_invariant_is_caught() -> None:
    """The checker is not vacuous: corrupt the backup's copy and it must object."""
    sim = ShardSim(3)
    sim.run()
    corrupt(sim.B, sim.B.log.gsns[0], b"corrupted")
    with pytest.raises(AssertionError, match="disagree"):
        sim.check()


def test_joining_shard_waits_for_its_first_epoch() -> None:
    """A client may see a shard in ZooKeeper's membership before the epoch admitting it
    reaches the shard: the insert waits for that epoch instead of being refused."""
    core = ReplicaCore(ReplicaSettings(1, 0, 1))
    core.on_epoch(EpochConfig(0, (0,), (1000,)), 0)
    request(core, b"c", wire.Insert(req_id=7, client_id=1, seq=1, after=0, data=b"early"), 1)
    assert not core.ready().messages, "a joining shard must not refuse"
    core.on_epoch(EpochConfig(1, (0, 1), (1000, 1000)), 2)
    (route, msg), = core.ready().messages
    assert isinstance(msg, wire.Ack) and msg.req_id == 7
    # once a member, leaving the membership means refusing after one more epoch (the
    # client may have seen a rejoin in ZooKeeper before its epoch reached us)
    core.on_epoch(EpochConfig(2, (0,), (1000,)), 3)
    core.ready()  # (the rate report of epoch 1)
    request(core, b"c", wire.Insert(req_id=8, client_id=1, seq=2, after=0, data=b"late"), 4)
    assert not core.ready().messages
    core.on_epoch(EpochConfig(3, (0,), (1000,)), 5)
    last = core.ready().messages[-1][1]
    assert isinstance(last, wire.Error) and last.code == wire.E_NOT_MEMBER
    request(core, b"c", wire.Insert(req_id=8, client_id=1, seq=2, after=0, data=b"late"), 6)  # a resend: refused for good
    last = core.ready().messages[-1][1]
    assert isinstance(last, wire.Error) and last.code == wire.E_NOT_MEMBER


def test_refusal_memories_stay_bounded_with_an_insert_always_in_flight() -> None:
    """A backup with an insert in flight at every moment for 100 simulated seconds: its
    memory of records it will never guess, and the primary's of records it refused, keep
    only the last ``refusal_memory_ns`` of entries (5 s here, 20 s by default: twenty
    memory spans in the run). (Both memories once shared one prune timestamp with the
    backup's pending routes, which an insert always in flight kept from ever pruning them.)"""
    memory_s, run_s = 5, 100
    sim = ShardSim(11, clients=1, inserts=10, epoch_ms=50, rates=(200,),
                   overrides={"refusal_memory_ns": memory_s * 1000 * MS})
    stuck = StuckWriter(sim, period_ns=100 * MS)
    sizes: list[tuple[int, int, int]] = []

    def sample() -> None:
        P, B = sim.P, sim.B
        sizes.append((len(B.role.no_guess), len(P.role.refused), len(B.role.pending_routes)))  # type: ignore[union-attr]
        if sim.world.now < run_s * 1000 * MS:
            sim.mms.call_at(sim.world.now + 1000 * MS, sample)

    sim.mms.call_at(1000 * MS, sample)
    sim.mms.call_at(100 * MS, stuck.next)
    sim.run(limit_ms=(run_s + 100) * 1000, until_ms=run_s * 1000 + 500)
    settings = sim.P.s
    assert settings.refusal_memory_ns == memory_s * 1000 * MS
    # what one memory span (plus one prune interval) of refusals holds, with room to spare;
    # without pruning they would hold every refusal of the run
    rate = stuck.refused / run_s
    per_memory = int(rate * (settings.refusal_memory_ns + settings.prune_interval_ns) / 1e9 * 1.5) + 10
    late = sizes[3 * memory_s:]  # after the first memory spans
    assert len(sizes) >= run_s - 10 and per_memory < stuck.refused / 4, (len(sizes), stuck.refused, per_memory)
    assert all(pending > 0 for _, _, pending in late), "an insert must be in flight all along"
    assert max(ng for ng, _, _ in late) <= per_memory, (max(ng for ng, _, _ in late), per_memory)
    assert max(rf for _, rf, _ in late) <= per_memory, (max(rf for _, rf, _ in late), per_memory)
    assert min(ng for ng, _, _ in late) > 0 and min(rf for _, rf, _ in late) > 0, "the memories were used"


class StuckWriter:
    """Inserts, one after another, records the primary never decides: each names a rid
    many epochs ahead, so the primary parks it until it times out (a final refusal) and
    the backup says NO_GUESS (the rid is ahead of its epoch) and keeps the client's route."""

    def __init__(self, sim: ShardSim, period_ns: int) -> None:
        self.sim = sim
        self.period_ns = period_ns
        self.app = ShardApp(sim, 77, 0)
        self.refused = 0

    def next(self) -> None:
        sim, app = self.sim, self.app
        ahead = epoch_base(max(sim.epoch, 0) + 40)
        # One id per call: the deadline falls before the client would try again after the
        # primary's TIMEOUT (it tries a parked insert again within the deadline), so each
        # call is one refusal, ended by ZiplogTimeoutError.
        deadline = sim.world.now + sim.P.s.park_timeout_ns + app.state.retry_after_ns // 2
        call = InsertCall(app.state, b"never", ahead, None, deadline)
        app.driver.start(call, lambda: self.finished(call))

    def finished(self, call: InsertCall) -> None:
        try:
            call.result()
        except ZiplogTimeoutError:
            self.refused += 1
        except NoShardAvailableError:
            pass  # the writer's view of ZooKeeper does not show the shard yet
        if self.sim.world.now < 300_000 * MS:
            self.app.proc.call_at(self.sim.world.now + self.period_ns, self.next)


def test_the_insert_turn_histogram_times_only_the_turn_an_insert_was_read_in() -> None:
    """Handling takes no simulated time, so every sample of a replica's insert-turn
    histogram is 0: a turn's first INSERT is timed to the end of that turn, never to a
    later one's (an arrival left behind would be measured from the next turn that reads
    an INSERT)."""
    counted = 0
    for seed in range(20):
        sim = ShardSim(seed)  # duplicates, resends and losses drawn per seed
        sim.run()
        for driver in sim.drivers.values():
            assert driver.insert_turns.sum == 0, (seed, driver.settings.replica, driver.insert_turns.counts)
            counted += sum(driver.insert_turns.counts)
    assert counted > 0
