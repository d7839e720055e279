"""A primary stopped gracefully vouches for its log (the clean-close marker), and its next
incarnation serves again without a failure recovery although its backup shows guesses
above its frontier; without the marker, or with one that does not match the disk, it
blocks. A backup in step with no guess outstanding vouches too (what that buys a
recovery: ``tests/test_recovery_core.py``). The cores stepped by hand
(``tests/harness.py``), and the segment files' marker itself."""

from __future__ import annotations

from pathlib import Path

from tests.harness import ShardHarness
from ziplog.cores.replica import ReplicaCore
from ziplog.io.segments import CLEAN_CLOSE_NAME, SegmentLog
from ziplog.protocol import frames as wire
from ziplog.protocol.events import SnapshotEvent


def _shard_with_a_guess_above_the_primary() -> tuple[ShardHarness, int]:
    """Record one decided on both replicas; record two reached only the backup, which
    guessed (and acknowledged) a gsn the primary never decided. The primary's vouching
    frontier (it serves: it holds everything any replica acknowledged)."""
    h = ShardHarness()
    h.B.connect_primary(0)
    h.pump()
    h.next_epoch()
    h.insert(1, b"one")
    h.pump()
    h.insert(2, b"two", to=(1,), after=h.P.frontier)
    h.pump()
    assert any(isinstance(m, wire.Ack) and i == 1 for i, m in h.replies(2)), "the backup guessed record two"
    frontier = h.P.clean_close_frontier()
    assert frontier == h.P.frontier
    return h, frontier


def _restart_primary(h: ShardHarness, clean_frontier: int | None) -> ReplicaCore:
    h.P = h.new_core(0)
    h.P.replay(list(h.disk[0]), clean_frontier=clean_frontier)
    h.B.connect_primary(h.now)  # the backup says HELLO to the new incarnation
    h.pump()
    return h.P


def test_a_primary_restarted_on_its_marker_serves_without_a_recovery() -> None:
    h, frontier = _shard_with_a_guess_above_the_primary()
    p = _restart_primary(h, frontier)
    assert p.restarted_clean
    assert p.blocked is None
    h.next_epoch()
    assert p.role.deciding
    # Record two is decided now (its client resends to both), once, and both replicas
    # hold the same log.
    h.client.clear()
    h.insert(2, b"two")
    h.insert(3, b"three")
    h.pump()
    h.tick(50_000_000)
    assert not h.suspects, "nobody asked for a failure recovery"
    decided = {m.gsn for i, m in h.replies(2) if i == 0 and isinstance(m, wire.Ack)}
    assert len(decided) == 1
    assert [h.P.log.records[g].data for g in h.P.log.gsns] == [b"one", b"two", b"three"]
    assert h.B.log.gsns == h.P.log.gsns
    assert [h.B.log.records[g].data for g in h.B.log.gsns] == [b"one", b"two", b"three"]


def test_without_the_marker_the_same_restart_blocks() -> None:
    h, _ = _shard_with_a_guess_above_the_primary()
    p = _restart_primary(h, None)
    assert not p.restarted_clean
    assert p.blocked is not None and "failure recovery needed" in p.blocked
    h.tick(50_000_000)
    assert h.suspects, "the blocked primary asks for a recovery"


def test_a_marker_that_does_not_match_the_disk_counts_for_nothing() -> None:
    h, frontier = _shard_with_a_guess_above_the_primary()
    del h.disk[0][-2:]  # the tail the marker vouched for is not there
    p = _restart_primary(h, frontier)
    assert not p.restarted_clean and p.blocked is not None


def test_what_a_stop_may_vouch_for() -> None:
    h, frontier = _shard_with_a_guess_above_the_primary()
    assert h.B.clean_close_frontier() is None, "a backup holding a guess (in its memory only) may not vouch"
    # A restarted primary that has not heard its backups cannot know what it lacks...
    unclean = ReplicaCore(h.P.s)
    unclean.replay(list(h.disk[0]))
    assert unclean.clean_close_frontier() is None
    # ... unless it restarted clean (and decided nothing since).
    clean = ReplicaCore(h.P.s)
    clean.replay(list(h.disk[0]), clean_frontier=frontier)
    assert clean.clean_close_frontier() == frontier
    # A blocked primary lacks records a backup holds: it must never vouch, or its next
    # incarnation would take the backup's guesses for records nobody acknowledged.
    blocked = _restart_primary(h, None)
    assert blocked.blocked is not None and blocked.clean_close_frontier() is None
    # Nor one that a recovery froze.
    h.handler.on_suspect(0, 0, h.now)
    h.pump()
    assert blocked.frozen and blocked.clean_close_frontier() is None


def test_what_a_backups_stop_may_vouch_for() -> None:
    h = ShardHarness()
    assert not h.B.qualified and h.B.clean_close_frontier() is None, "not in step yet: it may have lost records"
    h.B.connect_primary(0)
    h.pump()
    h.next_epoch()
    h.insert(1, b"one")
    h.pump()
    assert h.B.qualified and h.B.clean_close_frontier() == h.B.frontier, "in step, every guess decided"
    h.insert(2, b"two", to=(1,), after=h.P.frontier)  # acknowledged by the backup alone: a guess
    h.pump()
    assert h.B.clean_close_frontier() is None, "a guess lives in memory only"
    # Restarted on the marker (of the state before the guess): it holds everything it
    # acknowledged, it still guesses nothing until in step, and it may vouch again.
    disk = list(h.disk[1]) + h.B.flush_marks()
    clean = ReplicaCore(h.B.s)
    clean.replay(disk, clean_frontier=h.B.frontier)
    assert clean.restarted_clean and not clean.qualified
    assert clean.clean_close_frontier() == clean.frontier
    unclean = ReplicaCore(h.B.s)
    unclean.replay(disk)
    assert not unclean.restarted_clean and unclean.clean_close_frontier() is None
    # A recovery's freeze ends what either may vouch for.
    h.B = clean
    h.handler.on_suspect(0, 1, h.now)
    h.pump()
    assert clean.frozen and clean.clean_close_frontier() is None


def test_the_segment_files_marker_vouches_for_one_start(tmp_path: Path) -> None:
    snap = SnapshotEvent([], 0, 0, 0)
    disk = SegmentLog(tmp_path, fsync="never")
    assert disk.take_clean_close() is None
    disk.start(snap)
    disk.close(clean_frontier=1234)
    assert (tmp_path / CLEAN_CLOSE_NAME).read_text() == "1234"
    again = SegmentLog(tmp_path)
    assert again.take_clean_close() == 1234
    assert not (tmp_path / CLEAN_CLOSE_NAME).exists(), "taken at start: a crash later is not a clean stop"
    assert again.take_clean_close() is None
    again.start(snap)
    again.close()  # a stop that may not vouch leaves no marker
    assert SegmentLog(tmp_path).take_clean_close() is None


def test_an_unreadable_marker_is_removed_and_vouches_for_nothing(tmp_path: Path) -> None:
    (tmp_path / CLEAN_CLOSE_NAME).write_text("not a frontier")
    disk = SegmentLog(tmp_path)
    assert disk.take_clean_close() is None
    assert not (tmp_path / CLEAN_CLOSE_NAME).exists()
