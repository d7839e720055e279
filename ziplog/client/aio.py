"""The asyncio client: ``ziplog.AsyncClient``, the twin of the blocking ``ziplog.Client``.

    import ziplog, ziplog.aio

    async def main(hosts):
        async with ziplog.AsyncClient(hosts) as log:
            a = await log.insert_after(b"hello")
            async with log.subscribe() as sub:
                async for rec in sub:
                    print(rec.rid, rec.data)

    ziplog.aio.run(main(hosts))      # on uvloop when it is installed

Any number of tasks of one event loop may share one client. The protocol is the client
core, driven by the same :class:`~ziplog.client.driver.ClientDriver` as the blocking
client, on an asyncio runtime; a call's coroutine waits for the driver to say it is done.
"""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any, AsyncIterator, Coroutine, Sequence, TypeVar

from ziplog.client.common import (
    INSERT_WINDOW,
    ClientBase,
    SubscriptionBase,
    new_client_id,
    payloads_of,
)
from ziplog.client.driver import ClientDriver, Record, SubscriptionDriver
from ziplog.cores.client.calls import Call
from ziplog.cores.client.state import NS_PER_S, ClientState
from ziplog.cores.client.subscription import SubState
from ziplog.cores.client.watermark import RangePager, WatermarkQuery
from ziplog.io import zk
from ziplog.io.asyncio_runtime import AsyncioRuntime
from ziplog.io.keys import client_credentials
from ziplog.io.ports import wall_offset_ns
from ziplog.protocol.keys import Credentials
from ziplog.io.zmtp_poll import native_transport_wanted
from ziplog.protocol import frames as wire
from ziplog.protocol.errors import (
    ClientClosedError,
    NoShardAvailableError,
    ZiplogError,
    ZiplogTimeoutError,
)
from ziplog.protocol.types import RID_GENESIS, Policy, RecordId

__all__ = ["AsyncClient", "AsyncSubscription", "Record", "run"]

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``, on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    if hasattr(asyncio, "Runner"):  # Python 3.11+
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    return uvloop.run(coro)  # type: ignore[attr-defined,no-any-return]


class AsyncClient(ClientBase):
    """An asyncio ziplog client. Start it with ``await AsyncClient.connect(...)`` or
    ``async with AsyncClient(...)``; any number of tasks of one event loop may use it."""

    def __init__(self, zk_hosts: str, *, timeout: float = 30.0, policy: Policy | None = None,
                 client_id: int | None = None, key_file: str | os.PathLike[str] | None = None,
                 credentials: Credentials | None = None) -> None:
        self.zk_hosts = zk_hosts
        #: CURVE keys (``credentials``, else from ``key_file`` or ``$ZIPLOG_CLIENT_KEY_FILE``;
        #: a cluster's own processes pass the cluster's); None: NULL
        self.credentials = credentials if credentials is not None else client_credentials(key_file)
        self.timeout = timeout
        self._state = ClientState(client_id if client_id is not None else new_client_id(), policy, random.Random(),
                                  int(timeout * 1e9), wall_offset_ns=wall_offset_ns())
        self._zk: Any = None
        self.topology: zk.Topology | None = None
        self._rt: AsyncioRuntime | None = None
        self._driver: ClientDriver | None = None
        self._subs: list[AsyncSubscription] = []
        self._closed = False

    def live_shards(self) -> list[int]:
        """Shards in the current membership with every replica up."""
        assert self.topology is not None
        return list(self.topology.live_shards())

    # -- lifecycle --------------------------------------------------------------------------------
    @classmethod
    async def connect(cls, zk_hosts: str, **kw: Any) -> "AsyncClient":
        client = cls(zk_hosts, **kw)
        await client._start()
        return client

    async def _start(self) -> None:
        if self._driver is not None:
            return
        if self._closed:
            raise ClientClosedError("client is closed")

        def start() -> tuple[Any, zk.Topology]:  # blocking: runs in a worker thread
            conn = zk.connect(self.zk_hosts)
            try:
                topo = zk.Topology(conn)
                if not topo.wait(lambda: bool(topo.live_shards()), self.timeout):
                    raise NoShardAvailableError("no live shard appeared in ZooKeeper")
            except BaseException:
                zk.stop(conn)
                raise
            return conn, topo

        self._zk, topology = await asyncio.to_thread(start)
        self._rt = rt = AsyncioRuntime(native=native_transport_wanted() or self.credentials is not None,
                                       credentials=self.credentials)
        self.topology = topology
        self._driver = driver = ClientDriver(rt, rt, topology, self._state)
        topology.on_change(lambda: rt.call_soon_threadsafe(driver.on_topology))

    async def close(self) -> None:
        """Close every subscription and socket; requests still in flight fail with
        ClientClosedError."""
        if self._closed:
            return
        self._closed = True
        for sub in list(self._subs):
            await sub.aclose()
        if self._driver is not None:
            self._driver.close()
        if self._rt is not None:
            await self._rt.aclose()
        if self._zk is not None:
            await asyncio.to_thread(zk.stop, self._zk)

    async def __aenter__(self) -> "AsyncClient":
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def _live_driver(self) -> ClientDriver:
        if self._closed:
            raise ClientClosedError("client is closed")
        if self._driver is None:
            raise ClientClosedError("client is not connected: use `await AsyncClient.connect(...)` or `async with`")
        return self._driver

    async def _wait(self, start: Any) -> Any:
        """Start a call through ``start(on_done)`` and wait until the driver says it is done."""
        done = asyncio.get_running_loop().create_future()

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        call: Call = start(finished)
        if not call.done:
            await done
        return call.result()

    # -- the calls --------------------------------------------------------------------------------
    async def insert_after(self, data: bytes, after: RecordId = RID_GENESIS, *, key: bytes | None = None) -> RecordId:
        """Insert ``data`` somewhere after record ``after``; returns its record id, whose
        gsn is greater than ``after.gsn``. Raises ``ReusedIdentityError`` (the record is
        already in the log, at its ``rid``) if a replica answers a gsn not above it: this
        client's id was used before, and this record's sequence number placed after
        another rid."""
        driver = self._live_driver()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError("data must be bytes")
        payload, after_gsn = bytes(data), max(after.gsn, 0)
        rid: RecordId = await self._wait(lambda done: driver.insert(payload, after_gsn, key, done))
        assert rid.gsn > after.gsn, ("InsertAfter returned a gsn not above the rid", rid, after)
        return rid

    async def insert_many(self, records: Sequence[bytes], after: RecordId = RID_GENESIS, *,
                          key: bytes | None = None, window: int = INSERT_WINDOW) -> list[RecordId]:
        """Insert every record somewhere after ``after``, at most ``window`` in flight
        (see :meth:`ziplog.Client.insert_many`); their record ids, in the order given.
        Concurrent ``insert_after`` calls from many tasks pipeline too."""
        driver = self._live_driver()
        payloads = payloads_of(records)
        after_gsn = max(after.gsn, 0)
        rids: list[RecordId] = []
        for lo in range(0, len(payloads), window):
            chunk = payloads[lo:lo + window]
            got = await asyncio.gather(*(self._wait(lambda done, p=p: driver.insert(p, after_gsn, key, done))
                                         for p in chunk), return_exceptions=True)
            errors = [g for g in got if isinstance(g, BaseException)]
            if errors:
                raise errors[0]
            for rid in got:
                assert rid.gsn > after.gsn, ("InsertAfter returned a gsn not above the rid", rid, after)  # type: ignore[union-attr]
                rids.append(rid)  # type: ignore[arg-type]
        return rids

    async def read_record(self, rid: RecordId) -> bytes:
        """The record with id ``rid``. Raises TrimmedError below the trim point and
        NotFoundError where the log holds no record."""
        driver = self._live_driver()
        data: bytes = await self._wait(lambda done: driver.read(rid, done))
        return data

    async def trim(self, rid: RecordId) -> None:
        """Delete every record below ``rid`` on every shard."""
        driver = self._live_driver()
        if rid.gsn <= 0:
            return
        topo = driver.topology
        shards = topo.shards()
        for shard in shards:
            if topo.replica_addrs(shard) is None:
                raise ZiplogError(f"shard {shard} is not fully up; cannot trim everywhere")
        await self._wait(lambda done: driver.each_replica(shards, lambda req: wire.Trim(req_id=req, gsn=rid.gsn),
                                                          "trim", done))

    async def status(self, wait: float = 1.0) -> dict[int, list[dict[str, Any]]]:
        """Every replica the topology names, answered or not (see :meth:`ziplog.Client.status`)."""
        driver = self._live_driver()
        result: dict[int, list[dict[str, Any]]] = await self._wait(
            lambda done: driver.status(int(wait * NS_PER_S), done))
        return result

    def subscribe(self, start: RecordId = RID_GENESIS, end: int | None = None) -> "AsyncSubscription":
        """Iterate the log in gsn order from ``start`` (inclusive): forever, or up to gsn
        ``end`` (inclusive). For RID_RECENT the position is found by a status round trip:
        ``async with`` or ``await`` the subscription to know it is fixed before inserting
        what it must see."""
        driver = self._live_driver()
        sub = AsyncSubscription(self, driver.subscribe(start), end)
        self._subs.append(sub)
        return sub

    # -- ranges and the watermark ---------------------------------------------------------------
    async def watermark(self) -> int:
        """The stable-prefix watermark (see :meth:`ziplog.Client.watermark`)."""
        driver = self._live_driver()
        assert self.topology is not None
        query = WatermarkQuery(self.topology.history, self._state)

        async def ask(shard: int) -> None:
            try:
                query.got(shard, await self._wait(lambda done: driver.shard_query(shard, query.request, "watermark",
                                                                                   done)))
            except ZiplogError:
                query.got(shard, None)
        while True:
            await asyncio.gather(*(ask(s) for s in query.to_ask()))
            # read after the stables: the history covers every epoch they reach
            w = query.on_history(await asyncio.to_thread(zk.read_membership_history, self._zk))
            if w is not None:
                return w

    async def count_range(self, shard: int, lo: int, hi: int, nth: int = 0) -> tuple[int, int, int]:
        """See :meth:`ziplog.Client.count_range`."""
        driver = self._live_driver()
        msg = await self._wait(lambda done: driver.shard_query(
            shard, lambda req: wire.Count(req_id=req, lo=lo, hi=hi, nth=nth), "count", done))
        return msg.count, msg.nth_gsn, msg.upto

    async def read_range(self, shard: int, lo: int, hi: int) -> AsyncIterator[Record]:
        """See :meth:`ziplog.Client.read_range`."""
        driver = self._live_driver()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        pager = RangePager(lo, hi)
        while not pager.done:
            make = pager.request()
            msg = await self._wait(lambda done: driver.shard_query(shard, make, "range", done))
            for g, data in msg.records:
                yield Record(RecordId(g, shard), data)
            if pager.on_answer(msg):
                deadline = loop.time() + self.timeout
            elif loop.time() > deadline:
                raise ZiplogTimeoutError(f"shard {shard} is not stable up to gsn {hi}")
            else:
                await asyncio.sleep(0.005)  # the replica asked is behind the watermark: ask again


class AsyncSubscription(SubscriptionBase):
    """Async iterator over records in gsn order. ``aclose()`` it (or use ``async with``) to
    free its sockets; iteration ends once it is closed."""

    def __init__(self, client: AsyncClient, sub: SubscriptionDriver, end: int | None = None) -> None:
        self._client = client
        self._sub = sub
        self.end = end
        self._wake = asyncio.Event()
        self._closed = False
        sub.on_change = self._wake.set

    async def ready(self) -> "AsyncSubscription":
        """Wait until the start position is fixed: immediate, but for RID_RECENT a status
        round trip. Records inserted after this are seen; ``async with`` and ``await`` of
        the subscription do this."""
        core = self._sub.core
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._client.timeout
        while core.state is SubState.POSITIONING:
            self._wake.clear()
            left = deadline - loop.time()
            if left <= 0:
                raise asyncio.TimeoutError("subscription position not found in time")
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except asyncio.TimeoutError:
                pass
        if core.state is SubState.FAILED and core.merge is None:
            core.raise_error()
        return self

    def __await__(self) -> Any:
        return self.ready().__await__()

    def __aiter__(self) -> "AsyncSubscription":
        return self

    async def __anext__(self) -> Record:
        try:
            rec = await self.next()
        except ClientClosedError:
            raise StopAsyncIteration from None
        if rec is None:
            assert self.ended
            raise StopAsyncIteration
        return rec

    async def next(self, timeout: float | None = None) -> Record | None:
        """The next record, or None if none arrives within ``timeout`` seconds (or the
        subscription reached its ``end``: see :attr:`ended`). Raises ClientClosedError
        once closed, and the error that broke the subscription if any."""
        return await self._next(timeout, None)

    async def next_until(self, position: int, timeout: float | None = None) -> Record | None:
        """The next record, or None as soon as none is buffered and :attr:`position` is
        at or past ``position`` (or after ``timeout`` seconds): a reader catches up to
        a position without waiting for a record that may never come."""
        return await self._next(timeout, position)

    async def _next(self, timeout: float | None, until: int | None) -> Record | None:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        sub = self._sub
        sub.read()
        while True:
            if self._closed:
                raise ClientClosedError("subscription is closed")
            if self.end is not None and self.ended:
                return None
            rec = sub.pop()
            if rec is not None:
                return rec
            sub.core.raise_error()
            if until is not None and sub.core.position >= until:
                return None
            self._wake.clear()
            if deadline is None:
                await self._wake.wait()
                continue
            left = deadline - loop.time()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sub.close()
        self._wake.set()  # a consumer waiting in next() ends
        if self in self._client._subs:
            self._client._subs.remove(self)

    async def __aenter__(self) -> "AsyncSubscription":
        try:
            return await self.ready()
        except BaseException:
            await self.aclose()
            raise

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
