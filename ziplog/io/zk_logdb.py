"""Where a LogDB lives in ZooKeeper, through kazoo: its node, its processes'
registrations, their collection positions, and a client's watched view of it.

Under ``/ziplog/logdb/<name>`` (a cluster path: only members write, anyone reads):

* the node itself: ``{"kv_shards": N}``, fixed by the first process that starts (a KV
  shard started with another N refuses to run);
* ``election/``: the coordinator replicas contend here; the lowest leads;
* ``coordinators/<id>``: ephemeral ``{"addr": ..., "pid": ...}`` of each coordinator replica;
* ``kv/<i>``: ephemeral ``{"addr": ..., "pid": ...}`` of KV shard i;
* ``gc/<who>``: persistent ``{"position": P}``: ``who`` (``coordinator-<id>``,
  ``kv-<i>``) has a durable snapshot at P and could replay from P + 1. The coordinator
  leader trims the log below the smallest of them (all N KV shards and every
  coordinator replica that ever published must have one: a replica retired for good
  must have its node removed, or it holds collection back): see
  ``ziplog.logdb.coordinator.collectable``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NodeExistsError, NoNodeError
from kazoo.protocol.states import KazooState

from ziplog.protocol.layout import dec, enc

log = logging.getLogger("ziplog.logdb")

ROOT = "/ziplog/logdb"
SUBDIRS = ("election", "coordinators", "kv", "gc")


def db_path(name: str) -> str:
    if not name or "/" in name:
        raise ValueError(f"bad LogDB name {name!r}")
    return f"{ROOT}/{name}"


def ensure_db(zk: KazooClient, name: str, kv_shards: int) -> None:
    """Create the LogDB's node with its shard count, or check the count it has."""
    path = db_path(name)
    zk.ensure_path(ROOT)
    # the node and its children in one transaction: a client that sees the node finds
    # the children to watch
    tx = zk.transaction()
    tx.create(path, enc({"kv_shards": kv_shards}))
    for sub in SUBDIRS:
        tx.create(f"{path}/{sub}")
    results = tx.commit()
    if any(isinstance(r, Exception) and not isinstance(r, NodeExistsError) for r in results):
        if not zk.exists(path):
            raise RuntimeError(f"could not create LogDB {name!r}: {results}")
    have = dec(zk.get(path)[0]) or {}
    if have.get("kv_shards") != kv_shards:
        raise SystemExit(f"LogDB {name!r} has {have.get('kv_shards')} KV shards, not {kv_shards}")
    for sub in SUBDIRS:
        zk.ensure_path(f"{path}/{sub}")


def publish_gc(zk: KazooClient, name: str, who: str, position: int) -> None:
    """Say (without waiting) that ``who`` could replay from ``position`` + 1."""
    path = f"{db_path(name)}/gc/{who}"
    data = enc({"position": position})

    def done(reply: Any) -> None:
        try:
            reply.get()
        except NoNodeError:
            zk.create_async(path, data)
        except Exception as exc:  # the next snapshot publishes again
            log.warning("could not publish the collection position of %s: %r", who, exc)

    try:
        zk.set_async(path, data).rawlink(done)
    except KazooException as exc:
        log.warning("could not publish the collection position of %s: %r", who, exc)


def gc_positions(zk: KazooClient, name: str) -> tuple[dict[str, int], int | None]:
    """Every published collection position (who -> position) and the LogDB's KV shard
    count (None: unreadable); the apps decide from them where the log may be trimmed."""
    path = db_path(name)
    shards = (dec(zk.get(path)[0]) or {}).get("kv_shards")
    positions: dict[str, int] = {}
    for who in zk.get_children(f"{path}/gc"):
        try:
            meta = dec(zk.get(f"{path}/gc/{who}")[0]) or {}
        except NoNodeError:
            continue
        if type(meta.get("position")) is int:
            positions[who] = meta["position"]
    return positions, shards if isinstance(shards, int) else None


class Directory:
    """A client's view of one LogDB: its KV shard count, its coordinators (leader first)
    and its KV shards' addresses, kept current by ZooKeeper watches."""

    def __init__(self, zk: KazooClient, name: str, timeout: float = 30.0) -> None:
        self.zk = zk
        self.path = db_path(name)
        self._cond = threading.Condition()
        self._coordinators: list[str] = []
        self._kv: dict[int, str] = {}
        self.kv_shards = 0
        ready = threading.Event()

        def on_meta(data: bytes | None, stat: Any) -> bool:
            meta = dec(data) if data else None
            if meta and isinstance(meta.get("kv_shards"), int):
                self.kv_shards = meta["kv_shards"]
                ready.set()
                return False  # fixed for good
            return True

        zk.DataWatch(self.path, on_meta)
        if not ready.wait(timeout):
            raise NoNodeError(f"no LogDB at {self.path} (start its coordinators and KV shards)")
        #: a watch callback could not read what changed: read it all again on reconnecting
        self._stale = False
        zk.add_listener(self._on_session_state)
        zk.ChildrenWatch(f"{self.path}/election", lambda kids: self._refresh_coordinators())
        zk.ChildrenWatch(f"{self.path}/coordinators", lambda kids: self._refresh_coordinators())
        zk.ChildrenWatch(f"{self.path}/kv", self._on_kv)

    def _on_session_state(self, state: str) -> None:
        if state == KazooState.CONNECTED and self._stale:
            self._stale = False
            self.zk.handler.spawn(self._refresh_all)

    def _refresh_all(self) -> None:
        self._refresh_coordinators()
        try:
            self._on_kv(self.zk.retry(self.zk.get_children, f"{self.path}/kv"))
        except KazooException:
            self._stale = True

    def _read_addr(self, path: str) -> str | None:
        """A registration's address (None: gone), retried; a read that still fails marks
        the directory stale (a watch fires once per change: it would stay wrong)."""
        try:
            meta = dec(self.zk.retry(self.zk.get, path)[0]) or {}
        except NoNodeError:
            return None
        except KazooException:
            self._stale = True
            return None
        addr = meta.get("addr")
        return addr if isinstance(addr, str) else None

    def _refresh_coordinators(self) -> None:
        try:
            order = self.zk.retry(self.zk.Election(f"{self.path}/election").contenders)
            ids = self.zk.retry(self.zk.get_children, f"{self.path}/coordinators")
        except KazooException:
            self._stale = True
            return
        addrs = {i: self._read_addr(f"{self.path}/coordinators/{i}") for i in ids}
        ranked = [addrs[i] for i in order if addrs.get(i)]
        ranked += [a for i, a in sorted(addrs.items()) if a and i not in order]
        with self._cond:
            self._coordinators = [a for a in ranked if a is not None]
            self._cond.notify_all()

    def _on_kv(self, kids: list[str]) -> None:
        kv: dict[int, str] = {}
        for k in kids:
            addr = self._read_addr(f"{self.path}/kv/{k}")
            if addr is not None and k.isdigit():
                kv[int(k)] = addr
        with self._cond:
            self._kv = kv
            self._cond.notify_all()

    def coordinators(self) -> list[str]:
        """Coordinator addresses, the leader first."""
        with self._cond:
            return list(self._coordinators)

    def kv_addr(self, shard: int) -> str | None:
        with self._cond:
            return self._kv.get(shard)

    def wait(self, what: str, timeout: float) -> bool:
        """Wait until some coordinator (``what="coordinator"``) or every KV shard
        (``"kv"``) is registered."""
        def ok() -> bool:
            if what == "coordinator":
                return bool(self._coordinators)
            return all(i in self._kv for i in range(self.kv_shards))
        with self._cond:
            return self._cond.wait_for(ok, timeout)
