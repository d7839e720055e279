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

import importlib
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
