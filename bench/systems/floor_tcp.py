"""The plain-TCP floor: what "write to two replicas and wait for both" costs in Python
here without ZeroMQ or msgpack, beside the pyzmq floor (:mod:`bench.systems.floor`).

Two echo processes (``python -m bench.echo_server --tcp``), each an asyncio Protocol on
uvloop that sends every complete frame straight back. A frame is a 4-byte big-endian
length, then an 8-byte request number and the record. The blocking client holds one
blocking socket per echo process (TCP_NODELAY on both sides), sends the frame to both
and reads both replies; the asyncio client writes to both transports and matches the
replies by request number, so any number of appends may be in flight. No ordering, no
replication logic, no disk: the least a two-replica exchange costs in Python here.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import struct
from typing import Any

from .floor import FloorSystem

#: length (of what follows it), request number; the record follows
HEADER = struct.Struct("!IQ")
LENGTH_BYTES = 4
#: a blocking read gives up after this long (SO_RCVTIMEO: no poll before each recv)
RECV_TIMEOUT_S = 10


def frame(req: int, data: bytes) -> bytes:
    return HEADER.pack(HEADER.size - LENGTH_BYTES + len(data), req) + data


class FloorTcpSystem(FloorSystem):
    name = "floor (plain TCP)"
    echo_args = ("--tcp",)
    servers_are = "echo processes (plain TCP, uvloop)"
    client_module = __name__
    needs_uvloop = True


class TcpFloorAppender:
    """One blocking socket per echo process: send the frame to all, read every reply."""

    def __init__(self, ports: list[int]) -> None:
        self.socks: list[socket.socket] = []
        try:
            for port in ports:
                s = socket.create_connection(("127.0.0.1", port), timeout=RECV_TIMEOUT_S)
                self.socks.append(s)
                s.settimeout(None)  # truly blocking: no poll before every call
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                # a dead or stuck echo process makes recv fail (EAGAIN), not hang
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", RECV_TIMEOUT_S, 0))
        except BaseException:
            self.close()
            raise
        self.buf = bytearray(64 * 1024)
        self.n = 0

    def _read_reply(self, sock: socket.socket, expect: int) -> int:
        """Read one frame (``expect`` bytes if it is the echo of what was sent; only one
        frame is ever in flight per socket, so a read cannot take part of the next);
        its request number."""
        if expect > len(self.buf):
            self.buf = bytearray(expect)
        view = memoryview(self.buf)
        got, need, header_seen = 0, expect, False
        while got < need:
            k = sock.recv_into(view[got:need])
            if k == 0:
                raise ConnectionError("echo server closed the connection")
            got += k
            if not header_seen and got >= HEADER.size:
                header_seen = True
                length, req = HEADER.unpack_from(self.buf)
                need = LENGTH_BYTES + length
                if need > len(self.buf):
                    view.release()
                    self.buf.extend(bytes(need - len(self.buf)))
                    view = memoryview(self.buf)
                if got > need:
                    raise ConnectionError(f"echo server sent {got} bytes for a frame of {need}")
        if not header_seen:
            raise ConnectionError(f"echo server sent a {got}-byte frame, shorter than its header")
        return req  # type: ignore[no-any-return]

    def append(self, data: bytes) -> Any:
        self.n += 1
        out = frame(self.n, data)
        for s in self.socks:
            s.sendall(out)
        for s in self.socks:  # latency is that of the slower reply; order doesn't matter
            req = self._read_reply(s, len(out))
            if req != self.n:
                raise ConnectionError(f"echo server answered request {req}, expected {self.n}")
        return self.n

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.socks = []


class _Replies(asyncio.Protocol):
    """One connection of the asyncio client: hands every complete reply frame's request
    number to ``on_reply``; fails everything in flight when the connection goes."""

    def __init__(self, owner: "AsyncTcpFloorAppender") -> None:
        self.owner = owner
        self.transport: Any = None
        self.pending = bytearray()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        buf = self.pending
        buf += data
        end, n = 0, len(buf)
        while n - end >= HEADER.size:
            length, req = HEADER.unpack_from(buf, end)
            if n - end - LENGTH_BYTES < length:
                break
            end += LENGTH_BYTES + length
            self.owner.on_reply(req)
        if end:
            del buf[:end]

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.on_lost(exc)


class AsyncTcpFloorAppender:
    """The plain-TCP floor with any number of frames in flight, matched by request number."""

    def __init__(self) -> None:
        self.protocols: list[_Replies] = []
        self.ids = itertools.count(1)
        self.waiting: dict[int, tuple[asyncio.Future[int], list[int]]] = {}
        self.closing = False

    async def connect(self, ports: list[int]) -> None:
        loop = asyncio.get_running_loop()
        for port in ports:
            _, proto = await loop.create_connection(lambda: _Replies(self), "127.0.0.1", port)
            self.protocols.append(proto)

    def on_reply(self, req: int) -> None:
        entry = self.waiting.get(req)
        if entry is not None:
            entry[1][0] -= 1
            if entry[1][0] == 0:
                del self.waiting[req]
                if not entry[0].done():
                    entry[0].set_result(req)

    def on_lost(self, exc: Exception | None) -> None:
        if self.closing:
            return
        error = ConnectionError(f"echo server connection lost ({exc!r})")
        for fut, _ in self.waiting.values():
            if not fut.done():
                fut.set_exception(error)
        self.waiting.clear()

    async def append(self, data: bytes) -> Any:
        req = next(self.ids)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.waiting[req] = (fut, [len(self.protocols)])
        out = frame(req, data)
        for p in self.protocols:
            if p.transport.is_closing():
                self.waiting.pop(req, None)
                raise ConnectionError("echo server connection closed")
            p.transport.write(out)
        return await fut

    async def close(self) -> None:
        self.closing = True
        for p in self.protocols:
            if p.transport is not None:
                p.transport.close()
        self.protocols = []


def open_sync(ports: list[int]) -> TcpFloorAppender:
    return TcpFloorAppender(ports)


async def open_async(ports: list[int]) -> AsyncTcpFloorAppender:
    appender = AsyncTcpFloorAppender()
    try:
        await appender.connect(ports)
    except BaseException:
        await appender.close()
        raise
    return appender
