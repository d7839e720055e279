"""Client rights at an app server's ROUTER (LogDB's coordinator and KV shards, LogBook's
index nodes and aggregators) under CURVE: the same registry and table as a storage
replica's (:mod:`ziplog.protocol.access`), so a key that may not read the log may not
read it through an app either (a KV shard's values, the index's gsns of a tag).

Under NULL (loopback without ``--curve``) there are no keys and nothing is checked, as
at a storage replica."""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any, Callable

from ziplog.protocol.access import AccessTable
from ziplog.protocol.auth import ClusterKey
from ziplog.protocol.keys import ClientEntry, Right

log = logging.getLogger("ziplog.rights")

#: (route, decoded request) -> why its sender may not make it (None: it may)
Refusal = Callable[[bytes, object], "str | None"]


class RouterRights:
    """The table of the moment, judging each decoded request by the right its type
    needs (``needs``; a type not there needs none) and the key its connection's
    handshake vouched for (``peer_key`` of the route)."""

    def __init__(self, table: AccessTable, needs: dict[type, Right]) -> None:
        self.table = table
        self.needs = needs
        #: the ROUTER's key of a route (:meth:`bind`: the ROUTER is made after its handler)
        self.peer_key: Callable[[bytes], bytes | None] = lambda route: None
        #: requests refused, since the process started
        self.refused = 0

    def bind(self, router: Any) -> None:
        """Judge by the keys ``router``'s handshakes vouched for."""
        self.peer_key = router.peer_key

    def refusal(self, route: bytes, req: object) -> str | None:
        needed = self.needs.get(type(req))
        if needed is None:
            return None
        why = self.table.refusal_for(self.peer_key(route), needed)
        if why is not None:
            self.refused += 1
        return why


def follow_registry(zk_client: Any, key: ClusterKey, rt: Any, table: AccessTable, server: str) -> None:
    """Load ``table`` from the client key registry now (before the process serves: an
    empty table would refuse every client), and again on the runtime's thread at every
    change (the watch fires on kazoo's); after each load, confirm it in ZooKeeper as
    ``server`` (:class:`LoadConfirmer`), again whenever the session is new."""
    from ziplog.io.zk_clients import ClientRegistry

    registry = ClientRegistry(zk_client, key)
    entries, version = registry.read()
    table.load(entries, version)
    confirmer = LoadConfirmer(registry, server)
    confirmer.loaded(version)

    def changed(entries: list[ClientEntry], version: int) -> None:
        def load() -> None:
            table.load(entries, version)
            confirmer.loaded(version)

        rt.call_soon_threadsafe(load)

    registry.on_connected(confirmer.again)  # a new session has no ephemeral node: say it again
    registry.watch(changed)


class LoadConfirmer:
    """Writes the registry version the server's table holds to its ZooKeeper node, on a
    thread of its own (the runtime's thread never waits for ZooKeeper); only the
    latest version is written, and a failed write is tried again a second later."""

    def __init__(self, registry: Any, server: str) -> None:
        self.registry = registry
        self.server = server
        self._cond = threading.Condition()
        self._want = -1
        self._written = -1
        #: bumped by :meth:`again`: a write that began before it does not count
        self._session = 0
        threading.Thread(target=self._run, name=f"registry-confirm-{server}", daemon=True).start()

    def loaded(self, version: int) -> None:
        with self._cond:
            self._want = max(self._want, version)
            self._cond.notify()

    def again(self) -> None:
        with self._cond:
            self._session += 1
            self._written = -1
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._want <= self._written:
                    self._cond.wait()
                want, session = self._want, self._session
            try:
                self.registry.confirm_loaded(self.server, want)
            except Exception as exc:  # ZooKeeper away: the next change or session says it again
                log.warning("could not confirm registry version %d as %s: %s", want, self.server, exc)
                with self._cond:
                    self._cond.wait(1.0)
                continue
            with self._cond:
                if session == self._session:
                    self._written = max(self._written, want)


def server_name(role: str) -> str:
    """A name for this process's registry confirmation: its role, pid and host."""
    return f"{role}-{os.getpid()}@{socket.gethostname()}".replace("/", "_")


def router_rights(rt: Any, zk_client: Any, key: ClusterKey, needs: dict[type, Right],
                  role: str) -> RouterRights | None:
    """The rights an app server checks at its clients' ROUTER (bind it to the ROUTER
    before it serves): None under NULL (the runtime has no credentials), else a table
    loaded from the registry, followed, and each load confirmed as ``role``'s."""
    if rt.credentials is None:
        return None
    table = AccessTable(rt.credentials.server.public)
    follow_registry(zk_client, key, rt, table, server_name(role))
    return RouterRights(table, needs)
