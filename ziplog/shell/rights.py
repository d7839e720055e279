"""Client rights at an app server's ROUTER (LogDB's coordinator and KV shards, LogBook's
index nodes and aggregators) under CURVE: the same registry and table as a storage
replica's (:mod:`ziplog.protocol.access`), so a key that may not read the log may not
read it through an app either (a KV shard's values, the index's gsns of a tag).

Under NULL (loopback without ``--curve``) there are no keys and nothing is checked, as
at a storage replica."""

from __future__ import annotations

from typing import Any, Callable

from ziplog.protocol.access import AccessTable
from ziplog.protocol.auth import ClusterKey
from ziplog.protocol.keys import ClientEntry, Right

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


def follow_registry(zk_client: Any, key: ClusterKey, rt: Any, table: AccessTable) -> None:
    """Load ``table`` from the client key registry now (before the process serves: an
    empty table would refuse every client), and again on the runtime's thread at every
    change (the watch fires on kazoo's)."""
    from ziplog.io.zk_clients import ClientRegistry

    registry = ClientRegistry(zk_client, key)
    entries, version = registry.read()
    table.load(entries, version)

    def changed(entries: list[ClientEntry], version: int) -> None:
        rt.call_soon_threadsafe(lambda: table.load(entries, version))

    registry.watch(changed)


def router_rights(rt: Any, zk_client: Any, key: ClusterKey, needs: dict[type, Right]) -> RouterRights | None:
    """The rights an app server checks at its clients' ROUTER (bind it to the ROUTER
    before it serves): None under NULL (the runtime has no credentials), else a table
    loaded from the registry and followed."""
    if rt.credentials is None:
        return None
    table = AccessTable(rt.credentials.server.public)
    follow_registry(zk_client, key, rt, table)
    return RouterRights(table, needs)
