"""The systems the benchmarks compare: ziplog, the floors (raw ZeroMQ through pyzmq,
ZeroMQ's wire protocol spoken natively on uvloop, and plain TCP on uvloop), NOPaxos-style and Scalog-style baselines on ziplog's own stack, and real peers
(ZooKeeper, NATS JetStream with 1 and 3 replicas, Redis Streams alone and with a replica
and ``WAIT``). ``make(name)`` builds one by its key in :data:`SYSTEMS`."""

from __future__ import annotations

import importlib
from typing import Any

from .base import Appender, AsyncAppender, ClientSpec, System, Unavailable

#: key -> "module:Class"; the key is what ``--systems`` takes
SYSTEMS: dict[str, str] = {
    "ziplog": "bench.systems.ziplog_system:ZiplogSystem",
    "ziplog-poll": "bench.systems.ziplog_system:ZiplogPollingSystem",
    "ziplog-curve": "bench.systems.ziplog_system:ZiplogCurveSystem",
    "floor": "bench.systems.floor:FloorSystem",
    "floor-tcp": "bench.systems.floor_tcp:FloorTcpSystem",
    "floor-zmtp": "bench.systems.floor_zmtp:FloorZmtpSystem",
    "nopaxos": "bench.systems.nopaxos:NOPaxosSystem",
    "scalog": "bench.systems.scalog:ScalogSystem",
    "zookeeper": "bench.systems.zookeeper:ZooKeeperSystem",
    "nats": "bench.systems.nats_jetstream:NatsJetStreamSystem",
    "nats-r3": "bench.systems.nats_jetstream:NatsJetStreamR3System",
    "redis": "bench.systems.redis_streams:RedisStreamsSystem",
    "redis-replica": "bench.systems.redis_streams:RedisReplicaStreamsSystem",
}


def make(key: str, **kw: Any) -> System:
    modname, _, cls = SYSTEMS[key].partition(":")
    return getattr(importlib.import_module(modname), cls)(**kw)  # type: ignore[no-any-return]


__all__ = ["SYSTEMS", "make", "System", "Unavailable", "ClientSpec", "Appender", "AsyncAppender"]
