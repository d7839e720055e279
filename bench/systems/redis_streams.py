"""Redis Streams as a shared log: ``XADD log * d <data>`` on one redis-server.

One server, no replica: Redis replication is asynchronous (an XADD is acknowledged
before any replica has it), so a replica would add no guarantee to what is measured
here. Durability is the append-only file with ``appendfsync everysec``, the setting
Redis recommends: the XADD is acknowledged once written to the AOF, which is fsynced
once a second, so a machine crash can lose the last second.

The position of a record is its entry id, returned as ``(milliseconds, sequence)`` so
positions compare in log order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .base import ClientSpec, System, Unavailable
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


class RedisAppender:
    """Blocking XADDs on one connection."""

    def __init__(self, host: str, port: int, stream: str) -> None:
        self._client = _redis().Redis(host=host, port=port)
        self._stream = stream

    def append(self, data: bytes) -> tuple[int, int]:
        return entry_position(self._client.xadd(self._stream, {FIELD: data}))

    def close(self) -> None:
        self._client.close()


class AsyncRedisAppender:
    """XADDs through ``redis.asyncio``. Concurrent calls each take a connection from
    the client's pool (redis-py does not pipeline independent commands on one
    connection), which is what a Python user issuing concurrent XADDs gets. The pool
    blocks when all of its ``MAX_CONNECTIONS`` are busy: a burst waits for a
    connection (and the wait counts in its latency) instead of failing."""

    MAX_CONNECTIONS = 64

    def __init__(self, host: str, port: int, stream: str) -> None:
        import redis.asyncio

        pool = redis.asyncio.BlockingConnectionPool(host=host, port=port, max_connections=self.MAX_CONNECTIONS,
                                                    timeout=None)
        self._client = redis.asyncio.Redis(connection_pool=pool)
        self._stream = stream

    async def append(self, data: bytes) -> tuple[int, int]:
        return entry_position(await self._client.xadd(self._stream, {FIELD: data}))

    async def close(self) -> None:
        await self._client.aclose()


def open_sync(host: str, port: int, stream: str = STREAM) -> RedisAppender:
    return RedisAppender(host, port, stream)


async def open_async(host: str, port: int, stream: str = STREAM) -> AsyncRedisAppender:
    _redis()
    return AsyncRedisAppender(host, port, stream)


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
        self.server = ServerProcess("redis-server", self.server_argv(binary, self.port, self._dir),
                                    self._dir / "redis.log", cwd=self._dir)  # fmt: skip
        self.server.start()
        self.server.wait_for_port(self.port, timeout=self.start_timeout)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=self.start_timeout)
        try:
            # An open port can still answer LOADING while the AOF is read.
            if not wait_until(lambda: _pings(client, redis), self.start_timeout):
                raise self.server.failure(f"did not answer PING within {self.start_timeout:.0f} s")
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


def _pings(client: Any, redis: Any) -> bool:
    try:
        return bool(client.ping())
    except redis.exceptions.BusyLoadingError:
        return False
    except redis.exceptions.RedisError as e:
        raise Unavailable(f"redis-server opened its port but PING failed: {e!r}") from e
