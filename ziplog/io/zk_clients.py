"""The client key registry in ZooKeeper: one node, ``/ziplog/clients``, holding every
registered key by name (``{name: {"public": 32 bytes, "rights": ["append", ...]}}``),
under an ACL that lets only the cluster's digest read or write it (a client learns
nothing of the others' keys). One node, so a change is one versioned write and a
replica's table is always one whole registry (its ZooKeeper version numbers it); the
servers watch it, and ``ziplog client add/remove`` compare-and-set it.

Each server that judges client keys (a storage process; LogDB's coordinators and KV
shards, LogBook's index nodes and aggregators) says which version its table holds, and
how long its registry lease is, in an ephemeral node of its own under
``/ziplog/clients-loaded`` (same ACL), so that ``ziplog client remove`` can wait for each
to confirm a removal, or for its lease to run out.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NoAuthError, NodeExistsError, NoNodeError
from kazoo.security import make_acl

from ziplog.protocol.auth import ClusterKey
from ziplog.protocol.keys import KEY_BYTES, ClientEntry, Right
from ziplog.protocol.layout import CLIENTS, CLIENTS_LOADED, ROOT, dec, enc

log = logging.getLogger("ziplog.zk")

#: registry size bound: a ZooKeeper node holds at most 1 MiB, about 15,000 entries
MAX_CLIENTS = 10_000

OnRegistry = Callable[[list[ClientEntry], int], None]


class RegistryError(ValueError):
    """A registry change that cannot be made (a name or key taken, a name unknown), or a
    session that may not see the registry (not a member's)."""


class LeaseEvidenceError(Exception):
    """A registry check that cannot renew a lease: the server's own node is not this
    session's (:meth:`ClientRegistry.current`)."""


class Loaded(NamedTuple):
    """What a server says in its node under ``/ziplog/clients-loaded``."""

    #: the registry version its table holds (-1: it did not say)
    version: int
    #: its registry lease, in milliseconds (None: it keeps none)
    lease_ms: int | None


_NOT_MEMBER = "ZooKeeper refused: this session is not a member's (the cluster key is not this cluster's)"


def parse_registry(data: bytes | None) -> list[ClientEntry]:
    """The entries of the registry node's value; malformed entries are skipped (logged):
    a hand-edited node must not stop a replica."""
    try:
        doc = dec(data)
    except Exception as exc:  # msgpack raises several types on junk
        log.error("the client key registry is not msgpack (%s): no client key is accepted", exc)
        return []
    if not isinstance(doc, dict):
        return []
    out: list[ClientEntry] = []
    for name, entry in doc.items():
        try:
            public = entry["public"]
            rights = frozenset(Right(r) for r in entry["rights"])
            if not isinstance(name, str) or type(public) is not bytes or len(public) != KEY_BYTES:
                raise ValueError("a name and a 32-byte key")
        except (TypeError, KeyError, ValueError) as exc:
            log.error("client key registry entry %r is malformed (%s): skipped", name, exc)
            continue
        out.append(ClientEntry(name, public, rights))
    return out


class ClientRegistry:
    """The registry, through a member's session (it carries the cluster's digest)."""

    def __init__(self, zk: KazooClient, key: ClusterKey) -> None:
        self.zk = zk
        self.acl = [make_acl("digest", key.zk_digest_id, all=True)]

    def _ensure(self) -> None:
        try:
            if self.zk.exists(CLIENTS) is None:
                # the parent first, with the session's ACL: ``makepath`` would make it
                # members-only too, and then no client could read the layout
                self.zk.ensure_path(ROOT)
                self.zk.create(CLIENTS, enc({}), acl=self.acl, makepath=True)
        except NodeExistsError:
            pass
        except NoAuthError:
            raise RegistryError(_NOT_MEMBER) from None

    def read(self) -> tuple[list[ClientEntry], int]:
        """(the entries, the node's version) now."""
        self._ensure()
        self.zk.sync(CLIENTS)
        try:
            data, stat = self.zk.get(CLIENTS)
        except NoAuthError:
            raise RegistryError(_NOT_MEMBER) from None
        return parse_registry(data), stat.version

    def watch(self, on_change: OnRegistry) -> None:
        """Call ``on_change(entries, version)`` now and after every change (on kazoo's
        thread: hand it over to the process's loop)."""
        self._ensure()

        def changed(data: bytes | None, stat: Any) -> None:
            if stat is not None:
                on_change(parse_registry(data), stat.version)

        self.zk.DataWatch(CLIENTS, changed)

    def _update(self, change: Callable[[dict[str, Any]], None]) -> int:
        self._ensure()
        while True:
            try:
                data, stat = self.zk.get(CLIENTS)
            except NoAuthError:
                raise RegistryError(_NOT_MEMBER) from None
            doc = dec(data)
            if not isinstance(doc, dict):
                doc = {}
            change(doc)
            try:
                return int(self.zk.set(CLIENTS, enc(doc), version=stat.version).version)
            except BadVersionError:
                continue  # another operator's change came first: apply ours to it
            except NoNodeError:
                self._ensure()

    def add(self, name: str, public: bytes, rights: frozenset[Right]) -> int:
        """Register ``public`` as ``name`` with ``rights`` (a name's rights may be changed
        by adding it again with the same key); the registry's new version."""
        if not name or len(name) > 200:
            raise RegistryError("a client name is 1 to 200 characters")

        def change(doc: dict[str, Any]) -> None:
            old = doc.get(name)
            for other, entry in doc.items():
                if other != name and isinstance(entry, dict) and entry.get("public") == public:
                    raise RegistryError(f"that key is registered already, as {other!r}")
            if isinstance(old, dict) and old.get("public") != public:
                raise RegistryError(f"client {name!r} exists with another key (remove it first)")
            if old is None and len(doc) >= MAX_CLIENTS:
                raise RegistryError(f"the registry holds {MAX_CLIENTS} keys, its limit")
            doc[name] = {"public": public, "rights": sorted(r.value for r in rights)}

        return self._update(change)

    def on_connected(self, call: Callable[[], None]) -> None:
        """Call ``call`` (on kazoo's thread: it must not block) whenever the session
        connects again: a new session has lost its ephemeral nodes."""
        from kazoo.client import KazooState

        def on_state(state: Any) -> None:
            if state == KazooState.CONNECTED:
                call()

        self.zk.add_listener(on_state)

    def on_lost(self, call: Callable[[], None]) -> None:
        """Call ``call`` (on kazoo's thread: it must not block) when the session expires:
        its ephemeral nodes are gone."""
        from kazoo.client import KazooState

        def on_state(state: Any) -> None:
            if state == KazooState.LOST:
                call()

        self.zk.add_listener(on_state)

    def serving(self) -> bool:
        """The session has not been stopped (a stopped one answers nothing again)."""
        return bool(self.zk.handler.running)

    def confirm_loaded(self, server: str, version: int, lease_ms: int | None = None) -> None:
        """Say, in ``server``'s ephemeral node (gone with its session), that its table
        holds registry ``version``, and how long its registry lease is (``lease_ms``:
        :class:`~ziplog.protocol.access.RegistryLease`; None: it keeps none)."""
        if not server or "/" in server:
            raise ValueError(f"a server's name has no '/': {server!r}")
        doc: dict[str, int] = {"version": version}
        if lease_ms is not None:
            doc["lease_ms"] = lease_ms
        path, data = f"{CLIENTS_LOADED}/{server}", enc(doc)
        try:
            try:
                self.zk.set(path, data)
            except NoNodeError:
                self.zk.ensure_path(ROOT)  # as in _ensure
                try:
                    self.zk.create(path, data, acl=self.acl, ephemeral=True, makepath=True)
                except NodeExistsError:
                    self.zk.set(path, data)
        except NoAuthError:
            raise RegistryError(_NOT_MEMBER) from None

    def loaded(self) -> dict[str, Loaded]:
        """What each server that judges client keys last said of its table: the registry
        version it holds and its lease. A server whose node is gone since it was listed
        is not there (its session ended); one whose node does not say is there, at
        version -1 without a lease (nothing can be vouched for it)."""
        try:
            names = self.zk.get_children(CLIENTS_LOADED)
        except NoNodeError:
            return {}
        except NoAuthError:
            raise RegistryError(_NOT_MEMBER) from None
        out: dict[str, Loaded] = {}
        for name in names:
            try:
                data = self.zk.get(f"{CLIENTS_LOADED}/{name}")[0]
            except NoNodeError:
                continue
            except NoAuthError:
                raise RegistryError(_NOT_MEMBER) from None
            try:
                doc = dec(data)
            except Exception:  # not msgpack (several types)
                doc = None
            if not isinstance(doc, dict):
                doc = {}
            version, lease_ms = doc.get("version"), doc.get("lease_ms")
            out[name] = Loaded(version if type(version) is int else -1,
                               lease_ms if type(lease_ms) is int and lease_ms > 0 else None)
        return out

    def current(self, server: str, held: int) -> tuple[int, list[ClientEntry] | None]:
        """One check for a registry lease (:class:`~ziplog.protocol.access.RegistryLease`):
        after a ``sync`` (what follows reads ZooKeeper as of now, not a lagging server's
        past), ``server``'s node is this session's, and then the registry's version; its
        entries too when that version is newer than ``held``. The node comes first: a
        ``ziplog client remove`` that did not see the node (made after it listed them)
        committed its change before, and this read sees it. Raises
        :class:`LeaseEvidenceError` when the node is not this session's (not made yet,
        or gone with an expired session), ZooKeeper's errors when it cannot be asked."""
        self.zk.sync(CLIENTS)
        node = self.zk.exists(f"{CLIENTS_LOADED}/{server}")
        session = self.zk.client_id
        if node is None or session is None or node.ephemeralOwner != session[0]:
            raise LeaseEvidenceError(f"{CLIENTS_LOADED}/{server} is not this session's")
        stat = self.zk.exists(CLIENTS)
        if stat is None:  # a new cluster's: made empty (the session saw it missing after the sync)
            self._ensure()
            stat = self.zk.exists(CLIENTS)
            if stat is None:
                raise LeaseEvidenceError(f"{CLIENTS} is gone")
        if stat.version <= held:
            return stat.version, None
        try:
            data, stat = self.zk.get(CLIENTS)
        except NoAuthError:
            raise RegistryError(_NOT_MEMBER) from None
        return stat.version, parse_registry(data)

    def remove(self, name: str) -> int:
        """Remove ``name``; the registry's new version (RegistryError if it is unknown)."""

        def change(doc: dict[str, Any]) -> None:
            if doc.pop(name, None) is None:
                raise RegistryError(f"no client is registered as {name!r}")

        return self._update(change)
