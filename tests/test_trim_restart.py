"""Trim deletes records everywhere; a restarted cluster recovers its log from disk."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ziplog
from ziplog import RID_GENESIS
from ziplog.protocol.events import DiskEvent, RecordEvent


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blob=st.binary(max_size=3000), most=st.integers(1, 700))
def test_a_write_goes_on_after_a_short_one(tmp_path: Path, blob: bytes, most: int) -> None:
    """``_write_all`` against the reference (the bytes themselves), with the kernel made to
    take at most ``most`` bytes per call; the bytearray written may be resized after."""
    import os

    from ziplog.io import segments
    from ziplog.io.files import OsFiles

    class ShortWrites(OsFiles):
        def write(self, fd: int, data: memoryview) -> int:
            return os.write(fd, bytes(data)[:most])

    path = tmp_path / f"short-{len(blob)}-{most}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    buf = bytearray(blob)
    try:
        segments._write_all(ShortWrites(), fd, buf)
    finally:
        os.close(fd)
    assert path.read_bytes() == blob
    buf.extend(b"more")  # no view of it is left


_EVENTS = st.lists(st.builds(lambda g, c, s, d: RecordEvent(g, 0, c, s, d), st.integers(1, 2**40),
                             st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.binary(max_size=5000)),
                   min_size=1, max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(_EVENTS, min_size=1, max_size=5))
def test_a_batch_is_written_as_its_events_encoded_one_after_another(tmp_path: Path,
                                                                     batches: list[list[RecordEvent]]) -> None:
    """Batches encoded into the one buffer the log keeps (each shorter or longer than the
    last) put in the file exactly what msgspec's ``encode`` of each event, joined, would:
    the reference is ``encode_event``; and they load back."""
    import uuid

    from ziplog.io.segments import SegmentLog
    from ziplog.protocol.events import SnapshotEvent, encode_event
    d = tmp_path / uuid.uuid4().hex
    log = SegmentLog(d, fsync="never")
    list(log.load())
    log.start(SnapshotEvent([], 0, 0, 0))
    for batch in batches:
        log.append(batch, SnapshotEvent([], 0, 0, 0))
    log.close()
    [segment] = log.segments()
    body = segment.read_bytes()
    expected = b"".join(encode_event(ev) for batch in batches for ev in batch)
    assert body.endswith(expected)  # after the segment's opening snapshot
    assert [ev for ev in SegmentLog(d).load() if type(ev) is RecordEvent] == [ev for b in batches for ev in b]


@pytest.mark.parametrize("n", [0, 1, 15, 16, 65535, 65536])
def test_a_batch_encodes_as_its_events_one_after_another_whatever_its_array_header(n: int) -> None:
    """One encoder call for the batch, its array header skipped (fixarray, array 16,
    array 32): the reference is ``encode_event`` of each, joined."""
    from ziplog.protocol.events import StableEvent, encode_event, encode_events_into
    events: list[DiskEvent] = [StableEvent(i) for i in range(n)]
    buf = bytearray(b"left over from a longer batch" * 100)
    start = encode_events_into(events, buf)
    assert bytes(buf[start:]) == b"".join(encode_event(ev) for ev in events)


def test_a_batch_larger_than_the_kept_buffer_lets_it_go(tmp_path: Path) -> None:
    from ziplog.io import segments
    from ziplog.protocol.events import SnapshotEvent
    log = segments.SegmentLog(tmp_path, fsync="never")
    list(log.load())
    log.start(SnapshotEvent([], 0, 0, 0))
    small = [RecordEvent(1, 0, 1, 1, b"s" * 100)]
    log.append(small, SnapshotEvent([], 1, 1, 0))
    kept = log._batch
    log.append([RecordEvent(2, 0, 1, 2, b"s" * 200)], SnapshotEvent([], 2, 2, 0))
    assert log._batch is kept  # reused
    big = [RecordEvent(3 + i, 0, 1, 3 + i, b"b" * (1 << 20)) for i in range(segments.BATCH_BUFFER_KEPT >> 20)]
    log.append(big, SnapshotEvent([], 10, 10, 0))
    assert log._batch is not kept and len(log._batch) == 0
    log.close()
    gsns = [ev.gsn for ev in segments.SegmentLog(tmp_path).load() if type(ev) is RecordEvent]
    assert gsns == [1, 2] + [ev.gsn for ev in big]


def test_segments_below_a_trim_are_deleted(tmp_path: Path) -> None:
    from ziplog.io.segments import SegmentLog
    from ziplog.protocol.events import RecordEvent, SnapshotEvent
    log = SegmentLog(tmp_path, fsync="never", segment_bytes=2000)
    list(log.load())
    log.start(SnapshotEvent([], 0, 0, 0))
    for g in range(1, 101):
        log.append([RecordEvent(g, 0, 1, g, b"x" * 100)], SnapshotEvent([], g, g, 0))
    before = len(log.segments())
    assert before > 3
    log.drop_below(60)
    kept = log.segments()
    assert len(kept) < before
    log.close()
    gsns = [ev.gsn for ev in SegmentLog(tmp_path).load() if isinstance(ev, RecordEvent)]
    assert gsns and min(gsns) < 60 <= max(gsns) and gsns == sorted(gsns)
    assert set(range(60, 101)) <= set(gsns), "nothing at or above the cut is lost"


def _load_state(path: Path) -> tuple[list[int], int, int]:
    """(record gsns, frontier, trim point) a replica restarting on ``path`` would have."""
    from ziplog.cores.effects import Outbox
    from ziplog.cores.replica.log import DecidedLog
    from ziplog.io.segments import SegmentLog
    log = DecidedLog(Outbox())
    log.replay(SegmentLog(path).load())
    return list(log.gsns), log.frontier, log.trim_point


def test_a_trim_frees_the_one_open_segment(tmp_path: Path) -> None:
    """Every record in the open segment: a trim above them all opens a new segment (the
    old one's state, trim raised) and deletes the old one; a restart has the state."""
    from ziplog.io.segments import RESERVE_NAME, SegmentLog
    from ziplog.protocol.events import EpochEvent, RecordEvent, SnapshotEvent
    log = SegmentLog(tmp_path, fsync="always")
    list(log.load())
    log.start(SnapshotEvent([], 0, 0, 0))
    ranges: list[tuple[int, int, tuple[int, ...]]] = [(0, 0, (0,))]
    log.append([EpochEvent(0, 0, (0,))] + [RecordEvent(g, 0, 1, g, b"x" * 1000) for g in range(1, 51)],
               SnapshotEvent(ranges, 60, 50, 0))
    (only,) = log.segments()
    assert (tmp_path / RESERVE_NAME).stat().st_size >= 64 << 10
    assert log.drop_below(40) == 0, "records at or above the cut: the segment stays"
    assert log.drop_below(51) == 1
    (new,) = log.segments()
    assert new != only and new.stat().st_size < 200, "the new segment holds the snapshot alone"
    assert _load_state(tmp_path) == ([], 60, 51)
    log.append([RecordEvent(61, 0, 1, 61, b"after")], SnapshotEvent(ranges, 61, 50, 51))
    log.close()
    assert _load_state(tmp_path) == ([61], 61, 51)


def test_a_trim_frees_a_full_disk_through_the_reserve(tmp_path: Path) -> None:
    """On a full disk (a 256 KiB tmpfs) the new segment's snapshot is written into the
    reserve's room; the reserve is made again once the old segment is gone."""
    import errno
    import subprocess

    from ziplog.io.segments import RESERVE_NAME, SegmentLog
    from ziplog.protocol.events import EpochEvent, RecordEvent, SnapshotEvent
    small = tmp_path / "small"
    small.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)], capture_output=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {out.stderr!r}")
    try:
        log = SegmentLog(small, fsync="always")
        list(log.load())
        log.start(SnapshotEvent([], 0, 0, 0))
        ranges: list[tuple[int, int, tuple[int, ...]]] = [(0, 0, (0,))]
        log.append([EpochEvent(0, 0, (0,))], SnapshotEvent(ranges, 0, 0, 0))
        g = 0
        with pytest.raises(OSError) as full:
            while True:
                log.append([RecordEvent(g + 1, 0, 1, g + 1, b"y" * 4000)], SnapshotEvent(ranges, g + 1, g + 1, 0))
                g += 1
        assert full.value.errno == errno.ENOSPC and g > 10 and len(log.segments()) == 1
        assert log.drop_below(g + 1) == 1
        assert (small / RESERVE_NAME).exists(), "the reserve is made again"
        log.append([RecordEvent(g + 5, 0, 1, g + 5, b"z" * 4000)], SnapshotEvent(ranges, g + 5, g, g + 1))
        log.close()
        assert _load_state(small) == ([g + 5], g + 5, g + 1)
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)


def test_trim_then_restart_from_disk(tmp_path: Path) -> None:
    data_dir = tmp_path / "cluster"
    with ziplog.local_cluster(shards=2, replicas=2, data_dir=data_dir) as cluster:
        with cluster.client() as c:
            rid = RID_GENESIS
            rids = []
            for i in range(60):
                rid = c.insert_after(b"rec-%d" % i, rid)
                rids.append(rid)
            with c.subscribe(rids[0]) as sub:  # delivered = stable on every replica
                seen = [sub.next(timeout=30) for _ in rids]
            assert [r.rid for r in seen if r] == rids
            cut = rids[20]
            c.trim(cut)
            for r in rids[:20]:
                with pytest.raises(ziplog.TrimmedError):
                    c.read_record(r)
            assert c.read_record(cut) == b"rec-20"
            with pytest.raises(ziplog.TrimmedError):
                c.subscribe(rids[5]).next(timeout=30)
            with c.subscribe(RID_GENESIS) as sub:  # genesis after a trim: starts at the cut
                first = sub.next(timeout=30)
                assert first is not None and first.rid == cut
            last = rids[-1]
    # Every process is gone; bring the same cluster back on the same data directory.
    with ziplog.local_cluster(shards=2, replicas=2, data_dir=data_dir) as cluster:
        with cluster.client() as c:
            for i, r in enumerate(rids[20:], start=20):
                assert c.read_record(r) == b"rec-%d" % i
            with pytest.raises(ziplog.TrimmedError):
                c.read_record(rids[3])
            new = c.insert_after(b"after restart", last)
            assert new.gsn > last.gsn
            with c.subscribe(RID_GENESIS) as sub:
                got: list[ziplog.Record] = []
                while not got or got[-1].rid != new:
                    rec = sub.next(timeout=30)
                    assert rec is not None
                    got.append(rec)
            assert [r.rid for r in got] == rids[20:] + [new]
