"""The rivals the dissertation built on ziplog's own codebase (section 4.4): a
NOPaxos-style log (end-host sequencer, 2f+1 replicas) and a Scalog-style log (storage
servers replicate first, an ordering process interleaves them by periodic cuts).

Same stack as ziplog so the comparison measures the protocols, not the plumbing:
pyzmq ROUTER/DEALER over TCP on 127.0.0.1, msgpack frames, one OS process per server,
records appended to a file by the loop every few milliseconds without fsync (the
dissertation's baselines write to disk asynchronously, as ziplog does).

This module holds what the server processes of both share: the asynchronous record
file, a sub-millisecond timer for zmq poll sets, the stop flag, and the parent's side
of starting one (``start_server``; ``wait_ready`` reads the port it bound, from the
``READY`` line in its log)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO

from ziplog.tools import procs

#: Buffered records reach the OS at least this often (no fsync: the OS writes them back).
DISK_FLUSH_NS = 5_000_000
#: Start-up of one server process (Python, pyzmq and msgpack imports) on a busy machine.
START_TIMEOUT_S = 30.0

_ROOT = Path(__file__).resolve().parents[2]  # the directory holding the ``bench`` package


#: The longest a server blocks in one zmq call, hence how long it may take to notice a
#: stop signal: a signal that lands just before a blocking zmq call does not interrupt
#: it (pyzmq has no wakeup fd), so the loop sees the request when the call returns.
MAX_BLOCK_MS = 100


class StopFlag:
    """Set by SIGTERM/SIGINT; a server's loop checks ``requested`` between messages and
    then flushes its record file. A flag rather than an exception raised from the
    handler, which could land anywhere, e.g. between the two writes of one record."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._set)
        signal.signal(signal.SIGINT, self._set)

    def _set(self, signum: int, frame: Any) -> None:
        self.requested = True


def announce_ready(*fields: object) -> None:
    """Tell the parent we serve: one ``READY f1 f2 ...`` line on stdout (its log file)."""
    sys.stdout.write("READY " + " ".join(str(f) for f in fields) + "\n")
    sys.stdout.flush()


class RecordFile:
    """An append-only file of msgpack frames, written asynchronously: ``write`` only
    copies into a 1 MiB user-space buffer; ``flush_if_due`` hands it to the OS at most
    every :data:`DISK_FLUSH_NS`, called by the loop after the replies went out. No fsync:
    the records are durable in the memory of f+1 processes, as in ziplog."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: BinaryIO = open(path, "ab", buffering=1 << 20)
        self.write = self._file.write
        self.dirty = False
        self.last_flush_ns = time.monotonic_ns()

    def ms_until_due(self, now: int) -> int:
        """A zmq poll timeout (ms, rounded up) that wakes the loop for the next flush,
        or :data:`MAX_BLOCK_MS` when nothing is buffered."""
        if not self.dirty:
            return MAX_BLOCK_MS
        left = self.last_flush_ns + DISK_FLUSH_NS - now
        return 0 if left <= 0 else -(-left // 1_000_000)

    def flush_if_due(self, now: int) -> None:
        if self.dirty and now - self.last_flush_ns >= DISK_FLUSH_NS:
            self.flush(now)

    def flush(self, now: int) -> None:
        self._file.flush()
        self.dirty = False
        self.last_flush_ns = now

    def close(self) -> None:
        self._file.flush()
        self._file.close()


# -- sub-millisecond timer -------------------------------------------------------------
# zmq poll timeouts are whole milliseconds; a timerfd is a file descriptor the kernel
# makes readable at a precise (hrtimer) instant, and a zmq.Poller can wait on it next to
# sockets. Python 3.11 has no os.timerfd_*, hence ctypes.

_CLOCK_MONOTONIC = 1  # the clock of time.monotonic_ns()
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class OneShotTimer:
    """A timerfd on CLOCK_MONOTONIC: ``at(deadline_ns)`` (absolute, time.monotonic_ns)
    makes ``fd`` readable at that instant; ``fired()`` consumes the expiry. Armed at
    most once at a time; re-arm after it fired."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._settime = libc.timerfd_settime
        self._settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
        fd = libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        self.fd: int = fd
        self.armed = False
        # One preallocated spec: arming costs one ctypes call, no allocation.
        self._spec = _Itimerspec()
        self._spec_ref = ctypes.byref(self._spec)

    def at(self, deadline_ns: int) -> None:
        assert deadline_ns > 0 and not self.armed
        self._spec.it_value.tv_sec, self._spec.it_value.tv_nsec = divmod(deadline_ns, 1_000_000_000)
        if self._settime(self.fd, _TFD_TIMER_ABSTIME, self._spec_ref, None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")
        self.armed = True

    def fired(self) -> bool:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            return False
        self.armed = False
        return True

    def close(self) -> None:
        os.close(self.fd)


# -- parent side ---------------------------------------------------------------------------


def python_module_argv(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def start_server(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Spawn a server process (own process group, dies with us; output to ``log_path``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"  # tracebacks and READY reach the log at once
    return procs.spawn(argv, log_path, env=env, cwd=str(_ROOT))


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_bytes()[-32768:].decode("utf-8", "replace")
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return "\n".join(text.splitlines()[-lines:])


def wait_ready(proc: subprocess.Popen[bytes], log_path: Path, label: str,
               timeout: float = START_TIMEOUT_S) -> list[str]:
    """The fields of the ``READY ...`` line ``proc`` writes to its log once it serves.

    The child's stdout is its log file (``procs.spawn``), so the parent reads the file
    until the line appears; a child that exits or stays silent raises with its log."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = log_path.read_text(errors="replace")
        except FileNotFoundError:
            text = ""
        for line in text.splitlines():
            if line.startswith("READY "):
                return line.split()[1:]
        code = proc.poll()
        if code is not None:
            raise RuntimeError(f"{label} exited with code {code} before it was ready; "
                               f"last lines of {log_path}:\n{log_tail(log_path)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{label} not ready after {timeout:.0f} s; last lines of {log_path}:\n{log_tail(log_path)}")
        time.sleep(0.01)  # no notification exists for "a line was appended"; bounded by deadline


def check_alive(procs_by_label: dict[str, tuple[subprocess.Popen[bytes], Path]]) -> None:
    """Raise, with its log, if any server died (e.g. a replica stopped on a gap)."""
    for label, (proc, log_path) in procs_by_label.items():
        code = proc.poll()
        if code is not None:
            raise RuntimeError(f"{label} exited with code {code}; last lines of {log_path}:\n{log_tail(log_path)}")


def new_client_id() -> bytes:
    """A ZeroMQ routing id for one client: unique, and not starting with a zero byte
    (reserved by ZeroMQ for the ids it makes up itself)."""
    return b"c" + os.urandom(8)
