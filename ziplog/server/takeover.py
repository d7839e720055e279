"""``ziplog.server --take-over PID``: a storage server that replaces a running one of the
same shard and replica on this machine.

A restart's gap is the old process's stop plus the new one's start, and most of the
start (the interpreter, the imports, the ZooKeeper session) needs nothing the old process
holds. So the new process does all of that first, while the old one still serves; only
then does it stop the old one (SIGTERM, through a pidfd, so a recycled pid can never be
signalled) and, once that has exited, open the data directory, bind and register. A
primary stopped so vouches for its log (the clean-close marker), and its successor serves
again without a failure recovery.

The process to stop must be the one ZooKeeper holds registered as this shard's replica,
and must run ``ziplog.server``: a wrong pid is refused, never signalled."""

from __future__ import annotations

import logging
import os
import select
import signal
from pathlib import Path

log = logging.getLogger("ziplog.server")

#: how long the old process gets to write what it holds and exit before it is killed
#: (its successor then restarts as after a crash: the peer holds what it had not written)
STOP_TIMEOUT_S = 30.0


class TakeOverRefused(Exception):
    """The pid named is not this replica's running storage server."""


def looks_like_storage_server(pid: int) -> bool:
    """``pid`` runs ``ziplog.server`` (by its command line)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(a == b"ziplog.server" or a.endswith(b"/ziplog/server/__main__.py") for a in argv)


def take_over(pid: int, registered_pid: int | None, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop the storage server ``pid`` and return once it has exited.

    ``registered_pid``: the pid in this replica's ZooKeeper registration (None: none).
    Raises :class:`TakeOverRefused` when ``pid`` is not that process or does not run
    ``ziplog.server``. A process gone already is fine: there is nothing to stop."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        log.info("process %d is gone already: nothing to take over", pid)
        return
    try:
        # Checked after the pidfd is open: from here on the pid cannot name another process.
        if registered_pid != pid:
            raise TakeOverRefused(f"process {pid} is not this replica's registered server "
                                  f"(ZooKeeper names {registered_pid})")
        if not looks_like_storage_server(pid):
            raise TakeOverRefused(f"process {pid} does not run ziplog.server")
        log.info("taking over from process %d: stopping it", pid)
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        if not _exited(pidfd, timeout_s):
            log.warning("process %d did not stop within %.0f s: killing it (this replica restarts as after "
                        "a crash; its peer holds what it had not written)", pid, timeout_s)
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            _exited(pidfd, None)
    finally:
        os.close(pidfd)


def _exited(pidfd: int, timeout_s: float | None) -> bool:
    """Wait until the process behind ``pidfd`` has exited (its pidfd turns readable)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else int(timeout_s * 1000)))
