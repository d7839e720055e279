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
