"""Starting third-party server binaries (nats-server, redis-server) for the benchmarks.

Each peer system runs its servers as children of the harness, on loopback, with their
data in a temporary directory that is removed afterwards. What goes wrong when starting
a server is almost always visible in its own log (a bad flag, a port taken, a missing
directory), so every failure here raises :class:`Unavailable` carrying the log's tail.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ziplog.tools import procs

from .base import Unavailable

__all__ = [
    "ServerProcess",
    "binary_version",
    "find_binary",
    "free_ports",
    "log_tail",
    "make_temp_dir",
    "remove_temp_dir",
    "stop_all",
    "wait_until",
]

#: How long a freshly started server may take until its port accepts connections.
DEFAULT_START_TIMEOUT_S = 15.0


def find_binary(name: str, path: str | None, install_hint: str) -> str:
    """The executable to run: ``path`` when given, else ``name`` on PATH (or in
    /usr/sbin, where Debian puts some daemons and which a non-root PATH may lack).

    Raises Unavailable("<name> not installed: <install_hint>") when there is none.
    """
    if path is not None:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
        raise Unavailable(f"{name} not found at {path}: {install_hint}")
    found = shutil.which(name) or shutil.which(name, path="/usr/local/sbin:/usr/sbin:/sbin")
    if found is None:
        raise Unavailable(f"{name} not installed: {install_hint}")
    return found


def binary_version(argv: Sequence[str], pattern: str, timeout: float = 10.0) -> str:
    """The version a binary reports (``argv`` is e.g. ``[binary, "--version"]``):
    group 1 of ``pattern`` in its output, or "unknown" if it did not say."""
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    m = re.search(pattern, out.stdout + out.stderr)
    return m.group(1) if m else "unknown"


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (see :func:`ziplog.tools.procs.free_tcp_ports`)."""
    return procs.free_tcp_ports(n)


def make_temp_dir(prefix: str, parent: str | None = None) -> Path:
    """A fresh directory for one system's data and logs; ``parent`` picks the file
    system (the durability settings measured depend on what fsync costs there)."""
    if parent is not None:
        os.makedirs(parent, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


def remove_temp_dir(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file (only its last 64 KiB are read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return "\n".join(text.splitlines()[-lines:])


def _port_accepts(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_until(ready: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``ready`` until it returns True (then True) or ``timeout`` passes (False).

    Servers offer no notification that they are ready to serve, so starting them
    means asking until they answer; the bound keeps a broken setup from hanging.
    """
    deadline = time.monotonic() + timeout
    while True:
        if ready():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


class ServerProcess:
    """One server binary running as our child (own process group, dies with us),
    its output appended to ``log_path``."""

    def __init__(self, label: str, argv: Sequence[str], log_path: Path, cwd: Path | None = None) -> None:
        self.label = label
        self.argv = list(argv)
        self.log_path = log_path
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        try:
            self.proc = procs.spawn(self.argv, self.log_path, cwd=self.cwd)
        except OSError as e:
            raise Unavailable(f"{self.label} could not be started ({' '.join(self.argv)}): {e}") from e

    def exited(self) -> int | None:
        """The exit code if the process has ended, else None (also None if never started)."""
        return self.proc.poll() if self.proc is not None else None

    def failure(self, what: str) -> Unavailable:
        """An Unavailable saying ``what`` went wrong, with the server's last log lines."""
        return Unavailable(f"{self.label} {what}; last lines of {self.log_path}:\n{log_tail(self.log_path)}")

    def check_running(self) -> None:
        code = self.exited()
        if code is not None:
            raise self.failure(f"exited with code {code}")

    def wait_for_port(self, port: int, host: str = "127.0.0.1", timeout: float = DEFAULT_START_TIMEOUT_S) -> None:
        """Return once ``port`` accepts connections; raise Unavailable if the process
        exits first or the port stays closed for ``timeout`` seconds."""

        def ready() -> bool:
            self.check_running()
            return _port_accepts(host, port)

        if not wait_until(ready, timeout):
            raise self.failure(f"did not open port {port} within {timeout:.0f} s")

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; safe to call twice or if never started."""
        if self.proc is not None:
            procs.stop(self.proc, timeout)


def stop_all(servers: Sequence[ServerProcess], timeout: float = 5.0) -> None:
    """Stop several servers concurrently (one shared timeout)."""
    procs.stop_many([s.proc for s in servers if s.proc is not None], timeout)

