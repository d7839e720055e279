"""The asyncio client: ``ziplog.AsyncClient``, the twin of the blocking ``ziplog.Client``.

    import ziplog, ziplog.aio

    async def main(hosts):
        async with ziplog.AsyncClient(hosts) as log:
            a = await log.insert_after(b"hello")
            async with log.subscribe() as sub:
                async for rec in sub:
                    print(rec.rid, rec.data)

    ziplog.aio.run(main(hosts))      # on uvloop when it is installed

Any number of tasks may share one client: every socket has exactly one reader
task, which hands each reply to the request waiting for its ``req_id``. The
protocol decisions (when an insert or a read is settled, fast or slow path,
redirects) are the sans-I/O classes of :mod:`ziplog.cores.client`, as in the
blocking client.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Coroutine, TypeVar

import zmq
import zmq.asyncio

from ziplog.io import zk as discovery
from ziplog.protocol import frames as wire
from ziplog.client.blocking import STABLE_READ_WAIT_S, SUB_CREDIT_BYTES, SUB_KEEPALIVE_S, Record
from ziplog.cores.client import RETRY_AFTER_S, RETRY_TROUBLED_S, ClientCommon, EachReplica, InsertWait, ReadWait, Redirect
from ziplog.protocol.errors import (ClientClosedError, NoShardAvailableError, UnknownRecordError, ZiplogError, ZiplogTimeoutError,
                     from_reply)
from ziplog.cores.merge import SubscriberMerge
from ziplog.protocol.types import RID_GENESIS, RID_RECENT, Policy, RecordId
from ziplog.protocol.frames import PROTOCOL_VERSION as V
from ziplog.protocol.frames import pack, unpack

__all__ = ["AsyncClient", "AsyncSubscription", "Record", "run"]

T = TypeVar("T")

#: How often an idle subscription looks for shards it is not connected to yet.
SUB_RECONNECT_S = 0.2
#: How long a closed subscription's sockets may take to deliver their UNSUBSCRIBE.
SUB_UNSUBSCRIBE_LINGER_MS = 200


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


class _Stale(Exception):
    """The replica sockets a request waited on were replaced (the shard's addresses changed)."""


def _spawn(coro: Coroutine[Any, Any, Any], sock: zmq.asyncio.Socket, name: str) -> asyncio.Task[Any]:
    """A task owning ``sock``: the socket is closed once the task is over (even if it is
    cancelled before it ever ran)."""
    task = asyncio.get_running_loop().create_task(coro, name=name)
    task.add_done_callback(lambda _t: sock.close())  # with the socket's own LINGER
    return task


class _AsyncReplicas:
    """One DEALER per replica of a shard, each drained by its own reader task, which
    feeds replies to the waiter registered under the reply's req_id."""

    def __init__(self, ctx: zmq.asyncio.Context, addrs: list[str]) -> None:
        self.addrs = addrs
        self.closed: Callable[[], BaseException] | None = None  # the error for users, once closed
        #: req_id -> (wait, future, only): ``only`` set = a request sent to that replica alone
        self.pending: dict[int, tuple[Any, asyncio.Future[Any], int | None]] = {}
        self.socks: list[zmq.asyncio.Socket] = []
        self.readers: list[asyncio.Task[None]] = []
        for i, a in enumerate(addrs):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(a)
            self.socks.append(s)
            self.readers.append(_spawn(self._read(i, s), s, f"ziplog-reader-{a}"))

    async def _read(self, i: int, sock: zmq.asyncio.Socket) -> None:
        pending = self.pending
        while True:
            frame = await sock.recv()
            try:
                msg = unpack(frame)
            except Exception:
                continue
            if type(msg) is not list or len(msg) < 3:
                continue
            entry = pending.get(msg[2])
            if entry is None:
                continue  # a late answer to a request that is over
            wait, fut, only = entry
            if fut.done() or (only is not None and i != only):
                continue
            try:
                if wait.feed(i if only is None else 0, msg):
                    fut.set_result(wait)
            except Exception as exc:  # the server's error (or Redirect) for that request
                fut.set_exception(exc)

    def expect(self, wait: Any, only: int | None) -> asyncio.Future[Any]:
        fut = asyncio.get_running_loop().create_future()
        self.pending[wait.req_id] = (wait, fut, only)
        return fut

    def forget(self, req_id: int, fut: asyncio.Future[Any]) -> None:
        entry = self.pending.get(req_id)
        if entry is not None and entry[1] is fut:
            del self.pending[req_id]
        if fut.done() and not fut.cancelled():
            fut.exception()  # retrieved: no "exception was never retrieved" noise

    async def send(self, frame: bytes, only: int | None = None) -> None:
        if self.closed is not None:
            raise self.closed()
        copy = len(frame) < 65536  # zero-copy only pays off for large frames
        socks = self.socks if only is None else (self.socks[only],)
        try:
            for f in [s.send(frame, copy=copy) for s in socks]:
                await f
        except zmq.ZMQError:
            if self.closed is not None:
                raise self.closed() from None
            raise

    def close(self, exc: Callable[[], BaseException]) -> None:
        """Stop the readers (their sockets close once they are done); fail waiters and
        later sends with ``exc``."""
        self.closed = exc
        for t in self.readers:
            t.cancel()
        for _, fut, _ in self.pending.values():
            if not fut.done():
                fut.set_exception(exc())
        self.pending.clear()


class AsyncClient(ClientCommon):
    """An asyncio ziplog client. Start it with ``await AsyncClient.connect(...)`` or
    ``async with AsyncClient(...)``; any number of tasks of one event loop may use it."""

    def __init__(self, zk_hosts: str, *, timeout: float = 30.0, policy: Policy | None = None,
                 client_id: int | None = None) -> None:
        self.zk_hosts = zk_hosts
        self._init_identity(timeout, policy, client_id)
        self._zk: Any = None
        self.topology: discovery.Topology | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._shards: dict[int, _AsyncReplicas] = {}
        self._retired: set[asyncio.Task[None]] = set()  # readers of replaced sockets, still ending
        self._subs: list[AsyncSubscription] = []
        self._closed = False
        self.stats: dict[str, int] = {"fast_path": 0, "slow_path": 0, "retries": 0, "redirects": 0}

    # -- lifecycle ------------------------------------------------------------------------------
    @classmethod
    async def connect(cls, zk_hosts: str, **kw: Any) -> "AsyncClient":
        client = cls(zk_hosts, **kw)
        await client._start()
        return client

    async def _start(self) -> None:
        if self.topology is not None:
            return
        if self._closed:
            raise ClientClosedError("client is closed")

        def start() -> tuple[Any, discovery.Topology]:  # blocking: runs in a worker thread
            zk = discovery.connect(self.zk_hosts)
            try:
                topo = discovery.Topology(zk)
                if not topo.wait(lambda: bool(topo.live_shards()), self.timeout):
                    raise NoShardAvailableError("no live shard appeared in ZooKeeper")
            except BaseException:
                _stop_zk(zk)
                raise
            return zk, topo

        self._zk, topology = await asyncio.to_thread(start)
        self._ctx = zmq.asyncio.Context()
        self.topology = topology

    async def close(self) -> None:
        """Close every subscription and socket; requests still in flight fail with
        ClientClosedError."""
        if self._closed:
            return
        self._closed = True
        for sub in list(self._subs):
            await sub.aclose()
        for r in self._shards.values():
            r.close(lambda: ClientClosedError("client is closed"))
            self._retired.update(r.readers)
        self._shards.clear()
        if self._retired:
            await asyncio.gather(*self._retired, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        if self._zk is not None:
            await asyncio.to_thread(_stop_zk, self._zk)

    async def __aenter__(self) -> "AsyncClient":
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosedError("client is closed")
        if self.topology is None:
            raise ClientClosedError("client is not connected: use `await AsyncClient.connect(...)` or `async with`")

    # -- routing (the blocking client's, shared) ------------------------------------------------

    def _replicas(self, shard: int) -> _AsyncReplicas:
        assert self.topology is not None and self._ctx is not None
        addrs = self.topology.replica_addrs(shard)
        if addrs is None:
            raise UnknownRecordError(f"shard {shard} is unknown or not all of its replicas are up")
        r = self._shards.get(shard)
        if r is None or r.addrs != addrs:
            if r is not None:  # a replica moved: requests waiting on the old sockets resend
                r.close(_Stale)
                for t in r.readers:
                    self._retired.add(t)
                    t.add_done_callback(self._retired.discard)
            r = self._shards[shard] = _AsyncReplicas(self._ctx, addrs)
        return r

    def _refresh(self, shard: int) -> None:
        """Replace the shard's sockets if its replicas' addresses changed (a replica that is
        down right now changes nothing: keep sending where it was)."""
        try:
            self._replicas(shard)
        except UnknownRecordError:
            pass

    async def _roundtrip(self, shard: int, make_wait: Callable[[int], Any], frame: bytes, deadline: float,
                         what: str, *, one: bool = False, resend: bool = False) -> Any:
        """Send ``frame`` to every replica of ``shard`` (one random replica if ``one``) and
        return the waiter once it is settled. ``resend`` repeats the frame every
        RETRY_AFTER_S while it is unanswered (inserts: replicas deduplicate them)."""
        loop = asyncio.get_running_loop()
        while True:
            reps = self._replicas(shard)
            n = len(reps.socks)
            only = self._rng.randrange(n) if one else None
            wait = make_wait(n)
            fut = reps.expect(wait, only)
            try:
                await reps.send(frame, only)
                retry_at = loop.time() + RETRY_AFTER_S if resend else deadline
                while True:
                    done, _ = await asyncio.wait((fut,), timeout=max(0.0, min(deadline, retry_at) - loop.time()))
                    if done:
                        return fut.result()
                    now = loop.time()
                    if now >= deadline:
                        raise ZiplogTimeoutError(f"{what} not answered in time")
                    # Unanswered: resend with the same client id and sequence number; replicas
                    # answer a duplicate with the gsn they already gave it.
                    self.stats["retries"] += 1
                    self._avoid(shard, time.monotonic())
                    self._refresh(shard)  # a restarted replica may listen elsewhere now
                    await reps.send(frame, only)  # raises _Stale if it does: resend there
                    retry_at = now + (RETRY_TROUBLED_S if getattr(wait, "troubled", False) else RETRY_AFTER_S)
            except _Stale:
                if loop.time() >= deadline:
                    raise ZiplogTimeoutError(f"{what} not answered in time") from None
            finally:
                reps.forget(wait.req_id, fut)

    # -- insert ---------------------------------------------------------------------------------
    async def insert_after(self, data: bytes, after: RecordId = RID_GENESIS, *,
                           key: bytes | None = None) -> RecordId:
        """Insert ``data`` somewhere after record ``after``; returns its record id, whose
        gsn is greater than ``after.gsn``."""
        self._check_open()
        assert self.topology is not None
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError("data must be bytes")
        data = bytes(data)
        after_gsn = max(after.gsn, 0)
        seq = next(self._seq)
        deadline = asyncio.get_running_loop().time() + self.timeout
        excluded: set[int] = set()
        while True:
            shard = self._choose_shard(key, data, excluded, time.monotonic())
            if shard is None and self._pinned_shard_may_return(excluded):
                # As Client.insert_after: wait for the pinned shard within the deadline.
                topo, pinned = self.topology, self._policy.shard
                await asyncio.to_thread(topo.wait, lambda: pinned in topo.live_shards(),
                                        max(0.0, deadline - asyncio.get_running_loop().time()))
                shard = self._choose_shard(key, data, excluded, time.monotonic())
            if shard is None:
                raise NoShardAvailableError(f"shard {self._policy.shard} is not live" if self._policy.kind == "fixed"
                                            else "no live shard accepts inserts")
            req_id = next(self._req)
            frame = pack([V, wire.INSERT, req_id, self.client_id, seq, after_gsn, data])
            try:
                wait: InsertWait = await self._roundtrip(
                    shard, lambda n: InsertWait(req_id, n), frame, deadline,
                    f"insert on shard {shard}", resend=True)
            except Redirect:
                # The shard provably holds no copy: the same id on another shard is safe.
                excluded.add(shard)
                self._avoid(shard, time.monotonic())
                self.stats["redirects"] += 1
                continue
            self.stats["fast_path" if wait.fast else "slow_path"] += 1
            self._learn_stable(shard, wait.stable)
            gsn = wait.decided
            assert gsn is not None and gsn > after_gsn, ("InsertAfter returned a gsn not above the rid", gsn, after_gsn)
            return RecordId(gsn, shard)

    # -- read -----------------------------------------------------------------------------------
    async def read_record(self, rid: RecordId) -> bytes:
        """The record with id ``rid``. Raises TrimmedError below the trim point and
        NotFoundError where the log holds no record."""
        self._check_open()
        if rid.gsn <= 0 or rid.shard < 0:
            raise UnknownRecordError(f"{rid!r} names no record")
        now = asyncio.get_running_loop().time()
        deadline = now + self.timeout
        # Stable: every replica holds it, so one answer suffices (and spreads the load); if
        # that replica is slow or gone, ask them all. Recent: ask every replica; a stable
        # answer or agreement of all settles it.
        if rid.gsn <= self._stable.get(rid.shard, 0):
            req_id = next(self._req)
            try:
                wait: ReadWait = await self._roundtrip(
                    rid.shard, lambda n: ReadWait(req_id, rid.gsn, 1),
                    pack([V, wire.READ, req_id, rid.gsn]), min(deadline, now + STABLE_READ_WAIT_S),
                    f"read of {rid!r}", one=True)
                assert wait.data is not None
                self._learn_stable(rid.shard, wait.stable)
                return wait.data
            except ZiplogTimeoutError:
                pass
        req_id = next(self._req)
        wait = await self._roundtrip(
            rid.shard, lambda n: ReadWait(req_id, rid.gsn, n),
            pack([V, wire.READ, req_id, rid.gsn]), deadline, f"read of {rid!r}", one=False)
        assert wait.data is not None
        self._learn_stable(rid.shard, wait.stable)
        return wait.data

    # -- trim and status ------------------------------------------------------------------------
    async def _each_replica(self, shards: list[int], frame_of: Callable[[int], bytes]) -> list[EachReplica]:
        """One request to every replica of ``shards``; every answer, shard by shard."""
        deadline = asyncio.get_running_loop().time() + self.timeout
        req_id = next(self._req)
        frame = frame_of(req_id)
        results = await asyncio.gather(
            *(self._roundtrip(s, lambda n: EachReplica(req_id, n), frame, deadline, f"request to shard {s}")
              for s in shards), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results  # type: ignore[return-value]

    async def trim(self, rid: RecordId) -> None:
        """Delete every record below ``rid`` on every shard."""
        self._check_open()
        assert self.topology is not None
        if rid.gsn <= 0:
            return
        shards = sorted(self.topology.replica_counts)
        for shard in shards:
            if self.topology.replica_addrs(shard) is None:
                raise ZiplogError(f"shard {shard} is not fully up; cannot trim everywhere")
        await self._each_replica(shards, lambda req_id: pack([V, wire.TRIM, req_id, rid.gsn]))

    async def status(self) -> dict[int, list[dict[str, Any]]]:
        """Every replica's status map, by shard."""
        self._check_open()
        assert self.topology is not None
        shards = [s for s in sorted(self.topology.replica_counts) if self.topology.replica_addrs(s) is not None]
        waits = await self._each_replica(shards, lambda req_id: pack([V, wire.STATUS, req_id]))
        return {s: [w.replies[i][3] for i in range(w.n)] for s, w in zip(shards, waits)}

    async def _recent_position(self) -> int:
        stables = [min(r["stable"] for r in reps) for reps in (await self.status()).values() if reps]
        return max(min(stables), 0) + 1 if stables else 1

    # -- subscribe ------------------------------------------------------------------------------
    def subscribe(self, start: RecordId = RID_GENESIS) -> "AsyncSubscription":
        """Iterate the log in gsn order from ``start`` (inclusive), forever. Call it from a
        coroutine: the subscription's tasks start at once. For RID_RECENT the position is
        found by a status round trip: ``async with`` or ``await`` the subscription to know
        it is fixed before inserting what it must see."""
        self._check_open()
        sub = AsyncSubscription(self, start)
        self._subs.append(sub)
        return sub


def _stop_zk(zk: Any) -> None:
    try:
        zk.stop()
        zk.close()
    except Exception:
        pass


class AsyncSubscription:
    """Async iterator over records in gsn order. ``aclose()`` it (or use ``async with``) to
    free its sockets; iteration ends once it is closed.

    One reader task per shard feeds a :class:`SubscriberMerge`; a housekeeping task
    connects to shards as they become known and keeps the subscriptions' leases alive.
    Credit is returned as records are consumed, exactly as in the blocking Subscription.
    """

    def __init__(self, client: AsyncClient, start: RecordId) -> None:
        self._client = client
        self._sub_id = next(client._req)
        self._explicit = start.gsn > 0
        self.from_gsn = 0 if start == RID_RECENT else max(start.gsn, 1)
        self._merge: SubscriberMerge | None = None
        self._socks: dict[int, zmq.asyncio.Socket] = {}
        self._addrs: dict[int, str] = {}
        self._readers: dict[int, asyncio.Task[None]] = {}
        self._consumed: dict[int, int] = {}
        self._wake = asyncio.Event()
        self._positioned = asyncio.Event()  # set once the start position is fixed (or failed)
        self._error: BaseException | None = None
        self._closed = False
        self._housekeeper = asyncio.get_running_loop().create_task(self._housekeep(), name="ziplog-subscription")

    # -- tasks ----------------------------------------------------------------------------------
    async def _housekeep(self) -> None:
        try:
            if self.from_gsn == 0:  # RID_RECENT
                self.from_gsn = await self._client._recent_position()
            self._merge = SubscriberMerge(self.from_gsn)
            self._positioned.set()
            self._wake.set()
            loop = asyncio.get_running_loop()
            keepalive_at = loop.time() + SUB_KEEPALIVE_S
            while True:
                self._connect_known()
                await asyncio.sleep(SUB_RECONNECT_S)
                if loop.time() >= keepalive_at:  # renew the lease even while nothing is consumed
                    keepalive_at = loop.time() + SUB_KEEPALIVE_S
                    for s in list(self._socks.values()):
                        await s.send(pack([V, wire.CREDIT, self._sub_id, 0]))
        except Exception as exc:
            self._fail(exc)

    def _connect_known(self) -> None:
        assert self._merge is not None
        topo = self._client.topology
        assert topo is not None and self._client._ctx is not None
        for shard in sorted(set(topo.replica_counts) | self._merge.known_shards()):
            if self._closed:
                return
            addrs = topo.replica_addrs(shard)
            if addrs is None:
                continue
            resume = None
            if shard in self._socks:
                if self._addrs.get(shard) == addrs[0]:
                    continue
                # The shard's serving replica moved (restarted): drop the old stream and
                # subscribe again from just past what that shard already sent.
                self._readers.pop(shard).cancel()  # its done-callback closes the old socket
                del self._socks[shard]
                resume = self._merge.resume_point(shard)
            s = self._client._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(addrs[0])
            self._socks[shard] = s
            self._addrs[shard] = addrs[0]
            self._readers[shard] = _spawn(self._pump(shard, s, resume), s, f"ziplog-subscription-shard{shard}")

    async def _pump(self, shard: int, sock: zmq.asyncio.Socket, resume: int | None = None) -> None:
        merge = self._merge
        assert merge is not None
        try:
            # 0 asks for the start of the log (no TrimmedError); an explicit position must exist.
            start = self.from_gsn if self._explicit else (0 if self.from_gsn == 1 else self.from_gsn)
            if resume is not None:
                start = resume
            await sock.send(pack([V, wire.SUBSCRIBE, self._sub_id, start, SUB_CREDIT_BYTES]))
            while True:
                msg = unpack(await sock.recv())
                if msg[1] == wire.SUB_BATCH and msg[2] == self._sub_id:
                    merge.on_batch(shard, msg[3], msg[4], msg[5])
                    await self._credit(shard, wire.SUB_BATCH_COST)
                    self._wake.set()
                    if merge.known_shards() - set(self._socks):
                        self._connect_known()
                elif msg[1] == wire.ERROR:
                    raise from_reply(msg[3], msg[4])
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self._positioned.set()
        self._wake.set()

    async def ready(self) -> "AsyncSubscription":
        """Wait until the start position is fixed: immediate, but for RID_RECENT a status
        round trip. Records inserted after this are seen; ``async with`` and ``await`` of
        the subscription do this."""
        if not self._positioned.is_set():
            await asyncio.wait_for(self._positioned.wait(), self._client.timeout)
        if self._error is not None and self._merge is None:
            raise self._error
        return self

    def __await__(self) -> Any:
        return self.ready().__await__()

    # -- consuming ------------------------------------------------------------------------------
    def __aiter__(self) -> "AsyncSubscription":
        return self

    async def __anext__(self) -> Record:
        try:
            rec = await self.next()
        except ClientClosedError:
            raise StopAsyncIteration from None
        assert rec is not None
        return rec

    async def next(self, timeout: float | None = None) -> Record | None:
        """The next record, or None if none arrives within ``timeout`` seconds. Raises
        ClientClosedError once closed, and the error that broke the subscription if any."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            if self._closed:
                raise ClientClosedError("subscription is closed")
            item = self._merge.pop() if self._merge is not None else None
            if item is not None:
                gsn, shard, data = item
                await self._credit(shard, len(data))
                return Record(RecordId(gsn, shard), data)
            if self._error is not None:
                raise self._error
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

    async def _credit(self, shard: int, nbytes: int) -> None:
        c = self._consumed.get(shard, 0) + nbytes
        if c >= SUB_CREDIT_BYTES // 4:
            await self._socks[shard].send(pack([V, wire.CREDIT, self._sub_id, c]))
            c = 0
        self._consumed[shard] = c

    # -- closing --------------------------------------------------------------------------------
    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake.set()  # a consumer waiting in next() ends
        frame = pack([V, wire.UNSUBSCRIBE, self._sub_id])
        for s in self._socks.values():
            try:
                await s.send(frame, zmq.NOBLOCK)
                s.setsockopt(zmq.LINGER, SUB_UNSUBSCRIBE_LINGER_MS)  # let the UNSUBSCRIBE leave
            except zmq.ZMQError:
                pass
        tasks = [self._housekeeper, *self._readers.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # their done callbacks close the sockets
        self._socks.clear()
        self._readers.clear()
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
