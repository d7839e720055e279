"""The benchmark's real peers (ZooKeeper, NATS JetStream R1 and R3, Redis Streams alone
and with a replica) start on loopback, take appends from blocking and asyncio clients
opened from their picklable client specs, and hold exactly the records that were
acknowledged (with a Redis replica and WAIT, the replica too)."""

from __future__ import annotations

import asyncio
import os
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bench.systems import System, Unavailable, make
from bench.systems.nats_jetstream import NatsJetStreamR3System, NatsJetStreamSystem, run_in_fresh_loop
from bench.systems.redis_streams import RedisReplicaStreamsSystem, RedisStreamsSystem

RECORD = b"\xab" * 4096
SYNC_APPENDS = 100
ASYNC_APPENDS = 100
ASYNC_CONCURRENCY = 10


def _zookeeper_children(system: Any) -> int:
    from kazoo.client import KazooClient

    client = KazooClient(hosts=system.hosts)
    client.start(timeout=10)
    try:
        return len(client.get_children("/log"))
    finally:
        client.stop()
        client.close()


def _nats_messages(system: Any) -> int:
    import nats

    async def count() -> int:
        conn = await nats.connect(servers=system.urls)
        try:
            info = await conn.jetstream().stream_info("LOG")
            return int(info.state.messages)
        finally:
            await conn.close()

    return run_in_fresh_loop(count)


def _redis_xlen(system: Any) -> int:
    import redis

    client = redis.Redis(host="127.0.0.1", port=system.port)
    try:
        return int(client.xlen("log"))
    finally:
        client.close()


#: (registry key, constructor options, how to count what the server holds)
PEERS: dict[str, tuple[str, dict[str, Any], Callable[[Any], int]]] = {
    "zookeeper": ("zookeeper", {}, _zookeeper_children),
    "nats": ("nats", {}, _nats_messages),
    "nats-r3": ("nats-r3", {}, _nats_messages),
    "redis": ("redis", {}, _redis_xlen),
    "redis-replica": ("redis-replica", {}, _redis_xlen),
}


@pytest.fixture(params=sorted(PEERS))
def peer(request: pytest.FixtureRequest) -> Iterator[tuple[System, Callable[[Any], int]]]:
    key, options, count = PEERS[request.param]
    with make(key, **options) as system:
        yield system, count


async def _append_concurrently(system: System) -> list[Any]:
    appender = await system.client_spec().open_async()
    try:
        per_task = ASYNC_APPENDS // ASYNC_CONCURRENCY

        async def task() -> list[Any]:
            return [await appender.append(RECORD) for _ in range(per_task)]

        batches = await asyncio.gather(*(task() for _ in range(ASYNC_CONCURRENCY)))
    finally:
        await appender.close()
    return [pos for batch in batches for pos in batch]


def test_appends_are_ordered_and_all_stored(peer: tuple[System, Callable[[Any], int]]) -> None:
    system, stored = peer
    spec = system.client_spec()
    spec = pickle.loads(pickle.dumps(spec))  # what a spawned load generator receives

    appender = spec.open_sync()
    try:
        sync_positions = [appender.append(RECORD) for _ in range(SYNC_APPENDS)]
    finally:
        appender.close()
    assert all(a < b for a, b in zip(sync_positions, sync_positions[1:])), sync_positions

    async_positions = asyncio.run(_append_concurrently(system))
    assert len(async_positions) == ASYNC_APPENDS
    assert len(set(async_positions)) == ASYNC_APPENDS
    assert min(async_positions) > sync_positions[-1]

    assert stored(system) == SYNC_APPENDS + ASYNC_APPENDS
    assert system.stored_count() == SYNC_APPENDS + ASYNC_APPENDS  # type: ignore[attr-defined]
    if isinstance(system, RedisReplicaStreamsSystem):
        # every append waited for WAIT 1 0, so the replica already has every record
        assert system.replica_count() == SYNC_APPENDS + ASYNC_APPENDS

    facts = system.describe()
    assert {"replication", "durability", "version"} <= facts.keys()
    assert facts["version"] != "unknown"


@pytest.mark.parametrize(
    "system, binary_name",
    [
        (NatsJetStreamSystem(binary="/nonexistent/nats-server"), "nats-server"),
        (NatsJetStreamR3System(binary="/nonexistent/nats-server"), "nats-server"),
        (RedisStreamsSystem(binary="/nonexistent/redis-server"), "redis-server"),
        (RedisReplicaStreamsSystem(binary="/nonexistent/redis-server"), "redis-server"),
    ],
)
def test_missing_binary_is_unavailable(system: System, binary_name: str) -> None:
    with pytest.raises(Unavailable, match=binary_name):
        with system:
            pass
    system.stop()  # safe again after a failed start


def test_server_that_exits_is_unavailable_with_its_log() -> None:
    # redis-server refuses an unknown appendfsync policy and exits at once.
    system = RedisStreamsSystem(appendfsync="sometimes")
    with pytest.raises(Unavailable, match=r"(?s)exited with code .*appendfsync"):
        with system:
            pass
    assert system.server is None
    assert system._dir is None or not os.path.exists(system._dir)


def test_redis_replica_is_in_sync_and_appends_wait_for_it() -> None:
    import redis

    with make("redis-replica") as system:
        assert isinstance(system, RedisReplicaStreamsSystem) and system.replica_port is not None
        assert system.client_spec().params["wait_replicas"] == 1
        replica = redis.Redis(host="127.0.0.1", port=system.replica_port)
        try:
            info = replica.info("replication")
            assert info["role"] == "slave" and info["master_port"] == system.port
            assert info["master_link_status"] == "up"
        finally:
            replica.close()
    assert system.replica is None and system.server is None


def test_nats_r3_is_one_cluster_with_a_meta_leader_and_clients_start_at_the_stream_leader() -> None:
    import nats

    with make("nats-r3") as system:
        assert isinstance(system, NatsJetStreamR3System) and len(system.servers) == 3
        leaders = {system._meta_leader(port) for port in system.monitor_ports}
        assert len(leaders) == 1 and leaders.pop().startswith("bench-nats-")

        async def stream_leader() -> str:
            conn = await nats.connect(servers=system.urls)
            try:
                info = await conn.jetstream().stream_info("LOG")
                assert info.config.num_replicas == 3
                assert info.cluster is not None and len(info.cluster.replicas or []) == 2
                return info.cluster.leader or ""
            finally:
                await conn.close()

        leader = run_in_fresh_loop(stream_leader)
        assert leader == f"bench-nats-{system.leader_index}"
        assert system.urls[0] == f"nats://127.0.0.1:{system.client_ports[system.leader_index]}"
