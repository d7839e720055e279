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

A server judges client keys only while it can show that its table is the registry's
current one (:class:`RegistryLease`): a server stopped, paused or cut off from ZooKeeper
would otherwise go on serving a key removed meanwhile. Past its lease it judges no client
key at all (:meth:`AccessTable.lapse_refusal`) until it has checked the registry again.
"""

from __future__ import annotations

from typing import Callable, Iterable

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

#: what a client hears from a server whose registry lease lapsed (REGISTRY_LAPSED)
LAPSED = ("this server cannot show that it holds the current client key registry (its registry lease lapsed: "
          "it was stopped, paused or cut off from ZooKeeper): it judges no client key until it has read the "
          "registry again; ask again")


class RegistryLease:
    """How long a server may go on judging client keys by the registry version it holds.

    Evidence that the table is current is a check of the registry in ZooKeeper that
    started at ``started`` (this process's clock, monotonic) and found the registry at a
    version the table holds (or older), after a ``sync`` and after finding the process's
    own confirmation node alive in the same session. Such a check holds the table good
    until ``started + lease_ns``: a change committed later than ``started`` would have
    been seen. ``ziplog client remove`` relies on it: a server that did not confirm the
    new version judges no key by the old one once ``lease_ns`` (and a margin for clock
    rates) has passed since the change was committed. Never held until the first
    renewal; :meth:`drop` ends it at once (the session is gone)."""

    __slots__ = ("lease_ns", "clock", "until")

    def __init__(self, lease_ns: int, clock: Callable[[], int]) -> None:
        if lease_ns <= 0:
            raise ValueError("a registry lease is longer than 0")
        self.lease_ns = lease_ns
        #: the process's monotonic clock, in nanoseconds (the checks' ``started`` too)
        self.clock = clock
        #: held while ``clock() < until`` (None: never held, or dropped)
        self.until: int | None = None

    def renew(self, started: int, seen: int, held: int) -> bool:
        """A check that started at ``started`` saw the registry at version ``seen``, and
        the table holds ``held``: the lease runs to ``started + lease_ns`` if the table is
        at least as recent as what was seen (a later change may be on its way to it: not
        evidence then). Whether it was renewed."""
        if seen > held:
            return False
        until = started + self.lease_ns
        if self.until is None or until > self.until:
            self.until = until
        return True

    def holds(self) -> bool:
        until = self.until
        return until is not None and self.clock() < until

    def drop(self) -> None:
        self.until = None


class AccessTable:
    """Rights by public key: the member's, and the registry's (at ``version``)."""

    __slots__ = ("member", "version", "lease", "_rights", "_names")

    def __init__(self, member: bytes, lease: RegistryLease | None = None) -> None:
        self.member = member
        #: the registry version loaded (-1: none yet: only the member may act)
        self.version = -1
        #: while it lapses no client key is judged (None: no lease: a test's table)
        self.lease = lease
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

    def lapse_refusal(self, key: bytes | None, needed: Right | None) -> str | None:
        """Why a request of ``key`` that needs ``needed`` cannot be judged now (None: it
        can): the lease lapsed. The cluster's own key, a connection without a key (never
        served) and a request that needs no right are not held up by it: their answer
        does not come from the registry."""
        lease = self.lease
        if needed is None or lease is None or key is None or key == self.member or lease.holds():
            return None
        return LAPSED

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
