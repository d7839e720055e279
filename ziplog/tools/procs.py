"""Process helpers used to start and stop every child process of a local cluster.

A local ziplog cluster is a tree of long-lived children (ZooKeeper JVMs,
sequencers, storage servers, clients).  Two things go wrong easily with such
trees and these helpers exist to prevent them:

* **Orphans.**  If the parent (a test run, the ``ziplog`` CLI) is killed with
  SIGKILL or dies on Ctrl-C before its cleanup runs, the children keep running,
  keep their ports bound, and poison the next run.  Every child is therefore
  started with ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` so the kernel kills it when
  the parent goes away.
* **Partial kills.**  A child may itself fork (a shell wrapper, a JVM helper).
  Every child is started in its own session/process group
  (``start_new_session=True``) and is always signalled as a *group*, so one
  call takes down the whole subtree.  Having its own group also means a Ctrl-C
  in the terminal is not delivered to the children directly; the parent decides
  how and in which order they stop.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Callable

__all__ = ["spawn", "stop", "stop_many", "kill", "wait_first", "free_tcp_ports"]

# From <linux/prctl.h>.
_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    """Resolve libc's ``prctl`` once, in the parent.

    Resolving it here (at import time) rather than inside the ``preexec_fn``
    matters: the child runs ``preexec_fn`` between ``fork`` and ``exec`` where
    only async-signal-safe work is really safe.  ``dlopen``/symbol lookup may
    take locks held by other parent threads at fork time and deadlock; calling
    an already resolved function pointer does not.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.prctl
    except (OSError, AttributeError):  # not Linux / no glibc
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn


_prctl = _load_prctl()


def _make_preexec(parent_pid: int) -> Callable[[], None]:
    """Build the ``preexec_fn`` that ties the child's life to the parent's.

    After setting the death signal it re-checks the parent pid: if the parent
    already died between ``fork`` and ``prctl`` the death signal would never
    fire, so the child kills itself instead of becoming an orphan.
    """

    def _preexec() -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)

    return _preexec


def spawn(
    argv: list[str],
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as a cluster child and return its ``Popen``.

    * stdout and stderr are *appended* to ``log_path`` (parent dirs are
      created), so a restarted child keeps the history of its previous
      incarnation in the same file, which is what you want when debugging a
      crash/restart test.
    * stdin is ``/dev/null`` so a child can never block on or steal the
      terminal.
    * The child gets its own process group (``start_new_session=True``) so
      :func:`stop`/:func:`kill` can signal its whole subtree and terminal
      Ctrl-C is handled by the parent only.
    * The child gets ``PR_SET_PDEATHSIG=SIGKILL`` so it dies with the parent.

    Caveat: Linux delivers the death signal when the *thread* that forked the
    child exits, not the whole process.  Call ``spawn`` from the main thread or
    from a thread that lives as long as the child must (not from a short-lived
    worker thread of a pool), or the child is killed when that thread ends.

    ``env`` replaces the environment entirely when given (like ``Popen``);
    pass ``{**os.environ, ...}`` to extend it.
    """
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab", buffering=0) as log:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_make_preexec(os.getpid()),
            close_fds=True,
        )


def _signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    """Send ``sig`` to the child's process group, ignoring "already gone".

    The group id equals the child's pid because of ``start_new_session``.  We
    signal the group even if the leader already exited, so grandchildren that
    outlived it are still reached.
    """
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _reap(proc: subprocess.Popen[Any], timeout: float | None) -> bool:
    """Wait for the child to exit; True if it did within ``timeout``."""
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


def wait_first(procs: Iterable[subprocess.Popen[Any]], timeout: float) -> None:
    """Until one of the children ``procs`` has exited (it is not reaped), or ``timeout``
    passed: their pidfds, polled together."""
    poller = select.poll()
    fds: list[int] = []
    try:
        for p in procs:
            try:
                fd = os.pidfd_open(p.pid)
            except ProcessLookupError:  # reaped already: it has exited
                return
            fds.append(fd)
            poller.register(fd, select.POLLIN)
        poller.poll(int(timeout * 1000))
    finally:
        for fd in fds:
            os.close(fd)


def stop(proc: subprocess.Popen[Any], timeout: float = 5.0) -> None:
    """Gracefully stop a child: SIGTERM its group, then SIGKILL after ``timeout``.

    Graceful first so servers can flush logs and close sockets cleanly; forced
    afterwards so a wedged child can never hang a test or the CLI.  Never
    raises if the child is already dead.
    """
    stop_many([proc], timeout)


def stop_many(procs: Iterable[subprocess.Popen[Any]], timeout: float = 5.0) -> None:
    """Stop several children concurrently with one shared ``timeout``.

    Signalling all of them before waiting makes shutting down an N-process
    cluster take about one child's shutdown time instead of N of them.
    """
    procs = list(procs)
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        if not _reap(p, max(0.0, deadline - time.monotonic())):
            kill(p)
        else:
            # Leader gone; make sure nothing else is left in its group.
            _signal_group(p, signal.SIGKILL)


def kill(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL the child's whole process group immediately and reap it.

    Used for crash-fault injection (no chance to clean up, like a power cut
    of that process) and as the last resort of :func:`stop`.  Never raises.
    """
    _signal_group(proc, signal.SIGKILL)
    _reap(proc, None)


def free_tcp_ports(n: int) -> list[int]:
    """Return ``n`` distinct TCP ports that are currently free on 127.0.0.1.

    All sockets are kept bound until every port is chosen so the kernel cannot
    hand out the same ephemeral port twice; they are closed before returning.
    There is an unavoidable window between this call and the child binding the
    port, but ephemeral ports are allocated round-robin-ish by Linux, so reuse
    inside that window is rare in practice.
    """
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
