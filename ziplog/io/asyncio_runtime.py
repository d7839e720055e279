"""The :class:`~ziplog.io.ports.Runtime`, the connecting half of the
:class:`~ziplog.io.ports.Network` and bound ROUTERs on an asyncio event loop (uvloop
when installed) with ``zmq.asyncio`` sockets: what ``ziplog.aio.AsyncClient`` runs its
driver on, and the LogDB processes theirs.

Each socket has one reader task; every frame it reads, every timer and every call
from another thread is one turn, after which the turn-end hooks run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import zmq
import zmq.asyncio

from ziplog.io.keys import client_keys, server_keys
from ziplog.io.ports import FrameHandler, MultipartHandler, RoutedHandler
from ziplog.io.zmq_runtime import bind, connect
from ziplog.protocol.keys import Credentials

log = logging.getLogger("ziplog.io")


class _Connection:
    __slots__ = ("rt", "sock", "addr", "reader")

    def __init__(self, rt: "AsyncioRuntime", sock: zmq.asyncio.Socket, addr: str, on_frame: FrameHandler) -> None:
        self.rt = rt
        self.sock = sock
        self.addr = addr
        self.reader = rt.loop.create_task(self._read(on_frame), name=f"ziplog-reader-{addr}")

    async def _read(self, on_frame: FrameHandler) -> None:
        sock, turn = self.sock, self.rt.turn
        while True:
            frame = await sock.recv()
            turn(on_frame, frame)

    def send(self, frame: bytes) -> bool:
        try:
            # queued at once unless the queue is full, then as soon as it has room; the
            # future is not awaited (its only failure is a closed socket)
            fut: Any = self.sock.send(frame, copy=len(frame) < 65536)
            fut.add_done_callback(_quiet)
            return True
        except zmq.ZMQError:
            return False

    def connect(self, addr: str) -> None:
        connect(self.sock, addr)

    def close(self, linger_ms: int = 0) -> None:
        self.rt._connections.discard(self)
        self.reader.cancel()
        self.sock.close(linger_ms)


class _NativeConnection:
    """A DEALER speaking ZMTP natively (:class:`~ziplog.io.zmtp_asyncio.ZmtpDealer`) with
    the interface of :class:`_Connection`: each message is a turn of ``on_frame``."""

    __slots__ = ("rt", "addr", "on_frame", "dealer", "reader")

    def __init__(self, rt: "AsyncioRuntime", addr: str, on_frame: FrameHandler, max_bytes: int) -> None:
        from ziplog.io.zmtp_asyncio import ZmtpDealer

        self.rt = rt
        self.addr = addr
        self.on_frame = on_frame
        self.dealer = ZmtpDealer(addr, self._on_message, max_message=max_bytes if max_bytes > 0 else 1 << 30,
                                 curve=client_keys(rt.credentials))
        self.dealer.start()
        self.reader: Any = self.dealer._task

    def _on_message(self, parts: list[bytes]) -> None:
        self.rt.turn(self.on_frame, parts[0] if len(parts) == 1 else b"".join(parts))

    def send(self, frame: bytes) -> bool:
        return self.dealer.send([frame])

    @property
    def refused(self) -> str | None:
        """Why the server refused the last handshake (None: it did not)."""
        return self.dealer.refused

    def connect(self, addr: str) -> None:
        raise NotImplementedError("a native DEALER connects to one address")

    def close(self, linger_ms: int = 0) -> None:
        self.rt._connections.discard(self)
        self.dealer.close()


class _Router:
    """A bound ROUTER; each message of two parts (route, frame) is a turn of ``on_frame``,
    one of more parts a turn of ``on_multipart``."""

    __slots__ = ("rt", "sock", "addr", "reader")

    def __init__(self, rt: "AsyncioRuntime", sock: zmq.asyncio.Socket, addr: str, on_frame: RoutedHandler,
                 on_multipart: MultipartHandler) -> None:
        self.rt = rt
        self.sock = sock
        self.addr = addr
        self.reader = rt.loop.create_task(self._read(on_frame, on_multipart), name=f"ziplog-router-{addr}")

    async def _read(self, on_frame: RoutedHandler, on_multipart: MultipartHandler) -> None:
        sock, turn = self.sock, self.rt.turn
        while True:
            parts = await sock.recv_multipart()
            if len(parts) == 2:
                turn(on_frame, parts[0], parts[1])
            else:
                turn(on_multipart, parts[0], len(parts) - 1)

    def peer_key(self, route: bytes) -> bytes | None:
        return None  # NULL only

    def send_to(self, route: bytes, frame: bytes) -> bool:
        try:
            fut: Any = self.sock.send_multipart([route, frame], copy=len(frame) < 65536)
            fut.add_done_callback(_quiet)
            return True
        except zmq.ZMQError:
            return False

    def close(self) -> None:
        self.rt._connections.discard(self)
        self.reader.cancel()
        self.sock.close(0)


class _NativeRouter:
    """A bound ROUTER speaking ZMTP natively (:class:`~ziplog.io.zmtp_asyncio.ZmtpRouter`)
    with the interface of :class:`_Router`: bound at once (its address is known before
    the loop turns), served by its reader task until closed."""

    __slots__ = ("rt", "addr", "router", "reader", "_closed")

    def __init__(self, rt: "AsyncioRuntime", on_frame: RoutedHandler, on_multipart: MultipartHandler, host: str,
                 port: int, max_bytes: int) -> None:
        from ziplog.io.zmtp_asyncio import DEFAULT_MAX_MESSAGE, ZmtpRouter

        turn = rt.turn

        def on_message(route: bytes, parts: list[bytes]) -> None:
            if len(parts) == 1:
                turn(on_frame, route, parts[0])
            else:
                turn(on_multipart, route, len(parts))

        self.rt = rt
        self.router = ZmtpRouter(on_message, host=host, port=port,
                                 max_message=DEFAULT_MAX_MESSAGE * 64 if max_bytes < 0 else max_bytes,
                                 curve=server_keys(rt.credentials))
        self.router.bind()
        self.addr = self.router.endpoint
        self._closed = asyncio.Event()
        self.reader = rt.loop.create_task(self._serve(), name=f"ziplog-router-{self.addr}")

    async def _serve(self) -> None:
        try:
            await self.router.start()
            await self._closed.wait()
        finally:
            await self.router.aclose()

    def send_to(self, route: bytes, frame: bytes) -> bool:
        return self.router.send_to(route, [frame])

    def peer_key(self, route: bytes) -> bytes | None:
        return self.router.peer_key(route)

    def close(self) -> None:
        self.rt._connections.discard(self)
        self._closed.set()


def _quiet(fut: Any) -> None:
    if not fut.cancelled():
        fut.exception()


class _Handle:
    __slots__ = ("handle",)

    def __init__(self, handle: asyncio.TimerHandle) -> None:
        self.handle = handle

    def cancel(self) -> None:
        self.handle.cancel()


class AsyncioRuntime:
    def __init__(self, loop: asyncio.AbstractEventLoop | None = None, native: bool = False,
                 credentials: Credentials | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()
        #: CURVE keys (None: NULL); only the native endpoints speak CURVE here
        self.credentials = credentials
        assert credentials is None or native, "CURVE is spoken by the native endpoints"
        #: DEALERs speak ZMTP natively (no libzmq I/O thread) instead of through zmq.asyncio
        self.native = native
        self.ctx = zmq.asyncio.Context()
        self._turn_answers: list[Callable[[], bool]] = []
        self._turn_end: list[Callable[[], None]] = []
        self._connections: set[_Connection | _NativeConnection | _Router | _NativeRouter] = set()
        self.closed = False

    # -- Runtime ----------------------------------------------------------------------------------
    #: monotonic nanoseconds (the C function itself: no Python frame on the hot path)
    now = staticmethod(time.monotonic_ns)

    def turn(self, fn: Callable[..., None], *args: Any) -> None:
        if self.closed:
            return
        try:
            fn(*args)
        finally:
            for answers in self._turn_answers:
                answers()
            for hook in self._turn_end:
                hook()

    def call_at(self, when_ns: int, fn: Callable[[], None]) -> _Handle:
        delay = (when_ns - time.monotonic_ns()) / 1e9
        return _Handle(self.loop.call_later(max(delay, 0.0), self.turn, fn))

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        try:
            self.loop.call_soon_threadsafe(self.turn, fn)
        except RuntimeError:
            pass  # the loop is closed: nothing is listening any more

    def at_turn_answers(self, fn: Callable[[], bool]) -> None:
        self._turn_answers.append(fn)

    def at_turn_end(self, fn: Callable[[], None]) -> None:
        self._turn_end.append(fn)

    # -- Network (connecting side) ----------------------------------------------------------------
    def dealer(self, addr: str, on_frame: FrameHandler, label: str = "", max_bytes: int = -1) -> Any:
        if self.native:
            n = _NativeConnection(self, addr, on_frame, max_bytes)
            self._connections.add(n)
            return n
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        connect(sock, addr)
        c = _Connection(self, sock, addr, on_frame)
        self._connections.add(c)
        return c

    # -- Network (binding side) ------------------------------------------------------------------
    def router(self, on_frame: RoutedHandler, on_multipart: MultipartHandler, host: str = "127.0.0.1",
               port: int = 0, max_bytes: int = -1) -> _Router | _NativeRouter:
        """Bind a ROUTER (port 0: any free port), natively or with libzmq as the runtime's
        DEALERs are."""
        if self.native:
            n = _NativeRouter(self, on_frame, on_multipart, host, port, max_bytes)
            self._connections.add(n)
            return n
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        r = _Router(self, sock, bind(sock, host, port), on_frame, on_multipart)
        self._connections.add(r)
        return r

    async def aclose(self) -> None:
        """Stop every reader and close every socket."""
        self.closed = True
        readers = [c.reader for c in self._connections]
        for c in list(self._connections):
            c.close()
        if readers:
            await asyncio.gather(*readers, return_exceptions=True)
        self.ctx.destroy(linger=0)
