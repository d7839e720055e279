"""The raw ZeroMQ latency floor.

What the cheapest possible "write to two replicas and wait for both" costs on this
machine with the same stack ziplog uses (Python, pyzmq, msgpack, TCP on loopback): a
client with one DEALER per echo server packs one record (a msgpack array holding the
payload bytes), sends it to both servers, waits for both replies and decodes them.
Each echo server is a separate process with a ROUTER that sends everything back.
"""

from __future__ import annotations

import gc
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import zmq

_ROOT = Path(__file__).resolve().parent.parent  # the directory holding the ``bench`` package


def _start_echo_server(timeout: float = 15.0) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.echo_server", "--port", "0"],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        cwd=str(_ROOT),
        env=env,
        text=True,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("READY "):
            raise RuntimeError(f"echo server did not start (exit={proc.poll()}, said {line!r})")
        return proc, int(line.split()[1])
    except BaseException:
        _stop(proc)
        raise


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


class EchoPair:
    """Two echo server processes and a client with one DEALER connected to each.

    Use as a context manager; the processes are killed on exit, also on exceptions.
    :meth:`measure` can be called any number of times (e.g. interleaved with other
    measurements) while the pair is open."""

    def __init__(self, servers: int = 2) -> None:
        self.n_servers = servers
        self.procs: list[subprocess.Popen] = []
        self.ports: list[int] = []
        self.ctx: zmq.Context | None = None
        self.socks: list[zmq.Socket] = []

    def __enter__(self) -> "EchoPair":
        try:
            for _ in range(self.n_servers):
                proc, port = _start_echo_server()
                self.procs.append(proc)
                self.ports.append(port)
            self.ctx = zmq.Context()
            for port in self.ports:
                s = self.ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.RCVTIMEO, 10_000)  # a dead echo server raises zmq.Again, not a hang
                s.connect(f"tcp://127.0.0.1:{port}")
                self.socks.append(s)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for s in self.socks:
            s.close(0)
        self.socks = []
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
        for p in self.procs:
            _stop(p)
        self.procs = []

    def measure(self, n: int, size: int = 4096, warmup: int = 200) -> list[int]:
        """``warmup`` untimed then ``n`` timed sequential round trips; latencies in ns."""
        payload = os.urandom(size)
        socks = self.socks
        packb, unpackb, clock = msgpack.packb, msgpack.unpackb, time.perf_counter_ns
        out = [0] * n
        gc.collect()
        for i in range(-warmup, n):
            t0 = clock()
            frame = packb([payload])
            for s in socks:
                s.send(frame, copy=False)
            for s in socks:  # latency is that of the slower reply; order doesn't matter
                reply = unpackb(s.recv(copy=False).buffer)
            t1 = clock()
            if i >= 0:
                out[i] = t1 - t0
        assert len(reply[0]) == size
        return out


def run_floor(n: int, size: int = 4096, warmup: int = 200) -> list[int]:
    """Start two echo servers, time ``n`` sequential send-to-both/wait-for-both round
    trips of a ``size``-byte record after ``warmup`` untimed ones, stop the servers and
    return the per-iteration latencies in nanoseconds."""
    with EchoPair() as pair:
        return pair.measure(n, size=size, warmup=warmup)
