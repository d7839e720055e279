"""Append-only segment files holding a replica's decided stream.

Events (msgpack arrays, see ``wire.EV_*``) are appended in batches by a writer
thread, off the ack path: the server acks before the record reaches disk (as
the dissertation argues, f+1 replicas in memory survive f failures), and
batching turns many small writes into one. ``fsync`` policy:

* ``never``    - leave it to the OS (fastest; survives process crashes, not power loss)
* ``interval`` - fsync at most every ``fsync_interval`` seconds (default)
* ``always``   - fsync every batch before the next one is written

Each segment starts with a snapshot event (membership history, frontier,
stable, trim point) so older segments can be deleted after a trim without
losing what recovery needs. A torn write at the tail (crash mid-append) is
detected on load and cut off.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import msgpack

EV_SNAPSHOT = 5  # (kind, membership_ranges, frontier, stable, trim_point)

SEGMENT_BYTES = 64 << 20


class SegmentLog:
    def __init__(self, directory: Path, fsync: str = "interval", fsync_interval: float = 0.05,
                 segment_bytes: int = SEGMENT_BYTES) -> None:
        assert fsync in ("never", "interval", "always"), fsync
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.fsync_interval = fsync_interval
        self.segment_bytes = segment_bytes
        self._q: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._file: Any = None
        self._size = 0
        self._seq = 0
        self._last_sync = 0.0
        self._snapshot: Any = None
        self.max_gsn: dict[int, int] = {}  # segment seq -> highest record gsn in it
        self.error: BaseException | None = None

    # -- loading ------------------------------------------------------------------------------
    def segments(self) -> list[Path]:
        return sorted(self.dir.glob("seg-*.log"))

    def load(self) -> Iterator[tuple[Any, ...]]:
        """Every event persisted, oldest first. Truncates a torn tail in place."""
        for path in self.segments():
            seq = int(path.stem.split("-")[1])
            self._seq = max(self._seq, seq)
            good = 0
            unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=1 << 31)
            with open(path, "rb") as f:
                unpacker.feed(f.read())
            try:
                for ev in unpacker:
                    good = unpacker.tell()
                    if ev and ev[0] == 0:
                        self.max_gsn[seq] = max(self.max_gsn.get(seq, 0), ev[1])
                    yield tuple(ev)
            except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
                pass
            size = path.stat().st_size
            if good < size:
                with open(path, "r+b") as f:
                    f.truncate(good)

    # -- writing ------------------------------------------------------------------------------
    def start(self, snapshot: tuple[Any, ...]) -> None:
        """Begin writing (a fresh segment that opens with ``snapshot``)."""
        self._snapshot = snapshot
        self._open_next()
        self._thread = threading.Thread(target=self._run, name="segment-writer", daemon=True)
        self._thread.start()

    def _open_next(self) -> None:
        if self._file is not None:
            self._sync()
            self._file.close()
        self._seq += 1
        path = self.dir / f"seg-{self._seq:08d}.log"
        self._file = open(path, "ab", buffering=0)
        self._size = 0
        if self._snapshot is not None:
            self._write(msgpack.packb(list(self._snapshot), use_bin_type=True))

    def _write(self, blob: bytes) -> None:
        self._file.write(blob)
        self._size += len(blob)

    def _sync(self) -> None:
        if self.fsync != "never" and self._file is not None:
            os.fsync(self._file.fileno())
        self._last_sync = time.monotonic()

    def append(self, events: list[tuple[Any, ...]], snapshot: tuple[Any, ...]) -> None:
        """Queue a batch (non-blocking). ``snapshot`` is the state after the batch, used
        to open the next segment."""
        if events:
            self._q.put(("batch", (events, snapshot)))

    def _run(self) -> None:
        packer = msgpack.Packer(use_bin_type=True)
        try:
            while True:
                kind, payload = self._q.get()
                if kind == "stop":
                    self._sync()
                    self._file.close()
                    payload.set()
                    return
                if kind == "sync":
                    self._sync()
                    payload.set()
                    continue
                batches = [payload]
                while True:  # coalesce whatever queued meanwhile into one write
                    try:
                        k2, p2 = self._q.get_nowait()
                    except queue.Empty:
                        break
                    if k2 != "batch":
                        self._q.put((k2, p2))  # handle after this write
                        break
                    batches.append(p2)
                parts = []
                for events, snapshot in batches:
                    for ev in events:
                        parts.append(packer.pack(list(ev)))
                        if ev[0] == 0:
                            self.max_gsn[self._seq] = max(self.max_gsn.get(self._seq, 0), ev[1])
                    self._snapshot = snapshot
                self._write(b"".join(parts))
                if self.fsync == "always" or (self.fsync == "interval" and time.monotonic() - self._last_sync >= self.fsync_interval):
                    self._sync()
                if self._size >= self.segment_bytes:
                    self._open_next()
        except BaseException as exc:  # surfaced by the server loop; never silently lost
            self.error = exc

    def sync(self, timeout: float = 10.0) -> None:
        """Block until everything appended so far is written and fsynced."""
        if self._thread is None:
            return
        done = threading.Event()
        self._q.put(("sync", done))
        done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        done = threading.Event()
        self._q.put(("stop", done))
        done.wait(timeout)
        self._thread = None

    def drop_below(self, gsn: int) -> int:
        """Delete whole segments (not the current one) whose records all lie below ``gsn``."""
        removed = 0
        for path in self.segments():
            seq = int(path.stem.split("-")[1])
            if seq >= self._seq:
                continue
            if self.max_gsn.get(seq, 0) < gsn:
                path.unlink(missing_ok=True)
                self.max_gsn.pop(seq, None)
                removed += 1
        return removed
