"""``ziplog client add/remove/list``: the client key registry (``ziplog.io.zk_clients``),
managed with the cluster key (only members may read or write it).

``add`` makes a key pair and writes the client's key file (``--out``), or registers a
public key the client made itself (``--public-key``); ``remove`` waits until every live
storage replica has loaded the change (STATUS ``access_version``), and every app server
has confirmed it (its node under ``/ziplog/clients-loaded``), so the removed key's next
request is refused once the command returns.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable

from ziplog.protocol.errors import ZiplogError

#: how long ``remove`` waits for the replicas to load the change
APPLY_TIMEOUT_S = 30.0


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
        except RegistryError as exc:
            raise CommandError(str(exc)) from None
    finally:
        stop(session)
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

    session, registry, key = _registry(args, hosts)
    try:
        try:
            version = registry.remove(args.name)
        except RegistryError as exc:
            raise CommandError(str(exc)) from None
        lagging = _wait_applied(hosts, key, version, args.timeout)
        lagging += _wait_apps(registry, version, args.timeout)
    finally:
        stop(session)
    if lagging:
        raise CommandError(f"removed {args.name!r} (registry version {version}), but these servers did not "
                           f"confirm it within {args.timeout:g} s: {', '.join(lagging)}")
    out(f"removed client {args.name!r} (registry version {version}); every live replica and app server refuses "
        "its key now")
    return 0


def _wait_apps(registry: Any, version: int, timeout: float) -> list[str]:
    """Until every app server that says which registry version it holds says ``version``
    or later (a server whose session ended is no longer there); those that did not."""
    return _until_none_lag(lambda: sorted(name for name, held in registry.loaded().items() if held < version),
                           timeout)


def _until_none_lag(lagging: Callable[[], list[str]], timeout: float) -> list[str]:
    """Ask ``lagging`` every 50 ms until it names nobody, or for at most
    ``min(timeout, APPLY_TIMEOUT_S)``; who lagged at the last asking."""
    deadline = time.monotonic() + min(timeout, APPLY_TIMEOUT_S)
    while True:
        late = lagging()
        if not late or time.monotonic() > deadline:
            return late
        time.sleep(0.05)


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


def _wait_applied(hosts: str, key: Any, version: int, timeout: float) -> list[str]:
    """Until every live replica's STATUS says it loaded ``version`` (asked as a member:
    the cluster's own key holds every right); the replicas that did not, by name. A
    cluster that speaks NULL checks no keys: nothing to wait for."""
    from ziplog.client.blocking import Client
    from ziplog.protocol.errors import UnauthenticatedError
    from ziplog.protocol.keys import Credentials

    try:
        client = Client(hosts, timeout=timeout, credentials=Credentials.member(key.curve_server()))
    except UnauthenticatedError:
        return []

    def lagging() -> list[str]:
        try:
            status = client.status(wait=1.0)
        except UnauthenticatedError:
            return []  # a NULL cluster: no table to load
        return [f"{s}.{r['replica']}" for s, rows in sorted(status.items()) for r in rows
                if r.get("answer") == "ok" and r.get("access_version", -1) < version]

    try:
        return _until_none_lag(lagging, timeout)
    finally:
        client.close()


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
    rm = action("remove", "remove a client key (its next request is refused)", cmd_client_remove)
    rm.add_argument("name", metavar="NAME")
    action("list", "list the registered keys and their rights", cmd_client_list)
