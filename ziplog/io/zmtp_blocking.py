"""A DEALER over a plain blocking :class:`socket.socket`, speaking ZMTP 3.1 (NULL, or CURVE
with ``curve=``) through the sans-I/O codec :mod:`ziplog.protocol.zmtp`: for a blocking
client that wants no libzmq I/O thread (each call does its own reads and writes, in the
caller's thread).

    with BlockingDealer("tcp://127.0.0.1:5555", identity=b"me") as d:
        d.send([b"request"])
        reply = d.recv(timeout=1.0)      # None when nothing came in time

It reconnects on error: a call that finds the connection broken (or the peer breaking
the protocol) connects again, with backoff, within its own deadline. What that means
for delivery: a message whose write failed is written again on the new connection (none
of it reached the peer as a message: a peer drops a partial message with its
connection); messages written before the failure may be lost, and messages the old
connection had received but not yet returned are lost with it. PINGs from the peer are
answered while :meth:`~BlockingDealer.recv` reads. One thread at a time.
"""

from __future__ import annotations

import socket
import time
from typing import Sequence

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

__all__ = ["BlockingDealer"]

#: bytes asked of one recv: below malloc's mmap threshold, so that a fresh buffer is not
#: a mmap, mremap and munmap per call (several times a 4 KiB message's whole read)
_RECV_BYTES = 64 << 10


class BlockingDealer:
    """A blocking DEALER connected to one ``tcp://host:port`` (lazily, on first use, or by
    :meth:`connect`)."""

    def __init__(self, endpoint: str, *, identity: bytes = b"", max_message: int = DEFAULT_MAX_MESSAGE,
                 max_frame: int | None = None, max_parts: int = DEFAULT_MAX_PARTS,
                 connect_timeout: float = 10.0, reconnect_ivl: float = 0.1, reconnect_ivl_max: float = 2.0,
                 curve: CurveKeys | None = None) -> None:
        assert curve is None or not curve.is_server, "a DEALER opens CURVE as the client"
        self.host, self.port = parse_endpoint(endpoint)
        self.curve = curve
        #: why the server refused the last handshake, until one succeeds
        self.refused: str | None = None
        self.identity = bytes(identity)
        self.connect_timeout = connect_timeout
        self.reconnect_ivl = reconnect_ivl
        self.reconnect_ivl_max = max(reconnect_ivl_max, reconnect_ivl)
        self._limits = (max_message, max_frame, max_parts)
        self._sock: socket.socket | None = None
        self._codec: ZmtpConnection | None = None
        #: the peer's READY, once handshaken
        self.handshake: Handshaken | None = None

    # -- the API ----------------------------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._sock is not None

    def connect(self, timeout: float | None = None) -> None:
        """Connect and handshake, retrying with backoff; TimeoutError after ``timeout``
        (default ``connect_timeout``)."""
        if not self._ensure(time.monotonic() + (self.connect_timeout if timeout is None else timeout)):
            raise TimeoutError(f"no ZMTP connection to {self.host}:{self.port}")

    def send(self, parts: Sequence[bytes]) -> None:
        """Write one message (connecting first if need be; once more on a fresh
        connection if the write fails). TimeoutError when no connection can be made
        within ``connect_timeout``."""
        deadline = time.monotonic() + self.connect_timeout
        for attempt in range(2):
            if not self._ensure(deadline):
                raise TimeoutError(f"no ZMTP connection to {self.host}:{self.port}")
            assert self._sock is not None and self._codec is not None
            data = self._codec.send_message(parts)  # per connection: a CURVE box's nonce is its own
            try:
                self._sock.settimeout(None)
                self._sock.sendall(data)
                return
            except OSError:
                self._drop()
                if attempt:
                    raise

    def recv(self, timeout: float | None = None) -> list[bytes] | None:
        """The next message's parts, or None if none came within ``timeout`` seconds
        (None: wait for ever). A broken connection is remade within the same time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._sock is None and not self._ensure(deadline):
                return None
            parts = self._pump()
            if parts is not None:
                return parts
            sock = self._sock
            if sock is None:
                continue  # the peer broke the protocol: connect again
            if deadline is None:
                sock.settimeout(None)
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                sock.settimeout(remaining)
            try:
                data = sock.recv(_RECV_BYTES)
            except TimeoutError:
                return None
            except OSError:
                self._drop()
                continue
            if not data:
                self._drop()  # the peer closed
                continue
            assert self._codec is not None
            self._codec.receive_data(data)

    def close(self) -> None:
        self._drop()

    def __enter__(self) -> "BlockingDealer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the connection --------------------------------------------------------------------------------------
    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
        self._codec = None
        self.handshake = None

    def _pump(self) -> list[bytes] | None:
        """Handle the events the codec has: the next message's parts, or None (and the
        connection dropped if it ended)."""
        codec = self._codec
        while codec is not None:
            ev = codec.next_event()
            if ev is None:
                return None
            if type(ev) is Message:
                return ev.parts
            if type(ev) is Ping:
                try:
                    assert self._sock is not None
                    self._sock.sendall(codec.send_pong(ev.context))
                except OSError:
                    self._drop()
                    return None
            elif type(ev) is ProtocolViolation or type(ev) is PeerError:
                self._drop()
                return None
        return None

    def _ensure(self, deadline: float | None) -> bool:
        """Be connected and handshaken before ``deadline`` (None: no limit); False if not."""
        delay = self.reconnect_ivl
        while self._sock is None:
            if self._attempt(deadline):
                return True
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            time.sleep(delay if remaining is None else min(delay, remaining))
            delay = min(delay * 2, self.reconnect_ivl_max)
        return True

    def _attempt(self, deadline: float | None) -> bool:
        """One connection and handshake; messages that follow the peer's READY in the same
        read stay in the codec for :meth:`recv`."""
        max_message, max_frame, max_parts = self._limits
        codec = ZmtpConnection("DEALER", identity=self.identity, max_message=max_message,
                               max_frame=max_frame, max_parts=max_parts, curve=self.curve)
        sock: socket.socket | None = None
        try:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            sock = socket.create_connection((self.host, self.port), timeout=remaining)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(codec.start())
            while True:
                ev = codec.next_event()
                if isinstance(ev, Handshaken):
                    self._sock, self._codec, self.handshake = sock, codec, ev
                    self.refused = None
                    return True
                if isinstance(ev, HandshakeReply):
                    sock.sendall(ev.data)
                    continue
                if isinstance(ev, (ProtocolViolation, PeerError)):  # this peer is no DEALER's, or refused us
                    self.refused = ev.reason if isinstance(ev.reason, str) else ev.reason.decode("ascii", "replace")
                    sock.close()
                    return False
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        sock.close()
                        return False
                    sock.settimeout(remaining)
                data = sock.recv(_RECV_BYTES)
                if not data:
                    sock.close()
                    return False
                codec.receive_data(data)
        except OSError:
            if sock is not None:
                sock.close()
            return False
