"""The client key registry in ZooKeeper: one node, ``/ziplog/clients``, holding every
registered key by name (``{name: {"public": 32 bytes, "rights": ["append", ...]}}``),
under an ACL that lets only the cluster's digest read or write it (a client learns
nothing of the others' keys). One node, so a change is one versioned write and a
replica's table is always one whole registry (its ZooKeeper version numbers it); the
servers watch it, and ``ziplog client add/remove`` compare-and-set it.

Each app server (LogDB's coordinators and KV shards, LogBook's index nodes and
aggregators) says which version its table holds in an ephemeral node of its own under
``/ziplog/clients-loaded`` (same ACL), so that ``ziplog client remove`` can wait for
them as it waits for the storage replicas' STATUS.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NoAuthError, NodeExistsError, NoNodeError
from kazoo.security import make_acl

from ziplog.protocol.auth import ClusterKey
from ziplog.protocol.keys import KEY_BYTES, ClientEntry, Right
from ziplog.protocol.layout import CLIENTS, CLIENTS_LOADED, dec, enc

log = logging.getLogger("ziplog.zk")

#: registry size bound: a ZooKeeper node holds at most 1 MiB, about 15,000 entries
MAX_CLIENTS = 10_000

OnRegistry = Callable[[list[ClientEntry], int], None]


class RegistryError(ValueError):
    """A registry change that cannot be made (a name or key taken, a name unknown), or a
    session that may not see the registry (not a member's)."""


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

    def confirm_loaded(self, server: str, version: int) -> None:
        """Say, in ``server``'s ephemeral node (gone with its session), that its table
        holds registry ``version``."""
        if not server or "/" in server:
            raise ValueError(f"a server's name has no '/': {server!r}")
        path, data = f"{CLIENTS_LOADED}/{server}", enc({"version": version})
        try:
            try:
                self.zk.set(path, data)
            except NoNodeError:
                try:
                    self.zk.create(path, data, acl=self.acl, ephemeral=True, makepath=True)
                except NodeExistsError:
                    self.zk.set(path, data)
        except NoAuthError:
            raise RegistryError(_NOT_MEMBER) from None

    def loaded(self) -> dict[str, int]:
        """The registry version each app server's table holds, as it last said (a server
        whose node is gone, or unreadable, is not there)."""
        try:
            names = self.zk.get_children(CLIENTS_LOADED)
        except NoNodeError:
            return {}
        except NoAuthError:
            raise RegistryError(_NOT_MEMBER) from None
        out: dict[str, int] = {}
        for name in names:
            try:
                doc = dec(self.zk.get(f"{CLIENTS_LOADED}/{name}")[0])
            except Exception:  # gone since listed, unreadable, or not msgpack (several types): not there
                continue
            if isinstance(doc, dict) and type(doc.get("version")) is int:
                out[name] = doc["version"]
        return out

    def remove(self, name: str) -> int:
        """Remove ``name``; the registry's new version (RegistryError if it is unknown)."""

        def change(doc: dict[str, Any]) -> None:
            if doc.pop(name, None) is None:
                raise RegistryError(f"no client is registered as {name!r}")

        return self._update(change)
