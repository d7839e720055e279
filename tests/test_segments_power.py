"""The segment log (``ziplog.io.segments``) on files that lose, at a power loss, whatever
was not synced (``tests/sim/files.py``): under every fsync policy a power loss leaves a
log whose frontier claims no position whose record is gone, the clean-close marker
vouches only for what is on disk, and ``sync`` (what a durable answer waits for) keeps
everything appended before it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.sim.files import SimFiles
from ziplog.cores.effects import Outbox
from ziplog.cores.replica.log import DecidedLog
from ziplog.io.segments import SegmentLog
from ziplog.protocol.events import (
    DiskEvent,
    EpochEvent,
    FrontierEvent,
    RecordEvent,
    SnapshotEvent,
    StableEvent,
    TruncateEvent,
)

DIR = "/data/shard0-replica0"
POLICIES = ("never", "interval", "always")


class Writer:
    """What a storage driver hands its segment log: batches of records, each ending with
    the watermarks, and the snapshot after each. ``log`` mirrors the replica's memory."""

    def __init__(self, files: SimFiles, policy: str, rng: random.Random, segment_bytes: int = 600) -> None:
        self.files = files
        self.rng = rng
        self.now = 0.0
        self.disk = SegmentLog(DIR, fsync=policy, fsync_interval=0.01, segment_bytes=segment_bytes, files=files,
                               clock=lambda: self.now, background=False)
        self.log = DecidedLog(Outbox())
        self.log.replay(self.disk.load())
        self.disk.start(self.log.snapshot())
        if self.log.last_epoch < 0:
            self.write([EpochEvent(0, 0, (0,))])
        self.next_gsn = self.log.frontier + 1

    def write(self, events: list[DiskEvent]) -> None:
        log = self.log
        for ev in events:
            if type(ev) is RecordEvent:
                log.records[ev.gsn] = ev
                log.gsns.append(ev.gsn)
                log.frontier = ev.gsn
            elif type(ev) is EpochEvent:
                log.apply_epochs(ev.first, ev.last, ev.members)
        self.now += self.rng.choice([0.001, 0.005, 0.02])
        self.disk.append(events + log.flush_marks(), log.snapshot())

    def records(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            batch = [RecordEvent(self.next_gsn + i, 0, 7, self.next_gsn + i, b"x" * self.rng.randint(1, 120))
                     for i in range(self.rng.randint(1, 4))]
            self.write(list(batch))
            self.next_gsn += len(batch)
            out += [ev.gsn for ev in batch]
        return out


def replayed(files: SimFiles) -> tuple[DecidedLog, int | None]:
    disk = SegmentLog(DIR, files=files, background=False)
    log = DecidedLog(Outbox())
    log.replay(disk.load())
    return log, disk.take_clean_close()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_power_loss_leaves_no_position_claimed_whose_record_is_gone(policy: str) -> None:
    """Across rotations (small segments) and restarts: after the power loss every record
    at or below the replayed frontier is there, and what was synced is all there."""
    for seed in range(150):
        rng = random.Random(seed)
        files = SimFiles()
        written: list[int] = []
        for _ in range(rng.randint(1, 3)):  # incarnations, each killed (files kept as they are)
            w = Writer(files, policy, rng)
            written += w.records(rng.randint(1, 25))
        synced_top = _synced_top(files)
        files.power_loss(rng)
        log, _ = replayed(files)
        assert log.gsns == written[:len(log.gsns)], (seed, "not a prefix of what was written")
        claimed = [g for g in written if g <= log.frontier]
        assert claimed == log.gsns, (seed, "the frontier claims positions whose records are gone")
        assert log.frontier >= synced_top, (seed, "lost what was synced")


def _synced_top(files: SimFiles) -> int:
    """The frontier a replay of only the synced bytes would reach (what a power loss must keep)."""
    copy = SimFiles()
    for path, d in files.dirs.items():
        copy.makedirs(path)
        for name, ino in d.durable.items():
            fd = copy.open_append(f"{path}/{name}")
            copy.write(fd, memoryview(bytes(ino.data[:ino.synced])))
    return replayed(copy)[0].frontier if any(d.durable for d in copy.dirs.values()) else 0


@pytest.mark.parametrize("policy", POLICIES)
def test_the_marker_vouches_only_for_what_is_on_disk(policy: str) -> None:
    """A graceful stop syncs every segment (older ones at their rotation) before the
    marker: a power loss right after keeps all of it, and the marker names the frontier
    the disk replays to. Under --fsync never too."""
    for seed in range(60):
        rng = random.Random(seed)
        files = SimFiles()
        w = Writer(files, policy, rng)
        w.records(rng.randint(5, 30))
        frontier = w.log.frontier
        w.disk.close(clean_frontier=frontier)
        files.power_loss(rng)
        log, marker = replayed(files)
        assert marker == frontier == log.frontier, seed
        assert log.gsns == sorted(w.log.records)


def test_a_torn_tail_voids_the_marker() -> None:
    """Something written after the marker's sync was lost (here: cut by hand, mid-event):
    the marker no longer describes the disk and vouches for nothing."""
    files = SimFiles()
    w = Writer(files, "never", random.Random(1), segment_bytes=1 << 20)
    w.records(5)
    w.disk.close(clean_frontier=w.log.frontier)
    seg = sorted(n for n in files.listdir(DIR) if n.startswith("seg-"))[-1]
    files.truncate(f"{DIR}/{seg}", files.size(f"{DIR}/{seg}") - 1)  # type: ignore[operator]
    _, marker = replayed(files)
    assert marker is None


@pytest.mark.parametrize("policy", POLICIES)
def test_sync_keeps_everything_appended_before_it(policy: str) -> None:
    """What a durable answer (an INSTALL's, say) waits for, whatever the policy."""
    for seed in range(40):
        rng = random.Random(seed)
        files = SimFiles()
        w = Writer(files, policy, rng)
        w.records(rng.randint(1, 20))
        w.disk.sync()
        top = w.log.frontier
        w.records(rng.randint(0, 5))
        files.power_loss(rng)
        assert replayed(files)[0].frontier >= top, seed


def test_always_syncs_every_batch() -> None:
    files = SimFiles()
    w = Writer(files, "always", random.Random(2))
    w.records(12)
    assert files.unsynced_bytes() == 0


def test_a_trim_deletes_only_the_oldest_segments() -> None:
    """A recovery's truncation in a later segment undoes records of an earlier one: the
    later segment stays while the earlier one does, so a replay never brings the undone
    records back (it used to delete every segment whose own records lay below the trim
    point, wherever it stood)."""
    files = SimFiles()
    disk = SegmentLog(DIR, fsync="never", segment_bytes=1, files=files, background=False)
    disk.start(SnapshotEvent([(0, 0, (0,))], 0, 0, 0))

    def rec(g: int) -> RecordEvent:
        return RecordEvent(g, 0, 7, g, b"r")

    def marks(frontier: int, stable: int) -> list[DiskEvent]:
        return [FrontierEvent(frontier, 0, 0), StableEvent(stable)]

    # seg 1: records 1..5; seg 2: the recovery keeps 1..2 and makes 3..5 no-ops; seg 3: 6.
    disk.append([EpochEvent(0, 0, (0,)), *map(rec, range(1, 6)), *marks(5, 2)], SnapshotEvent([(0, 0, (0,))], 5, 2, 0))
    disk.append([TruncateEvent(2), *marks(5, 5)], SnapshotEvent([(0, 0, (0,))], 5, 5, 0))
    disk.append([rec(6), *marks(6, 6)], SnapshotEvent([(0, 0, (0,))], 6, 6, 4))
    assert len(disk.segments()) == 3
    disk.drop_below(4)  # trimmed below 4: segment 2 holds no record, segment 1 holds 5
    log = DecidedLog(Outbox())
    log.replay(SegmentLog(DIR, files=files).load())
    assert 5 not in log.gsns, log.gsns


def test_the_interval_policy_syncs_a_tail_left_idle(tmp_path: Path) -> None:
    """The helper thread syncs a batch appended just before writes stopped, without
    waiting for another append: under `interval` nothing waits much longer than one
    interval to be on disk."""
    import threading

    from ziplog.io.files import OsFiles

    class Watched(OsFiles):
        def __init__(self) -> None:
            self.synced = threading.Event()

        def fdatasync(self, fd: int) -> None:
            super().fdatasync(fd)
            self.synced.set()

    files = Watched()
    disk = SegmentLog(tmp_path, fsync="interval", fsync_interval=0.05, files=files)
    disk.load()
    disk.start(SnapshotEvent([(0, 0, (0,))], 0, 0, 0))
    try:
        disk.append([EpochEvent(0, 0, (0,)), RecordEvent(1, 0, 7, 1, b"r"), FrontierEvent(1, 0, 0)],
                    SnapshotEvent([(0, 0, (0,))], 1, 0, 0))
        files.synced.clear()  # the rotation that opened the segment synced the directory only, and no data
        disk.append([RecordEvent(2, 0, 7, 2, b"s"), FrontierEvent(2, 0, 0)], SnapshotEvent([(0, 0, (0,))], 2, 0, 0))
        assert files.synced.wait(30), "the idle tail was never synced"
    finally:
        disk.close()
