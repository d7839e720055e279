"""Echo process for the latency floors.

``python -m bench.echo_server --port P`` binds a ROUTER on 127.0.0.1:P (P=0 picks a free
port) and sends every message straight back to its sender in a tight loop (the pyzmq
floor). ``--tcp`` instead listens on plain TCP with an asyncio Protocol on uvloop,
TCP_NODELAY on every connection, and sends back every complete frame of the stream it
receives, a frame being a 4-byte big-endian length and that many bytes (the plain-TCP
floor). Once bound it prints ``READY <port>`` on stdout so the parent knows the port and
that it may connect. The process exits on SIGTERM/SIGINT or when its parent dies
(checked once a second by a watchdog thread, so no per-message cost)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

import zmq

#: the length prefix of a plain-TCP frame (big-endian, counts the bytes after it)
LENGTH_BYTES = 4


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def complete_frames(buf: bytes | bytearray, start: int = 0) -> int:
    """Where the complete length-prefixed frames of ``buf`` from ``start`` end."""
    end, n = start, len(buf)
    while n - end >= LENGTH_BYTES:
        size = int.from_bytes(buf[end:end + LENGTH_BYTES], "big")
        if n - end - LENGTH_BYTES < size:
            break
        end += LENGTH_BYTES + size
    return end


class FrameEcho(asyncio.Protocol):
    """Sends every complete frame back as it arrives; keeps a partial one until the
    rest comes. A chunk that is whole frames (the usual case) goes back as it is."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.pending = bytearray()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if not self.pending:
            end = complete_frames(data)
            if end:
                self.transport.write(data if end == len(data) else data[:end])
            if end < len(data):
                self.pending += data[end:]
            return
        self.pending += data
        end = complete_frames(self.pending)
        if end:
            self.transport.write(bytes(self.pending[:end]))
            del self.pending[:end]


def serve_tcp(port: int) -> None:
    import uvloop

    async def run() -> None:
        server = await asyncio.get_running_loop().create_server(FrameEcho, "127.0.0.1", port)
        bound = server.sockets[0].getsockname()[1]
        sys.stdout.write(f"READY {bound}\n")
        sys.stdout.flush()
        await server.serve_forever()

    uvloop.run(run())


def serve_zmtp(port: int) -> None:
    """A ROUTER speaking ZMTP natively (ziplog's codec) on uvloop: every message goes
    back to the peer it came from, unchanged."""
    import uvloop

    from ziplog.io.zmtp_asyncio import ZmtpRouter

    async def run() -> None:
        routers: list[ZmtpRouter] = []

        def echo(route: bytes, parts: list[bytes]) -> None:
            routers[0].send_to(route, parts)

        router = ZmtpRouter(echo, port=port)
        routers.append(router)
        await router.start()
        sys.stdout.write(f"READY {router.port}\n")
        sys.stdout.flush()
        await asyncio.Event().wait()

    uvloop.run(run())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.echo_server")
    ap.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (0 = any free port)")
    ap.add_argument("--tcp", action="store_true",
                    help="plain TCP, length-prefixed frames, asyncio Protocol on uvloop (instead of a ZeroMQ ROUTER)")
    ap.add_argument("--zmtp", action="store_true",
                    help="a ROUTER speaking ZMTP 3.1 natively on uvloop (ziplog's codec), not libzmq's")
    args = ap.parse_args(argv)

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    if args.tcp or args.zmtp:
        try:
            (serve_tcp if args.tcp else serve_zmtp)(args.port)
        except KeyboardInterrupt:
            pass
        return 0

    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if args.port:
        sock.bind(f"tcp://127.0.0.1:{args.port}")
        port = args.port
    else:
        port = sock.bind_to_random_port("tcp://127.0.0.1")
    sys.stdout.write(f"READY {port}\n")
    sys.stdout.flush()

    recv = sock.recv_multipart
    send = sock.send_multipart
    try:
        while True:  # [identity, payload...] goes back to the same identity unchanged
            send(recv(copy=False), copy=False)
    except KeyboardInterrupt:
        pass
    finally:
        sock.close(0)
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
