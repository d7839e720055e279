"""A storage replica's rights checks under CURVE (:mod:`ziplog.protocol.access`), beside
its driver: the table of the moment judges each bare client request, and a registry
change ends the subscriptions whose key lost ``read``. While the table's registry lease
has lapsed no client request is judged (REGISTRY_LAPSED), and the client keys'
subscriptions are ended: nothing is sent to a key the registry may have removed."""

from __future__ import annotations

from typing import Any

from ziplog.cores.replica import ReplicaCore
from ziplog.protocol import frames as f
from ziplog.protocol.access import REQUEST_RIGHTS, AccessTable
from ziplog.protocol.keys import ClientEntry

#: why a client key's subscription ended when the lease lapsed
LAPSED_SUBSCRIPTION = ("this server cannot show that it holds the current client key registry (its registry lease "
                       "lapsed): the subscription ended; subscribe again")


class ClientRights:
    """The table and what it refused (STATUS ``access_version``, ``forbidden``; the
    refused-frames metric counts FORBIDDEN and REGISTRY_LAPSED with the other codes)."""

    def __init__(self, table: AccessTable, core: ReplicaCore, router: Any, refused: dict[str, int]) -> None:
        self.table = table
        self.core = core
        self.router = router
        self.refused = refused
        core.driver_stats["access_version"] = table.version
        core.driver_stats["forbidden"] = 0
        #: the client subscriptions were ended for the lease's lapse (until it holds again)
        self._lapse_seen = False

    def check(self, route: bytes, msg: f.Frame) -> None:
        """REGISTRY_LAPSED while the table's lease has lapsed, else FORBIDDEN unless the
        route's key holds the op's right (a ProtocolError, before the core sees the
        request)."""
        table = self.table
        key = self.router.peer_key(route)
        lapsed = table.lapse_refusal(key, REQUEST_RIGHTS.get(type(msg)))
        if lapsed is not None:
            req_id = getattr(msg, "req_id", None)
            raise f.ProtocolError(f.E_REGISTRY_LAPSED, lapsed, getattr(msg, "sub_id", req_id))
        why = table.refusal(key, msg)
        if why is not None:
            self.core.driver_stats["forbidden"] += 1
            req_id = getattr(msg, "req_id", None)
            raise f.ProtocolError(f.E_FORBIDDEN, why, getattr(msg, "sub_id", req_id))

    def at_turn(self) -> None:
        """Once a turn, before the subscriptions are served: when the lease has lapsed,
        every subscription of a client key ends with REGISTRY_LAPSED (its client subscribes
        again, and is judged, once the lease holds). A process paused past its lease
        sends nothing to a key it can no longer judge, not even in the turn it wakes in."""
        lease = self.table.lease
        if lease is None or lease.holds():
            self._lapse_seen = False
            return
        if self._lapse_seen:
            return  # ended already; a new SUBSCRIBE is refused at its check
        self._lapse_seen = True
        core = self.core
        member = self.table.member
        fanout = core.fanout
        for route, sub_id in list(fanout.subs):
            if self.router.peer_key(route) != member:
                fanout.on_unsubscribe(route, f.Unsubscribe(sub_id=sub_id))
                self.refused[f.E_REGISTRY_LAPSED] = self.refused.get(f.E_REGISTRY_LAPSED, 0) + 1
                core.error(route, sub_id, f.E_REGISTRY_LAPSED, LAPSED_SUBSCRIPTION)

    def load(self, entries: list[ClientEntry], version: int) -> None:
        """The registry changed: the table is replaced, and subscriptions whose key lost
        ``read`` end with FORBIDDEN (their client's subscription fails)."""
        self.table.load(entries, version)
        core = self.core
        core.driver_stats["access_version"] = self.table.version
        fanout = core.fanout
        for route, sub_id in list(fanout.subs):
            if self.table.lost_read(self.router.peer_key(route)):
                fanout.on_unsubscribe(route, f.Unsubscribe(sub_id=sub_id))
                self.refused[f.E_FORBIDDEN] = self.refused.get(f.E_FORBIDDEN, 0) + 1
                core.driver_stats["forbidden"] += 1
                core.error(route, sub_id, f.E_FORBIDDEN, "the subscription's key lost the 'read' right")
