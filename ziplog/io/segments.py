"""Append-only segment files holding a replica's decided stream.

Events (msgpack arrays, see :mod:`ziplog.protocol.events`) are appended in batches by the
server's loop thread after the acks went out: the server acks before the
record reaches disk (as the dissertation argues, f+1 replicas in memory survive
f failures), and batching turns many small writes into one. A write only
reaches the OS; a sync (``fdatasync`` of the open segment, and an ``fsync`` of the
directory when a file was created in it since the last one), which can take
milliseconds, runs per ``fsync`` policy:

* ``never``    - leave it to the OS (fastest; survives process crashes, not power loss)
* ``interval`` - a helper thread syncs each batch within about ``fsync_interval``
  seconds of its write, at most once per interval, an idle tail too (the default
  policy; ``ziplog.server`` defaults to 1 s)
* ``always``   - sync every batch on the writing thread before it continues

Whatever the policy, the log syncs where its own structure depends on it:

* **a segment is whole on disk before the next one exists** (:meth:`SegmentLog._open_next`
  syncs it and the directory first), so a power loss can cut only the newest segment's
  tail, never leave a later segment beyond a gap in an older one (a newer segment's
  opening snapshot would then claim positions whose records are gone);
* :meth:`SegmentLog.sync` (a replica's durable answer waits for it: an INSTALL is
  answered "durable" only once fsynced) and :meth:`SegmentLog.close`.

Each segment starts with a snapshot event (membership history, frontier,
stable, trim point), so recovery never needs an older segment:
:meth:`SegmentLog.drop_below` deletes whole segments whose records all lie below a
gsn; the server calls it with min(trim point, stable + 1). When the open segment's
records all lie below it too, a new segment is opened first (with the state the old
one ends in) and the old one then deleted, so a trim frees space even when every
record sits in one segment. On a full disk that new segment's few bytes come from a
**reserve** file kept beside the segments (like CockroachDB's ballast file): it is
released to make the room, and made again once there is space. The directory
always holds a snapshot: a crash at any point of a rotation loses nothing that was
not trimmed. A torn write at the tail (crash mid-append) is detected on load and cut
off.

A replica stopped gracefully may leave a **clean-close marker** beside the segments
(:meth:`SegmentLog.close` with a frontier): every segment synced first (older ones were
at their rotation), then the marker, synced, naming the frontier they end at. The next
start takes it (:meth:`SegmentLog.take_clean_close`) and deletes it, durably, before the
replica does anything: the marker vouches for one start only, so a crash of that
incarnation is never taken for a clean stop. A load that had to cut a torn tail off any
segment shows the disk lost what was written after the marker's sync; the marker then
vouches for nothing.

Every file operation goes through a :class:`~ziplog.io.files.Files` (the operating
system's by default), so the simulation runs this same log on files that lose, at a power
loss, whatever was not synced.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import msgspec

from ziplog.io.files import OS_FILES, Files
from ziplog.io.segment_index import (
    IndexBuilder,
    SegmentIndex,
    build_index,
    index_path,
    load_index,
    read_segments,
    write_index,
)
from ziplog.protocol.events import (
    DiskEvent,
    RecordEvent,
    SnapshotEvent,
    TruncateEvent,
    decode_events,
    encode_event,
    encode_events_into,
)

SEGMENT_BYTES = 64 << 20
#: the reserve file's size, at least (and four times a segment's opening snapshot)
RESERVE_BYTES = 64 << 10
RESERVE_NAME = "reserve"
#: the clean-close marker's file (its text: the frontier the segments end at)
CLEAN_CLOSE_NAME = "clean-close"
#: a batch's buffer is kept for the next batch while its memory is at most this (a
#: 5 ms batch of 4 KiB records at 20,000 a second is 400 KiB; a larger one, a recovery's
#: say, is let go)
BATCH_BUFFER_KEPT = 4 << 20


def replica_dir(data_dir: Path, shard: int, replica: int) -> Path:
    """Where a storage replica started with ``--data-dir data_dir`` keeps its segments."""
    return Path(data_dir) / f"shard{shard}-replica{replica}"


class SegmentLog:
    def __init__(self, directory: Path | str, fsync: str = "interval", fsync_interval: float = 0.05,
                 segment_bytes: int = SEGMENT_BYTES, reserve_bytes: int = RESERVE_BYTES, files: Files = OS_FILES,
                 clock: Callable[[], float] = time.monotonic, background: bool = True) -> None:
        """``files`` and ``clock`` are the operating system's unless a simulation runs the
        log; ``background`` False syncs the ``interval`` policy on the writing thread,
        when an append finds the interval passed, instead of on a helper thread (which
        also syncs a tail left idle for an interval)."""
        assert fsync in ("never", "interval", "always"), fsync
        self.dir = Path(directory)
        self._d = str(self.dir)
        self.files = files
        self.clock = clock
        self.background = background
        files.makedirs(self._d)
        self.fsync = fsync
        self.fsync_interval = fsync_interval
        self.segment_bytes = segment_bytes
        self.reserve_bytes = reserve_bytes
        self._thread: threading.Thread | None = None
        self._started = False
        self._fd: int | None = None
        #: the segment ``_fd`` writes (None: none open; the next batch opens one)
        self._open_seq: int | None = None
        self._rotate_due = False
        self._size = 0
        self._seq = 0
        self._last_sync = 0.0
        #: a file was created in the directory since it was last synced (set before the
        #: sync that clears it reads it, so a creation is never missed)
        self._dir_dirty = False
        self._snapshot: SnapshotEvent | None = None
        self.max_gsn: dict[int, int] = {}  # segment seq -> highest record gsn in it
        self.error: BaseException | None = None
        #: the load cut a torn tail off a segment: something written was lost
        self.torn = False
        #: where a batch is encoded (kept across batches: see ``encode_events_into``)
        self._batch = bytearray()
        #: the index of every segment but the open one (seq -> index): replaced whole,
        #: never changed in place, so a reader on another thread may take it at any time
        #: (``ziplog.io.segment_index``); the open one's is built as its batches go out
        self.indexes: dict[int, SegmentIndex] = {}
        self._builder = IndexBuilder()

    def _path(self, name: str) -> str:
        return f"{self._d}/{name}"

    # -- loading ------------------------------------------------------------------------------
    def segments(self) -> list[Path]:
        return sorted(self.dir / n for n in self.files.listdir(self._d) if n.startswith("seg-") and n.endswith(".log"))

    def load(self) -> Iterator[DiskEvent]:
        """Every event persisted, oldest first. Truncates a torn tail in place. Each
        segment's index is taken from its file if that is whole and describes the
        segment as it is, else built again (and written, best effort)."""
        for path in self.segments():
            seq = int(path.stem.split("-")[1])
            self._seq = max(self._seq, seq)
            good = 0
            blob = self.files.read(str(path))
            for ev, end in decode_events(blob):
                good = end
                if type(ev) is RecordEvent:
                    self.max_gsn[seq] = max(self.max_gsn.get(seq, 0), ev.gsn)
                yield ev
            if good < len(blob):
                self.torn = True
                self.files.truncate(str(path), good)
            idx = load_index(self.files, str(path))
            if idx is None:
                idx = build_index(memoryview(blob)[:good])
                self._write_index(str(path), idx)
            self.indexes = {**self.indexes, seq: idx}

    # -- writing ------------------------------------------------------------------------------
    # The server's loop thread writes (a write to the page cache costs microseconds and
    # needs no hand-off); only the interval policy's sync, which can take milliseconds,
    # runs on a helper thread. Handing every batch to a writer thread instead costs a
    # thread wake-up and a GIL hand-over per batch, right where the next request is being
    # served.
    #
    # A batch is written all or nothing: a write that fails (ENOSPC, EIO) is cut back off
    # the file and raised, so the caller keeps the batch and appends it again later, and
    # the file never holds half of it. A segment is opened lazily, by the first batch
    # that goes into it: a replica that cannot write (or restarts again and again) leaves
    # no empty segment files behind.
    def start(self, snapshot: SnapshotEvent) -> None:
        """Begin writing: the next batch opens a fresh segment with ``snapshot``."""
        self._snapshot = snapshot
        self._sync_wanted = threading.Event()
        self._stop = threading.Event()
        #: appended since the helper thread last began a sync (set by the writing thread,
        #: cleared by the helper just before it syncs)
        self._unsynced = False
        self._stopping = False
        self._rotate_due = True
        self._started = True
        if self.background and self.fsync == "interval":
            self._thread = threading.Thread(target=self._run, name="segment-fsync", daemon=True)
            self._thread.start()
        self._ensure_reserve()

    def _open_next(self) -> None:
        """Open the next segment and write its opening snapshot; on failure nothing is
        left behind and the current segment stays open. The segment before it is synced
        first, under every policy (once a segment, so it costs nothing that counts): the
        segments before the open one are always whole on disk. A previous incarnation's
        last segment too: what it wrote may still be in the page cache only."""
        assert self._snapshot is not None
        files = self.files
        old = self._fd
        self._sync_newest()
        seq = self._seq + 1
        path = self._path(f"seg-{seq:08d}.log")
        opening = encode_event(self._snapshot)
        fd = files.open_append(path)
        self._dir_dirty = True
        try:
            _write_all(files, fd, opening)
        except OSError:
            files.close(fd)
            files.unlink(path)
            raise
        if old is not None and self._open_seq is not None:
            # The segment just sealed (synced above): its index, beside it.
            sealed = self._builder.build(self._size)
            self._write_index(self._path(f"seg-{self._open_seq:08d}.log"), sealed)
            self.indexes = {**self.indexes, self._open_seq: sealed}
        self._builder = IndexBuilder()
        self._fd, self._seq, self._size = fd, seq, len(opening)
        self._open_seq = seq
        self._rotate_due = False
        if old is not None:
            files.close(old)

    def append(self, events: Sequence[DiskEvent], snapshot: SnapshotEvent) -> None:
        """Write a batch (to the OS; a sync follows per policy), all or nothing: on OSError
        nothing of it is in the file and the caller appends it again later. ``snapshot``
        is the state after the batch, which the next segment opens with."""
        if self.error is not None:
            self._sync_again()
        if not events:
            return
        if self._rotate_due:
            self._open_next()
        batch = self._batch
        start = encode_events_into(events if type(events) is list else list(events), batch)
        size = len(batch) - start
        top = 0
        truncating = False
        for ev in events:
            if type(ev) is RecordEvent:
                if ev.gsn > top:  # type: ignore[union-attr]
                    top = ev.gsn  # type: ignore[union-attr]
            elif type(ev) is TruncateEvent:
                truncating = True
        if sys.getsizeof(batch) > BATCH_BUFFER_KEPT:
            self._batch = bytearray()
        fd, before = self._fd, self._size
        assert fd is not None
        try:
            _write_all(self.files, fd, batch, start)
        except OSError:
            with contextlib.suppress(OSError):
                self.files.ftruncate(fd, before)  # a torn batch would be cut on load anyway; now, too
            raise
        self._size = before + size
        if truncating:
            self._index_events(events, before)
        elif top:
            b = self._builder
            if b.first == 0 or before - b.last_entry >= b.interval:
                # An entry at the batch's start (an event's start), for its first record.
                first = next(ev.gsn for ev in events if type(ev) is RecordEvent)  # type: ignore[union-attr]
                b.record(first, before, top)
            elif top > b.last:
                b.last = top
        seq = self._seq
        if top > self.max_gsn.get(seq, 0):
            self.max_gsn[seq] = top
        self._snapshot = snapshot
        if self.fsync == "always":
            try:
                self._sync_open()
            except OSError as exc:
                self.error = exc  # the batch is written: raised by the next append, before it writes
        elif self.fsync == "interval" and self._thread is not None:
            if not self._unsynced:
                self._unsynced = True
                self._sync_wanted.set()
        elif self.fsync == "interval" and self.clock() - self._last_sync >= self.fsync_interval:
            # no helper thread (a simulation): the append that finds the interval passed
            # syncs (an idle tail waits for the next append: a power loss may take more)
            self._last_sync = self.clock()
            try:
                self._sync_open()
            except OSError as exc:
                self.error = exc
        if self._size >= self.segment_bytes:
            self._rotate_due = True

    def _index_events(self, events: Sequence[DiskEvent], at: int) -> None:
        """The open segment's index after a batch written at offset ``at`` that holds a
        recovery's truncate (rare): each event at its own offset, since records after
        the truncate in the same batch stay live. (Any other batch gets at most one
        entry, at its start, for its first record: ``append``.)"""
        ends = itertools.accumulate((len(encode_event(ev)) for ev in events), initial=at)
        next(ends)  # the file holds each event as encode_event makes it
        end = self._builder.add_events(zip(events, ends), at)
        assert end == self._size, ("batch offsets", end, self._size)

    def _write_index(self, segment_path: str, idx: SegmentIndex) -> None:
        """Best effort: an index that could not be written is built again at the next
        load (a full disk must not stop a rotation)."""
        try:
            write_index(self.files, segment_path, idx, self._d)
        except OSError:
            self.files.unlink(index_path(segment_path) + ".tmp")

    def read(self, lo: int, hi: int, max_bytes: int) -> list[RecordEvent]:
        """The live records with ``lo <= gsn <= hi`` in the segments before the open one,
        from the files, in gsn order: at least one when any, then while their data stays
        within ``max_bytes``. Safe on another thread than the writer's (it reads only the
        sealed segments and their indexes; one deleted meanwhile ends the read short)."""
        indexes = self.indexes
        # (the open segment's truncates undo the sealed segments' records above them too)
        open_low = min((b for _, b in self._builder.truncates), default=None)
        return read_segments(self.files, [(self._path(f"seg-{q:08d}.log"), indexes[q]) for q in sorted(indexes)],
                             lo, hi, max_bytes, open_low)

    def _sync_again(self) -> None:
        """A sync failed since the last append: try again before writing anything more."""
        err = self.error
        if self._fd is not None and self.fsync != "never":
            try:
                self._sync_open()
            except OSError as exc:
                raise OSError(exc.errno, f"segment fsync failed: {exc.strerror}") from err
        self.error = None

    def _run(self) -> None:
        # Woken by the first append after a sync; syncs once the interval since the last
        # sync has passed. Every batch is on disk within about one interval of its write,
        # the tail appended before writes stopped too; at most one sync per interval, and
        # an idle log costs nothing.
        while True:
            self._sync_wanted.wait()
            self._sync_wanted.clear()
            if self._stopping:
                return
            rest = self._last_sync + self.fsync_interval - self.clock()
            if rest > 0 and self._stop.wait(rest):
                return
            self._unsynced = False
            self._last_sync = self.clock()
            try:
                self._sync_open()
            except OSError as exc:  # EBADF: rotated and closed meanwhile (synced then)
                if exc.errno != errno.EBADF:
                    self.error = exc  # raised by the next append, before it writes

    def sync(self) -> None:
        """Block until everything appended so far is on stable storage, whatever the
        policy (OSError when it cannot be)."""
        if not self._started:
            return
        self._sync_open()
        self._last_sync = self.clock()

    def _sync_open(self) -> None:
        """The open segment's bytes, and the directory if a file was created in it."""
        fd = self._fd
        if fd is not None:
            self.files.fdatasync(fd)
        self._sync_dir()

    def _sync_newest(self) -> None:
        """The newest segment on stable storage (open here, or the last one loaded: a
        previous incarnation's writes may be in the page cache only), and the directory."""
        if self._fd is not None:
            self.files.fdatasync(self._fd)
        elif self._seq > 0:
            self.files.sync_path(self._path(f"seg-{self._seq:08d}.log"))
            self._dir_dirty = True  # its entry, too
        self._sync_dir()

    def _sync_dir(self) -> None:
        if self._dir_dirty:
            self._dir_dirty = False
            try:
                self.files.fsync_dir(self._d)
            except OSError:
                self._dir_dirty = True
                raise

    def close(self, clean_frontier: int | None = None, timeout: float = 10.0) -> None:
        """Stop writing, everything synced. With ``clean_frontier`` (the caller's promise:
        every event it decided is appended, and the log ends at this frontier) the
        clean-close marker is then written and synced, so that a marker on disk always
        has the events it vouches for on disk before it."""
        if not self._started:
            return
        try:
            self.sync()
            if clean_frontier is not None:
                self._write_clean_close(clean_frontier)
        finally:
            self._started = False
            self._stopping = True
            self._stop.set()
            self._sync_wanted.set()
            if self._thread is not None:
                self._thread.join(timeout)
                self._thread = None
            if self._fd is not None:
                self.files.close(self._fd)
                self._fd = None
                self._open_seq = None

    def _write_clean_close(self, frontier: int) -> None:
        files = self.files
        tmp = self._path(CLEAN_CLOSE_NAME + ".tmp")
        fd = files.open_append(tmp)
        try:
            _write_all(files, fd, str(frontier).encode())
            files.fdatasync(fd)
        finally:
            files.close(fd)
        files.replace(tmp, self._path(CLEAN_CLOSE_NAME))
        files.fsync_dir(self._d)

    def take_clean_close(self) -> int | None:
        """The frontier the last incarnation vouched for when it stopped gracefully, or
        None (no marker: it crashed, or could not write everything; or the load found a
        torn tail, so the disk lost what was written before the marker). The marker is
        gone from the disk, durably, before this returns a frontier: None if it cannot
        be."""
        files = self.files
        path = self._path(CLEAN_CLOSE_NAME)
        try:
            text = files.read(path)
        except FileNotFoundError:
            return None
        except OSError:
            text = b""
        try:
            files.unlink(path)
            files.fsync_dir(self._d)
        except OSError:
            return None
        if self.torn:
            return None
        try:
            frontier = int(text.decode("ascii"))
        except ValueError:
            return None
        return frontier if frontier >= 0 else None

    def drop_below(self, gsn: int) -> int:
        """Delete the oldest segments, as long as each one's records all lie below
        ``gsn`` (also while writes fail: it is how a trim gives space back). Only a prefix
        of the segments goes: a recovery's truncation in a later segment undoes records
        of an earlier one, so a later segment never goes while an earlier one stays. The
        newest one (open, or the last one loaded) too: it is first replaced by a new
        segment opening with the state it ends in, its trim point raised to ``gsn``
        (every record below ``gsn`` is trimmed and stable: the caller's promise). Raises
        OSError when even the reserve cannot make room for that."""
        removed = 0
        paths = self.segments()
        if not paths:
            return 0
        files = self.files
        # The newest segment is never simply deleted: the directory must hold a snapshot
        # (on disk before anything older goes).
        newest = int(paths[-1].stem.split("-")[1])
        synced = False
        for path in paths[:-1]:
            seq = int(path.stem.split("-")[1])
            if self.max_gsn.get(seq, 0) >= gsn:
                return removed
            if not synced:
                self._sync_newest()  # what replaces the segments that go is on disk first
                synced = True
            files.unlink(str(path))
            files.unlink(index_path(str(path)))
            self.max_gsn.pop(seq, None)
            self.indexes = {q: i for q, i in self.indexes.items() if q != seq}
            removed += 1
        seq = newest
        if self._snapshot is not None and seq in self.max_gsn and self.max_gsn[seq] < gsn:
            snap = self._snapshot
            self._snapshot = msgspec.structs.replace(snap, trim=max(snap.trim, gsn))
            try:
                self._open_next()
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not self._release_reserve():
                    raise
                self._open_next()  # the reserve's room holds a snapshot many times over
            self._sync_open()  # the new segment that replaces it is on disk first
            files.unlink(self._path(f"seg-{seq:08d}.log"))
            files.unlink(self._path(f"seg-{seq:08d}.index"))
            self.max_gsn.pop(seq, None)
            self.indexes = {q: i for q, i in self.indexes.items() if q != seq}
            removed += 1
            self._ensure_reserve()
        return removed

    # -- the reserve -----------------------------------------------------------------------------
    def _release_reserve(self) -> bool:
        """Delete the reserve file (room for a new segment on a full disk); False if
        there was none."""
        path = self._path(RESERVE_NAME)
        if self.files.size(path) is None:
            return False
        self.files.unlink(path)
        return True

    def _ensure_reserve(self) -> None:
        """Make the reserve file if it is missing or too small (best effort: on a full
        disk it is made at a later rotation)."""
        want = self.reserve_bytes
        if self._snapshot is not None:
            want = max(want, 4 * len(encode_event(self._snapshot)))
        path = self._path(RESERVE_NAME)
        size = self.files.size(path)
        if size is not None and size >= want:
            return
        try:
            self.files.allocate(path, want)
        except OSError:
            self.files.unlink(path)


def _write_all(files: Files, fd: int, blob: bytes | bytearray, start: int = 0) -> None:
    """Write all of ``blob`` from ``start`` on (a short write goes on from where it
    stopped). Every view of it is released on return, so a bytearray may be resized
    again."""
    with memoryview(blob) as view:
        done = start
        while done < len(view):
            with view[done:] as rest:  # released even when the write raises (its traceback keeps it)
                done += files.write(fd, rest)
