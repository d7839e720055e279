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
:meth:`SegmentLog.drop_below` deletes whole segments (never the current one)
whose records all lie below a gsn; the server calls it with
min(trim point, stable + 1). A torn write at the tail (crash mid-append) is
detected on load and cut off.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from ziplog.protocol.events import (
    DiskEvent,
    RecordEvent,
    SnapshotEvent,
    decode_events,
    encode_event,
)

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
        self._thread: threading.Thread | None = None
        self._file: Any = None
        self._size = 0
        self._seq = 0
        self._last_sync = 0.0
        self._snapshot: SnapshotEvent | None = None
        self.max_gsn: dict[int, int] = {}  # segment seq -> highest record gsn in it
        self.error: BaseException | None = None

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
    def start(self, snapshot: SnapshotEvent) -> None:
        """Begin writing (a fresh segment that opens with ``snapshot``)."""
        self._snapshot = snapshot
        self._sync_wanted = threading.Event()
        self._stopping = False
        self._open_next()
        self._thread = threading.Thread(target=self._run, name="segment-fsync", daemon=True)
        self._thread.start()

    def _open_next(self) -> None:
        if self._file is not None:
            self._file.flush()
            if self.fsync != "never":
                os.fsync(self._file.fileno())
            self._file.close()
        self._seq += 1
        path = self.dir / f"seg-{self._seq:08d}.log"
        self._file = open(path, "ab")
        self._size = 0
        if self._snapshot is not None:
            self._write(encode_event(self._snapshot))

    def _write(self, blob: bytes) -> None:
        self._file.write(blob)
        self._size += len(blob)

    def append(self, events: list[DiskEvent], snapshot: SnapshotEvent) -> None:
        """Write a batch (to the OS; fsync follows per policy). ``snapshot`` is the state
        after the batch, which the next segment opens with."""
        if self.error is not None:
            raise RuntimeError("segment fsync failed") from self.error
        if not events:
            return
        seq = self._seq
        top = self.max_gsn.get(seq, 0)
        parts = []
        for ev in events:
            parts.append(encode_event(ev))
            if type(ev) is RecordEvent and ev.gsn > top:
                top = ev.gsn
        self.max_gsn[seq] = top
        self._snapshot = snapshot
        self._write(b"".join(parts))
        self._file.flush()
        if self.fsync == "always":
            self.sync()
        elif self.fsync == "interval" and time.monotonic() - self._last_sync >= self.fsync_interval:
            self._last_sync = time.monotonic()
            self._sync_wanted.set()
        if self._size >= self.segment_bytes:
            self._open_next()

    def _run(self) -> None:
        try:
            while True:
                self._sync_wanted.wait()
                self._sync_wanted.clear()
                if self._stopping:
                    return
                f = self._file
                if self.fsync != "never":
                    try:
                        os.fsync(f.fileno())
                    except ValueError:
                        pass  # rotated and closed meanwhile: _open_next synced it
        except BaseException as exc:  # surfaced by the next append; never silently lost
            self.error = exc

    def sync(self, timeout: float = 10.0) -> None:
        """Block until everything appended so far is on disk."""
        if self._thread is None:
            return
        self._file.flush()
        if self.fsync == "never":
            return
        os.fsync(self._file.fileno())
        self._last_sync = time.monotonic()

    def close(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self.sync()
        self._stopping = True
        self._sync_wanted.set()
        self._thread.join(timeout)
        self._thread = None
        self._file.close()

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
