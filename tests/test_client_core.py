"""Shard choice in the clients' shared core (no I/O)."""

from __future__ import annotations

from ziplog.cores.client import ClientCommon
from ziplog.protocol.types import Policy


class _Topology:
    def __init__(self, live: list[int]) -> None:
        self.live = live

    def live_shards(self) -> list[int]:
        return list(self.live)


def _client(policy: Policy, live: list[int]) -> ClientCommon:
    c = ClientCommon()
    c._init_identity(5.0, policy, 1)
    c.topology = _Topology(live)
    return c


def test_a_fixed_policy_keeps_its_shard_while_it_is_avoided() -> None:
    # One insert unanswered for a while marks its shard avoided; a client pinned to that
    # shard must keep inserting there, not fail with "shard is not live".
    c = _client(Policy.fixed(0), [0, 1])
    c._avoid(0, now=100.0)
    assert c._choose_shard(None, b"x", set(), now=100.5) == 0


def test_a_fixed_policy_gives_up_its_shard_when_it_refused() -> None:
    c = _client(Policy.fixed(0), [0, 1])
    assert c._choose_shard(None, b"x", {0}, now=0.0) is None


def test_a_random_policy_moves_off_an_avoided_shard_until_it_heals() -> None:
    c = _client(Policy.random(), [0, 1])
    c._avoid(0, now=100.0)
    assert {c._choose_shard(None, b"x", set(), now=100.5) for _ in range(50)} == {1}
    assert 0 in {c._choose_shard(None, b"x", set(), now=10_000.0) for _ in range(200)}
