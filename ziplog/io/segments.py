"""Append-only segment files holding a replica's decided stream.

Events (msgpack arrays, see :mod:`ziplog.protocol.events`) are appended in batches by the
server's loop thread after the acks went out: the server acks before the
record reaches disk (as the dissertation argues, f+1 replicas in memory survive
f failures), and batching turns many small writes into one. A write only
reaches the OS; fsync, which can take milliseconds, runs on a helper thread.
``fsync`` policy:

* ``never``    - leave it to the OS (fastest; survives process crashes, not power loss)
* ``interval`` - the helper thread fsyncs at most every ``fsync_interval`` seconds
  (the default policy; ``ziplog.server`` defaults to 1 s)
* ``always``   - fsync every batch on the writing thread before it continues

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
(:meth:`SegmentLog.close` with a frontier): the files synced first, then the marker,
synced, naming the frontier they end at. The next start takes it
(:meth:`SegmentLog.take_clean_close`) and deletes it, durably, before the replica does
anything: the marker vouches for one start only, so a crash of that incarnation is never
taken for a clean stop.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Sequence

from ziplog.protocol.events import (
    DiskEvent,
    RecordEvent,
    SnapshotEvent,
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
    def __init__(self, directory: Path, fsync: str = "interval", fsync_interval: float = 0.05,
                 segment_bytes: int = SEGMENT_BYTES, reserve_bytes: int = RESERVE_BYTES) -> None:
        assert fsync in ("never", "interval", "always"), fsync
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.fsync_interval = fsync_interval
        self.segment_bytes = segment_bytes
        self.reserve_bytes = reserve_bytes
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        #: the segment ``_fd`` writes (None: none open; the next batch opens one)
        self._open_seq: int | None = None
        self._rotate_due = False
        self._size = 0
        self._seq = 0
        self._last_sync = 0.0
        self._snapshot: SnapshotEvent | None = None
        self.max_gsn: dict[int, int] = {}  # segment seq -> highest record gsn in it
        self.error: BaseException | None = None
        #: where a batch is encoded (kept across batches: see ``encode_events_into``)
        self._batch = bytearray()

    # -- loading ------------------------------------------------------------------------------
    def segments(self) -> list[Path]:
        return sorted(self.dir.glob("seg-*.log"))

    def load(self) -> Iterator[DiskEvent]:
        """Every event persisted, oldest first. Truncates a torn tail in place."""
        for path in self.segments():
            seq = int(path.stem.split("-")[1])
            self._seq = max(self._seq, seq)
            good = 0
            with open(path, "rb") as f:
                blob = f.read()
            for ev, end in decode_events(blob):
                good = end
                if type(ev) is RecordEvent:
                    self.max_gsn[seq] = max(self.max_gsn.get(seq, 0), ev.gsn)
                yield ev
            if good < len(blob):
                with open(path, "r+b") as f:
                    f.truncate(good)

    # -- writing ------------------------------------------------------------------------------
    # The server's loop thread writes (a write to the page cache costs microseconds and
    # needs no hand-off); only fsync, which can take milliseconds, runs on a helper thread.
    # Handing every batch to a writer thread instead costs a thread wake-up and a GIL
    # hand-over per batch, right where the next request is being served.
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
        self._stopping = False
        self._rotate_due = True
        self._thread = threading.Thread(target=self._run, name="segment-fsync", daemon=True)
        self._thread.start()
        self._ensure_reserve()

    def _open_next(self) -> None:
        """Open the next segment and write its opening snapshot; on failure nothing is
        left behind and the current segment stays open."""
        assert self._snapshot is not None
        seq = self._seq + 1
        path = self.dir / f"seg-{seq:08d}.log"
        opening = encode_event(self._snapshot)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        try:
            _write_all(fd, opening)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        old = self._fd
        self._fd, self._seq, self._size = fd, seq, len(opening)
        self._open_seq = seq
        self._rotate_due = False
        if old is not None:
            if self.fsync != "never":
                try:
                    os.fsync(old)
                except OSError as exc:
                    self.error = exc
            os.close(old)

    def append(self, events: Sequence[DiskEvent], snapshot: SnapshotEvent) -> None:
        """Write a batch (to the OS; fsync follows per policy), all or nothing: on OSError
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
        for ev in events:
            if type(ev) is RecordEvent and ev.gsn > top:
                top = ev.gsn
        if sys.getsizeof(batch) > BATCH_BUFFER_KEPT:
            self._batch = bytearray()
        fd, before = self._fd, self._size
        assert fd is not None
        try:
            _write_all(fd, batch, start)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, before)  # a torn batch would be cut on load anyway; now, too
            raise
        self._size = before + size
        seq = self._seq
        if top > self.max_gsn.get(seq, 0):
            self.max_gsn[seq] = top
        self._snapshot = snapshot
        if self.fsync == "always":
            try:
                os.fsync(fd)
            except OSError as exc:
                self.error = exc  # the batch is written: raised by the next append, before it writes
        elif self.fsync == "interval" and time.monotonic() - self._last_sync >= self.fsync_interval:
            self._last_sync = time.monotonic()
            self._sync_wanted.set()
        if self._size >= self.segment_bytes:
            self._rotate_due = True

    def _sync_again(self) -> None:
        """An fsync failed since the last append: try again before writing anything more."""
        err = self.error
        if self._fd is not None and self.fsync != "never":
            try:
                os.fsync(self._fd)
            except OSError as exc:
                raise OSError(exc.errno, f"segment fsync failed: {exc.strerror}") from err
        self.error = None

    def _run(self) -> None:
        while True:
            self._sync_wanted.wait()
            self._sync_wanted.clear()
            if self._stopping:
                return
            fd = self._fd
            if self.fsync != "never" and fd is not None:
                try:
                    os.fsync(fd)
                except OSError as exc:  # EBADF: rotated and closed meanwhile (synced then)
                    if exc.errno != errno.EBADF:
                        self.error = exc  # raised by the next append, before it writes

    def sync(self, timeout: float = 10.0) -> None:
        """Block until everything appended so far is on disk."""
        if self._thread is None or self._fd is None or self.fsync == "never":
            return
        os.fsync(self._fd)
        self._last_sync = time.monotonic()

    def close(self, clean_frontier: int | None = None, timeout: float = 10.0) -> None:
        """Stop writing. With ``clean_frontier`` (the caller's promise: every event it
        decided is appended, and the log ends at this frontier) the segments are fsynced,
        whatever the policy, and then the clean-close marker is written and fsynced, so
        that a marker on disk always has the events it vouches for before it."""
        if self._thread is None:
            return
        try:
            self.sync()
            if clean_frontier is not None:
                if self._fd is not None and self.fsync == "never":
                    os.fsync(self._fd)  # sync() leaves it to the OS under that policy
                self._write_clean_close(clean_frontier)
        finally:
            self._stopping = True
            self._sync_wanted.set()
            self._thread.join(timeout)
            self._thread = None
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
                self._open_seq = None

    def _write_clean_close(self, frontier: int) -> None:
        tmp = self.dir / (CLEAN_CLOSE_NAME + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, str(frontier).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.dir / CLEAN_CLOSE_NAME)
        self._sync_dir()

    def take_clean_close(self) -> int | None:
        """The frontier the last incarnation vouched for when it stopped gracefully, or
        None (no marker: it crashed, or could not write everything). The marker is gone
        from the disk, durably, before this returns a frontier: None if it cannot be."""
        path = self.dir / CLEAN_CLOSE_NAME
        try:
            text = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError:
            text = b""
        try:
            path.unlink()
            self._sync_dir()
        except OSError:
            return None
        try:
            frontier = int(text.decode("ascii"))
        except ValueError:
            return None
        return frontier if frontier >= 0 else None

    def _sync_dir(self) -> None:
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def drop_below(self, gsn: int) -> int:
        """Delete whole segments whose records all lie below ``gsn`` (also while writes
        fail: it is how a trim gives space back). The newest one (open, or the last one
        loaded) too: it is first replaced by a new segment opening with the state it ends
        in, its trim point raised to ``gsn`` (every record below ``gsn`` is trimmed and
        stable: the caller's promise). Raises OSError when even the reserve cannot make
        room for that."""
        removed = 0
        paths = self.segments()
        if not paths:
            return 0
        # The newest segment is never simply deleted: the directory must hold a snapshot
        # (on disk before anything older goes).
        newest = int(paths[-1].stem.split("-")[1])
        for path in paths[:-1]:
            seq = int(path.stem.split("-")[1])
            if self.max_gsn.get(seq, 0) < gsn:
                self._sync_open()
                path.unlink(missing_ok=True)
                self.max_gsn.pop(seq, None)
                removed += 1
        seq = newest
        if self._snapshot is not None and seq in self.max_gsn and self.max_gsn[seq] < gsn:
            snap = self._snapshot
            self._snapshot = SnapshotEvent(snap.ranges, snap.frontier, snap.stable, max(snap.trim, gsn))
            try:
                self._open_next()
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not self._release_reserve():
                    raise
                self._open_next()  # the reserve's room holds a snapshot many times over
            self._sync_open()
            old = self.dir / f"seg-{seq:08d}.log"
            old.unlink(missing_ok=True)
            self.max_gsn.pop(seq, None)
            removed += 1
            self._ensure_reserve()
        return removed

    def _sync_open(self) -> None:
        """The open segment (its opening snapshot at least) and its directory entry on
        disk, under any policy but ``never``."""
        if self._fd is None or self.fsync == "never":
            return
        os.fsync(self._fd)
        self._sync_dir()

    # -- the reserve -----------------------------------------------------------------------------
    def _release_reserve(self) -> bool:
        """Delete the reserve file (room for a new segment on a full disk); False if
        there was none."""
        path = self.dir / RESERVE_NAME
        if not path.exists():
            return False
        path.unlink(missing_ok=True)
        return True

    def _ensure_reserve(self) -> None:
        """Make the reserve file if it is missing or too small (best effort: on a full
        disk it is made at a later rotation)."""
        want = self.reserve_bytes
        if self._snapshot is not None:
            want = max(want, 4 * len(encode_event(self._snapshot)))
        path = self.dir / RESERVE_NAME
        try:
            if path.stat().st_size >= want:
                return
        except FileNotFoundError:
            pass
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.posix_fallocate(fd, 0, want)  # real blocks: a sparse file would reserve nothing
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            path.unlink(missing_ok=True)


def _write_all(fd: int, blob: bytes | bytearray, start: int = 0) -> None:
    """Write all of ``blob`` from ``start`` on (a short write goes on from where it
    stopped). Every view of it is released on return, so a bytearray may be resized
    again."""
    with memoryview(blob) as view:
        done = start
        while done < len(view):
            done += os.write(fd, view[done:])
