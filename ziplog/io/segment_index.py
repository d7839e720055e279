"""Sparse indexes of segment files: where in a segment a record's gsn is, without holding
the records in memory (Kafka's ``.index`` beside each ``.log``).

A segment (:mod:`ziplog.io.segments`) is the decided stream as it was written: records,
epochs, and a recovery's ``TruncateEvent`` that undoes every record above its base
written before it, in this segment or an older one. A record written at position P (a
segment's sequence number and an offset in it) is **live** when no truncate written
after P has a base below its gsn; the replay of every segment
(:meth:`ziplog.cores.replica.log.DecidedLog.replay`) keeps exactly the live records, and
the tests hold this module to it. Live records, in the order they were written, have
increasing gsns (each one extends the log above everything live before it, a truncate
first cutting the log back to its base), so a sparse map from gsn to offset, one entry
per ``INDEX_INTERVAL`` bytes of records, finds any of them by bisection and a scan of at
most about that many bytes.

The index file ``seg-N.index`` beside ``seg-N.log`` holds a header (the segment length it
covers, the first and last live gsn, counts and a CRC-32 of the rest), the entries as
little-endian int64 pairs, and the segment's truncates (offset, base). It is written
whole under a temporary name, synced and renamed: it is on disk whole or not at all. One
that is missing, torn, fails its CRC, or covers another length than the segment's (the
segment lost a torn tail, or is still being written) is not trusted: it is built again
from the segment.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np

from ziplog.io.files import Files
from ziplog.protocol.events import DiskEvent, RecordEvent, TruncateEvent, decode_events

#: one index entry per this many bytes of a segment's records (Kafka's default too)
INDEX_INTERVAL = 4096
#: what a reader fetches at once when it scans from an entry (a record larger than this
#: is read on in further chunks)
READ_CHUNK = 64 << 10
MAGIC = b"ZLIDX001"
#: magic, segment length, first live gsn, last live gsn, entries, truncates, CRC-32
_HEADER = struct.Struct("<8sqqqqqI4x")
_PAIR = np.dtype("<i8")
INDEX_SUFFIX = ".index"


def index_path(segment_path: str) -> str:
    """``seg-N.index`` beside ``seg-N.log``."""
    assert segment_path.endswith(".log"), segment_path
    return segment_path[:-4] + INDEX_SUFFIX


@dataclass(frozen=True)
class SegmentIndex:
    """What one segment holds, by gsn: its live records' range, a sparse map of their
    offsets, and its truncates."""

    #: the segment bytes this index describes
    length: int
    #: bounds of the live records' gsns: none is below ``first_gsn`` or above
    #: ``last_gsn`` (0 and 0: the segment holds none)
    first_gsn: int
    last_gsn: int
    #: entry i: the live record at ``offsets[i]`` has gsn ``gsns[i]`` (both increasing)
    gsns: np.ndarray
    offsets: np.ndarray
    #: the segment's truncates, in file order: (offset just past it, base)
    truncates: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        assert len(self.gsns) == len(self.offsets), "one offset per indexed gsn"
        assert (self.first_gsn == 0) == (self.last_gsn == 0), (self.first_gsn, self.last_gsn)
        assert self.first_gsn <= self.last_gsn, (self.first_gsn, self.last_gsn)

    @property
    def min_truncate_base(self) -> int | None:
        """The lowest base a truncate in this segment cut back to (it undoes every older
        record above it), or None."""
        return min((b for _, b in self.truncates), default=None)

    def scan_from(self, gsn: int) -> int:
        """An offset at or before the first live record with a gsn at or above ``gsn``,
        at an event's start: a reader scans forward from here."""
        i = int(np.searchsorted(self.gsns, gsn, side="right")) - 1
        return int(self.offsets[i]) if i >= 0 else 0

    def killed_in_segment(self, offset: int, gsn: int) -> bool:
        """Whether a truncate later in this segment undid the record at ``offset``."""
        return any(t_off > offset and base < gsn for t_off, base in self.truncates)


class IndexBuilder:
    """A segment's index as its events are written: :meth:`record` for a live record (or
    the first of a batch of them) at an offset, :meth:`truncate` for a truncate."""

    def __init__(self, interval: int = INDEX_INTERVAL) -> None:
        self.interval = interval
        self.gsns: list[int] = []
        self.offsets: list[int] = []
        self.truncates: list[tuple[int, int]] = []
        self.first = 0
        self.last = 0
        #: the offset of the last entry (the next one is due ``interval`` bytes after it)
        self.last_entry = -interval

    def record(self, gsn: int, offset: int, last: int | None = None) -> None:
        """A record at ``offset`` (an event's start) with ``gsn``; ``last``: the highest
        gsn of the batch it starts, when it stands for several."""
        if offset - self.last_entry >= self.interval:
            assert not self.gsns or gsn > self.gsns[-1], ("live records out of gsn order", gsn, self.gsns[-1])
            self.gsns.append(gsn)
            self.offsets.append(offset)
            self.last_entry = offset
        if self.first == 0:
            self.first = gsn
        self.last = max(self.last, gsn if last is None else last)

    def truncate(self, end: int, base: int) -> None:
        """A truncate ending at ``end``: every record of this segment above ``base`` is dead
        from here on (entries for them go; the next record gets one)."""
        self.truncates.append((end, base))
        while self.gsns and self.gsns[-1] > base:
            self.gsns.pop()
            self.offsets.pop()
        if self.first > base:
            self.first = self.last = 0
        else:
            self.last = min(self.last, base)
        self.last_entry = -self.interval

    def add_events(self, events: Iterable[tuple[DiskEvent, int]], start: int) -> int:
        """Index events one by one, each given with the offset just past it, the first
        starting at ``start``; the offset past the last."""
        for ev, end in events:
            t = type(ev)
            if t is RecordEvent:
                self.record(ev.gsn, start)  # type: ignore[union-attr]
            elif t is TruncateEvent:
                self.truncate(end, ev.base)  # type: ignore[union-attr]
            start = end
        return start

    def build(self, length: int) -> SegmentIndex:
        return SegmentIndex(length, self.first, self.last, np.asarray(self.gsns, dtype=_PAIR),
                            np.asarray(self.offsets, dtype=_PAIR), tuple(self.truncates))


def build_index(blob: bytes | memoryview, interval: int = INDEX_INTERVAL) -> SegmentIndex:
    """Index a segment's bytes (a torn tail is left out: the index covers the whole
    events only)."""
    b = IndexBuilder(interval)
    return b.build(b.add_events(decode_events(bytes(blob)), 0))


def encode_index(idx: SegmentIndex) -> bytes:
    pairs = np.empty((len(idx.gsns), 2), dtype=_PAIR)
    pairs[:, 0] = idx.gsns
    pairs[:, 1] = idx.offsets
    truncs = np.asarray(idx.truncates, dtype=_PAIR).reshape(-1, 2)
    body = pairs.tobytes() + truncs.tobytes()
    head = _HEADER.pack(MAGIC, idx.length, idx.first_gsn, idx.last_gsn, len(idx.gsns), len(idx.truncates), 0)
    crc = zlib.crc32(body, zlib.crc32(head[:-8]))
    return _HEADER.pack(MAGIC, idx.length, idx.first_gsn, idx.last_gsn, len(idx.gsns), len(idx.truncates), crc) + body


def decode_index(blob: bytes) -> SegmentIndex | None:
    """The index a file holds, or None when it is not whole (torn, or another file)."""
    if len(blob) < _HEADER.size:
        return None
    magic, length, first, last, n, nt, crc = _HEADER.unpack_from(blob)
    if magic != MAGIC or n < 0 or nt < 0 or length < 0 or len(blob) != _HEADER.size + 16 * (n + nt):
        return None
    if (first == 0) != (last == 0) or not 0 <= first <= last:
        return None
    body = blob[_HEADER.size:]
    if zlib.crc32(body, zlib.crc32(blob[:_HEADER.size - 8])) != crc:
        return None
    pairs = np.frombuffer(body, dtype=_PAIR, count=2 * n).reshape(-1, 2)
    truncs = np.frombuffer(body, dtype=_PAIR, count=2 * nt, offset=16 * n).reshape(-1, 2)
    return SegmentIndex(length, first, last, pairs[:, 0].copy(), pairs[:, 1].copy(),
                        tuple((int(o), int(b)) for o, b in truncs))


def write_index(files: Files, segment_path: str, idx: SegmentIndex, directory: str) -> None:
    """Write ``idx`` beside its segment: whole, synced, then renamed into place."""
    final = index_path(segment_path)
    tmp = final + ".tmp"
    fd = files.open_append(tmp)
    try:
        blob = encode_index(idx)
        with memoryview(blob) as view:
            done = 0
            while done < len(view):
                done += files.write(fd, view[done:])
        files.fdatasync(fd)
    finally:
        files.close(fd)
    files.replace(tmp, final)
    files.fsync_dir(directory)


def load_index(files: Files, segment_path: str) -> SegmentIndex | None:
    """The index beside a segment if it is whole and describes the segment as it is now
    (its length); None otherwise (build it again)."""
    size = files.size(segment_path)
    try:
        blob = files.read(index_path(segment_path))
    except OSError:  # missing too
        return None
    idx = decode_index(blob)
    if idx is None or size is None or idx.length != size:
        return None
    return idx


def read_records(files: Files, segment_path: str, idx: SegmentIndex, lo: int, hi: int, max_bytes: int,
                 dead_above: int | None = None) -> Iterator[RecordEvent]:
    """The live records of one segment with ``lo <= gsn <= hi``, in gsn order, from the
    file: at least one (when any), then while their data stays within ``max_bytes``.
    ``dead_above``: the lowest base of the truncates in later segments (their records
    above it are dead), or None."""
    if idx.first_gsn == 0 or hi < lo or lo > idx.last_gsn or hi < idx.first_gsn:
        return
    if dead_above is not None:
        hi = min(hi, dead_above)
    pos = idx.scan_from(lo)
    size = 0
    buf = b""
    buf_at = pos  # the file offset of buf[0]
    while buf_at + len(buf) < idx.length or buf:
        consumed = 0
        for ev, end in decode_events(buf):
            start = buf_at + consumed
            consumed = end
            if type(ev) is not RecordEvent:
                continue
            gsn = ev.gsn  # type: ignore[union-attr]
            if gsn > hi:
                # Live records come in gsn order: a live one above hi ends the range (a
                # dead one may lie above a live one still to come; it is skipped).
                if not idx.killed_in_segment(start, gsn):
                    return
                continue
            if gsn < lo or idx.killed_in_segment(start, gsn):
                continue
            yield ev  # type: ignore[misc]
            size += len(ev.data)  # type: ignore[union-attr]
            if size >= max_bytes:
                return
        buf_at += consumed
        rest = buf[consumed:]
        more_at = buf_at + len(rest)
        if more_at >= idx.length:
            return  # the rest is a torn tail the index does not cover
        want = min(max(READ_CHUNK, 2 * len(rest)), idx.length - more_at)
        got = files.read_at(segment_path, more_at, want)
        if not got:
            return  # the file is shorter than its index says: cut since (nothing more to read)
        buf = rest + got


def read_segments(files: Files, segments: Sequence[tuple[str, SegmentIndex]], lo: int, hi: int, max_bytes: int,
                  dead_above: int | None = None) -> list[RecordEvent]:
    """The live records with ``lo <= gsn <= hi`` in ``segments`` (path and index, oldest
    first), in gsn order (live records were written in it): at least one when any, then
    while their data stays within ``max_bytes``. ``dead_above``: the lowest base of the
    truncates written after them all (a segment still being written), or None. A
    segment deleted meanwhile ends the read short."""
    out: list[RecordEvent] = []
    size = 0
    later = dead_above_by_segment([idx for _, idx in segments])
    for (path, idx), d in zip(segments, later):
        if dead_above is not None:
            d = dead_above if d is None else min(d, dead_above)
        try:
            for r in read_records(files, path, idx, lo, hi, max_bytes - size, d):
                out.append(r)
                size += len(r.data)
        except FileNotFoundError:
            break
        if size >= max_bytes:
            break
    return out


def dead_above_by_segment(indexes: Sequence[SegmentIndex]) -> list[int | None]:
    """For each segment (oldest first), the lowest truncate base among the segments after
    it: its records above that are dead."""
    out: list[int | None] = [None] * len(indexes)
    low: int | None = None
    for i in range(len(indexes) - 1, -1, -1):
        out[i] = low
        b = indexes[i].min_truncate_base
        if b is not None:
            low = b if low is None else min(low, b)
    return out
