"""ZooKeeper as a shared log: every record is a sequential znode under ``/log``.

``create("/log/r-", data, sequence=True)`` is the textbook way to get a totally ordered,
replicated append out of ZooKeeper: the leader assigns the suffix from the parent's
child counter, and the create is acknowledged once a quorum logged it (with
``forceSync=yes``, ZooKeeper's default, each server fsyncs its transaction log first).
The ensemble is our own 3-node one from :mod:`ziplog.tools.zk_ensemble` (the same Debian
package, JVM flags and zoo.cfg ziplog's own coordination runs on), separate from any
ziplog cluster, so the two never compete for one ZooKeeper.

ZooKeeper keeps its whole data tree in the JVM heap, so the number of records a run can
append is bounded by the heap (``heap_mb`` per node; about 4.5 KiB per 4 KiB record).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

from ziplog.tools.zk_ensemble import (
    ZooKeeperEnsemble,
    ZooKeeperNotInstalled,
    find_zookeeper_classpath,
    four_letter_word,
)

from .base import ClientSpec, System, Unavailable
from .servers import make_temp_dir, remove_temp_dir

#: the parent znode of every record; children are ``r-<10-digit sequence>``
LOG_PATH = "/log"
_KAZOO_HINT = "kazoo is not importable: pip install kazoo (a dependency of ziplog)"


def _kazoo() -> Any:
    try:
        import kazoo.client
    except ImportError as e:
        raise Unavailable(_KAZOO_HINT) from e
    return kazoo.client


def sequence_of(path: str) -> int:
    """The sequence number ZooKeeper appended to a created path ("/log/r-0000000042" -> 42)."""
    return int(path[path.rindex("-") + 1 :])


def _connect(hosts: str, timeout: float) -> Any:
    """A started KazooClient; stopped again if the session cannot be established."""
    client = _kazoo().KazooClient(hosts=hosts, timeout=timeout)
    try:
        client.start(timeout=timeout)
    except BaseException:
        client.stop()
        client.close()
        raise
    return client


def _disconnect(client: Any) -> None:
    client.stop()
    client.close()


class ZooKeeperAppender:
    """Blocking appends through kazoo (its I/O thread does the network; we wait)."""

    def __init__(self, hosts: str, timeout: float) -> None:
        self._client = _connect(hosts, timeout)
        self._prefix = LOG_PATH + "/r-"

    def append(self, data: bytes) -> int:
        return sequence_of(self._client.create(self._prefix, data, sequence=True))

    def close(self) -> None:
        _disconnect(self._client)


class AsyncZooKeeperAppender:
    """Appends through ``create_async``; kazoo's completion callback (on kazoo's
    callback thread) resolves an asyncio future via ``call_soon_threadsafe``, so any
    number of creates can be in flight on the one session."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._prefix = LOG_PATH + "/r-"

    async def append(self, data: bytes) -> int:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[str] = loop.create_future()

        def settle(result: Any) -> None:  # on kazoo's callback thread
            loop.call_soon_threadsafe(_resolve, future, result)

        self._client.create_async(self._prefix, data, sequence=True).rawlink(settle)
        return sequence_of(await future)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, _disconnect, self._client)


def _resolve(future: "asyncio.Future[str]", result: Any) -> None:
    """Copy a finished kazoo AsyncResult into an asyncio future (on the loop's thread)."""
    if future.done():  # the awaiting task was cancelled
        return
    if result.successful():
        future.set_result(result.value)
    else:
        future.set_exception(result.exception)


def open_sync(hosts: str, timeout: float = 10.0) -> ZooKeeperAppender:
    return ZooKeeperAppender(hosts, timeout)


async def open_async(hosts: str, timeout: float = 10.0) -> AsyncZooKeeperAppender:
    # KazooClient.start blocks until the session exists: keep it off the event loop.
    client = await asyncio.get_running_loop().run_in_executor(None, _connect, hosts, timeout)
    return AsyncZooKeeperAppender(client)


class ZooKeeperSystem(System):
    """A ``nodes``-server ZooKeeper ensemble on loopback; appends are sequential znodes."""

    name = "ZooKeeper"

    def __init__(
        self,
        nodes: int = 3,
        force_sync: bool = True,
        heap_mb: int = 1024,
        data_parent: str | None = None,
        start_timeout: float = 60.0,
        session_timeout: float = 10.0,
    ) -> None:
        self.nodes = nodes
        self.force_sync = force_sync
        self.heap_mb = heap_mb
        self.data_parent = data_parent
        self.start_timeout = start_timeout
        self.session_timeout = session_timeout
        self.ensemble: ZooKeeperEnsemble | None = None
        self._dir: Path | None = None
        self._version = "unknown"

    def start(self) -> None:
        _kazoo()
        try:
            find_zookeeper_classpath()
        except ZooKeeperNotInstalled as e:
            raise Unavailable(f"ZooKeeper not installed: {e}") from e
        self._dir = make_temp_dir("bench-zookeeper-", self.data_parent)
        # ziplog's JVM flags, with the heap raised: the data tree holds every record.
        flags = [f for f in ZooKeeperEnsemble.DEFAULT_JVM_FLAGS if not f.startswith("-Xmx")]
        flags.append(f"-Xmx{self.heap_mb}m")
        self.ensemble = ZooKeeperEnsemble(self._dir, size=self.nodes, force_sync=self.force_sync, jvm_flags=flags)
        try:
            self.ensemble.start(timeout=self.start_timeout)
        except ZooKeeperNotInstalled as e:
            raise Unavailable(f"ZooKeeper not installed: {e}") from e
        except RuntimeError as e:
            raise Unavailable(f"ZooKeeper ensemble did not start: {e}") from e
        self._version = self._read_version()
        try:
            client = _connect(self.ensemble.hosts, self.session_timeout)
            try:
                client.ensure_path(LOG_PATH)
            finally:
                _disconnect(client)
        except Exception as e:
            raise Unavailable(f"ZooKeeper ensemble runs but a client could not create {LOG_PATH}: {e!r}") from e

    def _read_version(self) -> str:
        """The version the running server reports ("Zookeeper version: 3.8.0-...")."""
        assert self.ensemble is not None
        reply = four_letter_word("127.0.0.1", self.ensemble.client_port(0), "srvr") or ""
        m = re.search(r"version: ([0-9][0-9.]*[0-9])", reply)
        if m:
            return m.group(1)
        m = re.search(r"zookeeper-([0-9.]+)\.jar", find_zookeeper_classpath())
        return m.group(1) if m else "unknown"

    def stop(self) -> None:
        if self.ensemble is not None:
            self.ensemble.stop()
            self.ensemble = None
        remove_temp_dir(self._dir)
        self._dir = None

    @property
    def hosts(self) -> str:
        if self.ensemble is None:
            raise RuntimeError("ZooKeeperSystem is not running")
        return self.ensemble.hosts

    def client_spec(self, shard: int = 0) -> ClientSpec:
        return ClientSpec(module=__name__, params={"hosts": self.hosts, "timeout": self.session_timeout})

    def stored_count(self) -> int:
        """How many records the ensemble holds (the parent's child count, from its stat,
        which stays small where get_children of a long log would exceed jute.maxbuffer)."""
        client = _connect(self.hosts, self.session_timeout)
        try:
            _, stat = client.get(LOG_PATH)
            return int(stat.numChildren)
        finally:
            _disconnect(client)

    def describe(self) -> dict[str, Any]:
        quorum = self.nodes // 2 + 1
        return {
            "replication": f"{self.nodes} servers, ack after a quorum of {quorum} logged it",
            "durability": "forceSync=yes (fsync of the txn log before ack)"
            if self.force_sync
            else "forceSync=no (no fsync)",
            "version": self._version,
            "heap": f"{self.heap_mb} MB per server (holds every record)",
        }
