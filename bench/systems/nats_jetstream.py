"""NATS JetStream as a shared log: ``js.publish("log", data)`` into a file-backed stream.

By default (``nats``) one nats-server with JetStream on (stream replicas 1): the PubAck
comes once that server stored the message. ``cluster=True`` (``nats-r3``) runs three
servers as one JetStream cluster on loopback (each its own store directory, client
port, route port and server name, routes to the other two) and a stream with 3
replicas: the PubAck then comes once the stream's Raft group (leader plus one
follower) has it. The start waits until the cluster has elected its meta leader (every
server's monitoring ``/jsz`` names the same one) and the stream has a leader; the
client lists the stream leader's server first, so a publish goes straight to the
leader rather than through a route (the best case for NATS). Either way the file store
is not fsynced per message: nats-server syncs its files every 2 minutes by default (2.9
has no setting for it), so JetStream's durability is the OS page cache plus, with R3,
other servers.

nats-py is asyncio only. The blocking appender runs its own event loop in the calling
thread and drives it once per append, which is what a blocking Python caller pays.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

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
    stop_all,
    wait_until,
)

#: the stream holding the log and the one subject it takes
STREAM = "LOG"
SUBJECT = "log"
_INSTALL_HINT = "make setup installs it (apt-get install nats-server)"
_CLIENT_HINT = "nats-py is not importable: pip install nats-py (make setup installs the bench extra)"

T = TypeVar("T")


def _nats() -> Any:
    try:
        import nats
        import nats.js.api
    except ImportError as e:
        raise Unavailable(_CLIENT_HINT) from e
    return nats


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop when uvloop is installed (as ziplog's own clients use), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()  # type: ignore[no-any-return]


async def connect(servers: list[str], timeout: float) -> Any:
    """A nats-py connection to the first of ``servers`` that answers; fails
    (NoServersError) instead of retrying forever when none does, so a dead system shows
    up as an error, not a hang."""
    return await _nats().connect(
        servers=servers,
        dont_randomize=True,  # the order is deliberate (R3: the stream leader first)
        connect_timeout=max(1, int(timeout)),
        max_reconnect_attempts=3,
        reconnect_time_wait=0.5,
    )


class NatsAppender:
    """Blocking publishes: one private event loop, run until each PubAck arrives."""

    def __init__(self, servers: list[str], subject: str, timeout: float) -> None:
        self._loop = new_event_loop()
        try:
            self._conn = self._loop.run_until_complete(connect(servers, timeout))
        except BaseException:
            self._loop.close()
            raise
        self._js = self._conn.jetstream(timeout=timeout)
        self._subject = subject

    def append(self, data: bytes) -> int:
        ack = self._loop.run_until_complete(self._js.publish(self._subject, data))
        return int(ack.seq)

    def close(self) -> None:
        try:
            self._loop.run_until_complete(self._conn.close())
        finally:
            self._loop.close()


class AsyncNatsAppender:
    """Publishes on the caller's loop; concurrent calls share the connection, each
    waiting for its own PubAck (nats-py multiplexes the replies on one inbox)."""

    def __init__(self, conn: Any, subject: str, timeout: float) -> None:
        self._conn = conn
        self._js = conn.jetstream(timeout=timeout)
        self._subject = subject

    async def append(self, data: bytes) -> int:
        ack = await self._js.publish(self._subject, data)
        return int(ack.seq)

    async def close(self) -> None:
        await self._conn.close()


def open_sync(servers: list[str], subject: str = SUBJECT, timeout: float = 10.0) -> NatsAppender:
    return NatsAppender(servers, subject, timeout)


async def open_async(servers: list[str], subject: str = SUBJECT, timeout: float = 10.0) -> AsyncNatsAppender:
    return AsyncNatsAppender(await connect(servers, timeout), subject, timeout)


def run_in_fresh_loop(coroutine_fn: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to completion on a new loop in a helper thread, so that
    ``start()`` also works when its caller is itself inside a running event loop."""
    box: dict[str, Any] = {}

    def main() -> None:
        async def wrapped() -> T:
            return await coroutine_fn()

        try:
            box["value"] = asyncio.run(wrapped())
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=main, name="nats-admin")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


class NatsJetStreamSystem(System):
    """nats-server(s) with JetStream on free loopback ports and a file-backed stream."""

    name = "NATS JetStream"

    def __init__(
        self,
        binary: str | None = None,
        cluster: bool = False,
        data_parent: str | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
        publish_timeout: float = 10.0,
    ) -> None:
        self.binary = binary
        self.cluster = cluster
        self.replicas = 3 if cluster else 1
        if cluster:
            self.name = "NATS JetStream R3"
        self.data_parent = data_parent
        self.start_timeout = start_timeout
        self.publish_timeout = publish_timeout
        self.servers: list[ServerProcess] = []
        self.client_ports: list[int] = []
        self.monitor_ports: list[int] = []
        self.leader_index = 0  # the server holding the stream leader (R3), listed first to clients
        self._dir: Path | None = None
        self._version = "unknown"
        self._max_payload: int | None = None

    # -- configuration -----------------------------------------------------------

    def server_config(self, index: int, client_port: int, route_ports: list[int], store_dir: Path,
                      monitor_port: int | None = None) -> str:
        """nats-server.conf for server ``index``; route_ports is empty for one server."""
        lines = [
            f'server_name: "bench-nats-{index}"',
            f'listen: "127.0.0.1:{client_port}"',
            "jetstream {",
            f'  store_dir: "{store_dir}"',
            "}",
        ]
        if monitor_port is not None:
            lines.append(f'http: "127.0.0.1:{monitor_port}"')
        if route_ports:
            routes = ", ".join(f'"nats-route://127.0.0.1:{p}"' for i, p in enumerate(route_ports) if i != index)
            lines += [
                "cluster {",
                '  name: "bench"',
                f'  listen: "127.0.0.1:{route_ports[index]}"',
                f"  routes: [{routes}]",
                "}",
            ]
        return "\n".join(lines) + "\n"

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        binary = find_binary("nats-server", self.binary, _INSTALL_HINT)
        _nats()
        self._version = binary_version([binary, "--version"], r"v(\d+\.\d+\.\d+\S*)")
        self._dir = make_temp_dir("bench-nats-", self.data_parent)
        count = self.replicas
        ports = free_ports(3 * count if self.cluster else 1)
        self.client_ports = ports[:count]
        route_ports = ports[count:2 * count]
        self.monitor_ports = ports[2 * count:]
        spread = CpuSpread()
        for i, port in enumerate(self.client_ports):
            node_dir = self._dir / f"n{i}"
            node_dir.mkdir()
            conf = node_dir / "nats-server.conf"
            monitor = self.monitor_ports[i] if self.monitor_ports else None
            conf.write_text(self.server_config(i, port, route_ports, node_dir / "jetstream", monitor))
            server = ServerProcess(f"nats-server {i}", spread.argv([binary, "-c", str(conf)]), node_dir / "nats-server.log",
                                   cwd=node_dir)  # fmt: skip
            self.servers.append(server)
            server.start()
        for server, port in zip(self.servers, self.client_ports):
            server.wait_for_port(port, timeout=self.start_timeout)
        if self.cluster:
            self._await_meta_leader()
        try:
            run_in_fresh_loop(self._create_stream)
        except Unavailable:
            raise
        except Exception as e:  # e.g. NoServersError: the servers run but take no client
            raise self.servers[0].failure(f"runs but the stream could not be created ({e!r})") from e

    def _meta_leader(self, monitor_port: int) -> str:
        """The JetStream meta leader a server names in its ``/jsz`` ("" if none yet)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/jsz", timeout=2.0) as reply:
                info = json.load(reply)
        except (OSError, ValueError):
            return ""
        meta = info.get("meta_cluster") or {}
        return str(meta.get("leader") or "")

    def _await_meta_leader(self) -> None:
        """Return once every server names the same JetStream meta leader."""

        def elected() -> bool:
            for server in self.servers:
                server.check_running()
            leaders = {self._meta_leader(port) for port in self.monitor_ports}
            return len(leaders) == 1 and "" not in leaders

        if not wait_until(elected, self.start_timeout, interval=0.1):
            raise self.servers[0].failure(f"cluster elected no JetStream meta leader within {self.start_timeout:.0f} s")

    async def _create_stream(self) -> None:
        """Create the stream, retrying while JetStream is not ready yet (a cluster
        elects its meta leader only after the routes are up)."""
        nats = _nats()
        conn = await connect(self.urls, self.start_timeout)
        try:
            self._max_payload = int(conn.max_payload)
            js = conn.jetstream(timeout=2.0)
            config = nats.js.api.StreamConfig(
                name=STREAM,
                subjects=[SUBJECT],
                storage=nats.js.api.StorageType.FILE,
                num_replicas=self.replicas,
            )
            deadline = time.monotonic() + self.start_timeout
            while True:
                for server in self.servers:
                    server.check_running()
                try:
                    if await self._stream_ready(js, config):
                        return
                except nats.js.errors.BadRequestError as e:  # the stream config itself is wrong
                    raise Unavailable(f"JetStream rejected the stream config: {e!r}") from e
                except nats.errors.Error as e:  # no responders, timeout, 503: not ready yet
                    if time.monotonic() >= deadline:
                        raise self.servers[0].failure(f"JetStream did not accept the stream ({e!r})") from e
                await asyncio.sleep(0.1)
        finally:
            await conn.close()

    async def _stream_ready(self, js: Any, config: Any) -> bool:
        """Create the stream if needed; True once it has a leader to take publishes
        (with replicas, creating it only starts its Raft group's election)."""
        await js.add_stream(config)
        if self.replicas == 1:
            return True
        info = await js.stream_info(STREAM)
        if info.cluster is None or not info.cluster.leader:
            return False
        names = [f"bench-nats-{i}" for i in range(len(self.servers))]
        if info.cluster.leader not in names:
            raise Unavailable(f"the stream leader is {info.cluster.leader!r}, not one of {names}")
        self.leader_index = names.index(info.cluster.leader)
        return True

    def stop(self) -> None:
        stop_all(self.servers)
        self.servers = []
        self.leader_index = 0
        remove_temp_dir(self._dir)
        self._dir = None

    @property
    def urls(self) -> list[str]:
        """Every server's client URL, the stream leader's first."""
        ports = self.client_ports[self.leader_index:] + self.client_ports[:self.leader_index]
        return [f"nats://127.0.0.1:{p}" for p in ports]

    def client_spec(self, shard: int = 0) -> ClientSpec:
        if not self.servers:
            raise RuntimeError("NatsJetStreamSystem is not running")
        return ClientSpec(
            module=__name__,
            params={"servers": self.urls, "subject": SUBJECT, "timeout": self.publish_timeout},
        )

    def stored_count(self) -> int:
        """The number of messages the stream holds (stream info)."""

        async def count() -> int:
            conn = await connect(self.urls, self.start_timeout)
            try:
                info = await conn.jetstream().stream_info(STREAM)
                return int(info.state.messages)
            finally:
                await conn.close()

        return run_in_fresh_loop(count)

    def describe(self) -> dict[str, Any]:
        if self.cluster:
            replication = ("3 servers, stream replicas 3 (ack after a Raft majority stored it); "
                           "client connected to the stream leader's server")
        else:
            replication = "none (1 server, stream replicas 1)"
        facts: dict[str, Any] = {
            "replication": replication,
            "durability": "file storage, no fsync per message (server syncs every 2 min)",
            "version": self._version,
        }
        if self._max_payload is not None:
            facts["max_payload"] = self._max_payload
        return facts


class NatsJetStreamR3System(NatsJetStreamSystem):
    """The three-server cluster with an R3 stream (``NatsJetStreamSystem(cluster=True)``)."""

    def __init__(
        self,
        binary: str | None = None,
        data_parent: str | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
        publish_timeout: float = 10.0,
    ) -> None:
        super().__init__(binary, cluster=True, data_parent=data_parent, start_timeout=start_timeout,
                         publish_timeout=publish_timeout)
