"""Sparse segment indexes (``ziplog.io.segment_index``) held to the replay: the records
read through the indexes from the files are exactly those ``DecidedLog.replay`` keeps,
for any history of records, recovery truncates and segment rotations; an index file that
is not whole, or describes another length of its segment, is never trusted."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from ziplog.cores.effects import Outbox
from ziplog.cores.replica.log import DecidedLog
from ziplog.io.files import OS_FILES
from ziplog.io.segment_index import (
    SegmentIndex,
    build_index,
    decode_index,
    encode_index,
    index_path,
    load_index,
    read_records,
    read_segments,
    write_index,
)
from ziplog.protocol.events import (
    DiskEvent,
    EpochEvent,
    FrontierEvent,
    RecordEvent,
    SnapshotEvent,
    TruncateEvent,
    encode_events,
)
from ziplog.protocol.gsna import epoch_base
from tests.sim.files import SimFiles

# One step of a replica's history: a record of some size, a recovery's truncate back by
# some records, or a new segment.
step = st.one_of(
    st.tuples(st.just("record"), st.integers(0, 300)),
    st.tuples(st.just("truncate"), st.integers(0, 6)),
    st.tuples(st.just("rotate"), st.just(0)),
)


def _segments(steps: list[tuple[str, int]]) -> list[list[DiskEvent]]:
    """The segments a replica with this history wrote (all in epoch 1)."""
    segs: list[list[DiskEvent]] = [[SnapshotEvent([], 0, 0, 0), EpochEvent(0, 1, (0,))]]
    live: list[int] = []  # the live records' gsns, as the replay keeps them
    top = epoch_base(1) - 1  # the frontier
    seq = 0
    for kind, n in steps:
        if kind == "record":
            seq += 1
            top += 1 + n % 3  # some slots are no-ops
            segs[-1].append(RecordEvent(top, 0, 1, seq, bytes([seq % 251]) * n))
            live.append(top)
        elif kind == "truncate":
            base = live[-1 - n] if n < len(live) else epoch_base(1) - 1
            base = max(base, epoch_base(1) - 1)
            segs[-1].append(TruncateEvent(base))
            live = [g for g in live if g <= base]
            top = base
        else:
            segs.append([SnapshotEvent([(0, 1, (0,))], top, 0, 0)])
        segs[-1].append(FrontierEvent(top, 1, 0))
    return segs


def _replayed(segs: list[list[DiskEvent]]) -> dict[int, RecordEvent]:
    log = DecidedLog(Outbox())
    log.replay([ev for seg in segs for ev in seg])
    return dict(log.records)


def _write(files: SimFiles, segs: list[list[DiskEvent]]) -> list[str]:
    files.makedirs("/d")
    paths = []
    for i, seg in enumerate(segs, 1):
        path = f"/d/seg-{i:08d}.log"
        fd = files.open_append(path)
        blob = encode_events(seg)
        with memoryview(blob) as view:
            files.write(fd, view)
        files.close(fd)
        paths.append(path)
    return paths


def _read_all(files: SimFiles, paths: list[str], idxs: list[SegmentIndex], lo: int, hi: int) -> list[RecordEvent]:
    return read_segments(files, list(zip(paths, idxs)), lo, hi, 1 << 40)


@settings(max_examples=300, deadline=None)
@given(st.lists(step, max_size=80), st.sampled_from([1, 64, 4096]), st.data())
def test_the_records_read_through_the_indexes_are_the_replayed_log(steps: list[tuple[str, int]], interval: int,
                                                                   data: st.DataObject) -> None:
    segs = _segments(steps)
    want = _replayed(segs)
    files = SimFiles()
    paths = _write(files, segs)
    idxs = [build_index(files.read(p), interval) for p in paths]
    got = _read_all(files, paths, idxs, 0, 1 << 62)
    assert [(r.gsn, r.seq, r.data) for r in got] == [(r.gsn, r.seq, r.data) for r in want.values()]
    if want:
        gsns = sorted(want)
        lo = data.draw(st.sampled_from(gsns))
        hi = data.draw(st.sampled_from([g for g in gsns if g >= lo]))
        ranged = _read_all(files, paths, idxs, lo, hi)
        assert [r.gsn for r in ranged] == [g for g in gsns if lo <= g <= hi]
        # one record: found alone, as a read asks for it
        assert [r.gsn for r in _read_all(files, paths, idxs, lo, lo)] == [lo]


def test_a_range_stops_once_its_bytes_are_read_and_gives_at_least_one_record() -> None:
    segs = _segments([("record", 100)] * 20)
    files = SimFiles()
    (path,) = _write(files, segs)
    idx = build_index(files.read(path), 256)
    got = list(read_records(files, path, idx, 0, 1 << 62, 250))
    assert [len(r.data) for r in got] == [100, 100, 100]
    assert len(list(read_records(files, path, idx, 0, 1 << 62, 1))) == 1


def test_an_index_is_trusted_only_whole_and_for_its_segment_as_it_is(tmp_path: Path) -> None:
    segs = _segments([("record", 50)] * 30 + [("truncate", 3)] + [("record", 10)] * 5)
    files = OS_FILES
    d = str(tmp_path)
    path = f"{d}/seg-00000001.log"
    fd = files.open_append(path)
    with memoryview(encode_events(segs[0])) as view:
        files.write(fd, view)
    files.close(fd)
    idx = build_index(files.read(path), 128)
    blob = encode_index(idx)
    again = decode_index(blob)
    assert again is not None and again.truncates == idx.truncates and list(again.gsns) == list(idx.gsns)
    # every cut of the file, and any one byte changed, is refused
    for n in range(len(blob)):
        assert decode_index(blob[:n]) is None
    for i in range(0, len(blob), 7):
        bad = bytearray(blob)
        bad[i] ^= 0x40
        assert decode_index(bytes(bad)) is None, i
    write_index(files, path, idx, d)
    loaded = load_index(files, path)
    assert loaded is not None and loaded.last_gsn == idx.last_gsn
    # the segment grew (it was still being written) or lost a torn tail: not trusted
    files.truncate(path, idx.length - 3)
    assert load_index(files, path) is None
    Path(index_path(path)).unlink()
    assert load_index(files, path) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(step, max_size=60), st.integers(200, 3000), st.data())
def test_a_segment_log_reads_its_sealed_segments_as_the_replay_holds_them(steps: list[tuple[str, int]],
                                                                          segment_bytes: int,
                                                                          data: st.DataObject) -> None:
    """Written through ``SegmentLog`` (its batches, its rotations, the open segment's index
    built as it goes), then loaded again with some index files missing or torn: every
    sealed segment's live records read back are the replay's."""
    import random

    from ziplog.io.segments import SegmentLog

    files = SimFiles()
    log = SegmentLog("/d", fsync="always", segment_bytes=segment_bytes, files=files, background=False)
    log.start(SnapshotEvent([], 0, 0, 0))
    events = [ev for seg in _segments(steps) for ev in seg if not isinstance(ev, SnapshotEvent)]
    rng = random.Random(data.draw(st.integers(0, 1 << 30)))
    i = 0
    while i < len(events):
        n = rng.randint(1, 6)
        log.append(events[i:i + n], SnapshotEvent([], 0, 0, 0))
        i += n
    log.close()

    def check(seg_log: SegmentLog) -> None:
        replayed = list(seg_log.load())  # every segment loaded is sealed: all are indexed
        got = seg_log.read(0, 1 << 62, 1 << 40)
        assert [(r.gsn, r.data) for r in got] == [(g, r.data) for g, r in _replayed([replayed]).items()]

    check(SegmentLog("/d", files=files, background=False))
    # indexes lost or torn: built again from the segments, the same records read
    for name in files.listdir("/d"):
        if name.endswith(".index") and rng.random() < 0.5:
            blob = files.read(f"/d/{name}")
            files.truncate(f"/d/{name}", rng.randrange(len(blob)))
    check(SegmentLog("/d", files=files, background=False))
