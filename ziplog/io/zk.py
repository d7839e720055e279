"""ZooKeeper through kazoo: the session, and a watched view of the topology (the layout
is :mod:`ziplog.protocol.layout`)."""

from __future__ import annotations

import threading
from typing import Any, Callable

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from ziplog.protocol.layout import (EPOCH_PATH, FH_REPLICAS, FH_ROOT, MEMBERSHIP_PATH, MMS_ELECTION, MMS_REPLICAS,  # noqa: F401
                                    RECOVERY, ROOT, SHARDS, dec, enc, fh_election_path)
from ziplog.protocol.membership import history_ranges, members_in_history  # noqa: F401


def connect(hosts: str, timeout: float = 30.0) -> KazooClient:
    # Reconnect forever, but give up on a single command after a few tries: an endless
    # command retry inside a watch callback can block kazoo's shutdown for good.
    zk = KazooClient(hosts=hosts, timeout=10.0, connection_retry={"max_tries": -1, "delay": 0.05, "max_delay": 1.0},
                     command_retry={"max_tries": 5, "delay": 0.05, "max_delay": 1.0})
    zk.start(timeout=timeout)
    return zk


class Topology:
    """A live view of shards, their replicas' addresses, and the latest membership.

    Kept current by ZooKeeper watches (callbacks in kazoo's thread replace whole
    dicts, so readers on other threads never see a half-built view)."""

    def __init__(self, zk: KazooClient) -> None:
        self.zk = zk
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.replicas: dict[int, dict[int, str]] = {}  # shard -> replica -> addr
        self.replica_counts: dict[int, int] = {}
        self.removed: frozenset[int] = frozenset()
        self.recovering: frozenset[int] = frozenset()
        self.fh: dict[str, dict[str, str]] = {}
        self.history: list[list[Any]] = []
        self.mms: dict[str, dict[str, str]] = {}
        self._watched_shards: set[int] = set()
        self._listeners: list[Callable[[], None]] = []
        zk.ensure_path(SHARDS)
        zk.ensure_path(MMS_REPLICAS)
        zk.ChildrenWatch(SHARDS, self._on_shards)
        zk.DataWatch(MEMBERSHIP_PATH, self._on_membership)
        zk.ChildrenWatch(MMS_REPLICAS, self._on_mms)
        zk.ensure_path(FH_REPLICAS)
        zk.ChildrenWatch(FH_REPLICAS, self._on_fh)

    def on_change(self, fn: Callable[[], None]) -> None:
        self._listeners.append(fn)

    def _changed(self) -> None:
        self._generation += 1
        self._live = None
        with self._cond:
            self._cond.notify_all()
        for fn in list(self._listeners):
            fn()

    def _on_shards(self, children: list[str]) -> None:
        for c in children:
            s = int(c)
            if s in self._watched_shards:
                continue
            self._watched_shards.add(s)
            # kazoo counts a watcher's parameters to decide what to pass, so the shard id
            # is bound by a closure, not a default argument.
            self.zk.DataWatch(f"{SHARDS}/{c}", self._meta_watcher(s))
            self.zk.ChildrenWatch(f"{SHARDS}/{c}", self._replicas_watcher(s))

    def _meta_watcher(self, shard: int) -> Callable[[bytes | None, Any], None]:
        def watch(data: bytes | None, stat: Any) -> None:
            self._on_shard_meta(shard, data)
        return watch

    def _replicas_watcher(self, shard: int) -> Callable[[list[str]], None]:
        def watch(kids: list[str]) -> None:
            self._on_replicas(shard, kids)
        return watch

    def _on_shard_meta(self, shard: int, data: bytes | None) -> None:
        meta = dec(data) or {}
        counts = dict(self.replica_counts)
        counts[shard] = int(meta.get("replicas", 0))
        self.replica_counts = counts
        if meta.get("removed") and shard not in self.removed:
            self.removed = self.removed | {shard}
        if meta.get("recovering") is not None:
            self.recovering = self.recovering | {shard}
        else:
            self.recovering = self.recovering - {shard}
        self._changed()

    def _on_replicas(self, shard: int, kids: list[str]) -> None:
        addrs: dict[int, str] = {}
        for k in kids:
            try:
                data, _ = self.zk.get(f"{SHARDS}/{shard}/{k}")
            except NoNodeError:
                continue
            info = dec(data) or {}
            if "addr" in info:
                addrs[int(k)] = info["addr"]
        reps = dict(self.replicas)
        reps[shard] = addrs
        self.replicas = reps
        self._changed()

    def _on_membership(self, data: bytes | None, stat: Any) -> None:
        self.history = dec(data) or []
        self._changed()

    def _read_children(self, parent: str, children: list[str]) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for c in children:
            try:
                data, _ = self.zk.get(f"{parent}/{c}")
            except NoNodeError:
                continue
            out[c] = dec(data) or {}
        return out

    def _on_mms(self, children: list[str]) -> None:
        self.mms = self._read_children(MMS_REPLICAS, children)
        self._changed()

    def _on_fh(self, children: list[str]) -> None:
        self.fh = self._read_children(FH_REPLICAS, children)
        self._changed()

    # -- queries ------------------------------------------------------------------------------
    _live: list[int] | None = None
    _generation = 0

    @property
    def generation(self) -> int:
        """Counts changes to this view: read it before reading the view, and a later
        change shows as a different value (a watch updates the view first, then this)."""
        return self._generation

    def live_shards(self) -> list[int]:
        """Shards in the latest membership whose replicas are all registered (cached until
        ZooKeeper says something changed: this is on every insert's path)."""
        live = self._live
        if live is None:
            gen = self._generation
            members = self.history[-1][1] if self.history else []
            out = self.removed | self.recovering
            live = [s for s in members if s not in out and self.shard_complete(s)]
            if gen == self._generation:  # no change raced with us: safe to keep
                self._live = live
        return live

    def shard_complete(self, shard: int) -> bool:
        n = self.replica_counts.get(shard, 0)
        addrs = self.replicas.get(shard, {})
        return n > 0 and all(i in addrs for i in range(n))

    def replica_addrs(self, shard: int) -> list[str] | None:
        n = self.replica_counts.get(shard, 0)
        addrs = self.replicas.get(shard, {})
        if n == 0 or any(i not in addrs for i in range(n)):
            return None
        return [addrs[i] for i in range(n)]

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(predicate, timeout)
