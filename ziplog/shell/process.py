"""What every server process's ``main`` shares: the cluster key it proves membership
with, whether its connections speak CURVE, and the end: run the runtime until SIGTERM/SIGINT, then close what it runs."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ziplog.protocol.auth import ClusterKey

if TYPE_CHECKING:
    import asyncio

    from ziplog.protocol.keys import Credentials


class _Closable(Protocol):
    def close(self) -> None: ...


class _Loop(_Closable, Protocol):
    def run_forever(self) -> None: ...

    def stop(self) -> None: ...

    def wake_on_signals(self) -> None: ...


def serve_forever(rt: _Loop, *parts: _Closable, on_stop: Callable[[], None] | None = None) -> int:
    """A process ``main``'s body: run ``rt`` until SIGTERM/SIGINT, then close ``parts`` (in
    order) and the runtime. ``on_stop`` is called first when the loop ended on a stop
    signal (not when it ended by an exception)."""

    def on_signal(signum: int, frame: Any) -> None:
        rt.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    rt.wake_on_signals()  # a stop signal ends the wait at once, however long the loop sleeps
    try:
        rt.run_forever()
        if on_stop is not None:
            on_stop()
    finally:
        for part in parts:
            part.close()
        rt.close()
    return 0


def stop_event() -> asyncio.Event:
    """An asyncio process's end: set on SIGTERM or SIGINT."""
    import asyncio  # here: a storage server's process runs no asyncio loop and skips its import

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


#: where a cluster process finds its secret when no ``--cluster-key-file`` is given
CLUSTER_KEY_ENV = "ZIPLOG_CLUSTER_KEY_FILE"


def add_cluster_key_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--cluster-key-file", type=Path, default=None,
                    help=f"the cluster's secret (default: the file named by ${CLUSTER_KEY_ENV}); every cluster "
                         "process and operator tool shares it")


def add_security_arguments(ap: argparse.ArgumentParser) -> None:
    """``--curve`` / ``--insecure``: whether the process's connections speak CURVE (see
    :func:`member_credentials`). Every process of a cluster must say the same. And
    ``--registry-lease-s``, under CURVE (:mod:`ziplog.shell.rights`)."""
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--curve", action="store_true",
                       help="speak CURVE (encrypted; clients need a key: `ziplog client add`) on a loopback address "
                            "too (off loopback it is the default)")
    group.add_argument("--insecure", action="store_true",
                       help="speak NULL (neither encrypted nor authenticated: anyone who can reach the port reads, "
                            "appends and trims) on a non-loopback address")
    from ziplog.shell.rights import DEFAULT_REGISTRY_LEASE_S

    ap.add_argument("--registry-lease-s", type=float, default=DEFAULT_REGISTRY_LEASE_S, metavar="S",
                    help="under CURVE, a process that serves clients (a storage server, an app's server) judges client "
                         "keys only this long after it last showed, through ZooKeeper, that it holds the current "
                         "client key registry, and refuses every client key past it (REGISTRY_LAPSED) until it shows "
                         "it again; `ziplog client remove` waits this long (and a tenth more, and half a second) "
                         "for a server that does not confirm a removal. Shorter: removals certain sooner; a shorter "
                         "ZooKeeper outage stops clients. At most half the ZooKeeper session's timeout (10 s) "
                         f"(default {DEFAULT_REGISTRY_LEASE_S:g})")


def member_credentials(args: argparse.Namespace, key: ClusterKey) -> "Credentials | None":
    """The process's CURVE credentials (the cluster's server pair, which members also
    connect with), or None for NULL: secure by default off loopback (``--insecure`` to
    refuse it), NULL by default on loopback (``--curve`` to ask for it)."""
    from ziplog.protocol.addresses import is_loopback
    from ziplog.protocol.keys import Credentials

    if getattr(args, "insecure", False):
        return None
    # a process that binds nothing (a LogBook feeder) speaks CURVE when told --curve
    if getattr(args, "curve", False) or not is_loopback(getattr(args, "bind", "127.0.0.1")):
        return Credentials.member(key.curve_server())
    return None


def add_address_arguments(ap: argparse.ArgumentParser, port_help: str | None = None) -> None:
    """``--bind`` (``--host`` is its old name), ``--advertise`` and, with ``port_help``,
    ``--port``: where a process listens and what it registers for others to dial."""
    ap.add_argument("--bind", "--host", dest="bind", default="127.0.0.1",
                    help="the IP address to listen on (IPv4 or IPv6; 0.0.0.0 or :: for every interface, which needs "
                         "--advertise)")
    ap.add_argument("--advertise", default=None,
                    help="the address (host or host:port) registered in ZooKeeper for others to dial (default: the "
                         "bind address)")
    if port_help is not None:
        ap.add_argument("--port", type=int, default=0, help=port_help)


def check_address_arguments(ap: argparse.ArgumentParser, args: argparse.Namespace, one_port: bool = True) -> None:
    """Exit with argparse's usage error when ``--bind``/``--advertise`` cannot work, before
    anything is bound or registered; ``args.bind`` becomes the canonical bind host. A
    process with several listening sockets (``one_port`` false) advertises a host only:
    each socket keeps its own port."""
    from ziplog.protocol.addresses import AddressError, advertised, check_bind_host, parse_host_port, tcp_addr
    try:
        args.bind = check_bind_host(args.bind)
        advertised(tcp_addr(args.bind, 1), args.advertise)
        if not one_port and args.advertise is not None and parse_host_port(args.advertise)[1] is not None:
            raise AddressError("this process listens on several ports: --advertise takes a host only")
    except AddressError as exc:
        ap.error(str(exc))


def load_cluster_key(path: Path | None) -> ClusterKey:
    """The cluster key from ``path`` or the file ``$ZIPLOG_CLUSTER_KEY_FILE`` names; exits
    with a clear message when there is none (a member without it could not be told from
    anyone else)."""
    if path is None and os.environ.get(CLUSTER_KEY_ENV):
        path = Path(os.environ[CLUSTER_KEY_ENV])
    if path is None:
        raise SystemExit(f"no cluster key: pass --cluster-key-file or set {CLUSTER_KEY_ENV} "
                         "(`ziplog keygen FILE` writes one)")
    try:
        return ClusterKey(path.read_bytes().strip())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"cluster key {path}: {exc}") from None


def write_cluster_key(path: Path) -> ClusterKey:
    """Write a new random cluster secret to ``path`` (readable by its owner only)."""
    secret = secrets.token_hex(32).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(secret + b"\n")
    return ClusterKey(secret)
