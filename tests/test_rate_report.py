"""A primary's rate reports per change (``ziplog/cores/replica/rate_report.py``): a steady
shard reports once and then only its heartbeat, spread over the epochs by shard id; a
move past 1/8 is reported; busy and idle turns are reported at once; a new leader of the
membership service is owed a report, spread too; between reports the figure the membership service holds stays within the bound
the module promises (1/8 or 64 records/s of the shard's own smoothed rate)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ziplog.cores.replica.rate_report import (
    HEARTBEAT_EPOCHS,
    IDLE_EPOCHS,
    LEADER_SPREAD,
    MOVE_DIVISOR,
    MOVE_FLOOR,
    OBSERVE_NS,
    RateReport,
    RateReporter,
)

EPOCH_NS = 10_000_000


def _run(r: RateReporter, counts: list[int], first: int = 0) -> list[RateReport]:
    out = []
    for i, n in enumerate(counts):
        rep = r.on_epoch_closed(first + i, n, EPOCH_NS)
        if rep is not None:
            out.append(rep)
    return out


def test_a_steady_shard_reports_once_then_only_its_heartbeat() -> None:
    r = RateReporter(0)
    reports = _run(r, [50] * (3 * HEARTBEAT_EPOCHS))  # 5,000 records/s throughout
    assert [x.epoch for x in reports] == [0, HEARTBEAT_EPOCHS, 2 * HEARTBEAT_EPOCHS]
    assert all(x.rate == 5000 and x.busy for x in reports)


def test_a_move_past_an_eighth_is_reported_and_a_smaller_one_is_not() -> None:
    r = RateReporter(0)
    _run(r, [100] * 5)  # 10,000/s, reported at epoch 0
    assert _run(r, [110] * 20, first=5) == []  # 11,000/s: the smoothed figure moves 1/10
    moved = _run(r, [120] * 5, first=25)  # 12,000/s: past 1/8 of 10,000
    assert moved and moved[0].rate > 10_000 + 10_000 // MOVE_DIVISOR


def test_two_broadcasts_taken_in_one_turn_do_not_make_a_report() -> None:
    """On a loaded machine a replica may take two epochs in one turn: the second closes
    after microseconds with no record. Taken into a window of whole epochs, it does not
    move the rate; smoothed an epoch at a time it halved it, and every epoch was a report."""
    r = RateReporter(0)
    counts_and_ns = [(90, EPOCH_NS), (0, 2_000)] * (HEARTBEAT_EPOCHS // 2)
    reports = [rep for epoch, (n, ns) in enumerate(counts_and_ns) if (rep := r.on_epoch_closed(epoch, n, ns))]
    assert [x.epoch for x in reports] == [0]  # the first; the next is the heartbeat
    assert r.rate is not None and abs(r.rate - 9000) * MOVE_DIVISOR <= 9000


def test_a_busy_shards_noisy_counts_are_reported_a_few_times_a_second() -> None:
    """A busy shard's count per epoch is a noisy figure (here Poisson, 3,000 records/s):
    windows of OBSERVE_NS report it a few times a second, where every other epoch did."""
    import random
    rng = random.Random(7)
    r = RateReporter(0)
    epochs = 1000
    counts = [sum(1 for _ in range(300) if rng.random() < 0.1) for _ in range(epochs)]  # mean 30 an epoch
    reports = _run(r, counts)
    assert OBSERVE_NS >= 2 * EPOCH_NS
    assert len(reports) < epochs // 8, len(reports)


def test_idle_and_busy_turns_are_reported_at_once() -> None:
    r = RateReporter(0)
    _run(r, [30] * 4)
    quiet = _run(r, [0] * (IDLE_EPOCHS + 5), first=4)
    assert [(x.epoch, x.busy) for x in quiet if not x.busy][:1] == [(4 + IDLE_EPOCHS - 1, False)]
    back = _run(r, [1], first=100)
    assert back and back[0].busy and back[0].epoch == 100  # the first epoch with a record


def test_a_new_leader_gets_a_report_at_the_next_epoch_close() -> None:
    r = RateReporter(0)
    r.on_leader(0)
    _run(r, [50] * 10)
    r.on_leader(0)  # the same leader again: nothing owed
    assert _run(r, [50], first=10) == []
    r.on_leader(2)  # owed: sent at the shard's first phase epoch within LEADER_SPREAD
    assert [x.epoch for x in _run(r, [50] * LEADER_SPREAD, first=11)] == [2 * LEADER_SPREAD]


def test_heartbeats_are_spread_by_shard_and_none_is_late() -> None:
    shards = range(1000)
    reporters = [RateReporter(s) for s in shards]
    per_epoch = []
    for epoch in range(3 * HEARTBEAT_EPOCHS):
        sent = sum(r.on_epoch_closed(epoch, 50, EPOCH_NS) is not None for r in reporters)
        per_epoch.append(sent)
    assert per_epoch[0] == len(shards)  # the first report of each
    # steady from then on: only heartbeats, ten an epoch, each shard once a hundred epochs
    assert set(per_epoch[1:]) == {len(shards) // HEARTBEAT_EPOCHS}
    assert all(r.silent_epochs < HEARTBEAT_EPOCHS for r in reporters)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2000), min_size=1, max_size=400))
def test_between_reports_the_reported_rate_is_within_the_bound(counts: list[int]) -> None:
    r = RateReporter(0)
    last: RateReport | None = None
    silent = 0
    for epoch, n in enumerate(counts):
        rep = r.on_epoch_closed(epoch, n, EPOCH_NS)
        if rep is not None:
            assert rep.rate == r.rate and rep.busy == r.busy
            last, silent = rep, 0
            continue
        silent += 1
        assert last is not None, "the first epoch is always reported"
        assert r.rate is not None
        moved = abs(r.rate - last.rate)
        assert moved * MOVE_DIVISOR <= last.rate or moved <= MOVE_FLOOR
        assert last.busy == r.busy and silent < HEARTBEAT_EPOCHS
