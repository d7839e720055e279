"""The floor: what the cheapest "write to two replicas and wait for both" costs here
with ziplog's own stack (Python, pyzmq, msgpack, TCP on loopback).

Two echo processes (``python -m bench.echo_server``), each a ROUTER that sends every
message straight back. A client packs the record into one msgpack frame, sends it on
one DEALER per echo server and waits for both replies. No ordering, no replication
logic, no disk: any log on this stack costs at least this much."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import zmq

from .base import ClientSpec, System, Unavailable
from .cpus import CpuSpread

_ROOT = Path(__file__).resolve().parents[2]  # the directory holding the ``bench`` package


def start_echo_server(timeout: float = 15.0, extra_args: tuple[str, ...] = (),
                      spread: CpuSpread | None = None) -> tuple[subprocess.Popen[str], int]:
    """Start ``python -m bench.echo_server --port 0 *extra_args`` (on ``spread``'s next
    CPU, if given); the process and its port."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    argv = [sys.executable, "-m", "bench.echo_server", "--port", "0", *extra_args]
    proc = subprocess.Popen(spread.argv(argv) if spread is not None else argv,
                            stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, cwd=str(_ROOT), env=env, text=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("READY "):
            raise Unavailable(f"echo server did not start (exit={proc.poll()}, said {line!r})")
        return proc, int(line.split()[1])
    except BaseException:
        stop_process(proc)
        raise


def stop_process(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


class FloorSystem(System):
    """Echo processes and a client of them. A variant names its echo processes'
    arguments, what they are, the module its clients live in, and whether uvloop is
    needed."""

    name = "floor"
    echo_args: tuple[str, ...] = ()
    servers_are = "echo processes"
    client_module = __name__
    needs_uvloop = False

    def __init__(self, servers: int = 2) -> None:
        self.n_servers = servers
        self.procs: list[subprocess.Popen[str]] = []
        self.ports: list[int] = []

    def start(self) -> None:
        if self.needs_uvloop and importlib.util.find_spec("uvloop") is None:
            raise Unavailable("uvloop is not importable: pip install uvloop (make setup installs the fast extra)")
        spread = CpuSpread()
        for _ in range(self.n_servers):
            proc, port = start_echo_server(extra_args=self.echo_args, spread=spread)
            self.procs.append(proc)
            self.ports.append(port)

    def stop(self) -> None:
        for p in self.procs:
            stop_process(p)
        self.procs, self.ports = [], []

    def client_spec(self, shard: int = 0) -> ClientSpec:
        return ClientSpec(self.client_module, {"ports": list(self.ports)})

    def server_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def describe(self) -> dict[str, Any]:
        return {"replication": f"{self.n_servers} {self.servers_are}", "durability": "none", "delays": 2}


class FloorAppender:
    """Send one frame to every echo server, wait for every reply (the bench's floor)."""

    def __init__(self, ports: list[int]) -> None:
        self.ctx = zmq.Context()
        self.socks: list[zmq.Socket] = []
        for port in ports:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, 10_000)  # a dead echo server raises zmq.Again, not a hang
            s.connect(f"tcp://127.0.0.1:{port}")
            self.socks.append(s)
        self.n = 0

    def append(self, data: bytes) -> Any:
        self.n += 1
        frame = msgpack.packb([self.n, data])
        for s in self.socks:
            s.send(frame, copy=False)
        for s in self.socks:  # latency is that of the slower reply; order doesn't matter
            reply = msgpack.unpackb(s.recv(copy=False).buffer)
        assert reply[0] == self.n
        return self.n

    def close(self) -> None:
        for s in self.socks:
            s.close(0)
        self.ctx.term()


class AsyncFloorAppender:
    """The floor with any number of frames in flight, matched by a request number."""

    def __init__(self, ports: list[int]) -> None:
        import zmq.asyncio
        self.ctx = zmq.asyncio.Context()
        self.socks = []
        for port in ports:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{port}")
            self.socks.append(s)
        self.ids = itertools.count(1)
        self.waiting: dict[int, tuple[asyncio.Future[int], list[int]]] = {}
        self.readers = [asyncio.ensure_future(self._read(s)) for s in self.socks]

    async def _read(self, sock: Any) -> None:
        while True:
            req = msgpack.unpackb(await sock.recv())[0]
            entry = self.waiting.get(req)
            if entry is not None:
                entry[1][0] -= 1
                if entry[1][0] == 0:
                    del self.waiting[req]
                    entry[0].set_result(req)

    async def append(self, data: bytes) -> Any:
        req = next(self.ids)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.waiting[req] = (fut, [len(self.socks)])
        frame = msgpack.packb([req, data])
        for s in self.socks:
            await s.send(frame, copy=False)
        return await fut

    async def close(self) -> None:
        for r in self.readers:
            r.cancel()
        await asyncio.gather(*self.readers, return_exceptions=True)
        for s in self.socks:
            s.close(0)
        self.ctx.term()


def open_sync(ports: list[int]) -> FloorAppender:
    return FloorAppender(ports)


async def open_async(ports: list[int]) -> AsyncFloorAppender:
    return AsyncFloorAppender(ports)
