"""Where the LogBook index tier lives in ZooKeeper, through kazoo.

Under ``/ziplog/logbook/tier`` (a cluster path: only members write, anyone reads):

* the node itself: ``{"nodes": N}``, how many index nodes the operator wants (it only
  grows: nodes are added, never removed);
* ``assignment``: ``{"history": [[first_epoch, nodes], ...]}``, the versioned epoch
  assignment (epoch ``e``'s entries are on node ``e % nodes``); only the feeder writes it,
  with ZooKeeper's version as a compare-and-set, at an epoch nothing was routed in yet;
* ``nodes/<i>``: ephemeral ``{"addr": ..., "pid": ...}`` of index node ``i``;
* ``aggregators/<id>``: ephemeral ``{"addr": ..., "pid": ...}`` of each aggregator.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, KazooException, NodeExistsError, NoNodeError

from ziplog.protocol.layout import dec, enc

log = logging.getLogger("ziplog.logbook")

TIER = "/ziplog/logbook/tier"
ASSIGNMENT = f"{TIER}/assignment"
NODES = f"{TIER}/nodes"
AGGREGATORS = f"{TIER}/aggregators"

History = list[tuple[int, int]]


def ensure_tier(zk: KazooClient, nodes: int | None = None) -> None:
    """Create the tier's nodes (with ``nodes`` wanted, or 1); with ``nodes``, raise the
    wanted count to it."""
    zk.ensure_path(NODES)
    zk.ensure_path(AGGREGATORS)
    try:
        zk.create(ASSIGNMENT, enc({"history": [[0, max(nodes or 1, 1)]]}))
    except NodeExistsError:
        pass
    if nodes is not None:
        set_desired(zk, nodes)


def desired(zk: KazooClient) -> int:
    meta = dec(zk.get(TIER)[0]) or {}
    n = meta.get("nodes") if isinstance(meta, dict) else None
    return n if type(n) is int and n >= 1 else 1


def desired_or_none(zk: KazooClient) -> int | None:
    """:func:`desired`, or None when it cannot be read now."""
    try:
        return desired(zk)
    except KazooException:
        return None


def set_desired(zk: KazooClient, nodes: int) -> None:
    """Want at least ``nodes`` index nodes (the feeder adds them to the assignment)."""
    while True:
        data, stat = zk.get(TIER)
        meta = dec(data) if data else {}
        have = meta.get("nodes") if isinstance(meta, dict) else None
        if type(have) is int and have >= nodes:
            return
        try:
            zk.set(TIER, enc({"nodes": nodes}), version=stat.version)
            return
        except BadVersionError:
            continue


def _history(data: bytes | None) -> History | None:
    meta = dec(data) if data else None
    raw = meta.get("history") if isinstance(meta, dict) else None
    if not isinstance(raw, list) or not raw:
        return None
    try:
        out = [(int(a), int(b)) for a, b in raw]
    except (TypeError, ValueError):
        return None
    return out if out[0][0] == 0 and all(n >= 1 for _, n in out) else None


def read_assignment(zk: KazooClient) -> tuple[History, int]:
    zk.sync(ASSIGNMENT)
    data, stat = zk.get(ASSIGNMENT)
    history = _history(data)
    if history is None:
        raise RuntimeError(f"the index tier's assignment at {ASSIGNMENT} is unreadable: {data!r}")
    return history, stat.version


def write_assignment(zk: KazooClient, history: History, version: int) -> tuple[History, int]:
    """Write ``history`` if the assignment is still at ``version``; what ZooKeeper holds
    after (another feeder's history if it wrote first)."""
    try:
        stat = zk.set(ASSIGNMENT, enc({"history": [list(h) for h in history]}), version=version)
        return history, stat.version
    except BadVersionError:
        return read_assignment(zk)


class TierDirectory:
    """Where the tier is now, kept current by watches: the index nodes' addresses, the
    aggregators', the assignment history, and the wanted node count. ``on_change`` is
    called (on kazoo's thread) after each change."""

    def __init__(self, zk: KazooClient, on_change: Callable[[], None] = lambda: None) -> None:
        self.zk = zk
        self.on_change = on_change
        self._lock = threading.Lock()
        self._nodes: dict[int, str] = {}
        self._aggregators: list[str] = []
        self.history: History | None = None
        self.wanted = 1
        zk.DataWatch(ASSIGNMENT, self._on_assignment)
        zk.DataWatch(TIER, self._on_tier)
        zk.ChildrenWatch(NODES, self._on_nodes, allow_session_lost=True)
        zk.ChildrenWatch(AGGREGATORS, self._on_aggregators, allow_session_lost=True)

    def _on_assignment(self, data: bytes | None, stat: Any) -> None:
        history = _history(data)
        if history is not None:
            with self._lock:
                self.history = history
            self.on_change()

    def _on_tier(self, data: bytes | None, stat: Any) -> None:
        meta = dec(data) if data else None
        n = meta.get("nodes") if isinstance(meta, dict) else None
        if type(n) is int:
            self.wanted = n
            self.on_change()

    def _addr(self, path: str) -> str | None:
        try:
            meta = dec(self.zk.get(path)[0]) or {}
        except (NoNodeError, KazooException):
            return None
        addr = meta.get("addr") if isinstance(meta, dict) else None
        return addr if isinstance(addr, str) else None

    def _on_nodes(self, kids: list[str]) -> None:
        nodes = {int(k): a for k in kids if k.isdigit() for a in [self._addr(f"{NODES}/{k}")] if a}
        with self._lock:
            self._nodes = nodes
        self.on_change()

    def _on_aggregators(self, kids: list[str]) -> None:
        addrs = [a for k in sorted(kids) for a in [self._addr(f"{AGGREGATORS}/{k}")] if a]
        with self._lock:
            self._aggregators = addrs
        self.on_change()

    def nodes(self) -> dict[int, str]:
        with self._lock:
            return dict(self._nodes)

    def aggregators(self) -> list[str]:
        with self._lock:
            return list(self._aggregators)

    def node_count(self) -> int:
        """The node count of the assignment now (0: none yet)."""
        with self._lock:
            return self.history[-1][1] if self.history else 0


def exists(zk: KazooClient) -> bool:
    """Whether an index tier was ever set up on this cluster."""
    try:
        return zk.exists(ASSIGNMENT) is not None
    except KazooException:
        return False
