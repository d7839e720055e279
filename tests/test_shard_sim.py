"""The replication protocol of one shard under a hostile simulated network."""

from __future__ import annotations

import pytest

from tests.sim.shard import NetParams, ShardSim, run

SEEDS = range(300)


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
    calm = NetParams(min_delay=20_000, max_delay=30_000, reorder=0.0, duplicate=0.0, client_loss=0.0, peer_loss=0.0)
    # One writer, a rate the membership service would have measured, epochs reaching
    # the two replicas at different moments: nearly every insert takes two delays.
    out = ShardSim(7, clients=1, inserts=400, net=calm, rates=(4000,), noop_timeout_ns=1_000_000).run()
    assert out.fast / (out.fast + out.slow) > 0.95


def test_a_broken_invariant_is_caught() -> None:
    """The checker is not vacuous: corrupt the backup's copy and it must object."""
    sim = ShardSim(3)
    sim.run()
    g = sim.B.gsns[0]
    sim.B.records[g].data = b"corrupted"
    with pytest.raises(AssertionError, match="disagree"):
        sim.check()


def test_joining_shard_waits_for_its_first_epoch() -> None:
    """A client may see a shard in ZooKeeper's membership before the epoch admitting it
    reaches the shard: the insert waits for that epoch instead of being refused."""
    from ziplog.protocol import frames as wire
    from ziplog.protocol.gsna import EpochConfig
    from ziplog.cores.replica import ReplicaCore, ReplicaSettings

    V = wire.PROTOCOL_VERSION
    core = ReplicaCore(ReplicaSettings(1, 0, 1))
    core.on_epoch(EpochConfig(0, (0,), (1000,)), 0)
    core.on_request(b"c", [V, wire.INSERT, 7, 1, 1, 0, b"early"], 1)
    assert not core.outbox, "a joining shard must not refuse"
    core.on_epoch(EpochConfig(1, (0, 1), (1000, 1000)), 2)
    (route, frame), = core.outbox
    msg = wire.unpack(frame)
    assert msg[1] == wire.ACK and msg[2] == 7
    # once a member, leaving the membership means refusing after one more epoch (the
    # client may have seen a rejoin in ZooKeeper before its epoch reached us)
    core.on_epoch(EpochConfig(2, (0,), (1000,)), 3)
    core.outbox.clear()  # (the rate report of epoch 1)
    core.on_request(b"c", [V, wire.INSERT, 8, 1, 2, 0, b"late"], 4)
    assert not core.outbox
    core.on_epoch(EpochConfig(3, (0,), (1000,)), 5)
    assert wire.unpack(core.outbox[-1][1])[3] == wire.E_NOT_MEMBER
    core.on_request(b"c", [V, wire.INSERT, 8, 1, 2, 0, b"late"], 6)  # a resend: refused for good
    assert wire.unpack(core.outbox[-1][1])[3] == wire.E_NOT_MEMBER
