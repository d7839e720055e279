"""The Scalog-style log (:mod:`bench.baselines.scalog`) behind the interface LogDB uses
of a log, so the same LogDB code (client, coordinator, KV shards) runs on it: the
paper's comparison (dissertation 4.4.6: appendToShard + readRecord).

(asyncio: what the coordinator and KV shard processes and the benchmark's clients use)

* ``insert_after(data, after)``: an append to a random shard; Scalog acknowledges a
  record once a cut orders it, so any record appended after ``after`` was acknowledged
  gets a higher gsn (asserted): InsertAfter is an append;
* ``read_record(rid)``: READ from a server of the record's shard;
* ``subscribe(start)``: SUBSCRIBE to one server per shard, merged in gsn order up to
  the smallest ``ordered`` point (every gsn below it is assigned, on every shard);
* ``trim``: nothing (the benchmark does not collect).

Scalog's gsns start at 0; here they are shifted by one, so 0 keeps meaning "none".
"""

from __future__ import annotations

import asyncio
import heapq
import random
from collections import deque
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from bench.baselines.scalog import APPEND, READ, SUBSCRIBE
from ziplog.protocol.errors import NotFoundError, ZiplogTimeoutError
from ziplog.protocol.types import RID_GENESIS, RecordId


def _dealer(ctx: Any, addr: str) -> Any:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 100_000)
    s.setsockopt(zmq.RCVHWM, 100_000)
    s.connect(addr)
    return s


class AsyncScalogLog:
    """asyncio: any number of requests in flight, matched by req id."""

    def __init__(self, addrs: list[list[str]], timeout_s: float = 10.0, seed: int | None = None) -> None:
        self.addrs = addrs
        self.ctx = zmq.asyncio.Context()
        self.rng = random.Random(seed)
        self.socks = [_dealer(self.ctx, servers[self.rng.randrange(len(servers))]) for servers in addrs]
        self.timeout_s = timeout_s
        self.req = 0
        self.waiting: dict[int, asyncio.Future[Any]] = {}
        self.readers = [asyncio.get_running_loop().create_task(self._read(s)) for s in self.socks]

    async def _read(self, sock: Any) -> None:
        while True:
            req, value = msgpack.unpackb(await sock.recv())
            fut = self.waiting.pop(req, None)
            if fut is not None and not fut.done():
                fut.set_result(value)

    async def _call(self, shard: int, msg: list[Any]) -> Any:
        self.req += 1
        msg[1] = req = self.req
        fut = self.waiting[req] = asyncio.get_running_loop().create_future()
        await self.socks[shard].send(msgpack.packb(msg))
        try:
            return await asyncio.wait_for(fut, self.timeout_s)
        except asyncio.TimeoutError:
            raise ZiplogTimeoutError(f"Scalog-style shard {shard}: no answer") from None
        finally:
            self.waiting.pop(req, None)

    async def insert_after(self, data: bytes, after: RecordId = RID_GENESIS, shard: int | None = None) -> RecordId:
        """An append to ``shard`` (default: a random one)."""
        if shard is None:
            shard = self.rng.randrange(len(self.socks))
        gsn = int(await self._call(shard, [APPEND, 0, data])) + 1
        assert gsn > after.gsn, (gsn, after)
        return RecordId(gsn, shard)

    async def read_record(self, rid: RecordId) -> bytes:
        data = await self._call(rid.shard, [READ, 0, rid.gsn - 1])
        if data is None:
            raise NotFoundError(f"no record at {rid}")
        return bytes(data)

    async def trim(self, rid: RecordId) -> None:
        pass

    def subscribe(self, start: RecordId = RID_GENESIS) -> "AsyncScalogSubscription":
        return AsyncScalogSubscription(self, max(start.gsn, 1))

    async def close(self) -> None:
        for t in self.readers:
            t.cancel()
        for s in self.socks:
            s.close(0)
        self.ctx.destroy(linger=0)


class _Rec:
    __slots__ = ("rid", "data")

    def __init__(self, rid: RecordId, data: bytes) -> None:
        self.rid = rid
        self.data = data


class AsyncScalogSubscription:
    """Every record from gsn ``start`` on, in gsn order, merged over the shards."""

    def __init__(self, log: AsyncScalogLog, start: int) -> None:
        self.log = log
        self.start = start
        self.socks = [_dealer(log.ctx, servers[0]) for servers in log.addrs]
        #: per shard: every gsn up to here is assigned (1-based)
        self.progress = [start - 1] * len(self.socks)
        self.heap: list[tuple[int, int, bytes]] = []
        self.delivered = start - 1
        self.ready: deque[tuple[int, int, bytes]] = deque()
        self._wake = asyncio.Event()
        self.readers: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> "AsyncScalogSubscription":
        loop = asyncio.get_running_loop()
        for shard, s in enumerate(self.socks):
            await s.send(msgpack.packb([SUBSCRIBE, 1, self.start - 1]))
            self.readers.append(loop.create_task(self._read(shard, s)))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for t in self.readers:
            t.cancel()
        for s in self.socks:
            s.close(0)

    async def _read(self, shard: int, sock: Any) -> None:
        while True:
            _, ordered, batch = msgpack.unpackb(await sock.recv())
            for g, d in batch:
                if g + 1 >= self.start:
                    heapq.heappush(self.heap, (g + 1, shard, d))
            self.progress[shard] = max(self.progress[shard], ordered)
            limit = min(self.progress)
            while self.heap and self.heap[0][0] <= limit:
                self.ready.append(heapq.heappop(self.heap))
            self.delivered = max(self.delivered, limit)
            self._wake.set()

    @property
    def position(self) -> int:
        return self.ready[0][0] - 1 if self.ready else self.delivered

    async def next(self, timeout: float | None = None) -> _Rec | None:
        if not self.ready and timeout != 0:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        if not self.ready:
            return None
        g, shard, d = self.ready.popleft()
        return _Rec(RecordId(g, shard), d)


class BlockingScalogSubscription:
    """A subscription for blocking code: the asyncio one on a loop of its own thread,
    its records handed over through a queue (``next(timeout)``, ``buffered``, ``close``)."""

    def __init__(self, addrs: list[list[str]]) -> None:
        import queue
        import threading
        self._q: queue.Queue[_Rec] = queue.Queue()
        self._loop = asyncio.new_event_loop()
        self._stopped = asyncio.Event()
        ready = threading.Event()

        async def follow() -> None:
            log = AsyncScalogLog(addrs)
            try:
                async with log.subscribe(RID_GENESIS) as sub:
                    ready.set()
                    while not self._stopped.is_set():
                        rec = await sub.next(timeout=0.1)
                        while rec is not None:
                            self._q.put(rec)
                            rec = await sub.next(timeout=0)
            finally:
                ready.set()
                await log.close()

        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(follow(),), daemon=True)
        self._thread.start()
        ready.wait(30)

    def next(self, timeout: float | None = None) -> _Rec | None:
        import queue
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            return None

    @property
    def buffered(self) -> int:
        return self._q.qsize()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(10)

