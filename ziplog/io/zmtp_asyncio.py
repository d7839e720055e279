"""ROUTER and DEALER sockets on asyncio (uvloop when the loop is one), speaking ZMTP 3.1
(NULL, or CURVE when given ``curve=`` keys: the router as the server, which knows each
route's client key, :meth:`ZmtpRouter.peer_key`; the dealer as the client) through the sans-I/O codec :mod:`ziplog.protocol.zmtp`: no libzmq I/O thread and no hop
between threads per message, still wire-compatible with pyzmq/libzmq peers.

* :class:`ZmtpRouter` binds host:port and hands each message to ``on_message(route,
  parts)``; :meth:`ZmtpRouter.send_to` writes to a route. A peer's route is its Identity
  when it sent a non-empty one, else a generated 5-byte id (0x00 + 4 bytes, as libzmq's
  ROUTER makes them).
* :class:`ZmtpDealer` connects to ``tcp://host:port``, reconnects with backoff when the
  connection drops, and hands each message to ``on_message(parts)``.

Each connection is an :class:`asyncio.Protocol` (not streams): ``data_received`` feeds
the codec and dispatches its events inline; a message goes out as one ``transport.write``
of its frames joined. Both ends write greeting and READY at once (as libzmq does), answer
PING with PONG, and optionally send heartbeats (``heartbeat_ivl``): a PING every
interval to 3.1 peers, and the connection is dropped when nothing at all arrived for
``heartbeat_timeout`` (any traffic is a sign of life, 37/ZMTP "Connection Heartbeating").
A connection that has not finished its handshake within ``handshake_timeout`` is dropped
(libzmq's ZMQ_HANDSHAKE_IVL), so a stalled or silent peer holds nothing for long, and
one that sends PINGs while reading none of our PONGs is dropped once ``max_write_buffer``
bytes wait for it. Callbacks run inline in ``data_received``: they must not block (an
exception in one is logged, and the connection goes on).

What is dropped (the HWM analogues; callers count on neither socket to retry):

* ROUTER: :meth:`~ZmtpRouter.send_to` a route that is not connected, or whose connection
  has more than ``max_write_buffer`` bytes unsent (the peer is not reading), drops the
  message and returns False (libzmq's ROUTER drops silently at SNDHWM).
* DEALER: while no connection is handshaken, or the connection's write buffer is above
  asyncio's high-water mark, messages wait in a queue of at most ``queue_limit``; a
  message sent to a full queue is dropped and :meth:`~ZmtpDealer.send` returns False
  (libzmq's non-blocking send fails with EAGAIN at SNDHWM). Queued messages survive a
  reconnect and go out, in order, once the next handshake is done; messages already
  handed to a connection that then breaks are lost with it, as in libzmq.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import struct
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol, cast

from ziplog.protocol.addresses import tcp_addr
from ziplog.protocol.zmtp import (
    DEFAULT_MAX_MESSAGE,
    DEFAULT_MAX_PARTS,
    CurveKeys,
    HandshakeReply,
    Handshaken,
    Message,
    PeerError,
    Ping,
    ProtocolViolation,
    ZmtpConnection,
    parse_endpoint,
)

__all__ = ["RouteHandler", "MessageHandler", "ZmtpDealer", "ZmtpRouter", "parse_endpoint"]

log = logging.getLogger("ziplog.io.zmtp")

#: ``on_message(route, parts)`` of a ROUTER
RouteHandler = Callable[[bytes, list[bytes]], None]
#: ``on_message(parts)`` of a DEALER
MessageHandler = Callable[[list[bytes]], None]

#: libzmq's ZMQ_HANDSHAKE_IVL default
DEFAULT_HANDSHAKE_TIMEOUT = 30.0
#: a ROUTER drops messages to a peer with this many bytes unsent
DEFAULT_MAX_WRITE_BUFFER = 64 << 20
#: a DEALER queues at most this many messages while it cannot write
DEFAULT_QUEUE_LIMIT = 100_000
#: a queued backlog is written in pieces of about this size, so a pause can stop it
_FLUSH_BYTES = 256 << 10


class _Owner(Protocol):
    """What a connection tells the socket it belongs to."""

    def _handshaken(self, link: "_Link", ev: Handshaken) -> None: ...

    def _message(self, link: "_Link", parts: list[bytes]) -> None: ...

    def _writable(self, link: "_Link") -> None: ...

    def _lost(self, link: "_Link") -> None: ...

    def _refused(self, link: "_Link", reason: str) -> None: ...


@dataclass(frozen=True)
class _Settings:
    """What both sockets give each of their connections."""

    max_message: int
    max_frame: int | None
    max_parts: int
    max_write_buffer: int
    handshake_timeout: float
    heartbeat_ivl: float | None
    heartbeat_timeout: float | None
    curve: CurveKeys | None = None

    def link(self, owner: _Owner, socket_type: str, identity: bytes = b"") -> "_Link":
        codec = ZmtpConnection(socket_type, identity=identity, max_frame=self.max_frame,
                               max_message=self.max_message, max_parts=self.max_parts, curve=self.curve)
        return _Link(owner, codec, self)


class _Link(asyncio.Protocol):
    """One TCP connection speaking ZMTP: its codec, its transport, its timers."""

    def __init__(self, owner: _Owner, codec: ZmtpConnection, settings: _Settings) -> None:
        self.owner = owner
        self.codec = codec
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.handshake: Handshaken | None = None
        #: a ROUTER's name for this peer, once it is registered under one
        self.route: bytes | None = None
        self.paused = False
        self.done: asyncio.Future[None] = self.loop.create_future()
        self._ended = False
        self._max_write_buffer = settings.max_write_buffer
        self._handshake_timeout = settings.handshake_timeout
        self._ivl = ivl = settings.heartbeat_ivl
        self._timeout = settings.heartbeat_timeout if settings.heartbeat_timeout is not None else (
            3 * ivl if ivl else None)
        self._timer: asyncio.TimerHandle | None = None
        self._last_recv = 0.0

    # -- asyncio.Protocol ---------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = t = cast(asyncio.Transport, transport)
        if self._ended:  # closed before it was even made (its socket is shutting down)
            t.abort()
            return
        sock = t.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                pass  # not TCP (a test's pipe): nothing to tune
        t.write(self.codec.start())
        self._last_recv = self.loop.time()
        self._timer = self.loop.call_later(self._handshake_timeout, self._handshake_expired)

    def data_received(self, data: bytes) -> None:
        if self._ivl is not None:
            self._last_recv = self.loop.time()
        codec = self.codec
        codec.receive_data(data)
        next_event = codec.next_event
        owner = self.owner
        while not self._ended:
            ev = next_event()
            if ev is None:
                return
            if type(ev) is Message:
                owner._message(self, ev.parts)
            elif type(ev) is Ping:
                if self.write_buffer_size() > self._max_write_buffer:
                    # PINGs from a peer that reads none of our PONGs must not grow our buffer
                    log.warning("ZMTP peer %s: not reading; closing", self._peer())
                    self.abort()
                    return
                self.write(codec.send_pong(ev.context))
            elif type(ev) is HandshakeReply:
                self.write(ev.data)
            elif type(ev) is Handshaken:
                self.handshake = ev
                self._cancel_timer()
                if self._ivl is not None:
                    self._timer = self.loop.call_later(self._ivl, self._beat)
                owner._handshaken(self, ev)
            elif type(ev) is ProtocolViolation:
                log.warning("ZMTP peer %s: %s; closing", self._peer(), ev.reason)
                owner._refused(self, ev.reason)
                farewell = codec.send_error(ev.reason)
                if farewell:
                    self.write(farewell)
                    self.close()  # flush the ERROR, then close
                else:
                    self.abort()
            elif type(ev) is PeerError:
                log.warning("ZMTP peer sent ERROR %r; closing", ev.reason)
                owner._refused(self, ev.reason.decode("ascii", "replace"))
                self.abort()
            # Pong: any traffic already counted as a sign of life

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self.owner._writable(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended = True
        self._cancel_timer()
        if not self.done.done():
            self.done.set_result(None)
        self.owner._lost(self)

    # -- what the sockets use ----------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.transport is not None and not self._ended:
            self.transport.write(data)

    def _peer(self) -> object:
        return self.transport.get_extra_info("peername") if self.transport is not None else None

    def write_buffer_size(self) -> int:
        return self.transport.get_write_buffer_size() if self.transport is not None else 0

    def close(self) -> None:
        """Close once what is written is flushed."""
        self._ended = True
        self._cancel_timer()
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Close now, dropping anything unsent."""
        self._ended = True
        self._cancel_timer()
        if self.transport is not None:
            self.transport.abort()
        elif not self.done.done():
            self.done.set_result(None)  # no connection yet: nothing will call connection_lost

    # -- timers -------------------------------------------------------------------------------------------
    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _handshake_expired(self) -> None:
        self._timer = None
        log.warning("ZMTP peer %s: no handshake in %.1f s; closing", self._peer(), self._handshake_timeout)
        self.abort()

    def _beat(self) -> None:
        assert self._ivl is not None and self._timeout is not None
        self._timer = None
        silent = self.loop.time() - self._last_recv
        if silent > self._timeout:
            log.warning("ZMTP peer %s: silent for %.1f s; closing", self._peer(), silent)
            self.abort()
            return
        if self.handshake is not None and self.handshake.peer_version >= (3, 1):
            # The TTL tells the peer how long we wait for its traffic (tenths of a second).
            self.write(self.codec.send_ping(min(int(self._timeout * 10), 0xFFFF)))
        self._timer = self.loop.call_later(self._ivl, self._beat)


class ZmtpRouter:
    """A bound ROUTER. ``await router.start()`` (or ``async with``) binds; then every
    message of every peer goes to ``on_message(route, parts)``.

    ``handover``: when a peer connects with an Identity a live connection already has,
    the new connection takes the route and the old one is closed (libzmq's
    ZMQ_ROUTER_HANDOVER); without it the new connection is refused (libzmq's default).
    ``on_connect(route)`` / ``on_disconnect(route)`` are told of routes coming and going.
    """

    def __init__(self, on_message: RouteHandler, *, host: str = "127.0.0.1", port: int = 0,
                 max_message: int = DEFAULT_MAX_MESSAGE, max_frame: int | None = None,
                 max_parts: int = DEFAULT_MAX_PARTS, max_write_buffer: int = DEFAULT_MAX_WRITE_BUFFER,
                 heartbeat_ivl: float | None = None, heartbeat_timeout: float | None = None,
                 handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT, handover: bool = False,
                 on_connect: Callable[[bytes], None] | None = None,
                 on_disconnect: Callable[[bytes], None] | None = None, curve: CurveKeys | None = None) -> None:
        assert curve is None or curve.is_server, "a ROUTER answers CURVE as the server"
        self.on_message = on_message
        self.host = host
        self.port = port
        self.max_write_buffer = max_write_buffer
        self.handover = handover
        self.on_connect = on_connect
        self.on_disconnect = on_disconnect
        self._settings = _Settings(max_message, max_frame, max_parts, max_write_buffer, handshake_timeout,
                                   heartbeat_ivl, heartbeat_timeout, curve)
        self._routes: dict[bytes, _Link] = {}
        self._links: set[_Link] = set()
        self._server: asyncio.AbstractServer | None = None
        #: the listening socket :meth:`bind` made (start() then serves it)
        self._sock: socket.socket | None = None
        # libzmq starts its integral routing ids at a random value too.
        self._next_id = random.getrandbits(32)
        #: messages send_to dropped (unknown route or a peer not reading)
        self.dropped = 0

    def bind(self) -> None:
        """Bind and listen now, synchronously (:attr:`port` is then the bound port), for a
        caller that must know its address before the loop runs; :meth:`start` serves it."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(512)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self.port = sock.getsockname()[1]

    async def start(self) -> None:
        """Bind (unless :meth:`bind` did) and listen; :attr:`port` is then the bound port."""
        loop = asyncio.get_running_loop()
        if self._sock is not None:
            self._server = await loop.create_server(self._new_link, sock=self._sock)
        else:
            self._server = await loop.create_server(self._new_link, self.host, self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def endpoint(self) -> str:
        return tcp_addr(self.host, self.port)

    @property
    def routes(self) -> list[bytes]:
        """The routes of the handshaken peers."""
        return list(self._routes)

    def send_to(self, route: bytes, parts: list[bytes]) -> bool:
        """Write one message to ``route``; False (dropped) when the route is not connected
        or its peer has more than ``max_write_buffer`` bytes unread."""
        link = self._routes.get(route)
        if link is None or link.write_buffer_size() > self.max_write_buffer:
            self.dropped += 1
            return False
        link.write(link.codec.send_message(parts))
        return True

    def peer_key(self, route: bytes) -> bytes | None:
        """The CURVE key of the client on ``route`` (None: a NULL connection, or gone)."""
        link = self._routes.get(route)
        if link is None or link.handshake is None:
            return None
        return link.handshake.peer_key or None

    def disconnect(self, route: bytes) -> None:
        """Close a peer's connection (it may reconnect)."""
        link = self._routes.get(route)
        if link is not None:
            link.abort()

    async def aclose(self) -> None:
        """Stop listening and drop every connection."""
        if self._server is not None:
            self._server.close()
        links = list(self._links)
        for link in links:
            link.abort()
        for link in links:
            await link.done
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        elif self._sock is not None:  # bound, never served
            self._sock.close()
        self._sock = None

    async def __aenter__(self) -> "ZmtpRouter":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- what the links tell --------------------------------------------------------------------------------
    def _new_link(self) -> _Link:
        link = self._settings.link(self, "ROUTER")
        self._links.add(link)
        return link

    def _generated_route(self) -> bytes:
        while True:
            route = b"\x00" + struct.pack(">I", self._next_id)
            self._next_id = (self._next_id + 1) & 0xFFFFFFFF
            if route not in self._routes:
                return route

    def _handshaken(self, link: _Link, ev: Handshaken) -> None:
        route = ev.peer_identity or self._generated_route()
        old = self._routes.get(route)
        if old is not None:
            if not self.handover:
                log.warning("ZMTP ROUTER: a second peer with identity %r; refused", route)
                link.abort()
                return
            old.route = None  # its connection_lost must not unregister the newcomer
            old.abort()
        link.route = route
        self._routes[route] = link
        if self.on_connect is not None:
            self.on_connect(route)

    def _message(self, link: _Link, parts: list[bytes]) -> None:
        route = link.route
        if route is None:
            return  # refused or handed over: its last bytes are not delivered
        try:
            self.on_message(route, parts)
        except Exception:
            log.exception("ZMTP ROUTER: on_message failed")

    def _writable(self, link: _Link) -> None:
        pass

    def _refused(self, link: _Link, reason: str) -> None:
        pass

    def _lost(self, link: _Link) -> None:
        self._links.discard(link)
        route = link.route
        if route is not None and self._routes.get(route) is link:
            del self._routes[route]
            if self.on_disconnect is not None:
                self.on_disconnect(route)


class ZmtpDealer:
    """A DEALER connected to one ``tcp://host:port``. :meth:`start` (or ``async with``)
    begins connecting; the connection is remade, after ``reconnect_ivl`` doubling up to
    ``reconnect_ivl_max`` (plus up to as much again at random, as libzmq spreads its
    reconnects), whenever it drops. See the module's notes for what :meth:`send` drops."""

    def __init__(self, endpoint: str, on_message: MessageHandler, *, identity: bytes = b"",
                 max_message: int = DEFAULT_MAX_MESSAGE, max_frame: int | None = None,
                 max_parts: int = DEFAULT_MAX_PARTS, queue_limit: int = DEFAULT_QUEUE_LIMIT,
                 max_write_buffer: int = DEFAULT_MAX_WRITE_BUFFER,
                 reconnect_ivl: float = 0.1, reconnect_ivl_max: float = 5.0,
                 heartbeat_ivl: float | None = None, heartbeat_timeout: float | None = None,
                 handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
                 on_connect: Callable[[], None] | None = None,
                 on_disconnect: Callable[[], None] | None = None, curve: CurveKeys | None = None) -> None:
        assert curve is None or not curve.is_server, "a DEALER opens CURVE as the client"
        self.host, self.port = parse_endpoint(endpoint)
        self.on_message = on_message
        self.identity = bytes(identity)
        self.queue_limit = queue_limit
        self.reconnect_ivl = reconnect_ivl
        self.reconnect_ivl_max = max(reconnect_ivl_max, reconnect_ivl)
        self.on_connect = on_connect
        self.on_disconnect = on_disconnect
        self._settings = _Settings(max_message, max_frame, max_parts, max_write_buffer, handshake_timeout,
                                   heartbeat_ivl, heartbeat_timeout, curve)
        #: messages waiting for a connection, encoded when they leave (a CURVE box's nonce
        #: is its connection's)
        self._queue: deque[list[bytes]] = deque()
        #: why the server refused the last handshake (a mechanism or a key it does not
        #: take), until one succeeds: a client reports it instead of waiting
        self.refused: str | None = None
        self._link: _Link | None = None  # the handshaken connection, when there is one
        self._current: _Link | None = None  # the connection being made or in use
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        #: messages send dropped because the queue was full
        self.dropped = 0

    def start(self) -> None:
        """Begin connecting (in the running loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"zmtp-dealer-{self.port}")

    @property
    def connected(self) -> bool:
        """A handshaken connection is up."""
        return self._link is not None

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def wait_connected(self, timeout: float | None = None) -> None:
        """Until a connection is handshaken (TimeoutError after ``timeout``)."""
        await asyncio.wait_for(self._connected.wait(), timeout)

    def send(self, parts: list[bytes]) -> bool:
        """Write one message now, or queue it; False when the queue is full (dropped)."""
        link = self._link
        if link is not None and not link.paused and not self._queue:
            link.write(link.codec.send_message(parts))
            return True
        if len(self._queue) >= self.queue_limit:
            self.dropped += 1
            return False
        self._queue.append(parts)
        return True

    def close(self) -> None:
        """Drop the connection and stop reconnecting, now (from synchronous code; the
        connecting task ends at its next step)."""
        self._closing = True
        if self._current is not None:
            self._current.abort()
        if self._task is not None:
            self._task.cancel()
        self._queue.clear()

    async def aclose(self) -> None:
        """Drop the connection and stop reconnecting; queued messages are discarded."""
        self._closing = True
        link = self._current
        if link is not None:
            link.abort()
            await link.done
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._queue.clear()

    async def __aenter__(self) -> "ZmtpDealer":
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        delay = self.reconnect_ivl
        while not self._closing:
            link = self._settings.link(self, "DEALER", self.identity)
            self._current = link
            try:
                # bounded: a host that drops SYNs would otherwise hold us for minutes
                await asyncio.wait_for(loop.create_connection(lambda: link, self.host, self.port),
                                       self._settings.handshake_timeout)
            except (OSError, asyncio.TimeoutError) as e:
                log.debug("ZMTP DEALER: connect to %s:%d failed: %s", self.host, self.port, e)
            else:
                await link.done
                if link.handshake is not None:
                    delay = self.reconnect_ivl  # it worked: start the backoff over
            self._current = None
            if self._closing:
                return
            await asyncio.sleep(delay + random.uniform(0, delay))
            delay = min(delay * 2, self.reconnect_ivl_max)

    # -- what the link tells --------------------------------------------------------------------------------
    def _handshaken(self, link: _Link, ev: Handshaken) -> None:
        self._link = link
        self.refused = None
        self._connected.set()
        self._flush(link)
        if self.on_connect is not None:
            self.on_connect()

    def _message(self, link: _Link, parts: list[bytes]) -> None:
        try:
            self.on_message(parts)
        except Exception:
            log.exception("ZMTP DEALER: on_message failed")

    def _writable(self, link: _Link) -> None:
        if link is self._link:
            self._flush(link)

    def _flush(self, link: _Link) -> None:
        """Write the queue, in order, until it is empty or the transport pauses us."""
        q = self._queue
        encode = link.codec.send_message
        while q and not link.paused:
            batch: list[bytes] = []
            size = 0
            while q and size < _FLUSH_BYTES:
                data = encode(q.popleft())
                batch.append(data)
                size += len(data)
            link.write(b"".join(batch))

    def _refused(self, link: _Link, reason: str) -> None:
        if link.handshake is None:
            self.refused = reason

    def _lost(self, link: _Link) -> None:
        if self._link is link:
            self._link = None
            self._connected.clear()
            if self.on_disconnect is not None:
                self.on_disconnect()
