"""LogDB's clients: :class:`LogDB` (blocking) and :class:`AsyncLogDB` (asyncio).

    from ziplog.logdb import LogDB, TransactionAborted
    with LogDB(zk_hosts) as db:
        with db.transaction() as t:           # commits on a clean exit
            balance = int(t.get(b"alice") or b"0")
            t.put(b"alice", str(balance - 10).encode())
        db.run(lambda t: t.put(b"bob", b"10"))  # runs again after an abort
        print(db.get(b"alice"))

Both drive the same sans-I/O transaction steps (:mod:`ziplog.logdb.core.transaction`)
on a ziplog client and ZeroMQ DEALER sockets to the coordinators and KV shards, which
they find in ZooKeeper (:class:`~ziplog.logdb.coordination.Directory`). A request that
gets no answer within ``request_timeout`` goes to the next coordinator replica (every
request is idempotent; the leader is asked first); the call fails with
``ZiplogTimeoutError`` after ``timeout``.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from typing import Any, Awaitable, Callable, TypeVar

import zmq
import zmq.asyncio

from ziplog.io import zk
from ziplog.logdb.coordination import Directory
from ziplog.logdb.core import frames as f
from ziplog.logdb.core.records import TransactionAborted
from ziplog.logdb.core.transaction import (
    Ask,
    AskKv,
    Insert,
    Op,
    ReadRecord,
    Session,
    Steps,
    Transaction,
    get,
)
from ziplog.protocol.errors import ClientClosedError, ZiplogTimeoutError
from ziplog.protocol.types import RecordId

__all__ = ["LogDB", "AsyncLogDB", "Txn", "AsyncTxn", "TransactionAborted"]

T = TypeVar("T")

#: a request unanswered this long goes to the next replica
REQUEST_TIMEOUT_S = 1.0
#: sockets to addresses no longer in the directory are closed beyond this many
MAX_IDLE_SOCKETS = 8


class _Base:
    _session: Session
    _dir: Directory
    timeout: float
    request_timeout: float

    def _targets(self, op: Ask | AskKv) -> list[str]:
        if type(op) is AskKv:
            addr = self._dir.kv_addr(op.shard)
            return [addr] if addr else []
        return self._dir.coordinators()

    def _open_directory(self, zk_hosts: str, name: str) -> None:
        self._zk = zk.connect(zk_hosts, timeout=self.timeout)
        try:
            self._dir = Directory(self._zk, name, self.timeout)
            # transaction ids must not repeat across clients: seeded from the OS
            self._session = Session(self._dir.kv_shards, random.Random(secrets.randbits(128)))
        except BaseException:
            zk.stop(self._zk)
            raise

    @property
    def position(self) -> int:
        """The session's position: every commit this client saw decided is at or below it."""
        return self._session.position

    def observe(self, gsn: int) -> None:
        """Make this client's later reads reflect every commit up to ``gsn`` (a position
        or commit gsn learned elsewhere: another client's ``position``, a record id)."""
        self._session.position = max(self._session.position, gsn)


# -- blocking ----------------------------------------------------------------------------------------
class _TxnBase:
    _t: Transaction

    @property
    def txn(self) -> int:
        """The transaction's id (random 64 bits) in its records."""
        return self._t.txn

    @property
    def serialized_at(self) -> int | None:
        """Its serialization point once committed: the commit record's gsn, or for a
        read-only transaction the position its reads were all current at."""
        return self._t.serialized_at

    @property
    def commit_rid(self) -> RecordId | None:
        """Its commit record's id, once it inserted one."""
        rid = self._t.commit_rid
        return None if rid is None else RecordId(*rid)

    @property
    def reads(self) -> dict[bytes, bytes | None]:
        """What it read from the database (key -> value)."""
        return {k: v for k, (_, v) in self._t.reads.items()}

    @property
    def writes(self) -> dict[bytes, bytes | None]:
        """What it writes (key -> value; None: a delete)."""
        return dict(self._t.writes)

    def put(self, key: bytes, value: bytes) -> None:
        self._t.put(key, value)

    def delete(self, key: bytes) -> None:
        self._t.delete(key)


class Txn(_TxnBase):
    """A transaction of :class:`LogDB` (from :meth:`LogDB.transaction`)."""

    def __init__(self, db: "LogDB") -> None:
        self._db = db
        self._t = Transaction(db._session)

    def get(self, key: bytes) -> bytes | None:
        return self._db._drive(self._t.get_steps(key))  # type: ignore[no-any-return]

    def commit(self) -> None:
        """Commit now; raises TransactionAborted on a conflict."""
        self._db._drive(self._t.commit_steps())

    def __enter__(self) -> "Txn":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            if not self._t.done:
                self.commit()
        else:
            self._t.done = True  # nothing was appended but write records nobody will commit


class LogDB(_Base):
    """A LogDB client. Not thread-safe: one per thread."""

    def __init__(self, zk_hosts: str, *, name: str = "default", timeout: float = 30.0,
                 request_timeout: float = REQUEST_TIMEOUT_S, log: Any = None) -> None:
        self.timeout = timeout
        self.request_timeout = request_timeout
        self._closed = False
        self._open_directory(zk_hosts, name)
        self._ctx = zmq.Context()
        self._socks: dict[str, zmq.Socket[Any]] = {}
        self._poller = zmq.Poller()
        self._own_log = log is None
        try:
            if log is None:
                from ziplog.client.blocking import Client
                log = Client(zk_hosts, timeout=timeout)
        except BaseException:
            self.close()
            raise
        self._log = log
        self.committed = 0
        self.aborted = 0

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for s in self._socks.values():
            s.close(0)
        self._ctx.term()
        if getattr(self, "_own_log", False) and getattr(self, "_log", None) is not None:
            self._log.close()
        zk.stop(self._zk)

    def __enter__(self) -> "LogDB":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the calls --------------------------------------------------------------------------------
    def transaction(self) -> Txn:
        if self._closed:
            raise ClientClosedError("LogDB is closed")
        return Txn(self)

    def run(self, fn: Callable[[Txn], T], retries: int = 10) -> T:
        """``fn(t)`` in a fresh transaction, committed; again after an abort, up to
        ``retries`` more times (then the last TransactionAborted is raised)."""
        for attempt in range(retries + 1):
            try:
                with self.transaction() as t:
                    result = fn(t)
                self.committed += 1
                return result
            except TransactionAborted:
                self.aborted += 1
                if attempt == retries:
                    raise
        raise AssertionError("unreachable")

    def get(self, key: bytes) -> bytes | None:
        """The latest committed value of ``key`` (None: none, or deleted)."""
        if self._closed:
            raise ClientClosedError("LogDB is closed")
        return self._drive(get(self._session, key))  # type: ignore[no-any-return]

    # -- the driver -------------------------------------------------------------------------------
    def _drive(self, steps: Steps) -> Any:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                op = steps.send(value) if error is None else steps.throw(error)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            try:
                value = self._perform(op)
            except Exception as exc:  # thrown into the steps: they decide (a trimmed read goes to a KV shard)
                error = exc

    def _perform(self, op: Op) -> Any:
        if type(op) is Insert:
            return self._log.insert_after(op.data, RecordId(*op.after))
        if type(op) is ReadRecord:
            return self._log.read_record(RecordId(*op.rid))
        assert type(op) is Ask or type(op) is AskKv
        return self._ask(op)

    def _sock(self, addr: str) -> zmq.Socket[Any]:
        s = self._socks.get(addr)
        if s is None:
            if len(self._socks) >= MAX_IDLE_SOCKETS:
                live = set(self._dir.coordinators())
                for old in [a for a in self._socks if a not in live]:
                    self._poller.unregister(self._socks[old])
                    self._socks.pop(old).close(0)
            s = self._socks[addr] = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.MAXMSGSIZE, f.ANSWER_LIMIT)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(addr)
            self._poller.register(s, zmq.POLLIN)
        return s

    def _ask(self, op: Ask | AskKv) -> f.Answer:
        req = op.request.req
        frame = f.encode(op.request)
        deadline = time.monotonic() + self.timeout
        tried = 0
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise ZiplogTimeoutError(f"no answer to {type(op.request).__name__} within {self.timeout}s")
            targets = self._targets(op)
            if not targets:
                self._dir.wait("kv" if type(op) is AskKv else "coordinator", min(deadline - now, 0.5))
                continue
            addr = targets[tried % len(targets)]
            tried += 1
            try:
                self._sock(addr).send(frame, zmq.NOBLOCK)
            except zmq.Again:
                continue
            end = min(deadline, time.monotonic() + self.request_timeout)
            while (left := end - time.monotonic()) > 0:
                for sock, _ in self._poller.poll(max(1, int(left * 1000))):
                    try:
                        ans = f.decode_answer(sock.recv(zmq.NOBLOCK))
                    except (zmq.Again, f.BadFrame):
                        continue
                    if ans.req != req:
                        continue  # the answer to an earlier try
                    if type(ans) is f.Failed and ans.code == f.BUSY:
                        end = 0  # ask the next replica now
                        break
                    return ans


# -- asyncio -----------------------------------------------------------------------------------------
class AsyncTxn(_TxnBase):
    """A transaction of :class:`AsyncLogDB`: ``async with db.transaction() as t``."""

    def __init__(self, db: "AsyncLogDB") -> None:
        self._db = db
        self._t = Transaction(db._session)

    async def get(self, key: bytes) -> bytes | None:
        return await self._db._drive(self._t.get_steps(key))  # type: ignore[no-any-return]

    async def commit(self) -> None:
        await self._db._drive(self._t.commit_steps())

    async def __aenter__(self) -> "AsyncTxn":
        return self

    async def __aexit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            if not self._t.done:
                await self.commit()
        else:
            self._t.done = True


class AsyncLogDB(_Base):
    """The asyncio LogDB client: ``db = await AsyncLogDB.connect(zk_hosts)`` (or
    ``async with AsyncLogDB(zk_hosts) as db``). Transactions may run concurrently."""

    def __init__(self, zk_hosts: str, *, name: str = "default", timeout: float = 30.0,
                 request_timeout: float = REQUEST_TIMEOUT_S, log: Any = None) -> None:
        self.zk_hosts = zk_hosts
        self.name = name
        self.timeout = timeout
        self.request_timeout = request_timeout
        self._log = log
        self._own_log = log is None
        self._started = False
        self._closed = False
        self.committed = 0
        self.aborted = 0

    @classmethod
    async def connect(cls, zk_hosts: str, **kw: Any) -> "AsyncLogDB":
        db = cls(zk_hosts, **kw)
        await db._start()
        return db

    async def _start(self) -> None:
        if self._started:
            return
        await asyncio.get_running_loop().run_in_executor(None, self._open_directory, self.zk_hosts, self.name)
        self._ctx = zmq.asyncio.Context()
        self._socks: dict[str, zmq.asyncio.Socket] = {}
        self._readers: list[asyncio.Task[None]] = []
        self._waiting: dict[int, asyncio.Future[f.Answer]] = {}
        self._started = True
        if self._log is None:
            from ziplog.client.aio import AsyncClient
            try:
                self._log = await AsyncClient.connect(self.zk_hosts, timeout=self.timeout)
            except BaseException:
                await self.close()
                raise

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._started:
            return
        for t in self._readers:
            t.cancel()
        for s in self._socks.values():
            s.close(0)
        self._ctx.destroy(linger=0)
        if self._own_log and self._log is not None:
            await self._log.close()
        zk.stop(self._zk)

    async def __aenter__(self) -> "AsyncLogDB":
        await self._start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def transaction(self) -> AsyncTxn:
        if self._closed or not self._started:
            raise ClientClosedError("AsyncLogDB is closed or not connected")
        return AsyncTxn(self)

    async def run(self, fn: Callable[[AsyncTxn], Awaitable[T]], retries: int = 10) -> T:
        """``await fn(t)`` in a fresh transaction, committed; again after an abort."""
        for attempt in range(retries + 1):
            try:
                async with self.transaction() as t:
                    result = await fn(t)
                self.committed += 1
                return result
            except TransactionAborted:
                self.aborted += 1
                if attempt == retries:
                    raise
        raise AssertionError("unreachable")

    async def get(self, key: bytes) -> bytes | None:
        if self._closed or not self._started:
            raise ClientClosedError("AsyncLogDB is closed or not connected")
        return await self._drive(get(self._session, key))  # type: ignore[no-any-return]

    async def _drive(self, steps: Steps) -> Any:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                op = steps.send(value) if error is None else steps.throw(error)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            try:
                if type(op) is Insert:
                    value = await self._log.insert_after(op.data, RecordId(*op.after))
                elif type(op) is ReadRecord:
                    value = await self._log.read_record(RecordId(*op.rid))
                else:
                    assert type(op) is Ask or type(op) is AskKv
                    value = await self._ask(op)
            except Exception as exc:
                error = exc

    def _sock(self, addr: str) -> zmq.asyncio.Socket:
        s = self._socks.get(addr)
        if s is None:
            s = self._socks[addr] = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.MAXMSGSIZE, f.ANSWER_LIMIT)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(addr)
            self._readers.append(asyncio.get_running_loop().create_task(self._read(s)))
        return s

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            data = await sock.recv()
            try:
                ans = f.decode_answer(data)
            except f.BadFrame:
                continue
            fut = self._waiting.get(ans.req)
            if fut is not None and not fut.done():
                fut.set_result(ans)

    async def _ask(self, op: Ask | AskKv) -> f.Answer:
        req = op.request.req
        frame = f.encode(op.request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        tried = 0
        try:
            while True:
                now = loop.time()
                if now >= deadline:
                    raise ZiplogTimeoutError(f"no answer to {type(op.request).__name__} within {self.timeout}s")
                targets = self._targets(op)
                if not targets:
                    await loop.run_in_executor(None, self._dir.wait, "kv" if type(op) is AskKv else "coordinator",
                                               min(deadline - now, 0.5))
                    continue
                addr = targets[tried % len(targets)]
                tried += 1
                fut = self._waiting.get(req)
                if fut is None or fut.done():
                    fut = self._waiting[req] = loop.create_future()
                await self._sock(addr).send(frame)
                try:
                    ans = await asyncio.wait_for(asyncio.shield(fut), min(self.request_timeout, deadline - now))
                except asyncio.TimeoutError:
                    continue
                if type(ans) is f.Failed and ans.code == f.BUSY:
                    continue
                return ans
        finally:
            self._waiting.pop(req, None)
