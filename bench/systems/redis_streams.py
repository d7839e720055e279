"""Redis Streams as a shared log: ``XADD log * d <data>``, on one redis-server or on a
primary with one replica.

* :class:`RedisStreamsSystem` (``redis``): one server, no replica. The XADD is
  acknowledged once the primary applied it; nothing else has the record yet.
* :class:`RedisReplicaStreamsSystem` (``redis-replica``): a primary and one replica
  (``replicaof`` the primary). Redis replication is asynchronous, so every append is
  ``XADD`` followed by ``WAIT 1 0`` on the same connection (sent together, one round
  trip): the append returns only once the replica acknowledged the write, which is the
  replicated configuration Redis offers, and the one to set beside a log that
  acknowledges after two replicas have a record. (WAIT makes the write reach the
  replica; it is not a consensus protocol: a failover may still pick a replica that
  lacks acknowledged writes.)

Durability on every server is the append-only file with ``appendfsync everysec``, the
setting Redis recommends: the XADD is acknowledged once written to the AOF, which is
fsynced once a second, so a machine crash can lose the last second.

The position of a record is its entry id, returned as ``(milliseconds, sequence)`` so
positions compare in log order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .base import ClientSpec, System, Unavailable
from .cpus import CpuSpread
from .servers import (
    DEFAULT_START_TIMEOUT_S,
    ServerProcess,
    binary_version,
    find_binary,
    free_ports,
    make_temp_dir,
    remove_temp_dir,
    wait_until,
)

#: the stream every record goes to, and the one field each entry has
STREAM = "log"
FIELD = "d"
_INSTALL_HINT = "make setup installs it (apt-get install redis-server)"
_CLIENT_HINT = "redis-py is not importable: pip install redis (make setup installs the bench extra)"


def _redis() -> Any:
    try:
        import redis
    except ImportError as e:
        raise Unavailable(_CLIENT_HINT) from e
    return redis


def entry_position(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id as a comparable position: b"1700000000000-3" -> (1700000000000, 3)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq)


def _check_acked(replies: list[Any], replicas: int) -> tuple[int, int]:
    """The position from the replies to ``XADD`` + ``WAIT``; WAIT with no timeout
    returns only once ``replicas`` acknowledged, so fewer means something is wrong."""
    entry_id, acked = replies
    if int(acked) < replicas:
        raise RuntimeError(f"WAIT {replicas} 0 returned {acked} replicas")
    return entry_position(entry_id)


class RedisAppender:
    """Blocking XADDs on one connection; with ``wait_replicas`` each XADD is followed
    by ``WAIT <wait_replicas> 0`` in the same write (a non-transactional pipeline: a
    WAIT inside MULTI would not block), and the append returns after both replies."""

    def __init__(self, host: str, port: int, stream: str, wait_replicas: int = 0) -> None:
        self._client = _redis().Redis(host=host, port=port)
        self._stream = stream
        self._wait = wait_replicas
        self._pipe = self._client.pipeline(transaction=False) if wait_replicas else None

    def append(self, data: bytes) -> tuple[int, int]:
        pipe = self._pipe
        if pipe is None:
            return entry_position(self._client.xadd(self._stream, {FIELD: data}))
        pipe.xadd(self._stream, {FIELD: data})
        pipe.wait(self._wait, 0)
        return _check_acked(pipe.execute(), self._wait)

    def close(self) -> None:
        self._client.close()


class AsyncRedisAppender:
    """XADDs through ``redis.asyncio``. Concurrent calls each take a connection from
    the client's pool (redis-py does not pipeline independent commands on one
    connection), which is what a Python user issuing concurrent XADDs gets. The pool
    blocks when all of its ``MAX_CONNECTIONS`` are busy: a burst waits for a
    connection (and the wait counts in its latency) instead of failing. With
    ``wait_replicas`` each call sends ``XADD`` + ``WAIT <wait_replicas> 0`` together on
    its connection and returns after both replies, as the blocking appender does."""

    MAX_CONNECTIONS = 64

    def __init__(self, host: str, port: int, stream: str, wait_replicas: int = 0) -> None:
        import redis.asyncio

        pool = redis.asyncio.BlockingConnectionPool(host=host, port=port, max_connections=self.MAX_CONNECTIONS,
                                                    timeout=None)
        self._client = redis.asyncio.Redis(connection_pool=pool)
        self._stream = stream
        self._wait = wait_replicas

    async def append(self, data: bytes) -> tuple[int, int]:
        if not self._wait:
            return entry_position(await self._client.xadd(self._stream, {FIELD: data}))
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.xadd(self._stream, {FIELD: data})
            pipe.wait(self._wait, 0)
            return _check_acked(await pipe.execute(), self._wait)

    async def close(self) -> None:
        await self._client.aclose()


def open_sync(host: str, port: int, stream: str = STREAM, wait_replicas: int = 0) -> RedisAppender:
    return RedisAppender(host, port, stream, wait_replicas)


async def open_async(host: str, port: int, stream: str = STREAM, wait_replicas: int = 0) -> AsyncRedisAppender:
    _redis()
    return AsyncRedisAppender(host, port, stream, wait_replicas)


class RedisStreamsSystem(System):
    """One redis-server on a free loopback port, AOF on, no RDB snapshots, no replica."""

    name = "Redis Streams"

    def __init__(
        self,
        binary: str | None = None,
        appendfsync: str = "everysec",
        data_parent: str | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        self.binary = binary
        self.appendfsync = appendfsync
        self.data_parent = data_parent
        self.start_timeout = start_timeout
        self.port: int | None = None
        self.server: ServerProcess | None = None
        self._dir: Path | None = None
        self._cpus = CpuSpread()
        self._version = "unknown"

    def server_argv(self, binary: str, port: int, data_dir: Path) -> list[str]:
        return [
            binary,
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--appendonly", "yes",
            "--appendfsync", self.appendfsync,
            "--save", "",  # no RDB snapshots: the AOF is the only persistence
            "--dir", str(data_dir),
            "--protected-mode", "no",
            "--daemonize", "no",
        ]  # fmt: skip

    def start(self) -> None:
        binary = find_binary("redis-server", self.binary, _INSTALL_HINT)
        redis = _redis()
        self._version = binary_version([binary, "--version"], r"v=(\S+)")
        self._dir = make_temp_dir("bench-redis-", self.data_parent)
        self.port = free_ports(1)[0]
        self.server = ServerProcess("redis-server", self._cpus.argv(self.server_argv(binary, self.port, self._dir)),
                                    self._dir / "redis.log", cwd=self._dir)  # fmt: skip
        self.server.start()
        self._await_ping(self.server, self.port)

    def _await_ping(self, server: ServerProcess, port: int) -> None:
        """Return once ``server`` (just started) answers PING on ``port``."""
        redis = _redis()
        server.wait_for_port(port, timeout=self.start_timeout)
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=self.start_timeout)
        try:
            # An open port can still answer LOADING while the AOF is read.
            if not wait_until(lambda: _pings(client, redis), self.start_timeout):
                raise server.failure(f"did not answer PING within {self.start_timeout:.0f} s")
        finally:
            client.close()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        remove_temp_dir(self._dir)
        self._dir = None

    def client_spec(self, shard: int = 0) -> ClientSpec:
        if self.port is None or self.server is None:
            raise RuntimeError("RedisStreamsSystem is not running")
        return ClientSpec(module=__name__, params={"host": "127.0.0.1", "port": self.port, "stream": STREAM})

    def stored_count(self) -> int:
        """XLEN of the log stream."""
        if self.port is None:
            raise RuntimeError("RedisStreamsSystem is not running")
        client = _redis().Redis(host="127.0.0.1", port=self.port)
        try:
            return int(client.xlen(STREAM))
        finally:
            client.close()

    def describe(self) -> dict[str, Any]:
        parser = "hiredis" if getattr(_redis().utils, "HIREDIS_AVAILABLE", False) else "pure-Python parser"
        return {
            "replication": "none (1 server, no replica)",
            "durability": f"AOF, appendfsync {self.appendfsync}",
            "version": self._version,
            "client": f"redis-py {_redis().__version__} ({parser})",
        }


class RedisReplicaStreamsSystem(RedisStreamsSystem):
    """A primary as :class:`RedisStreamsSystem` starts it plus one replica
    (``--replicaof`` the primary, same persistence settings, its own directory); clients
    append with ``XADD`` + ``WAIT 1 0``, so an append is acknowledged once the replica
    has it."""

    name = "Redis Streams + replica, WAIT 1 0"

    #: replicas every append waits for
    WAIT_REPLICAS = 1

    def __init__(
        self,
        binary: str | None = None,
        appendfsync: str = "everysec",
        data_parent: str | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        super().__init__(binary, appendfsync, data_parent, start_timeout)
        self.replica_port: int | None = None
        self.replica: ServerProcess | None = None

    def server_argv(self, binary: str, port: int, data_dir: Path) -> list[str]:
        # The primary would wait 5 s (the default) for more replicas before the first
        # full sync; there is only one. This changes the start, not what is measured.
        return super().server_argv(binary, port, data_dir) + ["--repl-diskless-sync-delay", "0"]

    def start(self) -> None:
        super().start()
        assert self._dir is not None and self.server is not None and self.port is not None
        binary = find_binary("redis-server", self.binary, _INSTALL_HINT)
        replica_dir = self._dir / "replica"
        replica_dir.mkdir()
        self.replica_port = free_ports(1)[0]
        argv = self.server_argv(binary, self.replica_port, replica_dir) + ["--replicaof", "127.0.0.1", str(self.port)]
        self.replica = ServerProcess("redis-server (replica)", self._cpus.argv(argv), replica_dir / "redis.log",
                                     cwd=replica_dir)
        self.replica.start()
        self._await_ping(self.replica, self.replica_port)
        self._await_in_sync(self.server, self.replica, self.port, self.replica_port)

    def _await_in_sync(self, primary: ServerProcess, replica: ServerProcess, port: int, replica_port: int) -> None:
        """Return once the replica's link to the primary is up, the primary sees it
        online and the replica's offset has reached the primary's; then check that a
        ``WAIT 1`` is answered by one replica, as every append will need."""
        redis = _redis()
        p_client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=self.start_timeout)
        r_client = redis.Redis(host="127.0.0.1", port=replica_port, socket_timeout=self.start_timeout)

        def in_sync() -> bool:
            primary.check_running()
            replica.check_running()
            r_info = r_client.info("replication")
            p_info = p_client.info("replication")
            if r_info.get("master_link_status") != "up":
                return False
            if not isinstance(p_info.get("slave0"), dict) or p_info["slave0"].get("state") != "online":
                return False
            return int(r_info.get("slave_repl_offset", -1)) >= int(p_info["master_repl_offset"])

        try:
            if not wait_until(in_sync, self.start_timeout, interval=0.1):
                raise replica.failure(f"did not get in sync with the primary within {self.start_timeout:.0f} s")
            acked = int(p_client.wait(self.WAIT_REPLICAS, int(self.start_timeout * 1000)))
            if acked < self.WAIT_REPLICAS:
                raise replica.failure(f"is in sync but WAIT {self.WAIT_REPLICAS} saw {acked} replicas")
        finally:
            p_client.close()
            r_client.close()

    def stop(self) -> None:
        if self.replica is not None:
            self.replica.stop()
            self.replica = None
        self.replica_port = None
        super().stop()

    def client_spec(self, shard: int = 0) -> ClientSpec:
        spec = super().client_spec(shard)
        return ClientSpec(module=spec.module, params={**spec.params, "wait_replicas": self.WAIT_REPLICAS})

    def replica_count(self) -> int:
        """XLEN of the log stream on the replica."""
        if self.replica_port is None:
            raise RuntimeError("RedisReplicaStreamsSystem is not running")
        client = _redis().Redis(host="127.0.0.1", port=self.replica_port)
        try:
            return int(client.xlen(STREAM))
        finally:
            client.close()

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "replication": f"primary + 1 replica; XADD then WAIT {self.WAIT_REPLICAS} 0 (ack once the replica has it)",
            "durability": f"AOF, appendfsync {self.appendfsync}, on both servers",
        }


def _pings(client: Any, redis: Any) -> bool:
    try:
        return bool(client.ping())
    except redis.exceptions.BusyLoadingError:
        return False
    except redis.exceptions.RedisError as e:
        raise Unavailable(f"redis-server opened its port but PING failed: {e!r}") from e
