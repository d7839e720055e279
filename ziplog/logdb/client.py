"""LogDB's clients: :class:`LogDB` (blocking) and :class:`AsyncLogDB` (asyncio).

    from ziplog.logdb import LogDB, TransactionAborted
    with LogDB(zk_hosts) as db:
        with db.transaction() as t:           # commits on a clean exit
            balance = int(t.get(b"alice") or b"0")
            t.put(b"alice", str(balance - 10).encode())
        db.run(lambda t: t.put(b"bob", b"10"))  # runs again after an abort
        print(db.get(b"alice"))

A commit that fails with another ``ZiplogError`` (a timeout: its outcome unknown) may be
called again on the same transaction: it resends the same commit record if none was
placed and asks the outcome, and never commits twice. ``OutcomeUnknownError``: the
outcome is older than the coordinators remember; it may have committed.

Both run the same driver (:class:`~ziplog.logdb.driver.TransactionDriver`) over the
same sans-I/O transaction steps (:mod:`ziplog.logdb.core.transaction`), on their ziplog
client's runtime: the log's calls go to the client's driver, the coordinators' and KV
shards' requests over DEALERs of that runtime to the addresses ZooKeeper names
(:class:`~ziplog.io.zk_logdb.Directory`). A request that gets no answer within
``request_timeout`` goes to the next coordinator replica (every request is idempotent;
the leader is asked first); the call fails with ``ZiplogTimeoutError`` after ``timeout``.
"""

from __future__ import annotations

import asyncio
import random
import secrets
from typing import Any, Awaitable, Callable, TypeVar

from ziplog.io import zk
from ziplog.io.zk_logdb import Directory
from ziplog.logdb.core.records import TransactionAborted
from ziplog.logdb.core.transaction import LogDBError, OutcomeUnknownError, Rid, Session, Steps, Transaction, get
from ziplog.logdb.driver import REQUEST_TIMEOUT_NS, ClientLog, LogPort, OnResult, TransactionDriver
from ziplog.protocol.errors import ClientClosedError
from ziplog.protocol.types import RecordId

__all__ = ["LogDB", "AsyncLogDB", "Txn", "AsyncTxn", "TransactionAborted", "LogDBError", "OutcomeUnknownError"]

T = TypeVar("T")

#: a request unanswered this long goes to the next replica
REQUEST_TIMEOUT_S = REQUEST_TIMEOUT_NS / 1e9


class _Base:
    _session: Session
    _dir: Directory
    timeout: float
    request_timeout: float

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
        """Commit now; raises TransactionAborted on a conflict, OutcomeUnknownError when
        the outcome is forgotten. After another error (a timeout) call it again: it goes
        on from where it stopped and never commits twice."""
        self._db._drive(self._t.commit_steps())

    def __enter__(self) -> "Txn":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            if not self._t.done:
                self.commit()
        elif not self._t.committing:
            self._t.done = True  # nothing was appended but write records nobody will commit


class LogDB(_Base):
    """A LogDB client. Not thread-safe: one per thread. ``log``: a ziplog ``Client`` to
    run on (default: its own)."""

    def __init__(self, zk_hosts: str, *, name: str = "default", timeout: float = 30.0,
                 request_timeout: float = REQUEST_TIMEOUT_S, log: Any = None, key_file: str | None = None) -> None:
        self.timeout = timeout
        self.request_timeout = request_timeout
        self._closed = False
        self._driver: TransactionDriver | None = None
        self._open_directory(zk_hosts, name)
        self._own_log = log is None
        self._log = log
        try:
            if log is None:
                from ziplog.client.blocking import Client
                self._log = Client(zk_hosts, timeout=timeout, key_file=key_file)
            self._rt = self._log.runtime
            self._driver = TransactionDriver(self._rt, self._rt, self._dir, ClientLog(self._log.driver),
                                             int(timeout * 1e9), int(request_timeout * 1e9))
        except BaseException:
            self.close()
            raise
        self.committed = 0
        self.aborted = 0

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._driver is not None:
            self._driver.close()
        if self._own_log and self._log is not None:
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

    def _drive(self, steps: Steps) -> Any:
        """Turn the log client's runtime until the steps are done."""
        assert self._driver is not None
        run = self._driver.run(steps)
        self._rt.run_until(lambda: run.done)
        return run.result()


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
        elif not self._t.committing:
            self._t.done = True


class AsyncLogDB(_Base):
    """The asyncio LogDB client: ``db = await AsyncLogDB.connect(zk_hosts)`` (or
    ``async with AsyncLogDB(zk_hosts) as db``). Transactions may run concurrently."""

    def __init__(self, zk_hosts: str, *, name: str = "default", timeout: float = 30.0,
                 request_timeout: float = REQUEST_TIMEOUT_S, log: Any = None, key_file: str | None = None) -> None:
        self.zk_hosts = zk_hosts
        self.key_file = key_file
        self.name = name
        self.timeout = timeout
        self.request_timeout = request_timeout
        self._log = log
        self._own_log = log is None
        self._started = False
        self._closed = False
        self._driver: TransactionDriver | None = None
        self._own_rt: Any = None
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
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._open_directory, self.zk_hosts, self.name)
        self._started = True
        try:
            if self._log is None:
                from ziplog.client.aio import AsyncClient
                self._log = await AsyncClient.connect(self.zk_hosts, timeout=self.timeout, key_file=self.key_file)
            log: LogPort
            if hasattr(self._log, "driver"):  # a ziplog AsyncClient: run on its runtime
                rt, log = self._log.runtime, ClientLog(self._log.driver)
            else:  # another log with the same awaitable calls (a benchmark's)
                from ziplog.io.asyncio_runtime import AsyncioRuntime
                from ziplog.io.zmtp_poll import native_transport_wanted
                rt = self._own_rt = AsyncioRuntime(loop, native=native_transport_wanted())
                log = AwaitableLog(self._log)
            self._driver = TransactionDriver(rt, rt, self._dir, log, int(self.timeout * 1e9),
                                             int(self.request_timeout * 1e9))
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._started:
            return
        if self._driver is not None:
            self._driver.close()
        if self._own_rt is not None:
            await self._own_rt.aclose()
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
        assert self._driver is not None
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        run = self._driver.run(steps, finished)
        await done
        return run.result()


class AwaitableLog:
    """A LogPort on an object with ziplog's awaitable ``insert_after`` and
    ``read_record`` (a log other than ziplog's, in the benchmarks)."""

    def __init__(self, log: Any) -> None:
        self.log = log

    def insert(self, data: bytes, after: Rid, on_result: OnResult) -> None:
        self._report(self.log.insert_after(data, RecordId(*after)), on_result)

    def read(self, rid: Rid, on_result: OnResult) -> None:
        self._report(self.log.read_record(RecordId(*rid)), on_result)

    @staticmethod
    def _report(coro: Any, on_result: OnResult) -> None:
        def done(task: asyncio.Task[Any]) -> None:
            if task.cancelled():
                on_result(None, asyncio.CancelledError())
            elif task.exception() is not None:
                on_result(None, task.exception())
            else:
                on_result(task.result(), None)
        asyncio.ensure_future(coro).add_done_callback(done)
