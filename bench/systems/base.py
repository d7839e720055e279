"""What every benchmarked system provides: a process tree to start and stop, and a
client that appends records.

A :class:`System` starts its servers on loopback (``start``), stops them (``stop``) and
describes how to open a client in any process (``client_spec``: picklable, so load
generator workers started with ``spawn`` can open their own clients). A client is an
:class:`Appender` (blocking, one call at a time) or an :class:`AsyncAppender` (asyncio;
any number of concurrent ``append`` calls, which is how throughput runs pipeline).

A system that cannot start raises :class:`Unavailable` with a reason a reader can act
on ("nats-server not installed: apt-get install nats-server"); the harness prints it and
puts it in the results instead of a row of numbers.
"""

from __future__ import annotations

import asyncio
import importlib
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import zmq


class Unavailable(RuntimeError):
    """The system could not be started here; ``str(e)`` says why, plainly."""


class Appender(Protocol):
    def append(self, data: bytes) -> Any:
        """Append one record; return once the system acknowledged it (its position)."""

    def close(self) -> None: ...


class AsyncAppender(Protocol):
    async def append(self, data: bytes) -> Any:
        """Append one record; concurrent calls are allowed (pipelining)."""

    async def close(self) -> None: ...


@dataclass(frozen=True)
class ClientSpec:
    """How to open a client of a running system in any process: ``module`` defines
    ``open_sync(**params) -> Appender`` and ``async open_async(**params) -> AsyncAppender``."""

    module: str
    params: dict[str, Any] = field(default_factory=dict)

    def open_sync(self) -> Appender:
        return importlib.import_module(self.module).open_sync(**self.params)  # type: ignore[no-any-return]

    async def open_async(self) -> AsyncAppender:
        return await importlib.import_module(self.module).open_async(**self.params)  # type: ignore[no-any-return]


async def read_replies(sock: Any, handle: Callable[[bytes], None]) -> None:
    """Feed every frame arriving on ``sock`` (a ``zmq.asyncio`` socket) to ``handle``,
    forever: one awaited receive, then everything already queued through a blocking view
    of the same socket, without a trip through the event loop for each."""
    recv = sock.recv
    drain: zmq.Socket[Any] = zmq.Socket.shadow(sock.underlying)
    events, pollin, noblock = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
    while True:
        handle(await recv())
        while int(drain.getsockopt(events)) & pollin:
            handle(drain.recv(noblock))


class Waiting:
    """An append in flight: its future, and when it was sent (the watchdog's clock)."""

    __slots__ = ("future", "sent_at")

    def __init__(self, future: "asyncio.Future[int]", sent_at: float) -> None:
        self.future = future
        self.sent_at = sent_at


class PipelinedAppender:
    """What the rivals' asyncio clients share: any number of appends in flight, matched
    to their replies by request id (``pending``), one watchdog timer for all of them,
    every waiter failed at once when the reply stream breaks, and the close. A subclass
    makes its sockets, calls :meth:`_start` with the one replies arrive on, and says what
    a timeout means (:meth:`_timed_out`) and which sockets to close (:meth:`_sockets`)."""

    def __init__(self, timeout_s: float) -> None:
        import msgpack
        import zmq.asyncio

        self.timeout_s = timeout_s
        self.ctx = zmq.asyncio.Context()
        self.pending: dict[int, Any] = {}  # req_id -> a Waiting (or a subclass's)
        self.req_id = 0
        self._pack = msgpack.Packer().pack  # reused: msgpack.packb builds a Packer per call
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False
        self.broken: BaseException | None = None  # why later appends must fail at once

    def _start(self, replies: Any, on_frame: Callable[[bytes], None]) -> None:
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._read(replies, on_frame)), loop.create_task(self._watchdog())]

    async def _read(self, replies: Any, on_frame: Callable[[bytes], None]) -> None:
        try:
            await read_replies(replies, on_frame)
        except Exception as exc:  # a broken reply: fail every waiter loudly, not hang them
            self._fail_all(exc)
            raise

    def _fail_all(self, exc: BaseException) -> None:
        self.broken = exc
        for w in self.pending.values():
            if not w.future.done():
                w.future.set_exception(exc)
        self.pending.clear()

    def _timed_out(self, rid: int, w: Any) -> Exception:
        return TimeoutError(f"append {rid}: no acknowledgement within the timeout")

    async def _watchdog(self) -> None:
        """Fail appends that waited longer than the timeout (one timer, not one per append)."""
        while True:
            await asyncio.sleep(min(1.0, self.timeout_s / 4))
            limit = time.monotonic() - self.timeout_s
            for rid, w in list(self.pending.items()):
                if w.sent_at < limit:
                    del self.pending[rid]
                    if not w.future.done():
                        w.future.set_exception(self._timed_out(rid, w))

    def _sockets(self) -> list[Any]:
        return []

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self._fail_all(RuntimeError("appender closed"))
        for sock in self._sockets():
            sock.close(0)
        self.ctx.term()


def counters(appender: Any) -> dict[str, int]:
    """An appender's own counters (ziplog: fast_path, slow_path), or {}."""
    get = getattr(appender, "counters", None)
    return dict(get()) if get is not None else {}


class System(ABC):
    """One benchmarked system; a context manager that starts and stops it."""

    #: the row label in tables ("ziplog", "floor", "NOPaxos-style", ...)
    name: str = "?"

    @abstractmethod
    def start(self) -> None:
        """Start every process on loopback; raise Unavailable when it cannot."""

    @abstractmethod
    def stop(self) -> None:
        """Stop every process started; safe to call twice or after a failed start."""

    @abstractmethod
    def client_spec(self, shard: int = 0) -> ClientSpec:
        """How to open a client appending to ``shard`` (systems without shards ignore it)."""

    def describe(self) -> dict[str, Any]:
        """Configuration shown beside the numbers: replication, durability, version."""
        return {}

    def __enter__(self) -> "System":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
