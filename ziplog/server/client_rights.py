"""A storage replica's rights checks under CURVE (:mod:`ziplog.protocol.access`), beside
its driver: the table of the moment judges each bare client request, and a registry
change ends the subscriptions whose key lost ``read``."""

from __future__ import annotations

from typing import Any

from ziplog.cores.replica import ReplicaCore
from ziplog.protocol import frames as f
from ziplog.protocol.access import AccessTable
from ziplog.protocol.keys import ClientEntry


class ClientRights:
    """The table and what it refused (STATUS ``access_version``, ``forbidden``; the
    refused-frames metric counts FORBIDDEN with the other codes)."""

    def __init__(self, table: AccessTable, core: ReplicaCore, router: Any, refused: dict[str, int]) -> None:
        self.table = table
        self.core = core
        self.router = router
        self.refused = refused
        core.driver_stats["access_version"] = table.version
        core.driver_stats["forbidden"] = 0

    def check(self, route: bytes, msg: f.Frame) -> None:
        """FORBIDDEN (a ProtocolError, before the core sees the request) unless the
        route's key holds the op's right."""
        why = self.table.refusal(self.router.peer_key(route), msg)
        if why is not None:
            self.core.driver_stats["forbidden"] += 1
            req_id = getattr(msg, "req_id", None)
            raise f.ProtocolError(f.E_FORBIDDEN, why, getattr(msg, "sub_id", req_id))

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
