"""``ziplog client add/remove/list``: the client key registry (``ziplog.io.zk_clients``),
managed with the cluster key (only members may read or write it).

``add`` makes a key pair and writes the client's key file (``--out``), or registers a
public key the client made itself (``--public-key``); ``remove`` returns once it can
vouch that every server that judges client keys refuses the removed key: each one
registered under ``/ziplog/clients-loaded`` (the storage processes and the apps'
servers) has confirmed the new registry version, or its registry lease has certainly
run out since the change was committed (:func:`vouch_removal`); it names those that did
not confirm, and fails naming those it cannot vouch for within its timeout.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

from ziplog.protocol.errors import ZiplogError

#: ``remove`` counts a server's lease as run out this much later than the lease itself,
#: measured on its own clock from when the change was committed: a tenth of the lease
#: (the two machines' clocks may run at rates that differ, by far less than that) and
#: half a second of slack (a short lease's tenth is small)
LEASE_MARGIN_SHARE = 0.1
LEASE_MARGIN_S = 0.5
#: how often ``remove`` looks at the servers' confirmations
LOOK_EVERY_S = 0.05


class CommandError(ZiplogError):
    """A registry command that cannot be done (the CLI prints it and exits 1)."""


def _registry(args: argparse.Namespace, hosts: str) -> tuple[Any, Any, Any]:
    from ziplog.io import zk
    from ziplog.io.zk_clients import ClientRegistry
    from ziplog.shell.process import load_cluster_key

    key = load_cluster_key(Path(args.cluster_key_file) if args.cluster_key_file else None)
    session = zk.connect(hosts, timeout=args.timeout, key=key)
    return session, ClientRegistry(session, key), key


def cmd_client_add(args: argparse.Namespace, hosts: str, out: Callable[[str], None]) -> int:
    from ziplog.io.keys import KeyFileError, new_keypair, write_key_file, z85_key, z85_text
    from ziplog.io.zk import stop
    from ziplog.io.zk_clients import RegistryError
    from ziplog.protocol.keys import parse_rights

    try:
        rights = parse_rights(args.rights)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    if (args.out is None) == (args.public_key is None):
        raise CommandError("give --out FILE (a new key pair, written there) or --public-key=Z85 (the client's own)")
    session, registry, key = _registry(args, hosts)
    try:
        server = key.curve_server().public
        if args.public_key is not None:
            try:
                public, pair = z85_key(args.public_key, "public key"), None
            except KeyFileError as exc:
                raise CommandError(str(exc)) from None
        else:
            pair = new_keypair()
            public = pair.public
        try:
            version = registry.add(args.name, public, rights)
            behind = wait_loaded(registry, version, args.timeout)
        except RegistryError as exc:
            raise CommandError(str(exc)) from None
    finally:
        stop(session)
    if behind:
        out(f"warning: these servers did not load registry version {version} within {args.timeout:g} s and refuse "
            f"the key until they do: {', '.join(behind)}")
    if pair is not None:
        write_key_file(args.out, args.name, pair, server)
        out(f"registered client {args.name!r} with {', '.join(sorted(r.value for r in rights)) or 'no rights'} "
            f"(registry version {version}); its key file is {args.out}: give it to the client "
            "(key_file=, --key-file or $ZIPLOG_CLIENT_KEY_FILE)")
    else:
        out(f"registered client {args.name!r} with {', '.join(sorted(r.value for r in rights)) or 'no rights'} "
            f"(registry version {version}); the cluster's server key, for its key file: {z85_text(server)}")
    return 0


def cmd_client_remove(args: argparse.Namespace, hosts: str, out: Callable[[str], None]) -> int:
    from ziplog.io.zk import stop
    from ziplog.io.zk_clients import RegistryError

    session, registry, _ = _registry(args, hosts)
    try:
        try:
            version = registry.remove(args.name)
        except RegistryError as exc:
            raise CommandError(str(exc)) from None
        committed = time.monotonic()  # the write is committed by now
        vouched = vouch_removal(registry, version, committed, args.timeout)
    finally:
        stop(session)
    if vouched.unknown:
        raise CommandError(f"removed {args.name!r} (registry version {version}), but these servers did not confirm it "
                           f"within {args.timeout:g} s, and their registry lease has not certainly run out (or they "
                           f"keep none): {', '.join(vouched.unknown)}; they may still take the key")
    if not vouched.confirmed and not vouched.lapsed:
        out(f"removed client {args.name!r} (registry version {version}); no server judges client keys (a cluster that "
            "speaks NULL checks none)")
        return 0
    out(f"removed client {args.name!r} (registry version {version}); every server that judges client keys refuses "
        f"it now ({len(vouched.confirmed)} confirmed it)")
    if vouched.lapsed:
        out(f"these did not confirm it, but their registry lease has run out: they refuse every client key until "
            f"they read the registry again: {', '.join(vouched.lapsed)}")
    return 0


class Vouched(NamedTuple):
    """The servers registered under ``/ziplog/clients-loaded``, by what ``remove`` can
    say of each."""

    #: hold the removal's version, or a later one
    confirmed: list[str]
    #: did not confirm it, but their registry lease has run out since it was committed
    lapsed: list[str]
    #: neither (at the deadline)
    unknown: list[str]


def lease_runs_out_s(lease_ms: int) -> float:
    """How long after a registry change was committed a server with a lease of
    ``lease_ms`` has certainly stopped judging keys by an older version (unless it
    confirmed the new one): its lease and the margins."""
    return lease_ms / 1000 * (1 + LEASE_MARGIN_SHARE) + LEASE_MARGIN_S


def vouch_removal(registry: Any, version: int, committed: float, timeout: float,
                  clock: Callable[[], float] = time.monotonic,
                  pause: Callable[[float], None] = time.sleep) -> Vouched:
    """Look every LOOK_EVERY_S at what each server that judges client keys says in its
    node (``registry.loaded()``) until each has confirmed ``version`` or its lease has
    certainly run out since ``committed`` (this process's monotonic clock, read after
    the change's write returned), or until ``timeout`` from ``committed``.

    Why that suffices: a server judges keys only under a lease whose check started
    before the change was committed (a later check would have seen it), and the lease
    runs out ``lease_ms`` after the check started, on its own clock. A server whose node
    is not listed has a lease that ran out already: its session expired (a lease is at
    most half the session's timeout, counted from a check the session made), or its node
    was made after the change, and it checks its node before the registry. A server of an
    earlier build says no lease: it must confirm."""
    deadline = committed + timeout
    while True:
        now = clock()  # before the look: a lease counted as run out by it is
        confirmed, lapsed, unknown = [], [], []
        for name, held in sorted(registry.loaded().items()):
            if held.version >= version:
                confirmed.append(name)
            elif held.lease_ms is not None and now >= committed + lease_runs_out_s(held.lease_ms):
                lapsed.append(name)
            else:
                unknown.append(name)
        if not unknown or now >= deadline:
            return Vouched(confirmed, lapsed, unknown)
        pause(LOOK_EVERY_S)


def wait_loaded(registry: Any, version: int, timeout: float, clock: Callable[[], float] = time.monotonic,
                pause: Callable[[float], None] = time.sleep) -> list[str]:
    """Look every LOOK_EVERY_S until every server that judges client keys holds registry
    ``version`` (or later), or ``timeout`` passed: the servers that do not yet (they
    refuse a key added since, FORBIDDEN, until they do). An added key is usable at once
    only after this: a client handed it as soon as it was written was refused by a
    server whose watch had not fired yet."""
    deadline = clock() + timeout
    while True:
        behind = [name for name, held in sorted(registry.loaded().items()) if held.version < version]
        if not behind or clock() >= deadline:
            return behind
        pause(LOOK_EVERY_S)


def cmd_client_list(args: argparse.Namespace, hosts: str, out: Callable[[str], None]) -> int:
    from ziplog.io.keys import z85_text
    from ziplog.io.zk import stop

    from ziplog.io.zk_clients import RegistryError

    session, registry, key = _registry(args, hosts)
    try:
        entries, version = registry.read()
    except RegistryError as exc:
        raise CommandError(str(exc)) from None
    finally:
        stop(session)
    out(f"server key: {z85_text(key.curve_server().public)}  (a key file's `server`)")
    out(f"{'name':<20} {'public key':<40} rights")
    for e in sorted(entries, key=lambda e: e.name):
        out(f"{e.name:<20} {z85_text(e.public):<40} {','.join(sorted(r.value for r in e.rights)) or '-'}")
    out(f"({len(entries)} keys, registry version {version})")
    return 0


def add_client_key_commands(sub: Any, env_zk: str, run: Callable[[argparse.Namespace], int]) -> None:
    """``ziplog client add|remove|list``."""
    group = sub.add_parser("client", help="client keys and their rights (CURVE clusters)",
                           description="Register, remove and list client keys. A cluster that speaks CURVE serves "
                                       "a request only if the client's key holds its right: append (insert), read "
                                       "(read, subscribe), trim, admin (status). Needs the cluster key.")
    actions = group.add_subparsers(dest="client_command", metavar="ACTION")
    actions.required = True

    def action(name: str, help: str, func: Callable[..., int]) -> argparse.ArgumentParser:
        sp: argparse.ArgumentParser = actions.add_parser(name, help=help, description=help)
        sp.add_argument("--zk", metavar="HOSTS", default=None, help=f"ZooKeeper hosts (default: ${env_zk})")
        sp.add_argument("--cluster-key-file", default=None, metavar="FILE",
                        help="the cluster's secret (default: $ZIPLOG_CLUSTER_KEY_FILE)")
        sp.add_argument("--timeout", type=float, default=30.0, metavar="S", help="how long to wait (default 30)")
        sp.set_defaults(func=run, registry_func=func)
        return sp

    add = action("add", "register a client key with its rights", cmd_client_add)
    add.add_argument("name", metavar="NAME")
    add.add_argument("--rights", required=True, metavar="R[,R...]",
                     help="append, read, trim, admin (comma-separated), or all")
    add.add_argument("--out", default=None, metavar="FILE", help="make a key pair and write its key file here")
    add.add_argument("--public-key", default=None, metavar="Z85",
                     help="register this public key (the client's own; write --public-key=Z85: a Z85 text may start "
                          "with '-')")
    rm = action("remove", "remove a client key: returns once every server that judges client keys confirmed it, "
                          "or its registry lease ran out (names those that did not confirm)", cmd_client_remove)
    rm.add_argument("name", metavar="NAME")
    action("list", "list the registered keys and their rights", cmd_client_list)
