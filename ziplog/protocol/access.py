"""Who may do what at a storage replica's ROUTER under CURVE (pure); the apps' servers
(LogDB's coordinator and KV shards, LogBook's index nodes and aggregators) judge their
own requests by the same table (:meth:`AccessTable.refusal_for`).

Every CURVE connection carries the long-term key its INITIATE vouched for. A request is
served when that key holds the right its op needs (:data:`REQUEST_RIGHTS`); the cluster's
own key (a member: a peer replica, the failure handler, an operator's tool) holds every
right. Sealed frames keep their MAC check besides: a right never replaces membership.
The table is the registry in ZooKeeper (``ziplog client add``), replaced whole at each
change; a request is checked against the table of the moment it is read, so a removed
key's next request is refused, and a replica ends the subscriptions of a key that lost
``read`` (:meth:`AccessTable.lost_read`).
"""

from __future__ import annotations

from typing import Iterable

from ziplog.protocol import frames as f
from ziplog.protocol.keys import ALL_RIGHTS, ClientEntry, Right

#: the right each client request needs
REQUEST_RIGHTS: dict[type, Right] = {
    f.Insert: Right.APPEND,
    f.Read: Right.READ,
    f.Range: Right.READ,
    f.Count: Right.READ,
    f.Subscribe: Right.READ,
    f.Credit: Right.READ,
    f.Unsubscribe: Right.READ,
    f.Trim: Right.TRIM,
    f.Status: Right.ADMIN,
}

_NONE: frozenset[Right] = frozenset()


class AccessTable:
    """Rights by public key: the member's, and the registry's (at ``version``)."""

    __slots__ = ("member", "version", "_rights", "_names")

    def __init__(self, member: bytes) -> None:
        self.member = member
        #: the registry version loaded (-1: none yet: only the member may act)
        self.version = -1
        self._rights: dict[bytes, frozenset[Right]] = {}
        self._names: dict[bytes, str] = {}

    def load(self, entries: Iterable[ClientEntry], version: int) -> None:
        """Replace the table with the registry's at ``version`` (an older one is ignored:
        watches may deliver out of order after a reconnect)."""
        if version < self.version:
            return
        self.version = version
        self._rights = {e.public: e.rights for e in entries}
        self._names = {e.public: e.name for e in entries}

    def rights(self, key: bytes | None) -> frozenset[Right]:
        if key is None:
            return _NONE
        if key == self.member:
            return ALL_RIGHTS
        return self._rights.get(key, _NONE)

    def refusal(self, key: bytes | None, msg: f.Frame) -> str | None:
        """Why ``key`` may not send ``msg`` (None: it may). An op outside the table
        (a sealed frame's inner op has been opened by then) is not a client's to send
        and is left to the MAC check and the decoder."""
        return self.refusal_for(key, REQUEST_RIGHTS.get(type(msg)))

    def refusal_for(self, key: bytes | None, needed: Right | None) -> str | None:
        """Why ``key`` may not make a request that needs ``needed`` (None: it may; a
        request that needs no right is left to the MAC check and the decoder)."""
        if needed is None or needed in self.rights(key):
            return None
        if key is None:
            return "this server serves CURVE connections only"
        name = self._names.get(key)
        if name is None:
            return "this client key is not registered (ziplog client add), or was removed"
        return f"client {name!r} lacks the {needed.value!r} right"

    def lost_read(self, key: bytes | None) -> bool:
        return Right.READ not in self.rights(key)
