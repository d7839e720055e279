"""ZMTP 3.1 with the NULL or the CURVE security mechanism, sans I/O: the bytes ZeroMQ peers
exchange on a TCP connection, so a ROUTER or DEALER can be served from asyncio (or a plain blocking
socket) without libzmq's I/O thread and still talk to pyzmq/libzmq peers.

The reference is 37/ZMTP (https://rfc.zeromq.org/spec/37/); comments cite its sections.
libzmq (``src/zmtp_engine.cpp``, ``src/v2_decoder.cpp``, ``src/null_mechanism.cpp``) is
the reference implementation, and where it is laxer than the text this codec follows it
only when a libzmq peer would otherwise be refused (noted where it happens).

One :class:`ZmtpConnection` is one connection, in the h11 style: the caller feeds the bytes
it read with :meth:`~ZmtpConnection.receive_data`, pulls typed events with
:meth:`~ZmtpConnection.next_event` (or both at once with :meth:`~ZmtpConnection.receive`)
and writes whatever the ``send_*`` methods return. The codec never writes, sleeps or
reads a clock; heartbeat timing, reconnection and routing belong to the transports in
:mod:`ziplog.io`.

A connection, as the caller sees it::

    conn = ZmtpConnection("DEALER", identity=b"me")
    write(conn.start())                      # our greeting and our READY, at once
    for ev in conn.receive(read()):          # Handshaken, then Message / Ping / Pong
        ...                                  # ProtocolViolation or PeerError: close it
    write(conn.send_message([b"a", b"b"]))

Parsing is total: any byte sequence yields events, or stops at one
:class:`ProtocolViolation` (or :class:`PeerError`) after which the connection is dead and
further bytes are ignored. No input raises.

CURVE (RFC 26, CurveZMQ; the boxes are :mod:`ziplog.protocol.curve`'s) is asked for with
``curve=``: a :class:`CurveKeys` with ``server_public`` makes the connection the client
(it sends HELLO with its greeting, INITIATE when WELCOME comes, and is handshaken at
READY), one without makes it the server (WELCOME, then READY once INITIATE vouches for the
client's long-term key, which :class:`Handshaken` carries as ``peer_key``). Handshake
answers come out as :class:`HandshakeReply` events for the caller to write. Then every
wire frame is one MESSAGE box (flags 0, as libzmq sends it) holding one ZMTP frame's
flags (MORE, COMMAND, as libzmq's message flags 1 and 2) and body: PING, PONG and SUBSCRIBE travel boxed too. Limits apply
to the frames inside the boxes; a box is at most ``CURVE_OVERHEAD`` bytes larger. Sizes are checked from the frame header,
before the body is waited for, so a peer cannot make the codec hold more than one frame
header beyond the limits: ``max_frame`` per frame, ``max_message`` per multipart message
(libzmq's ZMQ_MAXMSGSIZE is per frame), ``max_parts`` frames per message, ``max_command``
per command.

Memory: the codec holds the bytes fed and not yet parsed. A caller that drains
:meth:`next_event` after each :meth:`receive_data` (as :meth:`receive` does) holds at most
one partial frame (at most ``max_frame`` + 9 bytes, refused from its header when larger)
plus the frames of the partial message (at most ``max_message``), plus the last chunk it fed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, Union

from ziplog.protocol.keys import CurveError

__all__ = [
    "CURVE_OVERHEAD",
    "CurveKeys",
    "DEFAULT_MAX_COMMAND",
    "DEFAULT_MAX_MESSAGE",
    "DEFAULT_MAX_PARTS",
    "GREETING_SIZE",
    "SOCKET_TYPES",
    "Event",
    "HandshakeReply",
    "Handshaken",
    "Message",
    "PeerError",
    "Ping",
    "Pong",
    "ProtocolViolation",
    "ZmtpConnection",
    "encode_frame",
    "encode_message",
    "frame_header",
    "parse_endpoint",
    "valid_peer",
]

#: The greeting is always 64 octets (37/ZMTP "Formal Grammar": greeting).
GREETING_SIZE = 64
#: Default ceiling on one multipart message (and on one frame of it).
DEFAULT_MAX_MESSAGE = 16 << 20
#: Default ceiling on the frames of one message: each costs a list slot even when empty.
DEFAULT_MAX_PARTS = 4096
#: Default ceiling on a command body: READY with a few properties, PING, ERROR.
DEFAULT_MAX_COMMAND = 64 << 10

# Flags octet (37/ZMTP "Framing"): bit 0 MORE, bit 1 LONG (8-octet size), bit 2 COMMAND;
# bits 7-3 are reserved and MUST be zero.
_MORE = 0x01
_LONG = 0x02
_COMMAND = 0x04
_RESERVED = 0xF8
#: A long frame's body is 0 to 2^63-1 octets ("Formal Grammar": long-size).
_MAX_LONG = (1 << 63) - 1
#: "The value SHALL be 0 to 2,147,483,647 octets" ("The NULL Security Mechanism").
_MAX_PROPERTY_VALUE = 0x7FFFFFFF
#: "identity = 0*255OCTET" ("The Identity Property").
_MAX_IDENTITY = 255
#: "ping-context = 0*16OCTET" ("Connection Heartbeating").
_MAX_PING_CONTEXT = 16

_U64 = struct.Struct(">Q")
_U32 = struct.Struct(">I")
_U16 = struct.Struct(">H")

# Signature: %xFF, 8 octets of padding that "a peer SHALL NOT assign any significance to"
# (we send zeros, as "Version Negotiation" recommends for full greetings), %x7F. Then
# version 3.1, the mechanism null-padded to 20 octets, as-server (MUST be zero under NULL),
# and 31 octets of zero filler.
_NULL_MECHANISM = b"NULL".ljust(20, b"\x00")
_CURVE_MECHANISM = b"CURVE".ljust(20, b"\x00")
_GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x01" + _NULL_MECHANISM + b"\x00" + bytes(31)
assert len(_GREETING) == GREETING_SIZE


def _greeting_bytes(mechanism: bytes, as_server: bool) -> bytes:
    return b"\xff" + bytes(8) + b"\x7f" + b"\x03\x01" + mechanism + bytes((as_server,)) + bytes(31)


# A box's flags byte: libzmq's message flags (more 1, command 2), not the wire's.
_BOX_MORE = 0x01
_BOX_COMMAND = 0x02

#: what a MESSAGE box adds to the frame it carries: its name (8), nonce (8), MAC (16) and
#: the flags byte (1)
CURVE_OVERHEAD = 33

#: Which peer socket types each socket type may talk to (37/ZMTP "The Socket-Type
#: Property", the table of legal combinations).
SOCKET_TYPES: Mapping[str, frozenset[str]] = {
    "REQ": frozenset({"REP", "ROUTER"}),
    "REP": frozenset({"REQ", "DEALER"}),
    "DEALER": frozenset({"REP", "DEALER", "ROUTER"}),
    "ROUTER": frozenset({"REQ", "DEALER", "ROUTER"}),
    "PUB": frozenset({"SUB", "XSUB"}),
    "XPUB": frozenset({"SUB", "XSUB"}),
    "SUB": frozenset({"PUB", "XPUB"}),
    "XSUB": frozenset({"PUB", "XPUB"}),
    "PUSH": frozenset({"PULL"}),
    "PULL": frozenset({"PUSH"}),
    "PAIR": frozenset({"PAIR"}),
    "CLIENT": frozenset({"SERVER"}),
    "SERVER": frozenset({"CLIENT"}),
    "RADIO": frozenset({"DISH"}),
    "DISH": frozenset({"RADIO"}),
    "SCATTER": frozenset({"GATHER"}),
    "GATHER": frozenset({"SCATTER"}),
    "PEER": frozenset({"PEER"}),
    "CHANNEL": frozenset({"CHANNEL"}),
}

#: Socket types whose READY carries an Identity property (libzmq: REQ, DEALER, ROUTER;
#: "The Identity Property": only these peers' identities address a ROUTER).
_IDENTITY_TYPES = frozenset({"REQ", "DEALER", "ROUTER"})

# "name-char = ALPHA | DIGIT | "-" | "_" | "." | "+"" (The NULL Security Mechanism).
_NAME_CHARS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.+"


def valid_peer(local: str, peer: str) -> bool:
    """True when a ``local`` socket may talk to a ``peer`` socket (both upper case)."""
    return peer in SOCKET_TYPES.get(local, frozenset())


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` (or ``host:port``; ``[v6]:port``) -> (host, port)."""
    rest = endpoint[6:] if endpoint.startswith("tcp://") else endpoint
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not a tcp://host:port endpoint: {endpoint!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


# -- events ---------------------------------------------------------------------------------------------
# Plain (not frozen) slotted dataclasses: a Message is made per received message, and a
# frozen dataclass's __init__ costs several times more.


@dataclass(slots=True)
class Handshaken:
    """Both greetings and the peer's READY are in: messages may flow."""

    peer_socket_type: str
    #: the peer's Identity property (b"" when it sent none or an empty one)
    peer_identity: bytes
    #: the (major, minor) the peer announced; (3, 0) peers get no PING (it is 3.1's)
    peer_version: tuple[int, int] = (3, 1)
    #: every READY property, names lower-cased ("names SHALL be case-insensitive")
    properties: dict[str, bytes] = field(default_factory=dict)
    #: under CURVE, the peer's long-term public key (a client's, as its INITIATE vouched
    #: for it; the server's, which the client named); b"" under NULL
    peer_key: bytes = b""


@dataclass(slots=True)
class HandshakeReply:
    """Bytes the CURVE handshake answers with (WELCOME, INITIATE, READY): write them
    before anything else."""

    data: bytes


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """A connection's CURVE keys (32 raw bytes each): our long-term pair, and, for a
    client, the server's public key; ``random_bytes(n)`` gives the transient keys and
    nonces (the operating system's generator in a driver)."""

    public: bytes
    secret: bytes
    random_bytes: Callable[[int], bytes]
    #: the server's public key when we are the client; b"" makes us the server
    server_public: bytes = b""

    @property
    def is_server(self) -> bool:
        return not self.server_public

    def __repr__(self) -> str:
        return f"CurveKeys(public={self.public.hex()[:16]}..., server={self.is_server})"


@dataclass(slots=True)
class Message:
    """One complete multipart message: every frame of it, in order."""

    parts: list[bytes]


@dataclass(slots=True)
class Ping:
    """A PING command; the transport answers it with :meth:`ZmtpConnection.send_pong`."""

    #: tenths of a second the peer says it waits for traffic before it gives up (0: none)
    ttl: int
    context: bytes


@dataclass(slots=True)
class Pong:
    """A PONG command, echoing the context of a PING we sent."""

    context: bytes


@dataclass(slots=True)
class ProtocolViolation:
    """The peer broke the protocol (or a limit): close the connection. Final."""

    reason: str


@dataclass(slots=True)
class PeerError:
    """The peer sent an ERROR command ("treat an incoming ERROR command as fatal",
    37/ZMTP "Error Handling"): close the connection. Final."""

    reason: bytes


Event = Union[Handshaken, HandshakeReply, Message, Ping, Pong, ProtocolViolation, PeerError]

# -- encoding -------------------------------------------------------------------------------------------


def _frame_header(flags: int, size: int) -> bytes:
    # "If the body is 0-255 octets, the command SHOULD use a short size field" (and
    # likewise for messages, as libzmq's encoder does).
    if size < 256:
        return bytes((flags, size))
    return bytes((flags | _LONG,)) + _U64.pack(size)


def encode_frame(body: bytes) -> bytes:
    """A one-frame message (what :func:`encode_message` makes of ``(body,)``, built
    without its loop: most of ziplog's messages are one frame)."""
    return _frame_header(0, len(body)) + body


def frame_header(size: int) -> bytes:
    """What :func:`encode_frame` puts before a body of ``size`` bytes (a transport may
    send the two side by side instead of copying a large body after its header)."""
    return _frame_header(0, size)


def encode_message(parts: Sequence[bytes]) -> bytes:
    """The frames of one multipart message, joined so the transport writes it in one
    call (a message is "sent atomically", 37/ZMTP "Messages")."""
    n = len(parts)
    if n == 0:
        raise ValueError("a message has at least one frame")
    out: list[bytes] = []
    last = n - 1
    for i, part in enumerate(parts):
        size = len(part)
        flags = _MORE if i < last else 0
        if size < 256:
            out.append(bytes((flags, size)))
        else:
            out.append(bytes((flags | _LONG,)) + _U64.pack(size))
        out.append(part)
    return b"".join(out)


def _command_body(name: bytes, data: bytes) -> bytes:
    # "command-body = command-name command-data; command-name = short-size 1*255ALPHA"
    return bytes((len(name),)) + name + data


def _encode_command(name: bytes, data: bytes) -> bytes:
    body = _command_body(name, data)
    return _frame_header(_COMMAND, len(body)) + body


def _encode_command_frame(body: bytes) -> bytes:
    return _frame_header(_COMMAND, len(body)) + body


def _encode_property(name: bytes, value: bytes) -> bytes:
    # "property = name value; name = short-size 1*255name-char; value = 4OCTET *OCTET"
    return bytes((len(name),)) + name + _U32.pack(len(value)) + value


# -- the connection -------------------------------------------------------------------------------------

_GREETING_STATE = 0
_HANDSHAKE = 1
_TRAFFIC = 2
_CLOSED = 3

# A state step that made progress without producing an event.
_AGAIN = object()


class ZmtpConnection:
    """One ZMTP 3.1/NULL connection's state: greeting -> NULL handshake (READY each way)
    -> traffic (messages and commands), or closed after a violation.

    Both ends send greeting and READY at once (:meth:`start`), as libzmq's NULL mechanism
    does whatever the role: nothing the peer says changes our READY, and it saves the
    round trip the spec's partial greeting would cost (we detect no ZMTP 1.0/2.0 peer to
    downgrade to, so the full greeting is what "Version Negotiation" asks of us).
    """

    __slots__ = (
        "socket_type", "identity", "max_frame", "max_message", "max_parts", "max_command",
        "metadata", "peer_socket_type", "peer_identity", "peer_version", "curve",
        "_state", "_buf", "_pos", "_chunks", "_chunks_len", "_parts", "_msg_bytes",
        "_wire_max_frame", "_handshake_side", "_boxes", "_curve_step", "_pending",
    )

    def __init__(self, socket_type: str, *, identity: bytes = b"",
                 max_frame: int | None = None, max_message: int = DEFAULT_MAX_MESSAGE,
                 max_parts: int = DEFAULT_MAX_PARTS, max_command: int = DEFAULT_MAX_COMMAND,
                 metadata: Mapping[str, bytes] | None = None, curve: CurveKeys | None = None) -> None:
        st = socket_type.upper()
        if st not in SOCKET_TYPES:
            raise ValueError(f"unknown ZMTP socket type {socket_type!r}")
        if len(identity) > _MAX_IDENTITY:
            raise ValueError("an identity is at most 255 bytes")
        if max_message < 0 or max_parts < 1 or max_command < 0:
            raise ValueError("limits must be positive")
        for name in metadata or {}:
            raw = name.encode("ascii", "replace")
            if not 0 < len(raw) < 256 or raw.translate(None, _NAME_CHARS):
                raise ValueError(f"bad metadata name {name!r}")
        self.socket_type = st
        self.identity = bytes(identity)
        self.max_message = max_message
        self.max_frame = max_message if max_frame is None else min(max_frame, max_message)
        self.max_parts = max_parts
        self.max_command = max_command
        self.metadata = dict(metadata or {})
        self.peer_socket_type: str | None = None
        self.peer_identity: bytes | None = None
        self.peer_version: tuple[int, int] | None = None
        self._state = _GREETING_STATE
        # Unparsed input: _buf[_pos:] and then the chunks (joined only once a frame's
        # bytes are all in, so a large frame arriving in pieces is copied once).
        self._buf = b""
        self._pos = 0
        self._chunks: list[bytes] = []
        self._chunks_len = 0
        # The frames of the message being received, and their total size.
        self._parts: list[bytes] = []
        self._msg_bytes = 0
        # CURVE: the handshake's side (a CurveClient or CurveServer), then the boxes of
        # the traffic; which handshake command comes next; a Handshaken held back behind
        # the READY it follows. A wire frame is the box of a frame within the limits.
        self.curve = curve
        self._handshake_side: Any = None
        self._boxes: Any = None
        self._curve_step = 0
        self._pending: Event | None = None
        self._wire_max_frame = self.max_frame
        if curve is not None:
            from ziplog.protocol import curve as curvezmq  # its crypto loads only when asked for

            if curve.is_server:
                self._handshake_side = curvezmq.CurveServer(curve.public, curve.secret, curve.random_bytes)
            else:
                self._handshake_side = curvezmq.CurveClient(curve.server_public, curve.public, curve.secret,
                                                            curve.random_bytes)
            self._wire_max_frame = self.max_frame + CURVE_OVERHEAD

    # -- what the caller looks at ---------------------------------------------------------------------
    @property
    def handshaken(self) -> bool:
        """Messages may flow (our READY was sent with :meth:`start`, the peer's is in)."""
        return self._state == _TRAFFIC

    @property
    def closed(self) -> bool:
        """A violation or an ERROR ended the connection; further input is ignored."""
        return self._state == _CLOSED

    @property
    def buffered(self) -> int:
        """Bytes fed and not yet parsed into events (0 once closed: a refused frame's
        body is never held)."""
        return len(self._buf) - self._pos + self._chunks_len

    # -- output ---------------------------------------------------------------------------------------
    def send_greeting(self) -> bytes:
        """Our 64-octet greeting: version 3.1, mechanism NULL (as-server 0) or CURVE
        (as-server 1 for the server)."""
        curve = self.curve
        if curve is None:
            return _GREETING
        return _greeting_bytes(_CURVE_MECHANISM, curve.is_server)

    def _metadata(self) -> bytes:
        # Socket-Type, Identity (for REQ/DEALER/ROUTER, even empty, as libzmq sends
        # it), then any extra metadata: READY's body under NULL, boxed under CURVE.
        props = [_encode_property(b"Socket-Type", self.socket_type.encode())]
        if self.socket_type in _IDENTITY_TYPES:
            props.append(_encode_property(b"Identity", self.identity))
        for name, value in self.metadata.items():
            props.append(_encode_property(name.encode("ascii"), bytes(value)))
        return b"".join(props)

    def send_ready(self) -> bytes:
        """Our NULL READY (CURVE's READY is the server's answer to INITIATE)."""
        return _encode_command(b"READY", self._metadata())

    def start(self) -> bytes:
        """What to write as soon as the TCP connection is up: the greeting and READY
        (NULL), the greeting and HELLO (a CURVE client), the greeting (a CURVE server)."""
        if self.curve is None:
            return self.send_greeting() + self.send_ready()
        if self.curve.is_server:
            return self.send_greeting()
        return self.send_greeting() + _encode_command_frame(self._handshake_side.hello())

    def send_message(self, parts: Sequence[bytes]) -> bytes:
        """One multipart message's frames (write only once :attr:`handshaken`)."""
        boxes = self._boxes
        if boxes is None:
            return encode_frame(parts[0]) if len(parts) == 1 else encode_message(parts)
        if len(parts) == 1:  # the common case: the frame and its box in one copy
            return boxes.seal(parts[0], 0, frame_header)  # type: ignore[no-any-return]
        last = len(parts) - 1
        if last < 0:
            raise ValueError("a message has at least one frame")
        return b"".join([encode_frame(boxes.seal(part, _BOX_MORE if i < last else 0)) for i, part in enumerate(parts)])

    def _send_command(self, name: bytes, data: bytes) -> bytes:
        boxes = self._boxes
        if boxes is None:
            return _encode_command(name, data)
        return encode_frame(boxes.seal(_command_body(name, data), _BOX_COMMAND))

    def send_ping(self, ttl: int = 0, context: bytes = b"") -> bytes:
        """A PING (ZMTP 3.1 only): ``ttl`` in tenths of a second, ``context`` <= 16 bytes."""
        if not 0 <= ttl <= 0xFFFF or len(context) > _MAX_PING_CONTEXT:
            raise ValueError("PING ttl is 0..65535 deciseconds, context at most 16 bytes")
        return self._send_command(b"PING", _U16.pack(ttl) + context)

    def send_pong(self, context: bytes = b"") -> bytes:
        """The PONG answering a PING: it echoes the PING's context."""
        if len(context) > _MAX_PING_CONTEXT:
            raise ValueError("PONG context is at most 16 bytes")
        return self._send_command(b"PONG", bytes(context))

    def send_subscribe_all(self) -> bytes:
        """A SUB's subscription to every message (write once :attr:`handshaken`): a
        SUBSCRIBE command with an empty topic to a 3.1 peer, a message of the one octet
        0x01 to a 3.0 one ("a subscription message begins with a 1")."""
        if self.peer_version is not None and self.peer_version >= (3, 1):
            return self._send_command(b"SUBSCRIBE", b"")
        return self.send_message((b"\x01",))

    def send_error(self, reason: str) -> bytes:
        """An ERROR command to write before closing, or b"" when the peer would not read
        one: the spec has ERROR only in the handshake ("explicit fatal error response
        during the mechanism handshake"), and a peer whose greeting was refused does not
        speak our framing."""
        # In the handshake (closed there or not): its greeting was good, its READY not in.
        if self.peer_version is None or self.peer_socket_type is not None:
            return b""
        # "error-reason = short-size 0*255VCHAR": printable ASCII, at most 255 octets.
        text = "".join(c if " " <= c <= "~" else "?" for c in reason)[:255].encode("ascii")
        return _encode_command(b"ERROR", bytes((len(text),)) + text)

    # -- input ----------------------------------------------------------------------------------------
    def receive_data(self, data: bytes) -> None:
        """Feed bytes read from the peer (any chunking: a greeting or a frame may arrive
        a byte at a time). Ignored once the connection is closed."""
        if self._state == _CLOSED or not data:
            return
        if self._pos == len(self._buf) and not self._chunks:
            self._buf = bytes(data)
            self._pos = 0
        else:
            self._chunks.append(bytes(data))
            self._chunks_len += len(data)

    def receive(self, data: bytes) -> list[Event]:
        """Feed ``data`` and return every event it completes."""
        self.receive_data(data)
        events: list[Event] = []
        while True:
            ev = self.next_event()
            if ev is None:
                return events
            events.append(ev)

    def next_event(self) -> Event | None:
        """The next event, or None until more bytes are fed (and forever once closed)."""
        if self._state == _TRAFFIC and not self._chunks and not self._parts and self._boxes is None:
            # The common case in one step: a whole one-frame message (flags 0, or LONG
            # alone) within the limits, or nothing buffered. Anything else (a command, a
            # MORE frame, a frame still arriving, one over a limit) takes the general
            # path below, which the result of this one always equals.
            buf = self._buf
            pos = self._pos
            avail = len(buf) - pos
            if avail == 0:
                return None
            if avail >= 2:
                flags = buf[pos]
                if flags == 0:
                    size = buf[pos + 1]
                    start = pos + 2
                elif flags == _LONG and avail >= 9:
                    size = _U64.unpack_from(buf, pos + 1)[0]
                    start = pos + 9
                else:
                    size = -1
                    start = 0
                end = start + size
                if 0 <= size <= self.max_frame and size <= self.max_message and end <= len(buf):
                    body = buf[start:end]
                    if end == len(buf):
                        self._buf = b""
                        self._pos = 0
                    else:
                        self._pos = end
                    return Message([body])
        return self._next_event_any()

    def _next_event_any(self) -> Event | None:
        """:meth:`next_event` for any input, one state step after the other (the
        reference the one-step case must agree with)."""
        pending = self._pending
        if pending is not None:
            self._pending = None
            return pending
        while True:
            st = self._state
            if st == _TRAFFIC:
                r = self._traffic()
            elif st == _GREETING_STATE:
                r = self._greeting()
            elif st == _HANDSHAKE:
                r = self._handshake()
            else:
                return None
            if r is not _AGAIN:
                return r  # type: ignore[return-value]

    # -- parsing --------------------------------------------------------------------------------------
    def _violation(self, reason: str) -> ProtocolViolation:
        self._close()
        return ProtocolViolation(reason)

    def _close(self) -> None:
        self._state = _CLOSED
        self._buf = b""
        self._pos = 0
        self._chunks = []
        self._chunks_len = 0
        self._parts = []
        self._msg_bytes = 0
        self._pending = None
        self._handshake_side = None
        self._boxes = None

    def _have(self, n: int) -> bool:
        """Make ``n`` bytes contiguous at ``_buf[_pos:]`` if that many are buffered."""
        avail = len(self._buf) - self._pos
        if avail >= n:
            return True
        if avail + self._chunks_len < n:
            return False
        self._buf = self._buf[self._pos:] + b"".join(self._chunks)
        self._pos = 0
        self._chunks = []
        self._chunks_len = 0
        return True

    def _greeting(self) -> object:
        # Checked as its octets arrive, so a non-ZMTP peer is refused at its first byte
        # rather than after we wait for 64 (libzmq's receive_greeting does the same).
        avail = min(self.buffered, GREETING_SIZE)
        if avail == 0:
            return None
        self._have(avail)
        g = self._buf[self._pos:self._pos + avail]
        if g[0] != 0xFF:
            return self._violation(
                f"not a ZMTP 3.x peer: first byte 0x{g[0]:02x} is not the signature's 0xff "
                "(a ZMTP 1.0 peer, or not ZeroMQ)")
        if avail < 10:
            return None
        # "Detecting ZMTP 1.0 and 2.0 Peers": the 10th octet's bit 0 is clear in a
        # ZMTP 1.0 identity frame's header, set in the %x7F of a versioned signature.
        if not g[9] & 0x01:
            return self._violation("ZMTP 1.0 peer (unversioned greeting): not supported")
        if avail < 11:
            return None
        major = g[10]
        if major < 3:
            # libzmq's names: revision 0 is ZMTP/1.0 with a version octet, 1 (and 2)
            # ZMTP/2.0. We speak 3.x only and cannot downgrade, so "it MUST close".
            old = "1.0" if major == 0 else "2.0"
            return self._violation(f"ZMTP {old} peer (version octet {major}): only ZMTP 3.x is supported")
        if avail < GREETING_SIZE:
            return None
        # "A peer MUST accept higher protocol versions as valid" and the higher one
        # downgrades: a major above 3 means it talks 3.1 to us.
        version = (3, g[11]) if major == 3 else (3, 1)
        mechanism = g[12:32]
        ours = _NULL_MECHANISM if self.curve is None else _CURVE_MECHANISM
        if mechanism != ours:
            # "If the mechanism that the peer received does not exactly match the mechanism
            # it sent, it MUST close the connection." The greeting was ZMTP's, so an
            # ERROR (send_error) reaches a peer that reads its handshake.
            self._pos += GREETING_SIZE
            self.peer_version = version
            return self._violation(
                f"the peer asks for security mechanism {mechanism.rstrip(bytes(1))!r}; this endpoint speaks "
                f"{ours.rstrip(bytes(1))!r}" + (" only (it needs CURVE keys)" if self.curve is None else
                                                 " only (the server is not CURVE)"))
        # as-server (g[32]) and the filler have no significance under NULL, and under
        # CURVE the roles are each side's own configuration (libzmq checks neither).
        self._pos += GREETING_SIZE
        self.peer_version = version
        self._state = _HANDSHAKE
        return _AGAIN

    def _frame(self, handshake: bool) -> tuple[int, bytes] | ProtocolViolation | None:
        """The next frame's (flags, body), None until it is all in, or a violation as
        soon as its header breaks a rule (before its body is waited for)."""
        if not self._have(2):
            return None
        buf = self._buf
        pos = self._pos
        flags = buf[pos]
        if flags & _RESERVED:
            return self._violation(f"frame flags 0x{flags:02x} set reserved bits (37/ZMTP Framing)")
        if flags & _LONG:
            if not self._have(9):
                return None
            buf = self._buf
            pos = self._pos
            size = _U64.unpack_from(buf, pos + 1)[0]
            if size > _MAX_LONG:
                return self._violation(f"frame size {size} is above 2^63-1")
            header = 9
        else:
            size = buf[pos + 1]
            header = 2
        if flags & _COMMAND:
            if flags & _MORE:
                return self._violation("command frame with MORE set (it SHALL be zero)")
            if size > self.max_command:
                return self._violation(f"command of {size} bytes is above the limit of {self.max_command}")
        elif handshake:
            return self._violation("message frame before the peer's READY")
        else:
            if size > self._wire_max_frame:
                return self._violation(f"frame of {size} bytes is above the limit of {self.max_frame}")
            if self._msg_bytes + size > self.max_message:
                return self._violation(
                    f"message of at least {self._msg_bytes + size} bytes is above the limit of {self.max_message}")
            if len(self._parts) >= self.max_parts:
                return self._violation(f"message of more than {self.max_parts} frames")
        end = header + size
        if not self._have(end):
            return None
        pos = self._pos
        body = self._buf[pos + header:pos + end]
        self._pos = pos + end
        if self._pos == len(self._buf) and self._chunks_len == 0:
            self._buf = b""
            self._pos = 0
        return flags, body

    def _handshake(self) -> object:
        fr = self._frame(True)
        if fr is None or isinstance(fr, ProtocolViolation):
            return fr
        if self.curve is not None:
            return self._curve_handshake(fr[1])
        cmd = self._command(fr[1])
        if isinstance(cmd, ProtocolViolation):
            return cmd
        name, data = cmd
        if name == b"READY":
            return self._ready(data)
        if name == b"ERROR":
            return self._error(data)
        # "null = ready *message | error": nothing else may come first.
        return self._violation(f"{name!r} command before READY")

    def _curve_handshake(self, body: bytes) -> object:
        """One CURVE handshake command: HELLO then INITIATE (server), WELCOME then READY
        (client); an ERROR ends it."""
        cmd = self._command(body)
        if isinstance(cmd, ProtocolViolation):
            return cmd
        if cmd[0] == b"ERROR":
            return self._error(cmd[1])
        side = self._handshake_side
        assert self.curve is not None and side is not None
        step = self._curve_step
        try:
            if self.curve.is_server:
                if step == 0:
                    welcome = side.on_hello(body)
                    self._curve_step = 1
                    return HandshakeReply(_encode_command_frame(welcome))
                client_key, metadata = side.on_initiate(body)
                done = self._curve_peer_ready(metadata, client_key)
                if isinstance(done, ProtocolViolation):
                    return done
                ready, self._boxes = side.ready(self._metadata())
                self._pending = done  # after the READY that tells the client
                return HandshakeReply(_encode_command_frame(ready))
            if step == 0:
                initiate = side.on_welcome(body, self._metadata())
                self._curve_step = 1
                return HandshakeReply(_encode_command_frame(initiate))
            metadata, boxes = side.on_ready(body)
            done = self._curve_peer_ready(metadata, self.curve.server_public)
            if isinstance(done, Handshaken):
                self._boxes = boxes
            return done
        except CurveError as exc:
            return self._violation(f"CURVE handshake: {exc.reason}")

    def _curve_peer_ready(self, metadata: bytes, peer_key: bytes) -> Handshaken | ProtocolViolation:
        """The peer's boxed metadata (INITIATE's, READY's): its properties, as READY's."""
        props = self._properties(metadata)
        if isinstance(props, ProtocolViolation):
            return props
        return self._peer_ready(props, peer_key)

    def _traffic(self) -> object:
        fr = self._frame(False)
        if fr is None or isinstance(fr, ProtocolViolation):
            return fr
        flags, body = fr
        boxes = self._boxes
        if boxes is not None:
            # Each wire frame is one MESSAGE box (libzmq's have flags 0 on the wire);
            # what it holds is the frame: its flags and body.
            if flags & (_COMMAND | _MORE):
                return self._violation(f"a wire frame with flags 0x{flags:02x} under CURVE (boxes carry the flags)")
            try:
                box_flags, body = boxes.open(body)
            except CurveError as exc:
                return self._violation(f"CURVE: {exc.reason}")
            flags = (_MORE if box_flags & _BOX_MORE else 0) | (_COMMAND if box_flags & _BOX_COMMAND else 0)
            if not flags & _COMMAND:
                if len(body) > self.max_frame:
                    return self._violation(f"frame of {len(body)} bytes is above the limit of {self.max_frame}")
                if self._msg_bytes + len(body) > self.max_message:
                    return self._violation(
                        f"message of at least {self._msg_bytes + len(body)} bytes is above the limit of "
                        f"{self.max_message}")
                if len(self._parts) >= self.max_parts:
                    return self._violation(f"message of more than {self.max_parts} frames")
        if flags & _COMMAND:
            # "traffic = *(command | message)". libzmq may put a PING or PONG between the
            # frames of a multipart message (its encoder takes the next message per
            # frame), so a command leaves the partial message as it is.
            return self._traffic_command(body)
        self._parts.append(body)
        if flags & _MORE:
            self._msg_bytes += len(body)
            return _AGAIN
        parts = self._parts
        self._parts = []
        self._msg_bytes = 0
        return Message(parts)

    def _command(self, body: bytes) -> tuple[bytes, bytes] | ProtocolViolation:
        # "command-name = short-size 1*255command-name-char; command-name-char = ALPHA"
        if not body:
            return self._violation("empty command frame")
        n = body[0]
        name = body[1:1 + n]
        if n == 0 or len(name) < n:
            return self._violation("command frame with a malformed name")
        if not name.isalpha():  # ASCII letters only
            return self._violation(f"command name {name!r} is not letters")
        return name, body[1 + n:]

    def _traffic_command(self, body: bytes) -> object:
        cmd = self._command(body)
        if isinstance(cmd, ProtocolViolation):
            return cmd
        name, data = cmd
        if name == b"PING":
            # "ping = command-size %d4 "PING" ping-ttl ping-context; ping-ttl = 2OCTET"
            if len(data) < 2:
                return self._violation("PING without its 2-byte TTL")
            # The context "MUST not exceed 16 octets"; libzmq truncates a longer one
            # rather than refuse it, and so do we (the PONG echoes the first 16).
            return Ping(_U16.unpack_from(data, 0)[0], data[2:2 + _MAX_PING_CONTEXT])
        if name == b"PONG":
            return Pong(data[:_MAX_PING_CONTEXT])
        if name == b"ERROR":
            return self._error(data)
        if name == b"READY":
            return self._violation("a second READY")
        # SUBSCRIBE, CANCEL, JOIN, LEAVE and commands of later versions mean nothing to
        # the socket types served here; libzmq ignores unknown commands too.
        return _AGAIN

    def _error(self, data: bytes) -> object:
        # "error-reason = short-size 0*255VCHAR"
        if not data or len(data) != 1 + data[0]:
            return self._violation("malformed ERROR command")
        self._close()
        return PeerError(data[1:])

    def _ready(self, data: bytes) -> object:
        props = self._properties(data)
        if isinstance(props, ProtocolViolation):
            return props
        return self._peer_ready(props, b"")

    def _properties(self, data: bytes) -> dict[str, bytes] | ProtocolViolation:
        props: dict[str, bytes] = {}
        i = 0
        n = len(data)
        while i < n:
            ln = data[i]
            i += 1
            # "The name SHALL be 1 to 255 characters. Zero-sized names are not valid."
            if ln == 0:
                return self._violation("READY property with an empty name")
            if i + ln + 4 > n:
                return self._violation("READY property truncated")
            name = data[i:i + ln]
            i += ln
            if name.translate(None, _NAME_CHARS):
                return self._violation(f"READY property name {name!r} has characters outside name-char")
            vlen = _U32.unpack_from(data, i)[0]
            i += 4
            if vlen > _MAX_PROPERTY_VALUE or i + vlen > n:
                return self._violation(f"READY property {name!r} value truncated")
            props[name.decode("ascii").lower()] = data[i:i + vlen]
            i += vlen
        return props

    def _peer_ready(self, props: dict[str, bytes], peer_key: bytes) -> Handshaken | ProtocolViolation:
        raw_type = props.get("socket-type")
        if raw_type is None:
            return self._violation("READY without Socket-Type")
        peer_type = raw_type.decode("latin-1")
        if peer_type not in SOCKET_TYPES:
            return self._violation(f"peer Socket-Type {raw_type!r} is not a ZMTP socket type")
        if not valid_peer(self.socket_type, peer_type):
            # "The peer SHOULD enforce that the other peer is using a valid socket type."
            return self._violation(f"a {self.socket_type} does not talk to a {peer_type}")
        identity = props.get("identity", b"") if peer_type in _IDENTITY_TYPES else b""
        if len(identity) > _MAX_IDENTITY:
            return self._violation(f"peer Identity of {len(identity)} bytes is above 255")
        self.peer_socket_type = peer_type
        self.peer_identity = identity
        self._state = _TRAFFIC
        assert self.peer_version is not None
        return Handshaken(peer_type, identity, self.peer_version, props, peer_key)
