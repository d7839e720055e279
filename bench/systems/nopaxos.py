"""NOPaxos-style: end-host sequencing on ziplog's stack (servers in
:mod:`bench.baselines.nopaxos`). A client sends a record to the sequencer, which stamps
the next position and sends it to 2f+1 replicas; the append is done when f+1 replicas
including the leader replied with that position. Three message delays, as ziplog's
slow path (dissertation 4.4.1)."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from bench.baselines import (
    check_alive,
    new_client_id,
    python_module_argv,
    start_server,
    wait_ready,
)
from bench.baselines.nopaxos import HELLO, HELLO_REQ_ID
from ziplog.tools import procs

from .base import ClientSpec, PipelinedAppender, System, Waiting
from .cpus import CpuSpread
from .servers import make_temp_dir, remove_temp_dir


class NOPaxosSystem(System):
    name = "NOPaxos-style"

    def __init__(self, replicas: int = 3, data_dir: str | None = None, timeout_s: float = 10.0) -> None:
        assert replicas >= 1 and replicas % 2 == 1, f"NOPaxos runs 2f+1 replicas, got {replicas}"
        self.replicas = replicas
        self.f = (replicas - 1) // 2
        self.data_parent = data_dir
        self.timeout_s = timeout_s
        self.dir: Path | None = None
        self.procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
        self.replica_addrs: list[str] = []
        self.sequencer_addr: str | None = None

    def start(self) -> None:
        self.dir = make_temp_dir("nopaxos-", self.data_parent)
        argvs = {f"replica {i}": python_module_argv("bench.baselines.nopaxos", "replica", "--index", str(i),
                                                    "--data", str(self.dir / f"replica{i}.log"))
                 for i in range(self.replicas)}
        spread = CpuSpread()
        for label, argv in argvs.items():  # start them all, then wait: start-ups overlap
            log = self.dir / f"{label.replace(' ', '')}.out"
            self.procs[label] = (start_server(spread.argv(argv), log), log)
        self.replica_addrs = [f"tcp://127.0.0.1:{wait_ready(*self.procs[label], label)[0]}" for label in argvs]
        argv = python_module_argv("bench.baselines.nopaxos", "sequencer",
                                  *[x for a in self.replica_addrs for x in ("--replica", a)])
        log = self.dir / "sequencer.out"
        self.procs["sequencer"] = (start_server(spread.argv(argv), log), log)
        self.sequencer_addr = f"tcp://127.0.0.1:{wait_ready(*self.procs['sequencer'], 'sequencer')[0]}"

    def stop(self) -> None:
        procs.stop_many([p for p, _ in self.procs.values()])
        self.procs = {}
        remove_temp_dir(self.dir)
        self.dir = None
        self.replica_addrs, self.sequencer_addr = [], None

    def check_alive(self) -> None:
        """Raise with its log if a server died (a replica stops on a sequence gap)."""
        check_alive(self.procs)

    def client_spec(self, shard: int = 0) -> ClientSpec:
        assert self.sequencer_addr is not None, "start() first"
        return ClientSpec(__name__, {"sequencer": self.sequencer_addr, "replicas": list(self.replica_addrs),
                                     "timeout_s": self.timeout_s})

    def server_pids(self) -> list[int]:
        return [p.pid for p, _ in self.procs.values()]

    def describe(self) -> dict[str, Any]:
        return {"replicas": self.replicas, "f": self.f,
                "quorum": f"f+1 = {self.f + 1} replies incl. the leader",
                "sequencer": "end-host process, one TCP connection per replica",
                "durability": "memory on f+1 replicas, disk async (5 ms batches, no fsync)",
                "transport": "pyzmq+msgpack, TCP loopback", "delays": 3,
                "failures": "normal case only (gap = error, no view change)"}


def _reply_socket(s: zmq.Socket[Any], client_id: bytes, replicas: list[str]) -> None:
    """One DEALER connected to every replica: replies from all of them arrive on one
    socket, so a blocking client waits with one recv and no poll set."""
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTING_ID, client_id)
    s.setsockopt(zmq.RCVHWM, 0)  # a pipelining client may have many replies queued
    for a in replicas:
        s.connect(a)


def _sequencer_socket(s: zmq.Socket[Any], client_id: bytes, addr: str) -> None:
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTING_ID, client_id)
    s.setsockopt(zmq.SNDHWM, 0)
    s.connect(addr)


def _greet(sock: zmq.Socket[Any], n: int, timeout_s: float) -> None:
    """Make sure every replica routes to us before the first append: send HELLOs (the
    DEALER deals them round-robin, one per connection) until all ``n`` answered."""
    hello = msgpack.packb([HELLO])
    seen: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while len(seen) < n:
        for _ in range(n - len(seen)):
            sock.send(hello)
        round_end = min(deadline, time.monotonic() + 0.2)
        while len(seen) < n and sock.poll(max(1, int((round_end - time.monotonic()) * 1000))):
            rid, _, replica = msgpack.unpackb(sock.recv())
            if rid == HELLO_REQ_ID:
                seen.add(replica)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"NOPaxos replicas {sorted(set(range(n)) - seen)} did not answer HELLO")


class NOPaxosAppender:
    """Blocking client: one append at a time."""

    def __init__(self, sequencer: str, replicas: list[str], timeout_s: float = 10.0) -> None:
        self.quorum = (len(replicas) - 1) // 2 + 1
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.client_id = new_client_id()
        self.replies = self.ctx.socket(zmq.DEALER)
        _reply_socket(self.replies, self.client_id, replicas)
        self.to_sequencer = self.ctx.socket(zmq.DEALER)
        _sequencer_socket(self.to_sequencer, self.client_id, sequencer)
        try:
            _greet(self.replies, len(replicas), timeout_s)
        except BaseException:
            self.close()
            raise
        self.replies.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self.req_id = HELLO_REQ_ID
        self._pack = msgpack.Packer().pack  # reused: msgpack.packb builds a Packer per call

    def append(self, data: bytes) -> int:
        self.req_id = rid = self.req_id + 1
        self.to_sequencer.send(self._pack([rid, data]))
        recv, unpackb, quorum = self.replies.recv, msgpack.unpackb, self.quorum
        got = 0
        position = -1
        leader = False
        while True:
            try:
                r, pos, replica = unpackb(recv())
            except zmq.Again:
                raise TimeoutError(f"append {rid}: {got} replica replies (leader: {leader}) "
                                   f"within the timeout, need {quorum} incl. the leader") from None
            if r != rid:
                continue  # a late reply to an earlier append, from a replica outside its quorum
            if got == 0:
                position = pos
            elif pos != position:
                raise AssertionError(f"append {rid}: replica {replica} put it at {pos}, another at {position}")
            got += 1
            if replica == 0:
                leader = True
            if leader and got >= quorum:
                return position

    def close(self) -> None:
        self.replies.close(0)
        self.to_sequencer.close(0)
        self.ctx.term()


class _Wait(Waiting):
    __slots__ = ("got", "position", "leader")

    def __init__(self, future: asyncio.Future[int], sent_at: float) -> None:
        super().__init__(future, sent_at)
        self.got = 0
        self.position = -1
        self.leader = False


class AsyncNOPaxosAppender(PipelinedAppender):
    """asyncio client: any number of appends in flight, matched to replies by req_id."""

    def __init__(self, sequencer: str, replicas: list[str], timeout_s: float = 10.0) -> None:
        super().__init__(timeout_s)
        self.replica_addrs = replicas
        self.sequencer_addr = sequencer
        self.quorum = (len(replicas) - 1) // 2 + 1
        self.client_id = new_client_id()
        self.req_id = HELLO_REQ_ID
        self.replies = self.ctx.socket(zmq.DEALER)
        _reply_socket(self.replies, self.client_id, self.replica_addrs)
        self.to_sequencer = self.ctx.socket(zmq.DEALER)
        _sequencer_socket(self.to_sequencer, self.client_id, self.sequencer_addr)

    async def _open(self) -> "AsyncNOPaxosAppender":
        await self._greet()
        self._start(self.replies, self._on_reply)
        return self

    async def _greet(self) -> None:
        n = len(self.replica_addrs)
        hello = msgpack.packb([HELLO])
        seen: set[int] = set()
        deadline = time.monotonic() + self.timeout_s
        while len(seen) < n:
            for _ in range(n - len(seen)):
                await self.replies.send(hello)
            round_end = min(deadline, time.monotonic() + 0.2)
            while len(seen) < n and await self.replies.poll(max(1, int((round_end - time.monotonic()) * 1000))):
                rid, _, replica = msgpack.unpackb(await self.replies.recv())
                if rid == HELLO_REQ_ID:
                    seen.add(replica)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"NOPaxos replicas {sorted(set(range(n)) - seen)} did not answer HELLO")

    def _on_reply(self, frame: bytes) -> None:
        rid, pos, replica = msgpack.unpackb(frame)
        w = self.pending.get(rid)
        if w is None:
            return  # late reply (outside the quorum) or a HELLO answer
        if w.got == 0:
            w.position = pos
        elif pos != w.position:
            del self.pending[rid]
            w.future.set_exception(AssertionError(f"append {rid}: replica {replica} put it at {pos}, another at {w.position}"))
            return
        w.got += 1
        if replica == 0:
            w.leader = True
        if w.leader and w.got >= self.quorum:
            del self.pending[rid]
            if not w.future.done():
                w.future.set_result(pos)

    def _timed_out(self, rid: int, w: Any) -> Exception:
        return TimeoutError(f"append {rid}: {w.got} replica replies (leader: {w.leader}) within the timeout")

    def _sockets(self) -> list[Any]:
        return [self.replies, self.to_sequencer]

    async def append(self, data: bytes) -> int:
        if self.broken is not None:
            raise RuntimeError(f"appender unusable: {self.broken!r}")
        self.req_id = rid = self.req_id + 1
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.pending[rid] = _Wait(fut, time.monotonic())
        await self.to_sequencer.send(self._pack([rid, data]))
        return await fut


def open_sync(sequencer: str, replicas: list[str], timeout_s: float = 10.0) -> NOPaxosAppender:
    return NOPaxosAppender(sequencer, replicas, timeout_s)


async def open_async(sequencer: str, replicas: list[str], timeout_s: float = 10.0) -> AsyncNOPaxosAppender:
    appender = AsyncNOPaxosAppender(sequencer, replicas, timeout_s)
    try:
        return await appender._open()
    except BaseException:
        await appender.close()
        raise
