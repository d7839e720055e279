"""The ZeroMQ floor served natively: the same exchange as :mod:`bench.systems.floor`
(a msgpack ``[n, record]`` to two echo processes, wait for both replies), but with
ZeroMQ's wire protocol spoken by ziplog's own ZMTP 3.1 code on both ends
(:mod:`ziplog.protocol.zmtp`): the echo processes run ``ZmtpRouter`` on uvloop
(``python -m bench.echo_server --zmtp``), the blocking client one ``BlockingDealer`` per
echo process over a plain socket, the asyncio client ``ZmtpDealer``. No frame crosses a
libzmq I/O thread; a pyzmq DEALER could still talk to these echo processes. It says
what serving ZeroMQ natively can reach, beside the pyzmq floor and the plain-TCP one.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import msgpack

from .floor import FloorSystem

#: a reply that does not come within this long is an error, not a hang
RECV_TIMEOUT_S = 10.0


class FloorZmtpSystem(FloorSystem):
    name = "floor (ZMTP native)"
    echo_args = ("--zmtp",)
    servers_are = "echo processes (ZMTP 3.1 natively, uvloop)"
    client_module = __name__
    needs_uvloop = True


class ZmtpFloorAppender:
    """One blocking DEALER (a plain socket speaking ZMTP) per echo process."""

    def __init__(self, ports: list[int]) -> None:
        from ziplog.io.zmtp_blocking import BlockingDealer

        self.dealers = [BlockingDealer(f"tcp://127.0.0.1:{port}") for port in ports]
        for d in self.dealers:
            d.connect(RECV_TIMEOUT_S)
        self.n = 0

    def append(self, data: bytes) -> Any:
        self.n += 1
        frame = msgpack.packb([self.n, data])
        for d in self.dealers:
            d.send([frame])
        for d in self.dealers:  # latency is that of the slower reply
            parts = d.recv(RECV_TIMEOUT_S)
            if parts is None:
                raise ConnectionError("an echo process did not answer")
            if msgpack.unpackb(parts[-1])[0] != self.n:
                raise ConnectionError("an echo process answered another request")
        return self.n

    def close(self) -> None:
        for d in self.dealers:
            d.close()


class AsyncZmtpFloorAppender:
    """``ZmtpDealer``s; replies matched by request number, any number in flight."""

    def __init__(self) -> None:
        self.dealers: list[Any] = []
        self.ids = itertools.count(1)
        self.waiting: dict[int, tuple[asyncio.Future[int], list[int]]] = {}

    def _on_reply(self, parts: list[bytes]) -> None:
        req = msgpack.unpackb(parts[-1])[0]
        entry = self.waiting.get(req)
        if entry is not None:
            entry[1][0] -= 1
            if entry[1][0] == 0:
                del self.waiting[req]
                if not entry[0].done():
                    entry[0].set_result(req)

    async def connect(self, ports: list[int]) -> None:
        from ziplog.io.zmtp_asyncio import ZmtpDealer

        for port in ports:
            d = ZmtpDealer(f"tcp://127.0.0.1:{port}", self._on_reply)
            d.start()
            self.dealers.append(d)

    async def append(self, data: bytes) -> Any:
        req = next(self.ids)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.waiting[req] = (fut, [len(self.dealers)])
        frame = msgpack.packb([req, data])
        for d in self.dealers:
            if not d.send([frame]):
                self.waiting.pop(req, None)
                raise ConnectionError("an echo process's queue is full")
        return await asyncio.wait_for(fut, RECV_TIMEOUT_S)

    async def close(self) -> None:
        for d in self.dealers:
            await d.aclose()


def open_sync(ports: list[int]) -> ZmtpFloorAppender:
    return ZmtpFloorAppender(ports)


async def open_async(ports: list[int]) -> AsyncZmtpFloorAppender:
    a = AsyncZmtpFloorAppender()
    await a.connect(ports)
    return a
