"""Scalog-style: replicate first, then order by periodic cuts, on ziplog's stack
(servers in :mod:`bench.baselines.scalog`). A client sends a record to one storage
server of its shard; the server replicates it to its peers; every server reports its
local cut to one ordering process on a grid of ``interval_us`` (the paper's
interleaving interval, 0.1 ms); the server acknowledges with the record's gsn once a
global cut covers it."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from bench.baselines import check_alive, python_module_argv, start_server, wait_ready
from bench.baselines.scalog import APPEND, STATS
from ziplog.tools import procs

from .base import ClientSpec, PipelinedAppender, System, Waiting
from .cpus import CpuSpread
from .servers import make_temp_dir, remove_temp_dir


class ScalogSystem(System):
    name = "Scalog-style"

    def __init__(self, shards: int = 1, replicas: int = 2, interval_us: int = 100, client_server: int = 0,
                 data_dir: str | None = None, timeout_s: float = 10.0) -> None:
        assert shards >= 1 and replicas >= 1 and interval_us >= 1
        assert 0 <= client_server < replicas, f"client_server {client_server} is not one of {replicas} servers"
        self.shards, self.replicas, self.interval_us = shards, replicas, interval_us
        self.client_server = client_server
        self.data_parent = data_dir
        self.timeout_s = timeout_s
        self.dir: Path | None = None
        self.procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
        #: addrs[shard][server]
        self.addrs: list[list[str]] = []

    def start(self) -> None:
        self.dir = make_temp_dir("scalog-", self.data_parent)
        shape = ",".join([str(self.replicas)] * self.shards)
        log = self.dir / "ordering.out"
        spread = CpuSpread()
        self.procs["ordering"] = (start_server(spread.argv(python_module_argv("bench.baselines.scalog", "ordering",
                                                                               "--shape", shape)), log), log)
        ordering = f"tcp://127.0.0.1:{wait_ready(*self.procs['ordering'], 'ordering process')[0]}"
        labels: list[list[str]] = []
        for s in range(self.shards):
            labels.append([])
            for i in range(self.replicas):
                label = f"server {s}.{i}"
                log = self.dir / f"server{s}.{i}.out"
                argv = python_module_argv("bench.baselines.scalog", "server", "--ordering", ordering,
                                          "--shape", shape, "--shard", str(s), "--server", str(i),
                                          "--interval-us", str(self.interval_us),
                                          "--data", str(self.dir / f"server{s}.{i}.log"))
                self.procs[label] = (start_server(spread.argv(argv), log), log)
                labels[-1].append(label)
        # All started before waiting: a server is READY only once every one said HELLO.
        self.addrs = [[f"tcp://127.0.0.1:{wait_ready(*self.procs[label], label)[0]}" for label in row]
                      for row in labels]

    def stop(self) -> None:
        procs.stop_many([p for p, _ in self.procs.values()])
        self.procs = {}
        remove_temp_dir(self.dir)
        self.dir = None
        self.addrs = []

    def check_alive(self) -> None:
        """Raise with its log if a server died (e.g. on a replication gap)."""
        check_alive(self.procs)

    def client_spec(self, shard: int = 0) -> ClientSpec:
        assert self.addrs, "start() first"
        return ClientSpec(__name__, {"servers": list(self.addrs[shard]), "server": self.client_server,
                                     "timeout_s": self.timeout_s})

    def server_pids(self) -> list[int]:
        return [p.pid for p, _ in self.procs.values()]

    def timer_stats(self) -> list[dict[str, Any]]:
        """Every storage server's counters (appends, replicated, reports, ticks, cuts)
        and timings over its latest events, each {p50, p99, mean} in us:
        ``tick_late_us`` (loop woke this long after the grid point it armed for),
        ``report_wait_us`` (a changed local cut waited this long for its report) and
        ``order_wait_us`` (an append's arrival to the cut that ordered it)."""
        out = []
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            for row in self.addrs:
                for addr in row:
                    s = ctx.socket(zmq.DEALER)
                    s.setsockopt(zmq.LINGER, 0)
                    s.setsockopt(zmq.RCVTIMEO, int(self.timeout_s * 1000))
                    s.connect(addr)
                    s.send(msgpack.packb([STATS, 0]))
                    out.append(msgpack.unpackb(s.recv())[1])
                    s.close(0)
        finally:
            ctx.term()
        return out

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "shards": self.shards, "replicas": self.replicas, "f": self.replicas - 1,
            "cut interval": f"{self.interval_us} us (timerfd grid; unchanged local cuts not reported)",
            "ordering": "one process, not Paxos-replicated: its latency is a lower bound on Scalog's",
            "durability": "memory on f+1 servers, disk async (5 ms batches, no fsync)",
            "transport": "pyzmq+msgpack, TCP loopback",
            # client -> server -> peer -> (next report tick) -> ordering -> server -> client
            "delays": "5 + wait for the peer's next report tick",
        }
        if self.addrs:  # running: what the timer achieved so far (worst server)
            stats = self.timer_stats()
            late = [st["tick_late_us"] for st in stats if st["tick_late_us"]]
            waits = [st["report_wait_us"] for st in stats if st["report_wait_us"]]
            if late:
                d["tick lateness"] = (f"p50 {max(x['p50'] for x in late):.0f} us, "
                                      f"p99 {max(x['p99'] for x in late):.0f} us after the grid point")
            if waits:
                d["report wait"] = (f"p50 {max(w['p50'] for w in waits):.0f} us, p99 {max(w['p99'] for w in waits):.0f} us "
                                    f"(ideal: uniform over 0..{self.interval_us})")
        return d


def _server_socket(s: zmq.Socket[Any], servers: list[str], server: int) -> None:
    assert 0 <= server < len(servers), f"server {server} is not one of {len(servers)}"
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    s.connect(servers[server])


class ScalogAppender:
    """Blocking client: one append at a time, to storage server ``server`` of the shard."""

    def __init__(self, servers: list[str], server: int = 0, timeout_s: float = 10.0) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        _server_socket(self.sock, servers, server)
        self.sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self.req_id = 0
        self._pack = msgpack.Packer().pack  # reused: msgpack.packb builds a Packer per call

    def append(self, data: bytes) -> int:
        self.req_id = rid = self.req_id + 1
        self.sock.send(self._pack([APPEND, rid, data]))
        try:
            r, gsn = msgpack.unpackb(self.sock.recv())
        except zmq.Again:
            raise TimeoutError(f"append {rid}: no acknowledgement within the timeout") from None
        if r != rid:
            raise AssertionError(f"append {rid}: acknowledgement for request {r}")
        return int(gsn)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class AsyncScalogAppender(PipelinedAppender):
    """asyncio client: any number of appends in flight, matched to acks by req_id."""

    def __init__(self, servers: list[str], server: int = 0, timeout_s: float = 10.0) -> None:
        super().__init__(timeout_s)
        self.sock = self.ctx.socket(zmq.DEALER)
        _server_socket(self.sock, servers, server)
        self._start(self.sock, self._on_ack)

    def _on_ack(self, frame: bytes) -> None:
        rid, gsn = msgpack.unpackb(frame)
        w = self.pending.pop(rid, None)
        if w is not None and not w.future.done():
            w.future.set_result(gsn)

    def _sockets(self) -> list[Any]:
        return [self.sock]

    async def append(self, data: bytes) -> int:
        if self.broken is not None:
            raise RuntimeError(f"appender unusable: {self.broken!r}")
        self.req_id = rid = self.req_id + 1
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.pending[rid] = Waiting(fut, time.monotonic())
        await self.sock.send(self._pack([APPEND, rid, data]))
        return await fut


def open_sync(servers: list[str], server: int = 0, timeout_s: float = 10.0) -> ScalogAppender:
    return ScalogAppender(servers, server, timeout_s)


async def open_async(servers: list[str], server: int = 0, timeout_s: float = 10.0) -> AsyncScalogAppender:
    return AsyncScalogAppender(servers, server, timeout_s)
