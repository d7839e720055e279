"""ziplog itself: a local cluster (3-node ZooKeeper, 3 MMS replicas, 3 failure handler
replicas, ``shards`` x ``replicas`` storage servers) and a client pinned to one shard.

Each appender inserts every record after the last record it had acknowledged, the way a
writer that keeps its own order uses InsertAfter; ``counters()`` gives the fast- and
slow-path counts its client observed (dissertation Figure 4.4)."""

from __future__ import annotations

import contextlib
from typing import Any

from .base import ClientSpec, System, Unavailable


class ZiplogSystem(System):
    name = "ziplog"

    def __init__(self, shards: int = 2, replicas: int = 2, data_dir: str | None = None, **cluster_kw: Any) -> None:
        self.shards = shards
        self.replicas = replicas
        self.data_dir = data_dir
        self.cluster_kw = cluster_kw
        self.cluster: Any = None
        self._stack: contextlib.ExitStack | None = None

    def start(self) -> None:
        try:
            import ziplog
            from ziplog.tools.zk_ensemble import ZooKeeperNotInstalled
        except Exception as e:  # a broken checkout: say so instead of a traceback
            raise Unavailable(f"cannot import ziplog ({type(e).__name__}: {e})") from e
        self._stack = contextlib.ExitStack()
        try:
            self.cluster = self._stack.enter_context(ziplog.local_cluster(
                shards=self.shards, replicas=self.replicas, data_dir=self.data_dir, **self.cluster_kw))
        except ZooKeeperNotInstalled as e:
            raise Unavailable(f"ZooKeeper is not installed ({e}); make setup installs it") from e

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None
        self.cluster = None

    def client_spec(self, shard: int | None = 0) -> ClientSpec:
        """A client pinned to ``shard``; None: the default policy (a random live shard
        per insert), as a user's plain ``Client`` inserts."""
        assert self.cluster is not None, "start() first"
        return ClientSpec(__name__, {"zk_hosts": self.cluster.zk_hosts, "shard": shard})

    def server_pids(self) -> list[int]:
        """The storage servers' process ids (for CPU accounting)."""
        return list(dict.fromkeys(p.pid for p in self.cluster.servers.values())) if self.cluster is not None else []

    def describe(self) -> dict[str, Any]:
        return {"replication": f"{self.replicas} replicas per shard (f={self.replicas - 1})",
                "durability": "memory on f+1 replicas, disk async (fsync 1 s)",
                "shards": self.shards, "delays": "2 (fast path), 3 (slow path)"}


#: what the polling variant's storage servers run with (``--poll-us``)
POLL_US = 200


class ZiplogPollingSystem(ZiplogSystem):
    """ziplog whose storage servers poll before they sleep (``--poll-us 200``): lower
    latency for a few clients, paid in CPU (docs/DEPLOY.md)."""

    name = f"ziplog, --poll-us {POLL_US}"

    def __init__(self, shards: int = 2, replicas: int = 2, data_dir: str | None = None, **cluster_kw: Any) -> None:
        server_args = list(cluster_kw.pop("server_args", [])) + ["--poll-us", str(POLL_US)]
        super().__init__(shards, replicas, data_dir, server_args=server_args, **cluster_kw)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "polling": f"storage servers poll up to {POLL_US} us before they sleep"}


class ZiplogCurveSystem(ZiplogSystem):
    """ziplog whose every connection speaks CURVE (``--curve``), its client holding a
    registered key with every right: what encryption and the rights check cost."""

    name = "ziplog, CURVE"

    def __init__(self, shards: int = 2, replicas: int = 2, data_dir: str | None = None, **cluster_kw: Any) -> None:
        super().__init__(shards, replicas, data_dir, curve=True, **cluster_kw)
        self.key_file: str | None = None

    def start(self) -> None:
        super().start()
        self.key_file = str(self.cluster.add_client("bench", "all"))

    def client_spec(self, shard: int | None = 0) -> ClientSpec:
        spec = super().client_spec(shard)
        return ClientSpec(spec.module, {**spec.params, "key_file": self.key_file})

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "security": "CURVE on every connection, the client's rights checked per request"}


class ZiplogAppender:
    def __init__(self, zk_hosts: str, shard: int | None, key_file: str | None = None) -> None:
        import ziplog
        self.client = ziplog.Client(zk_hosts, policy=None if shard is None else ziplog.Policy.fixed(shard),
                                    key_file=key_file)
        self.last = ziplog.RID_GENESIS
        self._insert = self.client.insert_after

    def append(self, data: bytes) -> Any:
        # a pinned shard in failure recovery makes this wait (the client's own timeout)
        self.last = rid = self._insert(data, self.last)
        return rid

    def counters(self) -> dict[str, int]:
        return dict(self.client.stats)

    def close(self) -> None:
        self.client.close()


class AsyncZiplogAppender:
    def __init__(self, client: Any) -> None:
        import ziplog
        self.client = client
        self.last = ziplog.RID_GENESIS

    async def append(self, data: bytes) -> Any:
        rid = await self.client.insert_after(data, self.last)
        if rid.gsn > self.last.gsn:  # concurrent appends: after the newest acknowledged one
            self.last = rid
        return rid

    def counters(self) -> dict[str, int]:
        return dict(self.client.stats)

    async def close(self) -> None:
        await self.client.close()


def open_sync(zk_hosts: str, shard: int | None, key_file: str | None = None) -> ZiplogAppender:
    return ZiplogAppender(zk_hosts, shard, key_file)


async def open_async(zk_hosts: str, shard: int | None, key_file: str | None = None) -> AsyncZiplogAppender:
    import ziplog
    client = await ziplog.AsyncClient.connect(zk_hosts, policy=None if shard is None else ziplog.Policy.fixed(shard),
                                              key_file=key_file)
    return AsyncZiplogAppender(client)
