"""How often a backup reports its prefix (real cores, the wire codec between them).

A shard's only backup knows what is stable the moment a FORWARD lands, and
subscriptions read such a shard from it, so its PREFIX only moves the primary's own
watermark: by default it answers the first FORWARD after a quiet spell at once and a
burst's together, once per millisecond. With two backups only the primary sees every
PREFIX, so each FORWARD is answered at once."""

from __future__ import annotations

from tests.harness import MS, ShardHarness
from ziplog.cores.replica.settings import LONE_BACKUP_PREFIX_NS, ReplicaSettings


def _serving(replicas: int) -> ShardHarness:
    h = ShardHarness({"prefix_interval_ns": None}, replicas=replicas)  # the shipped default
    h.now = 50 * MS
    for r in range(1, replicas):
        h.cores[r].connect_primary(h.now)  # type: ignore[union-attr]
    h.pump()
    h.next_epoch()
    h.now += 10 * MS  # a quiet spell: nothing reported for longer than the interval
    return h


def test_the_default_interval_follows_the_shards_size() -> None:
    assert ReplicaSettings(0, 1, 2).prefix_every_ns == LONE_BACKUP_PREFIX_NS == MS
    assert ReplicaSettings(0, 1, 3).prefix_every_ns == 0
    assert ReplicaSettings(0, 1, 2, prefix_interval_ns=0).prefix_every_ns == 0
    assert ReplicaSettings(0, 1, 3, prefix_interval_ns=5 * MS).prefix_every_ns == 5 * MS


def test_a_lone_backup_answers_a_quiet_spells_first_forward_at_once_and_a_burst_once_per_interval() -> None:
    h = _serving(2)
    h.insert(1, b"first after a quiet spell")
    h.pump()
    assert h.P.stable == h.P.frontier == h.B.stable, "answered at once"
    reported_at = h.now
    for seq in (2, 3, 4):  # a burst, well within the interval
        h.now += 100_000
        h.insert(seq, b"burst", after=h.P.log.gsns[-1])
        h.pump()
        assert h.B.stable == h.B.frontier == h.P.frontier, "the backup knows at once (subscriptions read it)"
        assert h.P.stable < h.P.frontier, "the primary hears of it at the interval's end"
    assert [g for g in h.B.log.gsns] == h.P.log.gsns
    # the backup's timer is due at the interval's end, and then the primary catches up
    due = h.B.next_deadline(h.now)
    assert due is not None and due <= reported_at + MS
    h.tick(due - h.now)
    assert h.P.stable == h.P.frontier


def test_with_two_backups_every_forward_is_answered_at_once() -> None:
    h = _serving(3)
    for seq in (1, 2, 3):
        h.now += 100_000
        h.insert(seq, b"x", to=(0, 1, 2), after=h.P.log.gsns[-1] if h.P.log.gsns else 0)
        h.pump()
        assert h.P.stable == h.P.frontier, "stable only through the PREFIXes: none waits"
