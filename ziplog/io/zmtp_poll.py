"""ZeroMQ's ROUTER, DEALER and SUB served natively inside a :class:`ZmqRuntime`'s poll loop:
plain non-blocking TCP sockets whose file descriptors the loop polls beside its libzmq
sockets, speaking ZMTP 3.1 (NULL, or CURVE: below) through the sans-I/O codec
(:mod:`ziplog.protocol.zmtp`). A frame read or written here never crosses a libzmq I/O
thread: the process's own thread reads it, hands it to the driver in the same turn, and
writes the answer with one ``send`` system call. Peers cannot tell: a pyzmq DEALER or
ROUTER talks to these as to libzmq's.

Semantics kept from libzmq's sockets:

* **ROUTER**: each connection's route is the Identity its peer sent, or a generated
  5-byte id (0x00 and 4 bytes); a message for a route that is gone is dropped
  (``send_to`` returns False), as is one for a peer more than ``HWM_BYTES`` behind on
  reading. A message of more than one frame goes to ``on_multipart``.
* **DEALER**: connects in the background and again after a failure (backoff 10 ms to
  1 s); messages sent before the handshake wait in a bounded queue (``QUEUE_LIMIT``
  messages; beyond it ``send`` returns False); messages written to a connection that
  then breaks are lost, as with libzmq.
* **SUB**: one DEALER-like link per publisher (each connecting and reconnecting as
  above), subscribed to every message; it sends nothing else. The subscription is a
  SUBSCRIBE command to a ZMTP 3.1 publisher and a message starting 0x01 to a 3.0 one,
  as libzmq's SUB does.
* Frames above ``max_bytes`` are refused from their header: the connection is closed
  (libzmq's ZMQ_MAXMSGSIZE).
* **CURVE**: with ``credentials`` (:class:`ziplog.protocol.keys.Credentials`), a ROUTER
  answers as the server with ``credentials.server`` and knows each route's client key
  (:meth:`NativeRouter.peer_key`); a DEALER or SUB connects as ``credentials.client``
  to ``credentials.server_public``. Every frame then travels in a box.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import socket
from collections import deque
from typing import Any, Callable

from ziplog.io.ports import FrameHandler, MultipartHandler, RoutedHandler
from ziplog.protocol.addresses import tcp_addr
from ziplog.io.keys import client_keys, server_keys
from ziplog.protocol.keys import Credentials
from ziplog.protocol.zmtp import (
    DEFAULT_MAX_MESSAGE,
    HandshakeReply,
    Handshaken,
    Message,
    PeerError,
    Ping,
    ProtocolViolation,
    ZmtpConnection,
    encode_frame,
    frame_header,
    parse_endpoint,
)

log = logging.getLogger("ziplog.io")

#: bytes read per recv call (into one buffer per loop, then copied out: a fresh 256 KiB
#: bytes object per recv would be a mmap, mremap and munmap each, several times the cost
#: of a 4 KiB message's whole read), and per connection per turn at most (then the next turn)
RECV_BYTES = 256 << 10
READ_BUDGET = 4 << 20
#: a peer further behind than this on reading loses what is sent to it
HWM_BYTES = 64 << 20
#: a one-frame message whose body is at least this large leaves beside its header (one
#: ``sendmsg`` of both) instead of copied after it first: a FORWARD of a loaded turn's
#: records is 100 KiB and more, and the copy's fresh memory was page-faulted in
GATHER_BYTES = 16 << 10
#: messages a DEALER queues while it is not connected
QUEUE_LIMIT = 100_000
#: a ROUTER logs refused peers at most once per this long
REFUSAL_LOG_NS = 1_000_000_000
RECONNECT_MIN_NS = 10_000_000
RECONNECT_MAX_NS = 1_000_000_000

_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK)


class _LoopState:
    """What the native endpoints of one runtime (one thread) share: the receive buffer,
    and the writes held back while a chunk of input is handled."""

    __slots__ = ("buf", "view", "corked", "pending")

    def __init__(self) -> None:
        self.buf = bytearray(RECV_BYTES)
        self.view = memoryview(self.buf)
        #: > 0 while the messages of one received chunk are handled: what they send
        #: waits in its connection's buffer, and leaves with one ``send`` per peer when
        #: the chunk is done (a pipelining client's 64 ACKs: one system call, not 64).
        #: With one message per chunk (low load) that is at once, as before.
        self.corked = 0
        self.pending: list[_Conn] = []

    def flush_if_pending(self) -> None:
        if self.pending:
            self.flush()

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        for conn in pending:
            conn.flush()


def _loop_state(rt: Any) -> _LoopState:
    got = getattr(rt, "_zmtp_loop_state", None)
    if got is None:
        got = rt._zmtp_loop_state = _LoopState()
        rt._before_poll.append(got.flush_if_pending)
    return got  # type: ignore[no-any-return]


class _Conn:
    """One TCP connection and its codec; the owner hands it events."""

    __slots__ = ("rt", "sock", "fd", "codec", "out", "owner", "route", "closed", "writing", "loop")

    def __init__(self, rt: Any, sock: socket.socket, codec: ZmtpConnection, owner: Any) -> None:
        self.rt = rt
        self.sock = sock
        self.fd = sock.fileno()
        self.codec = codec
        self.out = bytearray()
        self.owner = owner
        self.route: bytes | None = None
        self.closed = False
        self.writing = False
        self.loop = _loop_state(rt)
        rt.watch_fd(self.fd, self._readable, self._writable)

    def start(self) -> None:
        self.write(self.codec.start())

    def write(self, data: bytes) -> bool:
        if self.closed:
            return False
        if self.out:  # held back (corked) or waiting for the socket: after what is there
            if len(self.out) > HWM_BYTES:
                return False
            self.out += data
            return True
        if self.loop.corked:
            self.out += data
            self.loop.pending.append(self)
            return True
        try:
            n = self.sock.send(data)
        except BlockingIOError:
            n = 0
        except OSError:
            self.close()
            return False
        if n < len(data):
            self.out += memoryview(data)[n:]
            if not self.writing:
                self.writing = True
                self.rt.want_write(self.fd, True)
        return True

    def write_frame(self, body: bytes) -> bool:
        """``write(encode_frame(body))``, without joining a large body to its header
        first: both leave in one ``sendmsg``, or are appended to what waits (under
        CURVE, the frame's box)."""
        if self.codec.curve is not None:
            return self.write(self.codec.send_message((body,)))
        if len(body) < GATHER_BYTES:
            return self.write(encode_frame(body))
        if self.closed:
            return False
        header = frame_header(len(body))
        if self.out or self.loop.corked:  # behind what waits, or held back: as write() does
            if self.out:
                if len(self.out) > HWM_BYTES:
                    return False
            else:
                self.loop.pending.append(self)
            self.out += header
            self.out += body
            return True
        try:
            n = self.sock.sendmsg((header, body))
        except BlockingIOError:
            n = 0
        except OSError:
            self.close()
            return False
        h = len(header)
        if n < h + len(body):
            if n < h:
                self.out += header[n:]
                self.out += body
            else:
                self.out += memoryview(body)[n - h:]
            if not self.writing:
                self.writing = True
                self.rt.want_write(self.fd, True)
        return True

    def flush(self) -> None:
        """Send what was held back while corked (the rest when the socket is writable)."""
        if self.closed or not self.out or self.writing:
            return
        try:
            n = self.sock.send(self.out)
        except BlockingIOError:
            n = 0
        except OSError:
            self.close()
            return
        del self.out[:n]
        if self.out:
            self.writing = True
            self.rt.want_write(self.fd, True)

    def _writable(self) -> None:
        if self.closed or not self.out:
            return
        try:
            n = self.sock.send(self.out)
        except BlockingIOError:
            return
        except OSError:
            self.close()
            return
        del self.out[:n]
        if not self.out and self.writing:
            self.writing = False
            self.rt.want_write(self.fd, False)

    def _readable(self) -> None:
        got = 0
        loop = self.loop
        buf, view = loop.buf, loop.view
        while not self.closed and got < READ_BUDGET:
            try:
                n = self.sock.recv_into(buf)
            except BlockingIOError:
                return
            except OSError:
                self.close()
                return
            if not n:
                self.close()
                return
            got += n
            codec = self.codec
            codec.receive_data(bytes(view[:n]))
            loop.corked += 1
            try:
                while not self.closed:
                    ev = codec.next_event()
                    if ev is None:
                        break
                    if type(ev) is Message:
                        self.owner.on_message(self, ev.parts)
                    elif type(ev) is Ping:
                        self.write(codec.send_pong(ev.context))
                    elif type(ev) is HandshakeReply:
                        self.write(ev.data)
                    elif type(ev) is Handshaken:
                        self.owner.on_handshaken(self, ev)
                    elif type(ev) is ProtocolViolation or type(ev) is PeerError:
                        self.owner.on_refused(self, ev)
                        if type(ev) is ProtocolViolation:
                            farewell = codec.send_error(ev.reason)
                            if farewell:
                                self.write(farewell)
                                self.flush()
                        self.close()
                        return
            finally:
                loop.corked -= 1
                if not loop.corked and loop.pending:
                    loop.flush()
            if n < RECV_BYTES:
                return  # the kernel had no more

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.rt.unwatch_fd(self.fd)
        try:
            self.sock.close()
        except OSError:
            pass
        self.owner.on_closed(self)


class NativeRouter:
    """A bound ROUTER (see the module's docstring); ``addr`` is ``tcp://host:port``."""

    def __init__(self, rt: Any, on_frame: RoutedHandler, on_multipart: MultipartHandler, host: str, port: int,
                 max_bytes: int = -1, credentials: Credentials | None = None) -> None:
        self.rt = rt
        self.on_frame = on_frame
        self.on_multipart = on_multipart
        self.max_bytes = DEFAULT_MAX_MESSAGE * 64 if max_bytes < 0 else max_bytes
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, port))
        self.listener.listen(512)
        self.listener.setblocking(False)
        bound = self.listener.getsockname()[1]
        self.addr = tcp_addr(host, bound)
        self.routes: dict[bytes, _Conn] = {}
        #: route -> the client's CURVE key (routes of CURVE connections only)
        self.keys: dict[bytes, bytes] = {}
        self.conns: set[_Conn] = set()
        self.curve = server_keys(credentials)
        self._refusals = 0
        self._refusal_logged_ns = -REFUSAL_LOG_NS
        self._next_id = random.getrandbits(32)
        self.closed = False
        rt.watch_fd(self.listener.fileno(), self._accept, None)
        rt._native.add(self)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                log.warning("accepting a connection failed: %s", exc)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(self.rt, sock, ZmtpConnection("ROUTER", max_frame=self.max_bytes,
                                                       max_message=self.max_bytes, curve=self.curve), self)
            self.conns.add(conn)
            conn.start()

    def on_handshaken(self, conn: _Conn, ev: Handshaken) -> None:
        route = ev.peer_identity or b""
        if not route or route[0] == 0 or route in self.routes:
            self._next_id = (self._next_id + 1) & 0xFFFFFFFF
            route = b"\x00" + self._next_id.to_bytes(4, "big")
        conn.route = route
        self.routes[route] = conn
        if ev.peer_key:
            self.keys[route] = ev.peer_key

    def on_refused(self, conn: _Conn, ev: ProtocolViolation | PeerError) -> None:
        # A peer reconnecting with the wrong mechanism or key fails again every backoff:
        # one line per REFUSAL_LOG_NS, with how many there were.
        self._refusals += 1
        now = self.rt.now()
        if now - self._refusal_logged_ns >= REFUSAL_LOG_NS:
            log.warning("a ZeroMQ peer broke the protocol (%s): connection closed (%d such since the last line)",
                        ev.reason, self._refusals)
            self._refusals = 0
            self._refusal_logged_ns = now

    def peer_key(self, route: bytes) -> bytes | None:
        """The CURVE key of the client on ``route`` (None: a NULL connection, or gone)."""
        return self.keys.get(route)

    def on_message(self, conn: _Conn, parts: list[bytes]) -> None:
        route = conn.route
        assert route is not None, "a message before the handshake"
        if len(parts) == 1:
            self.on_frame(route, parts[0])
        else:
            self.on_multipart(route, len(parts))

    def on_closed(self, conn: _Conn) -> None:
        self.conns.discard(conn)
        if conn.route is not None and self.routes.get(conn.route) is conn:
            del self.routes[conn.route]
            self.keys.pop(conn.route, None)

    def send_to(self, route: bytes, frame: bytes) -> bool:
        conn = self.routes.get(route)
        if conn is None:
            return False
        return conn.write_frame(frame)

    def close(self, linger_ms: int = 0) -> None:
        if self.closed:
            return
        self.closed = True
        self.rt.unwatch_fd(self.listener.fileno())
        self.listener.close()
        for conn in list(self.conns):
            conn.close()
        self.rt._native.discard(self)


class NativeDealer:
    """A DEALER connected to ``addr`` in the background (see the module's docstring)."""

    #: the socket type named in the handshake
    SOCKET_TYPE = "DEALER"

    def __init__(self, rt: Any, addr: str, on_frame: FrameHandler, max_bytes: int = -1,
                 credentials: Credentials | None = None) -> None:
        self.rt = rt
        self.addr = addr
        self.curve = client_keys(credentials)
        #: why the server last refused the handshake (a mechanism or key mismatch), until
        #: a handshake succeeds: a client reports it instead of waiting
        self.refused: str | None = None
        self.host, self.port = parse_endpoint(addr)
        self.on_frame = on_frame
        self.max_bytes = DEFAULT_MAX_MESSAGE * 64 if max_bytes < 0 else max_bytes
        self.conn: _Conn | None = None
        self.ready = False
        self.queue: deque[bytes] = deque()
        self.closed = False
        self._backoff = RECONNECT_MIN_NS
        self._timer: Any = None
        self._connecting: socket.socket | None = None
        rt._native.add(self)
        self._connect()

    # -- connecting -------------------------------------------------------------------------------
    def _connect(self) -> None:
        self._timer = None
        if self.closed:
            return
        try:
            infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            family, _, _, _, sockaddr = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            err = sock.connect_ex(sockaddr)
        except OSError:
            self._retry()
            return
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            self._retry()
            return
        self._connecting = sock
        self.rt.watch_fd(sock.fileno(), None, self._connected)
        self.rt.want_write(sock.fileno(), True)

    def _connected(self) -> None:
        sock = self._connecting
        if sock is None:
            return
        self._connecting = None
        self.rt.unwatch_fd(sock.fileno())
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            sock.close()
            self._retry()
            return
        self.conn = _Conn(self.rt, sock, ZmtpConnection(self.SOCKET_TYPE, max_frame=self.max_bytes,
                                                        max_message=self.max_bytes, curve=self.curve), self)
        self.conn.start()

    def _retry(self) -> None:
        if self.closed:
            return
        self._timer = self.rt.call_at(self.rt.now() + self._backoff, self._connect)
        self._backoff = min(self._backoff * 2, RECONNECT_MAX_NS)

    def on_handshaken(self, conn: _Conn, ev: Handshaken) -> None:
        self.ready = True
        self.refused = None
        self._backoff = RECONNECT_MIN_NS
        while self.queue and not conn.closed:
            conn.write_frame(self.queue.popleft())

    def on_refused(self, conn: _Conn, ev: ProtocolViolation | PeerError) -> None:
        reason = ev.reason if isinstance(ev.reason, str) else ev.reason.decode("ascii", "replace")
        if reason != self.refused:  # said once, not at every reconnection
            log.warning("%s: the ZeroMQ connection ended (%s)", self.addr, reason)
        if conn.codec.peer_socket_type is None:  # in the handshake
            self.refused = reason

    def on_message(self, conn: _Conn, parts: list[bytes]) -> None:
        self.on_frame(parts[-1] if len(parts) == 1 else b"".join(parts))

    def on_closed(self, conn: _Conn) -> None:
        if conn is self.conn:
            self.conn = None
            self.ready = False
            self._retry()

    # -- the Endpoint -----------------------------------------------------------------------------
    def send(self, frame: bytes) -> bool:
        if self.closed:
            return False
        conn = self.conn
        if conn is not None and self.ready:
            return conn.write_frame(frame)
        if len(self.queue) >= QUEUE_LIMIT:
            return False
        self.queue.append(frame)  # framed (and boxed) when it leaves: nonces are per connection
        return True

    def connect(self, addr: str) -> None:
        raise NotImplementedError("a native DEALER connects to one address")

    def close(self, linger_ms: int = 0) -> None:
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._connecting is not None:
            self.rt.unwatch_fd(self._connecting.fileno())
            self._connecting.close()
            self._connecting = None
        if self.conn is not None:
            self.conn.close()
        self.rt._native.discard(self)


class _PublisherLink(NativeDealer):
    """A SUB's connection to one publisher: subscribes to everything once the handshake
    is done (again after each reconnect), then only receives."""

    SOCKET_TYPE = "SUB"

    def on_handshaken(self, conn: _Conn, ev: Handshaken) -> None:
        super().on_handshaken(conn, ev)
        conn.write(conn.codec.send_subscribe_all())


class NativeSubscriber:
    """A SUB (see the module's docstring): ``connect`` adds a publisher."""

    def __init__(self, rt: Any, addr: str, on_frame: FrameHandler, max_bytes: int = -1,
                 credentials: Credentials | None = None) -> None:
        self.rt = rt
        self.addr = addr
        self.on_frame = on_frame
        self.max_bytes = max_bytes
        self.credentials = credentials
        self.links: dict[str, _PublisherLink] = {}
        self.closed = False
        self.connect(addr)

    def connect(self, addr: str) -> None:
        if not self.closed and addr not in self.links:
            self.links[addr] = _PublisherLink(self.rt, addr, self.on_frame, self.max_bytes, self.credentials)

    def send(self, frame: bytes) -> bool:
        raise NotImplementedError("a SUB sends nothing")

    def close(self, linger_ms: int = 0) -> None:
        self.closed = True
        for link in self.links.values():
            link.close()
        self.links.clear()


def native_transport_wanted() -> bool:
    """Serve ROUTER and DEALER traffic with these endpoints (the default) unless
    ``ZIPLOG_TRANSPORT=zmq`` asks for libzmq's."""
    return os.environ.get("ZIPLOG_TRANSPORT", "native") != "zmq"
