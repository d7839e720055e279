"""Client rights at an app server's ROUTER (LogDB's coordinator and KV shards, LogBook's
index nodes and aggregators) under CURVE: the same registry and table as a storage
replica's (:mod:`ziplog.protocol.access`), so a key that may not read the log may not
read it through an app either (a KV shard's values, the index's gsns of a tag).

Every process that judges client keys (these and the storage processes) follows the
registry the same way (:func:`follow_registry`): its table is loaded before it serves and
replaced at every change, each load is confirmed in ZooKeeper, and the table is judged
by only under a registry lease (:class:`~ziplog.protocol.access.RegistryLease`) that a
check of ZooKeeper renews every fifth of it (:class:`LeaseKeeper`).

Under NULL (loopback without ``--curve``) there are no keys and nothing is checked, as
at a storage replica."""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, NamedTuple

from ziplog.protocol.access import AccessTable, RegistryLease
from ziplog.protocol.auth import ClusterKey
from ziplog.protocol.keys import ClientEntry, Right

log = logging.getLogger("ziplog.rights")

#: ``--registry-lease-s``'s default: how long a server judges client keys by the registry
#: version it last showed to be current. Shorter: a removal is certain sooner where a
#: server cannot confirm it (``ziplog client remove`` waits about this long for a server
#: that is stopped, paused or cut off from ZooKeeper), but a shorter outage of ZooKeeper
#: makes the servers refuse every client (REGISTRY_LAPSED) until they reach it again.
DEFAULT_REGISTRY_LEASE_S = 5.0
#: checks of the registry per lease: a check that fails (ZooKeeper slow, a leader
#: election) leaves this many - 1 more before the lease lapses
CHECKS_PER_LEASE = 5
#: a lease is at most this share of the ZooKeeper session's timeout: a server whose
#: session expired (its confirmation node gone, so ``ziplog client remove`` does not
#: wait for it) has then certainly been past its lease for a while
SESSION_SHARE = 0.5

#: one registry version loaded into a process's tables (on its runtime's thread)
Load = Callable[[list[ClientEntry], int], None]


def lease_clock() -> int:
    """The clock of registry leases, in nanoseconds: monotonic, and counting the time
    the machine was suspended (Linux's CLOCK_BOOTTIME; elsewhere the monotonic clock)."""
    return time.clock_gettime_ns(_LEASE_CLOCK)


_LEASE_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


class Refused(NamedTuple):
    """Why a request is refused: the lease lapsed (the apps answer BUSY: ask again), or
    the key's rights (FORBIDDEN)."""

    lapsed: bool
    why: str


#: (route, decoded request) -> why its sender may not make it now (None: it may)
Refusal = Callable[[bytes, object], "Refused | None"]


class RouterRights:
    """The table of the moment, judging each decoded request by the right its type
    needs (``needs``; a type not there needs none) and the key its connection's
    handshake vouched for (``peer_key`` of the route); while the table's lease has
    lapsed, judging no client key at all."""

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

    def refusal(self, route: bytes, req: object) -> Refused | None:
        needed = self.needs.get(type(req))
        if needed is None:
            return None
        key = self.peer_key(route)
        lapsed = self.table.lapse_refusal(key, needed)
        if lapsed is not None:
            self.refused += 1
            return Refused(True, lapsed)
        why = self.table.refusal_for(key, needed)
        if why is None:
            return None
        self.refused += 1
        return Refused(False, why)


def registry_lease_ns(lease_s: float, session_timeout_ms: int) -> int:
    """The lease a process keeps: ``lease_s``, at most SESSION_SHARE of its ZooKeeper
    session's timeout."""
    if lease_s <= 0:
        raise ValueError("--registry-lease-s must be more than 0")
    lease_ns = int(lease_s * 1e9)
    most = int(session_timeout_ms * 1_000_000 * SESSION_SHARE)
    if lease_ns > most:
        log.warning("a registry lease of %g s is more than %g of the ZooKeeper session's %d ms: keeping %d ms",
                    lease_s, SESSION_SHARE, session_timeout_ms, most // 1_000_000)
        return most
    return lease_ns


def follow_registry(zk_client: Any, key: ClusterKey, rt: Any, load: Load, server: str,
                    lease_s: float = DEFAULT_REGISTRY_LEASE_S) -> RegistryLease:
    """Load the client key registry now, with ``load`` (before the process serves: an
    empty table would refuse every client), and again on the runtime's thread at every
    change (the watch fires on kazoo's); confirm each load in ZooKeeper as ``server``
    (:class:`LoadConfirmer`), again whenever the session is new; and keep the lease
    under which the loaded tables may judge client keys (:class:`LeaseKeeper`): its
    first term starts now. Give the lease to every table ``load`` fills."""
    from ziplog.io.zk_clients import ClientRegistry

    registry = ClientRegistry(zk_client, key)
    lease = RegistryLease(registry_lease_ns(lease_s, getattr(zk_client, "_session_timeout", 10_000)), lease_clock)
    LeaseKeeper(registry, rt, load, server, lease).start()
    return lease


class LeaseKeeper:
    """Loads the registry into the process's tables, and renews their lease: every
    ``lease / CHECKS_PER_LEASE`` (and at once when the registry changes or the session
    is new) a thread of its own asks ZooKeeper (:meth:`ClientRegistry.current`) whether
    this process's confirmation node is its session's and which version the registry
    is at; the runtime's thread then renews the lease from the check's start, if its
    tables hold that version (a newer one is loaded first). A check that fails renews
    nothing: past its lease the process judges no client key until a check succeeds. A
    session that expired drops the lease at once. The lease, the tables and what they
    hold are touched on the runtime's thread only (after :meth:`start`)."""

    def __init__(self, registry: Any, rt: Any, load: Load, server: str, lease: RegistryLease) -> None:
        self.registry = registry
        self.rt = rt
        self.load = load
        self.server = server
        self.lease = lease
        self.lease_ms = lease.lease_ns // 1_000_000
        self.confirmer = LoadConfirmer(registry, server, self.lease_ms)
        #: the registry version the tables hold (the runtime's thread writes it; the
        #: checking thread reads it only to know whether to fetch the entries)
        self.held = -1
        self._cond = threading.Condition()
        self._soon = False
        #: the last check failed (its trouble was logged)
        self._failing = False

    def start(self) -> None:
        """The node, then the first check and load, on the caller's thread before the
        process serves (the runtime does not run yet); then the watch and the thread."""
        registry = self.registry
        registry.confirm_loaded(self.server, -1, self.lease_ms)  # before the check, which looks for it
        started = self.lease.clock()
        version, entries = registry.current(self.server, self.held)
        assert entries is not None  # held is -1: a registry node's version is 0 or more
        self._loaded(entries, version)
        self.lease.renew(started, version, self.held)
        registry.on_connected(self._on_connected)
        registry.on_lost(lambda: self.rt.call_soon_threadsafe(self.lease.drop))

        def changed(entries: list[ClientEntry], version: int) -> None:
            self.rt.call_soon_threadsafe(functools.partial(self._loaded, entries, version))
            self.soon()  # and renew the lease for it

        registry.watch(changed)
        threading.Thread(target=self._run, name=f"registry-lease-{self.server}", daemon=True).start()

    def soon(self) -> None:
        """Check now, not at the next interval."""
        with self._cond:
            self._soon = True
            self._cond.notify()

    def _on_connected(self) -> None:
        self.confirmer.again()  # a new session has no ephemeral node: say it again
        self.soon()

    def _loaded(self, entries: list[ClientEntry], version: int) -> None:
        """(the runtime's thread) A registry version for the tables; an older one than
        they hold is ignored (watches may deliver out of order after a reconnect)."""
        if version < self.held:
            return
        self.held = version
        self.load(entries, version)
        self.confirmer.loaded(version)

    def _renew(self, started: int, version: int, entries: list[ClientEntry] | None) -> None:
        """(the runtime's thread) A check that started at ``started`` saw ``version``."""
        if entries is not None:
            self._loaded(entries, version)
        lapsed = not self.lease.holds()
        if self.lease.renew(started, version, self.held) and lapsed:
            log.warning("registry lease renewed at version %d as %s: judging client keys again", version, self.server)

    def _run(self) -> None:
        from ziplog.io.zk_clients import LeaseEvidenceError

        interval = self.lease.lease_ns / CHECKS_PER_LEASE / 1e9
        registry = self.registry
        while registry.serving():
            with self._cond:
                self._cond.wait_for(lambda: self._soon, interval)
                self._soon = False
            started = self.lease.clock()
            try:
                version, entries = registry.current(self.server, self.held)
            except Exception as exc:  # ZooKeeper away, slow, or our node gone (several types)
                if not registry.serving():
                    return
                self._trouble(exc)
                if isinstance(exc, LeaseEvidenceError):
                    self.confirmer.again()  # write the node again, in this session
                continue
            if self._failing:
                self._failing = False
                log.info("the client key registry can be checked again (version %d)", version)
            self.rt.call_soon_threadsafe(functools.partial(self._renew, started, version, entries))

    def _trouble(self, exc: Exception) -> None:
        if not self._failing:
            self._failing = True
            log.warning("cannot check the client key registry as %s (%s: %s): without a check within its lease "
                        "(%d ms) this process refuses every client key (REGISTRY_LAPSED)", self.server,
                        type(exc).__name__, exc, self.lease_ms)


class LoadConfirmer:
    """Writes the registry version the server's table holds (and its lease) to its
    ZooKeeper node, on a thread of its own (the runtime's thread never waits for
    ZooKeeper); only the latest version is written, and a failed write is tried again a
    second later."""

    def __init__(self, registry: Any, server: str, lease_ms: int | None = None) -> None:
        self.registry = registry
        self.server = server
        self.lease_ms = lease_ms
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
            self._written = -2  # below -1: the node is written even before a version is loaded
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._want <= self._written:
                    self._cond.wait()
                want, session = self._want, self._session
            try:
                self.registry.confirm_loaded(self.server, want, self.lease_ms)
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


def router_rights(rt: Any, zk_client: Any, key: ClusterKey, needs: dict[type, Right], role: str,
                  lease_s: float = DEFAULT_REGISTRY_LEASE_S) -> RouterRights | None:
    """The rights an app server checks at its clients' ROUTER (bind it to the ROUTER
    before it serves): None under NULL (the runtime has no credentials), else a table
    loaded from the registry, followed, each load confirmed as ``role``'s, and judged by
    under a registry lease of ``lease_s`` (``--registry-lease-s``)."""
    if rt.credentials is None:
        return None
    table = AccessTable(rt.credentials.server.public)
    table.lease = follow_registry(zk_client, key, rt, table.load, server_name(role), lease_s)
    return RouterRights(table, needs)
