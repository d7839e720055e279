"""GSNA: the slot schedule partitions each epoch exactly, in exact integer arithmetic."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ziplog.protocol.gsna import (
    EpochConfig,
    EpochSchedule,
    SlotCursor,
    epoch_base,
    epoch_end,
    epoch_of,
)


def configs(max_shards: int = 1000, max_rate: int = 1_000_000) -> st.SearchStrategy[EpochConfig]:
    @st.composite
    def build(draw: st.DrawFn) -> EpochConfig:
        n = draw(st.integers(1, max_shards))
        ids = draw(st.lists(st.integers(0, 5000), min_size=n, max_size=n, unique=True))
        rates = draw(st.lists(st.integers(1, max_rate), min_size=n, max_size=n))
        return EpochConfig(draw(st.integers(0, 1000)), tuple(sorted(ids)), tuple(rates))
    return build()


def owners_up_to(cfg: EpochConfig, prefix: int) -> list[int]:
    """Definition by brute force: expected arrival times on one axis, ties by shard id."""
    events = []
    for s, r in zip(cfg.shards, cfg.rates):
        for k in range(prefix + 1):
            events.append((Fraction(k + 1, r), s))
    events.sort()
    return [s for _, s in events[:prefix]]


@settings(max_examples=60, deadline=None)
@given(configs(max_shards=1000), st.integers(1, 3000))
def test_slots_partition_every_prefix(cfg: EpochConfig, prefix: int) -> None:
    sched = EpochSchedule(cfg)
    limit = cfg.base + prefix - 1  # the prefix [base, limit]
    counts = sched.first_slots_after(limit)  # per shard: slots with gsn <= limit
    assert int(counts.sum()) == prefix, "slots up to the prefix must number exactly the prefix: no hole"
    gsns: list[int] = []
    for s, c in zip(cfg.shards, counts):
        c = int(c)
        if c:
            own = sched.slot_gsns(s, 0, c)
            assert own == sorted(own) and own[-1] <= limit
            gsns.extend(own)
        # the next slot lies beyond the prefix
        assert sched.slot_gsns(s, c, 1)[0] > limit
    assert sorted(gsns) == list(range(cfg.base, limit + 1)), "no duplicate, no hole"


@settings(max_examples=150, deadline=None)
@given(configs(max_shards=6, max_rate=50), st.integers(1, 80))
def test_schedule_matches_time_axis_definition(cfg: EpochConfig, prefix: int) -> None:
    sched = EpochSchedule(cfg)
    by_gsn = {}
    for s in cfg.shards:
        for k in range(prefix + 1):
            by_gsn[sched.gsn(s, k)] = s
    assert [by_gsn[cfg.base + i] for i in range(prefix)] == owners_up_to(cfg, prefix)


@settings(max_examples=150, deadline=None)
@given(configs(max_shards=40, max_rate=10_000), st.integers(-5, 20_000))
def test_first_slot_after_is_exact(cfg: EpochConfig, offset: int) -> None:
    sched = EpochSchedule(cfg)
    g = cfg.base + offset
    vec = sched.first_slots_after(g)
    for i, s in enumerate(cfg.shards):
        k = sched.first_slot_after(s, g)
        assert k == int(vec[i])
        assert sched.gsn(s, k) > g
        assert k == 0 or sched.gsn(s, k - 1) <= g


@settings(max_examples=50, deadline=None)
@given(configs(max_shards=300, max_rate=1_000_000))
def test_slot_counts_fill_the_epoch(cfg: EpochConfig) -> None:
    sched = EpochSchedule(cfg)
    total = sum(sched.slot_count(s) for s in cfg.shards)
    assert total == epoch_end(cfg.epoch) - cfg.base + 1  # all 2^32 gsns, each owned once


def test_cursor_agrees_with_schedule() -> None:
    cfg = EpochConfig(9, (1, 4, 7), (3000, 17, 250))
    sched = EpochSchedule(cfg)
    cur = SlotCursor(sched, 4)
    assert [cur.gsn(k) for k in range(600)] == [sched.gsn(4, k) for k in range(600)]
    assert cur.gsn(cur.count) == cfg.end + 1


def test_epoch_arithmetic() -> None:
    assert epoch_base(0) == 1 and epoch_end(0) == 2**32
    assert epoch_base(5) == 5 * 2**32 + 1 and epoch_end(5) == 6 * 2**32
    assert epoch_of(epoch_base(5)) == 5 and epoch_of(epoch_end(5)) == 5 and epoch_of(0) == -1


def test_numpy_and_python_paths_agree() -> None:
    rng = np.random.default_rng(1)
    shards = tuple(range(100))
    cfg = EpochConfig(3, shards, tuple(int(r) for r in rng.integers(1, 100_000, size=100)))
    sched = EpochSchedule(cfg)
    for s in (0, 50, 99):
        assert sched.slot_gsns(s, 10, 5) == [sched.gsn(s, k) for k in range(10, 15)]
