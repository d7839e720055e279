"""ZooKeeper through kazoo: the session, and a watched view of the topology (the layout
is :mod:`ziplog.protocol.layout`)."""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, KazooException, NoAuthError, NodeExistsError, NoNodeError
from kazoo.protocol.states import KazooState
from kazoo.security import ACL, Permissions, make_acl

from ziplog.io.election import Election
from ziplog.io.ports import CoordinationUnavailable
from ziplog.protocol.auth import ClusterKey
from ziplog.protocol.frames import READS
from ziplog.protocol.layout import (
    EPOCH_PATH,
    FH_REPLICAS,
    MEMBERSHIP_PATH,
    MMS_REPLICAS,
    RECOVERY,
    SHARDS,
    dec,
    enc,
)
from ziplog.protocol.topology import TopologyView

log = logging.getLogger("ziplog.zk")


def cluster_acl(key: ClusterKey) -> list[ACL]:
    """What every node the cluster creates carries: anyone reads, only members write."""
    return [make_acl("world", "anyone", read=True), make_acl("digest", key.zk_digest_id, all=True)]


def members_acl(key: ClusterKey) -> list[ACL]:
    """What a members-only node carries (the client key registry, the recovery records):
    the cluster's digest alone, READ included."""
    return [make_acl("digest", key.zk_digest_id, all=True)]


#: The nodes a new ensemble lets anyone create children under (world:anyone ALL): its
#: root, and its own ``/zookeeper`` and ``/zookeeper/quota`` (absent in a chroot).
ROOT_NODES = ("/", "/zookeeper", "/zookeeper/quota")


def _locked(acl: list[ACL], key: ClusterKey) -> list[ACL] | None:
    """``acl`` with world:anyone cut down to READ and the cluster's digest given ALL, any
    other entry kept (an operator's); None when anyone may do no more than read already."""
    world = [a for a in acl if a.id.scheme == "world" and a.id.id == "anyone"]
    if all(a.perms & ~Permissions.READ == 0 for a in world):
        return None
    out = [make_acl("world", "anyone", read=True)] + [a for a in acl if a not in world]
    if not any(a.id.scheme == "digest" and a.id.id == key.zk_digest_id for a in out):
        out.append(make_acl("digest", key.zk_digest_id, all=True))
    return out


def lock_root(zk: KazooClient, key: ClusterKey) -> None:
    """Let only members create or delete nodes at the root of the cluster's ZooKeeper
    (``/`` of its sessions: the chroot node when the connection string names one) and
    under ZooKeeper's own ``/zookeeper`` and ``/zookeeper/quota``, which an ensemble
    leaves open to anyone too (a disk and memory denial of service); anyone still reads
    them. Every member session does it when it connects, before it creates anything:
    the first one of a new cluster locks the root. Idempotent: a node that lets anyone
    read only is left as it is, whatever else its ACL says."""
    for path in ROOT_NODES:
        for _attempt in range(10):
            try:
                acl, stat = zk.retry(zk.get_acls, path)
            except NoNodeError:
                break  # ZooKeeper's own nodes are not in a chroot's namespace
            locked = _locked(acl, key)
            if locked is None:
                break
            try:
                zk.retry(zk.set_acls, path, locked, version=stat.aversion)
            except BadVersionError:
                continue  # another member changed it meanwhile: look again
            except NoAuthError:
                log.error("ZooKeeper's %s lets anyone create nodes under it, and this cluster may not change its "
                          "ACL: set it by hand to world:anyone READ and the cluster's digest ALL", path)
                break
            log.info("ZooKeeper's %s now takes new nodes from the cluster's members only", path)
            break


def connect(hosts: str, timeout: float = 30.0, key: ClusterKey | None = None) -> KazooClient:
    """A started session; with the cluster's ``key``, authenticated as a member, every
    node it creates writable by members only, and the root locked (:func:`lock_root`)
    before it returns (a client connects without one, and reads)."""
    # Reconnect forever, but give up on a single command after a few tries: an endless
    # command retry inside a watch callback can block kazoo's shutdown for good.
    member: dict[str, Any] = {} if key is None else {"auth_data": [key.zk_auth], "default_acl": cluster_acl(key)}
    zk = KazooClient(hosts=hosts, timeout=10.0, connection_retry={"max_tries": -1, "delay": 0.05, "max_delay": 1.0},
                     command_retry={"max_tries": 5, "delay": 0.05, "max_delay": 1.0}, **member)
    zk.start(timeout=timeout)
    # A session nobody stopped must not hang the process's exit. kazoo's own exit hook
    # stops only its callback threads, and joins them: one inside a watch callback,
    # waiting on a request to an ensemble that is gone (it reconnects forever), never
    # returns. Stopping the session first fails that request. (Registered after kazoo's
    # hook, so it runs before it.)
    hook = functools.partial(_stop_at_exit, weakref.ref(zk))
    with _exit_hooks_lock:
        # forget hooks of sessions stopped some other way (bounds this map by the
        # sessions alive)
        for hook_id, old in list(_exit_hooks.items()):
            gone = old.args[0]()
            if gone is None or not gone.handler.running:
                atexit.unregister(_exit_hooks.pop(hook_id))
        _exit_hooks[id(zk)] = hook
    atexit.register(hook)
    if key is not None:
        try:
            lock_root(zk, key)
        except BaseException:
            stop(zk)
            raise
    return zk


#: the exit hook of each session not stopped yet, by id of its client
_exit_hooks: dict[int, functools.partial[None]] = {}
_exit_hooks_lock = threading.Lock()


def _stop_at_exit(ref: weakref.ref[KazooClient]) -> None:
    zk = ref()
    if zk is None or not zk.handler.running:
        return  # stopped already
    log.warning("a ZooKeeper session was never stopped; stopping it at exit")
    stop(zk)


class _Stale(Exception):
    """A watch callback could not read what changed (the connection was lost past the
    command retries): the view is refreshed once the session is connected again."""


class Topology(TopologyView):
    """A live view of shards, their replicas' addresses, and the latest membership,
    kept current by ZooKeeper watches (callbacks in kazoo's thread replace whole
    fields, so readers on other threads never see a half-built view).

    A watch fires once per change: a callback that cannot read the nodes it was told
    of (ZooKeeper unreachable for longer than the command retries) would leave the
    view stale for good, a replica that registered again never seen. Reads are retried,
    and a callback that still fails marks the view stale; the next (re)connection
    re-reads every replica list and the control plane's (a busy machine's loaded
    ensemble drops connections: a client kept insisting a restarted shard was not live)."""

    def __init__(self, zk: KazooClient, create: bool = False) -> None:
        """``create``: make the parent nodes (a cluster member; a client only waits for
        them, since a node it created would be writable by anyone)."""
        super().__init__()
        self.zk = zk
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._watched_shards: set[int] = set()
        self._stale = False
        zk.add_listener(self._on_session_state)
        zk.DataWatch(MEMBERSHIP_PATH, self._on_membership)
        for path, fn in ((SHARDS, self._on_shards), (MMS_REPLICAS, self._on_mms), (FH_REPLICAS, self._on_fh)):
            if create:
                zk.ensure_path(path)
            self._watch_children(path, fn)

    def _watch_children(self, path: str, fn: Callable[[list[str]], None]) -> None:
        """A ChildrenWatch on ``path`` from when it exists (kazoo's needs the node)."""
        started = threading.Event()

        def arm(event: Any = None) -> None:
            if started.is_set():
                return
            try:
                exists = self.zk.exists(path, watch=arm)
            except Exception:  # the session is gone: nothing left to watch
                return
            if exists and not started.is_set():
                started.set()
                self.zk.ChildrenWatch(path, fn)

        arm()

    def changed(self) -> None:
        self._generation += 1
        self._live = None
        self._addrs = {}
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
            try:
                self._on_replicas(shard, kids)
            except _Stale:
                self._stale = True
        return watch

    def _read(self, path: str) -> bytes | None:
        """A node's data (None: it is gone), retried; _Stale if ZooKeeper stays away."""
        try:
            data, _ = self.zk.retry(self.zk.get, path)
        except NoNodeError:
            return None
        except KazooException as exc:
            raise _Stale(str(exc)) from exc
        return data  # type: ignore[no-any-return]

    def _read_owned(self, path: str) -> tuple[bytes, int] | None:
        """An ephemeral node's data and the session that owns it (None: it is gone)."""
        try:
            data, stat = self.zk.retry(self.zk.get, path)
        except NoNodeError:
            return None
        except KazooException as exc:
            raise _Stale(str(exc)) from exc
        return data, int(stat.ephemeralOwner)

    def _on_session_state(self, state: str) -> None:
        """kazoo's connection thread: never block it; re-read on a worker."""
        if state == KazooState.CONNECTED and self._stale:
            self.zk.handler.spawn(self._refresh)

    def _refresh(self) -> None:
        """Read again everything a failed callback may have missed."""
        self._stale = False
        try:
            for shard in list(self._watched_shards):
                self._on_replicas(shard, self.zk.retry(self.zk.get_children, f"{SHARDS}/{shard}"))
            self._on_mms(self.zk.retry(self.zk.get_children, MMS_REPLICAS))
            self._on_fh(self.zk.retry(self.zk.get_children, FH_REPLICAS))
        except (_Stale, KazooException):
            self._stale = True  # the next connection tries again

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
        self.changed()

    def _on_replicas(self, shard: int, kids: list[str]) -> None:
        addrs: dict[int, str] = {}
        owners: dict[int, int] = {}
        pids: dict[int, int] = {}
        reads: dict[int, int] = {}
        incs: dict[int, int] = {}
        clock: dict[int, int] = {}
        for k in kids:
            got = self._read_owned(f"{SHARDS}/{shard}/{k}")
            if got is None:
                continue
            data, owner = got
            info = dec(data) or {}
            if "addr" in info:
                addrs[int(k)] = info["addr"]
                owners[int(k)] = owner
                if type(info.get("pid")) is int:
                    pids[int(k)] = info["pid"]
                if type(info.get("reads")) is int:
                    reads[int(k)] = info["reads"]
                if type(info.get("inc")) is int:
                    incs[int(k)] = info["inc"]
                if type(info.get("clock")) is int:
                    clock[int(k)] = info["clock"]
        reps = dict(self.replicas)
        reps[shard] = addrs
        owned = dict(self.replica_owners)
        owned[shard] = owners
        by_pid = dict(self.replica_pids)
        by_pid[shard] = pids
        by_reads = dict(self.replica_reads)
        by_reads[shard] = reads
        by_inc = dict(self.replica_incs)
        by_inc[shard] = incs
        by_clock = dict(self.replica_clock)
        by_clock[shard] = clock
        self.replicas = reps
        self.replica_owners = owned
        self.replica_pids = by_pid
        self.replica_reads = by_reads
        self.replica_incs = by_inc
        self.replica_clock = by_clock
        self.changed()

    def _on_membership(self, data: bytes | None, stat: Any) -> None:
        self.history = dec(data) or []
        self.changed()

    def _read_children(self, parent: str, children: list[str]) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for c in children:
            data = self._read(f"{parent}/{c}")
            if data is not None:
                out[c] = dec(data) or {}
        return out

    def _on_mms(self, children: list[str]) -> None:
        try:
            self.mms = self._read_children(MMS_REPLICAS, children)
        except _Stale:
            self._stale = True
            return
        self.changed()

    def _on_fh(self, children: list[str]) -> None:
        try:
            self.fh = self._read_children(FH_REPLICAS, children)
        except _Stale:
            self._stale = True
            return
        self.changed()

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Block until ``predicate()`` holds (checked after every change) or ``timeout``."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout)


def stop(zk: KazooClient) -> None:
    """End a session (its ephemeral nodes go at once) without raising."""
    with _exit_hooks_lock:
        hook = _exit_hooks.pop(id(zk), None)
    if hook is not None:
        atexit.unregister(hook)
    try:
        zk.stop()
        zk.close()
    except Exception:
        pass


def read_membership_history(zk: KazooClient) -> list[list[Any]]:
    """The committed membership history, read fresh (after a sync): at least as new as
    anything a replica answered before this call."""
    try:
        zk.sync(MEMBERSHIP_PATH)
        data, _ = zk.get(MEMBERSHIP_PATH)
    except NoNodeError:
        return []
    return dec(data) or []


def register(zk: KazooClient, path: str, info: dict[str, Any]) -> None:
    """Create this process's ephemeral node at ``path`` (with its pid), replacing a stale
    one of its previous life."""
    try:
        zk.delete(path)
    except NoNodeError:
        pass
    zk.create(path, enc({**info, "pid": os.getpid()}), ephemeral=True, makepath=True)


class Session:
    """A process's ZooKeeper session, the topology it watches, and the ephemeral nodes
    that say it is up.

    A session can expire while the process lives (a partition longer than the session
    timeout): its ephemeral nodes are gone, and kazoo reconnects with a new session.
    kazoo's watches follow on their own; the registrations are made again here, so the
    process is found again (a storage replica's shard is live again) once it can reach
    ZooKeeper."""

    def __init__(self, zk_hosts: str, key: ClusterKey) -> None:
        self.key = key
        self.zk = connect(zk_hosts, key=key)
        self.topology = Topology(self.zk, create=True)
        #: path -> what this process registered there (made again after an expiry)
        self.registrations: dict[str, dict[str, Any]] = {}
        self._expired = False
        self.zk.add_listener(self._on_state)

    def on_change(self, fn: Callable[[], None]) -> None:
        self.topology.on_change(fn)

    def keep_registered(self, path: str, info: dict[str, Any]) -> None:
        """Register an ephemeral node at ``path``, and again after every session expiry."""
        self.registrations[path] = info
        register(self.zk, path, info)

    def _on_state(self, state: str) -> None:
        # A listener must not block kazoo's connection thread: the work is spawned.
        if state == KazooState.LOST:
            self._expired = True
        elif state == KazooState.CONNECTED and self._expired:
            self._expired = False
            self.zk.handler.spawn(self._register_again)

    def _register_again(self) -> None:
        for path, info in list(self.registrations.items()):
            for attempt in range(50):
                try:
                    register(self.zk, path, info)
                    break
                except Exception as exc:  # the connection may drop again: keep trying a while
                    if attempt == 49 or not self.zk.handler.running:
                        log.error("could not register %s again after the session expired: %s", path, exc)
                        break
                    time.sleep(0.1)
        log.warning("ZooKeeper session expired and was renewed: registered %s again", sorted(self.registrations))

    def close(self) -> None:
        self.registrations.clear()
        stop(self.zk)


class StorageCoordination(Session):
    """A storage replica's ZooKeeper: its registration, the topology it watches, and
    fresh reads of the membership history (the ``StorageCoordination`` port)."""

    def register_replica(self, shard: int, replica: int, replicas: int, addr: str, clock: int = 0,
                         inc: int = 0) -> None:
        shard_path = f"{SHARDS}/{shard}"
        try:
            self.zk.create(shard_path, enc({"replicas": replicas}), makepath=True)
        except NodeExistsError:
            pass
        self.keep_registered(f"{shard_path}/{replica}", {"addr": addr, "reads": READS, "clock": clock, "inc": inc})

    def registered_pid(self, shard: int, replica: int) -> int | None:
        """The pid in the replica's registration (None: not registered, or no pid)."""
        path = f"{SHARDS}/{shard}/{replica}"
        try:
            self.zk.sync(path)
            data, _ = self.zk.get(path)
        except NoNodeError:
            return None
        info = dec(data)
        pid = info.get("pid") if isinstance(info, dict) else None
        return pid if type(pid) is int else None

    def membership_history(self) -> list[list[Any]]:
        try:
            self.zk.sync(MEMBERSHIP_PATH)
            data, _ = self.zk.get(MEMBERSHIP_PATH)
        except KazooException as exc:
            raise CoordinationUnavailable(f"reading the membership history: {exc!r}") from exc
        return dec(data) or []

    def epoch_block(self) -> Any:
        try:
            self.zk.sync(EPOCH_PATH)
            data, _ = self.zk.get(EPOCH_PATH)
        except NoNodeError:
            return None
        except KazooException as exc:
            raise CoordinationUnavailable(f"reading the epoch block: {exc!r}") from exc
        return dec(data)

    def recovery_generation(self, shard: int) -> int:
        path = f"{RECOVERY}/{shard}"
        try:
            self.zk.sync(path)
            data, _ = self.zk.get(path)
        except NoNodeError:
            return -1
        except KazooException as exc:
            raise CoordinationUnavailable(f"reading the recovery record of shard {shard}: {exc!r}") from exc
        head = dec(data)  # a chunked record's head names its generation too
        gen = head.get("gen") if isinstance(head, dict) else None
        return gen if type(gen) is int else -1


class ElectedSession(Session):
    """The session of a control-plane replica: with the election it contends in."""

    def __init__(self, zk_hosts: str, key: ClusterKey, rt: Any, bind: str = "127.0.0.1",
                 advertise: str | None = None) -> None:
        super().__init__(zk_hosts, key)
        # ``bind``/``advertise``: where a leader's death-watch port listens, and the host
        # it names for the followers (the process's own --bind/--advertise)
        self.election = Election(self.zk, rt, bind, advertise)

    def close(self) -> None:
        self.election.close()
        super().close()
