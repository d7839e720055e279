"""ZMTP 3.1/NULL: the sans-I/O codec (:mod:`ziplog.protocol.zmtp`) and the transports on it
(:mod:`ziplog.io.zmtp_asyncio`, :mod:`ziplog.io.zmtp_blocking`).

(a) Properties of the codec: any message stream round-trips whatever its chunking; any
bytes (random, frame-shaped, or a valid stream with bytes flipped) give the same events
however they are chunked, end at most once, in a ProtocolViolation or PeerError, and never
raise; a frame over a limit is refused from its header, with none of its body held.

(b) Interop with pyzmq/libzmq both ways on loopback: pyzmq DEALER -> ZmtpRouter,
ZmtpDealer -> pyzmq ROUTER, reconnection after either side restarts, hostile raw peers
(bad greeting, stalled mid-frame, silent), floods kept in order, and the blocking
DEALER. Coroutines run on uvloop through ``ziplog.aio.run``; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.zmq_ports import bind_again
import ziplog.aio
from ziplog.io.zmtp_asyncio import ZmtpDealer, ZmtpRouter, parse_endpoint
from ziplog.io.zmtp_blocking import BlockingDealer
from ziplog.protocol.zmtp import (
    GREETING_SIZE,
    Event,
    Handshaken,
    Message,
    PeerError,
    Ping,
    Pong,
    ProtocolViolation,
    ZmtpConnection,
    encode_frame,
    encode_message,
)

T = TypeVar("T")
WAIT_S = 20.0  # bound on every wait, so a bug fails instead of hanging
PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- helpers ------------------------------------------------------------------------------------------


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` cut at the given offsets (taken modulo its length, so any list works)."""
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:])]


def feed(conn: ZmtpConnection, chunks: list[bytes]) -> list[Event]:
    events: list[Event] = []
    for chunk in chunks:
        events += conn.receive(chunk)
    return events


def pair(**limits: Any) -> tuple[ZmtpConnection, ZmtpConnection]:
    """A DEALER codec and a ROUTER codec (with ``limits``), handshaken with each other."""
    d = ZmtpConnection("DEALER", identity=b"d1")
    r = ZmtpConnection("ROUTER", **limits)
    assert r.receive(d.start()) == [Handshaken("DEALER", b"d1", (3, 1), {"socket-type": b"DEALER", "identity": b"d1"})]
    (ev,) = d.receive(r.start())
    assert isinstance(ev, Handshaken) and ev.peer_socket_type == "ROUTER"
    return d, r


def check_total(events: list[Event], conn: ZmtpConnection) -> None:
    """Events are typed, at most one is final and it is the last, and a closed codec
    holds nothing."""
    final = [i for i, e in enumerate(events) if isinstance(e, (ProtocolViolation, PeerError))]
    assert final in ([], [len(events) - 1])
    assert all(isinstance(e, (Handshaken, Message, Ping, Pong, ProtocolViolation, PeerError)) for e in events)
    if final:
        assert conn.closed and conn.buffered == 0
        assert conn.receive(b"\x00\x01x") == [] and conn.buffered == 0


frame_bodies = st.one_of(st.binary(max_size=40), st.binary(min_size=250, max_size=700))
messages = st.lists(st.lists(frame_bodies, min_size=1, max_size=6), min_size=1, max_size=8)
cuts = st.lists(st.integers(min_value=0, max_value=1 << 16), max_size=40)


def _command(name: bytes, data: bytes) -> bytes:
    body = bytes([len(name)]) + name + data
    return (bytes([0x04, len(body)]) if len(body) < 256 else b"\x06" + len(body).to_bytes(8, "big")) + body


#: byte strings shaped like frames (any flags, commands the codec knows and does not), to
#: reach deeper than uniformly random bytes do
frame_like = st.one_of(
    st.tuples(st.one_of(st.integers(0, 7), st.integers(0, 255)), st.binary(max_size=30)).map(
        lambda t: bytes([t[0], len(t[1])]) + t[1]),
    st.tuples(st.sampled_from([b"READY", b"PING", b"PONG", b"ERROR", b"SUBSCRIBE", b"X", b"r3"]),
              st.binary(max_size=40)).map(lambda t: _command(*t)),
    st.tuples(st.integers(0, 255), st.integers(0, (1 << 64) - 1)).map(lambda t: bytes([t[0]]) + t[1].to_bytes(8, "big")),
    st.binary(max_size=20),
)
junk = st.one_of(st.binary(max_size=600), st.lists(frame_like, max_size=12).map(b"".join))

# -- (a) the codec ------------------------------------------------------------------------------------


@PROPS
@given(messages, cuts)
def test_messages_round_trip_whatever_the_chunking(msgs: list[list[bytes]], at: list[int]) -> None:
    sender = ZmtpConnection("DEALER", identity=b"me")
    receiver = ZmtpConnection("ROUTER")
    stream = sender.start() + b"".join(sender.send_message(m) for m in msgs)
    events = feed(receiver, split(stream, at))
    assert isinstance(events[0], Handshaken) and events[0].peer_identity == b"me"
    assert [e.parts for e in events[1:] if isinstance(e, Message)] == msgs
    assert len(events) == 1 + len(msgs)
    assert receiver.buffered == 0


@PROPS
@given(messages, cuts, st.binary(max_size=16), st.integers(0, 0xFFFF))
def test_commands_between_the_frames_of_a_message(msgs: list[list[bytes]], at: list[int], ctx: bytes,
                                                  ttl: int) -> None:
    """libzmq may put a PING or PONG between the frames of a multipart message."""
    d, r = pair()
    ping = d.send_ping(ttl, ctx)
    out = []
    expect: list[Event] = []
    for m in msgs:
        for i, p in enumerate(m):
            out.append(_frame(p, i < len(m) - 1))
            out.append(ping)
            expect.append(Ping(ttl, ctx))
        expect.append(Message(m))
    stream = b"".join(out)
    # the Pings come as their commands arrive; a Message when its last frame does
    events = feed(r, split(stream, at))
    assert [e for e in events if isinstance(e, Message)] == [e for e in expect if isinstance(e, Message)]
    assert sum(isinstance(e, Ping) for e in events) == sum(len(m) for m in msgs)
    assert all(e == Ping(ttl, ctx) for e in events if isinstance(e, Ping))


def _frame(body: bytes, more: bool) -> bytes:
    return encode_message([body]) if not more else bytes([1 | (2 if len(body) > 255 else 0)]) + (
        bytes([len(body)]) if len(body) < 256 else len(body).to_bytes(8, "big")) + body


@PROPS
@given(junk, cuts)
def test_any_bytes_instead_of_a_greeting(data: bytes, at: list[int]) -> None:
    whole = ZmtpConnection("ROUTER")
    events = whole.receive(data)
    check_total(events, whole)
    chunked = ZmtpConnection("ROUTER")
    assert feed(chunked, split(data, at)) == events
    assert not any(isinstance(e, (Handshaken, Message)) for e in events)


@PROPS
@given(junk, cuts, st.booleans())
def test_any_bytes_after_a_valid_greeting(data: bytes, at: list[int], with_ready: bool) -> None:
    peer = ZmtpConnection("DEALER")
    prefix = peer.start() if with_ready else peer.send_greeting()
    results = []
    for chunks in ([prefix + data], split(prefix + data, at)):
        conn = ZmtpConnection("ROUTER", max_message=300, max_parts=5, max_command=100)
        events = []
        for chunk in chunks:
            events += conn.receive(chunk)
            # drained, it holds at most one frame in progress, and that within the limits
            assert conn.buffered < 9 + 300
        check_total(events, conn)
        results.append(events)
    assert results[0] == results[1]


class _StepByStep:
    """The codec without its one-step case for whole one-frame messages: the
    reference :meth:`ZmtpConnection.next_event` must agree with (a connection whose
    events are all taken by the general state machine; held, not subclassed, as the
    codec may run compiled)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.conn = ZmtpConnection(*args, **kwargs)

    def receive(self, data: bytes) -> list[Event]:
        conn = self.conn
        conn.receive_data(data)
        events: list[Event] = []
        while (ev := conn._next_event_any()) is not None:
            events.append(ev)
        return events

    @property
    def buffered(self) -> int:
        return self.conn.buffered

    @property
    def closed(self) -> bool:
        return self.conn.closed

    @property
    def handshaken(self) -> bool:
        return self.conn.handshaken


@PROPS
@given(junk, cuts, st.booleans(), st.sampled_from([(300, 300), (5000, 40), (1 << 20, 1 << 20)]))
def test_the_one_step_case_agrees_with_the_state_machine(data: bytes, at: list[int], with_ready: bool,
                                                         limits: tuple[int, int]) -> None:
    """Any bytes after a greeting (valid messages, commands, MORE frames, frames over
    a limit, junk), in any chunking: the same events, the same state after each chunk."""
    peer = ZmtpConnection("DEALER")
    prefix = peer.start() if with_ready else peer.send_greeting()
    max_message, max_frame = limits
    fast = ZmtpConnection("ROUTER", max_message=max_message, max_frame=max_frame, max_parts=5, max_command=100)
    ref = _StepByStep("ROUTER", max_message=max_message, max_frame=max_frame, max_parts=5, max_command=100)
    for chunk in split(prefix + data, at):
        assert fast.receive(chunk) == ref.receive(chunk)
        assert (fast.buffered, fast.closed, fast.handshaken) == (ref.buffered, ref.closed, ref.handshaken)


@PROPS
@given(messages, cuts)
def test_the_one_step_case_agrees_on_valid_traffic(msgs: list[list[bytes]], at: list[int]) -> None:
    sender = ZmtpConnection("DEALER")
    stream = sender.start() + b"".join(sender.send_message(m) for m in msgs)
    fast, ref = ZmtpConnection("ROUTER", max_message=600), _StepByStep("ROUTER", max_message=600)
    for chunk in split(stream, at):
        assert fast.receive(chunk) == ref.receive(chunk)
        assert fast.buffered == ref.buffered


@PROPS
@given(st.sampled_from([40, 255, 256, 300]), st.lists(st.tuples(st.integers(-2, 2), st.integers(0, 5)), min_size=1,
                                                   max_size=6), cuts)
def test_the_one_step_case_agrees_at_the_size_limits(limit: int, frames: list[tuple[int, int]], at: list[int]) -> None:
    """Frames of a few bytes either side of the frame limit, short and long headers,
    with and without MORE or reserved bits set: refused or taken alike."""
    stream = ZmtpConnection("DEALER").start()
    for delta, kind in frames:
        size = max(0, limit + delta)
        flags = (0, 0x01, 0x02, 0x03, 0x08, 0x02)[kind]
        if flags & 0x02 or size > 255:
            stream += bytes([flags | 0x02]) + size.to_bytes(8, "big") + bytes(size)
        else:
            stream += bytes([flags, size]) + bytes(size)
    fast = ZmtpConnection("ROUTER", max_message=limit + 1, max_frame=limit)
    ref = _StepByStep("ROUTER", max_message=limit + 1, max_frame=limit)
    for chunk in split(stream, at):
        assert fast.receive(chunk) == ref.receive(chunk)
        assert (fast.buffered, fast.closed) == (ref.buffered, ref.closed)


@given(st.one_of(st.binary(max_size=300), st.integers(0, 70_000).map(bytes)))
def test_a_one_frame_message_is_encoded_as_encode_message_does(body: bytes) -> None:
    assert encode_frame(body) == encode_message((body,)) == ZmtpConnection("DEALER").send_message([body])


@PROPS
@given(messages, st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 255)), min_size=1, max_size=6), cuts)
def test_a_valid_stream_with_bytes_flipped(msgs: list[list[bytes]], flips: list[tuple[int, int]], at: list[int]) -> None:
    sender = ZmtpConnection("DEALER")
    stream = bytearray(sender.start() + b"".join(sender.send_message(m) for m in msgs))
    for pos, x in flips:
        stream[pos % len(stream)] ^= x
    whole = ZmtpConnection("ROUTER", max_message=5000)
    events = whole.receive(bytes(stream))
    check_total(events, whole)
    assert feed(ZmtpConnection("ROUTER", max_message=5000), split(bytes(stream), at)) == events


@PROPS
@given(st.integers(min_value=1001, max_value=(1 << 64) - 1), st.booleans(), st.booleans(), st.integers(1, 1 << 16))
def test_an_oversized_frame_is_refused_from_its_header(size: int, command: bool, more: bool, body: int) -> None:
    d, r = pair(max_message=1000, max_command=1000)
    flags = 0x02 | (0x04 if command else (0x01 if more else 0))
    header = bytes([flags]) + size.to_bytes(8, "big")
    # the header alone is enough to refuse it: none of the body is waited for or held
    (ev,) = r.receive(header)
    assert isinstance(ev, ProtocolViolation)
    assert r.buffered == 0 and r.closed
    assert r.receive(b"\x00" * body) == [] and r.buffered == 0


@PROPS
@given(st.integers(1, 400), st.integers(1, 64))
def test_a_message_over_the_limit_is_refused_before_the_frame_that_tips_it(size: int, step: int) -> None:
    d, r = pair(max_message=1000, max_frame=400)
    stream = d.send_message([b"a" * size] * 5) + d.send_message([b"ok"])
    events: list[Event] = []
    for chunk in split(stream, list(range(0, len(stream), step))):
        events += r.receive(chunk)
        # never more than one frame (plus a chunk) beyond what the limits admit
        assert r.buffered <= 400 + 9 + step
    if 5 * size <= 1000:
        assert events == [Message([b"a" * size] * 5), Message([b"ok"])]
    else:
        assert len(events) == 1 and isinstance(events[0], ProtocolViolation)
        assert "above the limit of 1000" in events[0].reason


def test_too_many_parts_is_refused() -> None:
    d, r = pair(max_parts=3)
    assert r.receive(d.send_message([b""] * 3)) == [Message([b""] * 3)]
    (ev,) = r.receive(d.send_message([b""] * 4))
    assert isinstance(ev, ProtocolViolation) and "more than 3 frames" in ev.reason


def test_ready_is_the_spec_worked_example() -> None:
    """37/ZMTP "Worked Example": a DEALER's READY with an empty Identity, and the greeting."""
    assert ZmtpConnection("DEALER").send_ready() == (
        b"\x04\x29\x05READY\x0bSocket-Type\x00\x00\x00\x06DEALER\x08Identity\x00\x00\x00\x00")
    g = ZmtpConnection("ROUTER").send_greeting()
    assert len(g) == GREETING_SIZE and g[:12] == b"\xff" + bytes(8) + b"\x7f\x03\x01"
    assert g[12:32] == b"NULL" + bytes(16) and g[32:] == bytes(32)


def test_long_frames_for_short_bodies_and_short_frames_for_empty_ones() -> None:
    d, r = pair()
    # "SHOULD" use the short form; a long size for a small body is still valid
    assert r.receive(b"\x03" + (3).to_bytes(8, "big") + b"abc" + b"\x00\x00") == [Message([b"abc", b""])]


@pytest.mark.parametrize("data, words", [
    (b"\x01\x00", "first byte 0x01"),  # ZMTP 1.0: a short identity frame
    (b"GET / HTTP/1.1\r\n\r\n", "not ZeroMQ"),
    (b"\xff" + bytes(8) + b"\x00", "ZMTP 1.0 peer (unversioned"),  # 1.0 with a long identity length
    (b"\xff" + bytes(8) + b"\x7f\x00", "ZMTP 1.0 peer (version octet 0)"),
    (b"\xff" + bytes(8) + b"\x7f\x01\x05", "ZMTP 2.0 peer"),
    (b"\xff" + bytes(8) + b"\x7f\x02", "ZMTP 2.0 peer"),
    (b"\xff" + bytes(8) + b"\x7f\x03\x01" + b"CURVE".ljust(20, b"\0") + bytes(32), "b'CURVE'"),
])
def test_old_versions_and_other_protocols_are_refused_clearly(data: bytes, words: str) -> None:
    conn = ZmtpConnection("ROUTER")
    (ev,) = conn.receive(data)
    assert isinstance(ev, ProtocolViolation) and words in ev.reason, ev
    assert conn.send_error(ev.reason) == b"" or b"CURVE" in data  # no ERROR to who speaks no ZMTP 3


def test_a_zmtp_3_0_peer_and_a_later_version_are_accepted() -> None:
    peer = ZmtpConnection("DEALER")
    for version, seen in ((b"\x03\x00", (3, 0)), (b"\x04\x07", (3, 1))):
        greeting = bytearray(peer.send_greeting())
        greeting[10:12] = version
        greeting[1:9] = b"\x00" * 7 + b"\x05"  # libzmq puts its identity length + 1 in the padding
        conn = ZmtpConnection("ROUTER")
        (ev,) = feed(conn, [bytes([b]) for b in bytes(greeting) + peer.send_ready()])
        assert isinstance(ev, Handshaken) and ev.peer_version == seen


@pytest.mark.parametrize("local, peer, ok", [
    ("ROUTER", "DEALER", True), ("ROUTER", "ROUTER", True), ("ROUTER", "REQ", True),
    ("DEALER", "DEALER", True), ("DEALER", "REP", True), ("DEALER", "ROUTER", True),
    ("ROUTER", "PUB", False), ("ROUTER", "REP", False), ("DEALER", "REQ", False), ("DEALER", "PULL", False),
])
def test_socket_type_pairs(local: str, peer: str, ok: bool) -> None:
    conn = ZmtpConnection(local)
    (ev,) = conn.receive(ZmtpConnection(peer).start())
    assert isinstance(ev, Handshaken) is ok
    if not ok:
        assert isinstance(ev, ProtocolViolation) and f"does not talk to a {peer}" in ev.reason
        err = conn.send_error(ev.reason)  # refused in the handshake: the peer gets an ERROR
        other = ZmtpConnection(peer)
        other.receive(conn.send_greeting())
        (back,) = other.receive(err)
        assert isinstance(back, PeerError) and b"does not talk" in back.reason


def test_ready_properties() -> None:
    ready = _command(b"READY", b"\x0bsocket-TYPE\x00\x00\x00\x06DEALER" + b"\x05X-app\x00\x00\x00\x02hi")
    (ev,) = ZmtpConnection("ROUTER").receive(ZmtpConnection("DEALER").send_greeting() + ready)
    assert ev == Handshaken("DEALER", b"", (3, 1), {"socket-type": b"DEALER", "x-app": b"hi"})
    for bad, words in [
        (b"\x00\x00\x00\x00\x00", "empty name"),
        (b"\x0bSocket-Type\x00\x00\x00\x09DEALER", "truncated"),
        (b"\x0bSocket Type\x00\x00\x00\x06DEALER", "name-char"),
        (b"\x08Identity\x00\x00\x00\x00", "without Socket-Type"),
        (b"\x0bSocket-Type\x00\x00\x00\x03FOO", "not a ZMTP socket type"),
        (b"\x0bSocket-Type\x00\x00\x00\x06DEALER\x08Identity\x00\x00\x01\x00" + b"i" * 256, "above 255"),
    ]:
        (ev,) = ZmtpConnection("ROUTER").receive(ZmtpConnection("DEALER").send_greeting() + _command(b"READY", bad))
        assert isinstance(ev, ProtocolViolation) and words in ev.reason, (bad, ev)


def test_commands_in_traffic() -> None:
    d, r = pair()
    assert r.receive(d.send_ping(7, b"c" * 16)) == [Ping(7, b"c" * 16)]
    assert r.receive(d.send_pong(b"xy")) == [Pong(b"xy")]
    # a longer context is cut to 16 bytes, as libzmq does
    assert r.receive(_command(b"PING", b"\x00\x01" + b"z" * 20)) == [Ping(1, b"z" * 16)]
    # commands of other patterns and later versions are ignored
    assert r.receive(_command(b"SUBSCRIBE", b"topic") + _command(b"FUTURE", b"") + d.send_message([b"m"])) == [
        Message([b"m"])]
    for bad, words in [(_command(b"PING", b"\x00"), "TTL"), (b"\x04\x00", "empty command"),
                       (b"\x04\x02\x05R", "malformed name"), (_command(b"RE4DY", b""), "not letters"),
                       (_command(b"READY", b""), "second READY"), (b"\x05\x00", "MORE set"),
                       (b"\x08\x00", "reserved bits"), (_command(b"ERROR", b"\x05ab"), "malformed ERROR")]:
        _, r = pair()
        (ev,) = r.receive(bad)
        assert isinstance(ev, ProtocolViolation) and words in ev.reason, (bad, ev)
    _, r = pair()
    assert r.receive(_command(b"ERROR", b"\x04nope") + d.send_message([b"lost"])) == [PeerError(b"nope")]


def test_handshake_order() -> None:
    peer = ZmtpConnection("DEALER")
    (ev,) = ZmtpConnection("ROUTER").receive(peer.send_greeting() + peer.send_message([b"early"]))
    assert isinstance(ev, ProtocolViolation) and "before the peer's READY" in ev.reason
    (ev,) = ZmtpConnection("ROUTER").receive(peer.send_greeting() + peer.send_ping())
    assert isinstance(ev, ProtocolViolation) and "before READY" in ev.reason
    (ev,) = ZmtpConnection("ROUTER").receive(peer.send_greeting() + _command(b"ERROR", b"\x06denied"))
    assert ev == PeerError(b"denied")


def test_parse_endpoint() -> None:
    assert parse_endpoint("tcp://127.0.0.1:5555") == ("127.0.0.1", 5555)
    assert parse_endpoint("tcp://[::1]:7") == ("::1", 7)
    with pytest.raises(ValueError):
        parse_endpoint("tcp://nohost")


# -- (b) interop with pyzmq -----------------------------------------------------------------------------


def run(coro: Coroutine[Any, Any, T]) -> T:
    """On uvloop (via ziplog.aio.run), bounded."""
    return ziplog.aio.run(asyncio.wait_for(coro, 90))


async def waitfor(aw: Awaitable[T]) -> T:
    return await asyncio.wait_for(aw, WAIT_S)


def echo_router(**kw: Any) -> tuple[ZmtpRouter, asyncio.Queue[tuple[bytes, list[bytes]]]]:
    """A ZmtpRouter that sends every message back to its sender and queues (route, parts)."""
    seen: asyncio.Queue[tuple[bytes, list[bytes]]] = asyncio.Queue()

    def on_message(route: bytes, parts: list[bytes]) -> None:
        seen.put_nowait((route, parts))
        router.send_to(route, parts)

    router = ZmtpRouter(on_message, **kw)
    return router, seen


def zdealer(ctx: zmq.asyncio.Context, endpoint: str, identity: bytes = b"") -> zmq.asyncio.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RECONNECT_IVL, 20)
    if identity:
        s.setsockopt(zmq.IDENTITY, identity)
    s.connect(endpoint)
    return s


async def request(sock: zmq.asyncio.Socket, parts: list[bytes], tries: int = 40, each: float = 0.5) -> list[bytes]:
    """Send ``parts`` until the same parts come back (a message written to a connection
    that has just died is lost, and libzmq only then notices and reconnects)."""
    for _ in range(tries):
        await sock.send_multipart(parts)
        try:
            while True:
                reply = await asyncio.wait_for(sock.recv_multipart(), each)
                if reply == parts:
                    return reply
        except asyncio.TimeoutError:
            continue
    raise AssertionError(f"no reply to {parts!r}")


async def read_to_eof(reader: asyncio.StreamReader) -> bytes:
    data = b""
    try:
        while chunk := await reader.read(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_pyzmq_dealer_to_zmtp_router() -> None:
    limit = 8 << 20

    async def main() -> None:
        gone: asyncio.Queue[bytes] = asyncio.Queue()
        router, seen = echo_router(max_message=limit, on_disconnect=gone.put_nowait)
        await router.start()
        ctx = zmq.asyncio.Context()
        a = zdealer(ctx, router.endpoint, identity=b"A")
        b = zdealer(ctx, router.endpoint)
        try:
            for msg in ([b"one"], [b"", b""], [b""], [b"x", b"", b"y" * 1000, b"z"], [b"big" * 10, b"\x00" * (4 << 20)]):
                await a.send_multipart(msg)
                assert await waitfor(a.recv_multipart()) == msg
                route, parts = await waitfor(seen.get())
                assert route == b"A" and parts == msg
            await b.send_multipart([b"hi"])
            assert await waitfor(b.recv_multipart()) == [b"hi"]
            route_b, _ = await waitfor(seen.get())
            assert len(route_b) == 5 and route_b[0] == 0  # generated as libzmq does
            assert sorted(router.routes) == sorted([b"A", route_b])

            # a frame over the limit: A's connection is closed, B is served on
            await a.send_multipart([b"head", b"\x01" * (limit + 1)])
            assert await waitfor(gone.get()) == b"A"
            assert await request(b, [b"still", b"here"]) == [b"still", b"here"]
            # and A, reconnected by libzmq, is served again
            assert await request(a, [b"back"]) == [b"back"]
        finally:
            a.close(0)
            b.close(0)
            ctx.term()
            await router.aclose()

    run(main())


def test_zmtp_dealer_to_pyzmq_router() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        r = ctx.socket(zmq.ROUTER)
        r.setsockopt(zmq.LINGER, 0)
        port = r.bind_to_random_port("tcp://127.0.0.1")
        inbox: asyncio.Queue[list[bytes]] = asyncio.Queue()
        anon_inbox: asyncio.Queue[list[bytes]] = asyncio.Queue()
        named = ZmtpDealer(f"tcp://127.0.0.1:{port}", inbox.put_nowait, identity=b"zd")
        anon = ZmtpDealer(f"tcp://127.0.0.1:{port}", anon_inbox.put_nowait)
        try:
            # sent before any connection: queued, then written after the handshake
            assert named.send([b"early", b""])
            named.start()
            anon.start()
            await waitfor(named.wait_connected())
            await waitfor(anon.wait_connected())
            assert await waitfor(r.recv_multipart()) == [b"zd", b"early", b""]
            named.send([b"", b"x" * 70000, b""])
            assert await waitfor(r.recv_multipart()) == [b"zd", b"", b"x" * 70000, b""]
            anon.send([b"who"])
            route, body = await waitfor(r.recv_multipart())
            assert body == b"who" and len(route) == 5 and route[0] == 0
            # replies are routed by identity, to the right dealer
            await r.send_multipart([b"zd", b"for", b"zd"])
            await r.send_multipart([route, b"for anon"])
            assert await waitfor(inbox.get()) == [b"for", b"zd"]
            assert await waitfor(anon_inbox.get()) == [b"for anon"]
            assert inbox.empty() and anon_inbox.empty()
        finally:
            await named.aclose()
            await anon.aclose()
            r.close(0)
            ctx.term()

    run(main())


def test_pyzmq_dealer_reconnects_after_the_zmtp_router_restarts() -> None:
    async def main() -> None:
        router, _ = echo_router()
        await router.start()
        port = router.port
        ctx = zmq.asyncio.Context()
        d = zdealer(ctx, router.endpoint, identity=b"again")
        router2: ZmtpRouter | None = None
        try:
            assert await request(d, [b"first"]) == [b"first"]
            await router.aclose()
            router2, _ = echo_router(port=port)
            await router2.start()
            assert router2.port == port
            assert await request(d, [b"second"]) == [b"second"]
        finally:
            d.close(0)
            ctx.term()
            await router.aclose()
            if router2 is not None:
                await router2.aclose()

    run(main())


def test_zmtp_dealer_reconnects_after_the_pyzmq_router_restarts() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        r = ctx.socket(zmq.ROUTER)
        r.setsockopt(zmq.LINGER, 0)
        port = r.bind_to_random_port("tcp://127.0.0.1")
        inbox: asyncio.Queue[list[bytes]] = asyncio.Queue()
        lost = asyncio.Event()
        dealer = ZmtpDealer(f"tcp://127.0.0.1:{port}", inbox.put_nowait, identity=b"zd",
                            reconnect_ivl=0.02, reconnect_ivl_max=0.2, on_disconnect=lost.set)
        r2 = None
        try:
            dealer.start()
            await waitfor(dealer.wait_connected())
            dealer.send([b"1"])
            assert await waitfor(r.recv_multipart()) == [b"zd", b"1"]
            r.close(0)
            await waitfor(lost.wait())
            assert not dealer.connected
            # sent while disconnected: queued, delivered to the new ROUTER
            assert dealer.send([b"2"])
            r2 = ctx.socket(zmq.ROUTER)
            r2.setsockopt(zmq.LINGER, 0)
            bind_again(r2, port)
            await waitfor(dealer.wait_connected())
            assert await waitfor(r2.recv_multipart()) == [b"zd", b"2"]
            await r2.send_multipart([b"zd", b"reply"])
            assert await waitfor(inbox.get()) == [b"reply"]
        finally:
            await dealer.aclose()
            r.close(0)
            if r2 is not None:
                r2.close(0)
            ctx.term()

    run(main())


def test_hostile_raw_peers_do_not_disturb_the_router() -> None:
    async def main() -> None:
        router, seen = echo_router(handshake_timeout=0.5)
        await router.start()
        ctx = zmq.asyncio.Context()
        good = zdealer(ctx, router.endpoint, identity=b"good")
        writers: list[asyncio.StreamWriter] = []
        try:
            assert await request(good, [b"before"]) == [b"before"]
            # a bad greeting: closed at once (after our greeting went out), no ERROR
            reader, writer = await asyncio.open_connection(router.host, router.port)
            writers.append(writer)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await waitfor(read_to_eof(reader))
            # a peer that handshakes, starts a 1000-byte frame and stalls after 10 bytes
            stall_r, stall_w = await asyncio.open_connection(router.host, router.port)
            writers.append(stall_w)
            peer = ZmtpConnection("DEALER", identity=b"staller")
            stall_w.write(peer.start() + b"\x02" + (1000).to_bytes(8, "big") + b"s" * 10)
            await stall_w.drain()
            # a peer that says nothing: dropped when the handshake time is up
            silent_r, silent_w = await asyncio.open_connection(router.host, router.port)
            writers.append(silent_w)
            silent_w.write(b"\xff")
            # others are served meanwhile
            for i in range(50):
                assert await request(good, [b"during", b"%d" % i]) == [b"during", b"%d" % i]
            await waitfor(read_to_eof(silent_r))
            assert b"staller" in router.routes
            assert all(route == b"good" for route, _ in [seen.get_nowait() for _ in range(seen.qsize())])
            # the staller finishes its frame late: delivered whole
            stall_w.write(b"s" * 990)
            route, parts = await waitfor(seen.get())
            assert route == b"staller" and parts == [b"s" * 1000]
        finally:
            for w in writers:
                w.close()
            good.close(0)
            ctx.term()
            await router.aclose()

    run(main())


def test_heartbeats_drop_a_peer_that_stops_answering() -> None:
    async def main() -> None:
        router, _ = echo_router(heartbeat_ivl=0.05, heartbeat_timeout=0.3)
        await router.start()
        reader, writer = await asyncio.open_connection(router.host, router.port)
        try:
            peer = ZmtpConnection("DEALER", identity=b"mute")
            writer.write(peer.start())
            # read until the router gives up on us; it PINGed us first (with its TTL)
            events = peer.receive(await waitfor(read_to_eof(reader)))
            assert isinstance(events[0], Handshaken)
            assert Ping(3, b"") in events
        finally:
            writer.close()
            await router.aclose()

    run(main())


def test_floods_arrive_in_order_both_ways() -> None:
    n = 10_000

    async def main() -> None:
        router, seen = echo_router()
        await router.start()
        ctx = zmq.asyncio.Context()
        d = zdealer(ctx, router.endpoint, identity=b"flood")
        inbox: asyncio.Queue[list[bytes]] = asyncio.Queue()
        zr = ctx.socket(zmq.ROUTER)
        zr.setsockopt(zmq.LINGER, 0)
        zr.setsockopt(zmq.RCVHWM, 0)
        port = zr.bind_to_random_port("tcp://127.0.0.1")
        zd = ZmtpDealer(f"tcp://127.0.0.1:{port}", inbox.put_nowait, identity=b"zd")
        try:
            # pyzmq DEALER -> ZmtpRouter, echoed back: both directions in order
            async def send_all() -> None:
                for i in range(n):
                    await d.send_multipart([b"%d" % i, b"payload"])
            sender = asyncio.ensure_future(send_all())
            for i in range(n):
                assert await waitfor(d.recv_multipart()) == [b"%d" % i, b"payload"]
            await waitfor(sender)
            assert [seen.get_nowait()[1][0] for _ in range(n)] == [b"%d" % i for i in range(n)]
            # ZmtpDealer -> pyzmq ROUTER -> back
            zd.start()
            await waitfor(zd.wait_connected())
            for i in range(n):
                assert zd.send([b"%d" % i])
            for i in range(n):
                route, body = await waitfor(zr.recv_multipart())
                assert (route, body) == (b"zd", b"%d" % i)
                await zr.send_multipart([route, body])
            for i in range(n):
                assert await waitfor(inbox.get()) == [b"%d" % i]
        finally:
            await zd.aclose()
            d.close(0)
            zr.close(0)
            ctx.term()
            await router.aclose()

    run(main())


def test_blocking_dealer_with_a_pyzmq_router() -> None:
    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    r.setsockopt(zmq.LINGER, 0)
    r.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
    port = r.bind_to_random_port("tcp://127.0.0.1")
    r2 = None
    d = BlockingDealer(f"tcp://127.0.0.1:{port}", identity=b"bd", reconnect_ivl=0.02, connect_timeout=WAIT_S)
    try:
        d.connect()
        assert d.handshake is not None and d.handshake.peer_socket_type == "ROUTER"
        d.send([b"q", b"", b"w" * 5000])
        assert r.recv_multipart() == [b"bd", b"q", b"", b"w" * 5000]
        r.send_multipart([b"bd", b"a1"])
        r.send_multipart([b"bd", b"a2", b""])
        assert d.recv(WAIT_S) == [b"a1"]
        assert d.recv(WAIT_S) == [b"a2", b""]
        assert d.recv(0.01) is None
        # the ROUTER restarts on the same port: the dealer reconnects
        r.close(0)
        r2 = ctx.socket(zmq.ROUTER)
        r2.setsockopt(zmq.LINGER, 0)
        r2.setsockopt(zmq.RCVTIMEO, 200)
        bind_again(r2, port)
        got = None
        for i in range(100):
            d.send([b"again", b"%d" % i])  # one written to the dead connection is lost
            assert d.recv(0.05) is None  # reads the close, if it came, and reconnects
            try:
                got = r2.recv_multipart()
                break
            except zmq.Again:
                continue
        assert got is not None and got[:2] == [b"bd", b"again"]
        r2.send_multipart([b"bd", b"answer"])
        assert d.recv(WAIT_S) == [b"answer"]
    finally:
        d.close()
        r.close(0)
        if r2 is not None:
            r2.close(0)
        ctx.term()


def test_blocking_dealer_with_a_zmtp_router_answers_pings() -> None:
    """The blocking DEALER against the asyncio ROUTER (in a thread), with the ROUTER's
    heartbeats: the DEALER answers PINGs while it waits in recv."""
    async def main() -> None:
        router, seen = echo_router(heartbeat_ivl=0.01, heartbeat_timeout=5.0)
        await router.start()
        d = BlockingDealer(router.endpoint, identity=b"bd2")
        try:
            def client() -> list[list[bytes] | None]:
                out = []
                for i in range(20):
                    d.send([b"%d" % i])
                    out.append(d.recv(WAIT_S))
                return out
            replies = await waitfor(asyncio.to_thread(client))
            assert replies == [[b"%d" % i] for i in range(20)]
        finally:
            d.close()
            await router.aclose()

    run(main())


def test_a_second_peer_with_the_same_identity() -> None:
    """Refused by default (libzmq's ROUTER ignores it); with ``handover`` it takes the route."""
    async def connect(router: ZmtpRouter) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, ZmtpConnection]:
        reader, writer = await asyncio.open_connection(router.host, router.port)
        conn = ZmtpConnection("DEALER", identity=b"dup")
        writer.write(conn.start())
        while not conn.handshaken:
            conn.receive(await waitfor(reader.read(65536)))
        return reader, writer, conn

    async def main() -> None:
        for handover in (False, True):
            connected: asyncio.Queue[bytes] = asyncio.Queue()
            router, seen = echo_router(handover=handover, on_connect=connected.put_nowait)
            await router.start()
            writers = []
            try:
                r1, w1, c1 = await connect(router)
                writers.append(w1)
                assert await waitfor(connected.get()) == b"dup"
                r2, w2, c2 = await connect(router)  # its READY is answered before it is refused
                writers.append(w2)
                await waitfor(read_to_eof(r1 if handover else r2))
                kept_r, kept_w, kept_c = (r2, w2, c2) if handover else (r1, w1, c1)
                kept_w.write(kept_c.send_message([b"mine"]))
                assert await waitfor(seen.get()) == (b"dup", [b"mine"])
                assert kept_c.receive(await waitfor(kept_r.read(65536))) == [Message([b"mine"])]
                assert router.routes == [b"dup"]
            finally:
                for w in writers:
                    w.close()
                await router.aclose()

    run(main())


def test_libzmq_pings_parse_and_are_answered() -> None:
    """pyzmq DEALERs with heartbeats on (libzmq drops a connection on which nothing came
    for HEARTBEAT_TIMEOUT after a PING). A codec-driven server sees their PINGs, TTL
    included, as Ping events: answered, the connection outlives many timeouts; unanswered,
    libzmq drops it (so the check can fail). A ZmtpRouter answers an idle DEALER's PINGs,
    so it is not dropped either."""
    async def main() -> None:
        pings: asyncio.Queue[Ping] = asyncio.Queue()
        ended: asyncio.Queue[int] = asyncio.Queue()

        def server(answer: bool) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
            async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                conn = ZmtpConnection("ROUTER")
                writer.write(conn.start())
                n = 0
                while data := await read_some(reader):
                    for ev in conn.receive(data):
                        if isinstance(ev, Ping):
                            n += 1
                            pings.put_nowait(ev)
                            if answer:
                                writer.write(conn.send_pong(ev.context))
                ended.put_nowait(n)
                writer.close()
            return serve

        def dealer(endpoint: str, identity: bytes = b"") -> zmq.asyncio.Socket:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.HEARTBEAT_IVL, 10)
            s.setsockopt(zmq.HEARTBEAT_TTL, 2000)
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 100)
            if identity:
                s.setsockopt(zmq.IDENTITY, identity)
            s.connect(endpoint)
            return s

        ctx = zmq.asyncio.Context()
        socks: list[zmq.asyncio.Socket] = []
        servers: list[asyncio.AbstractServer] = []
        drops: asyncio.Queue[bytes] = asyncio.Queue()
        router, _ = echo_router(on_disconnect=drops.put_nowait)
        await router.start()
        try:
            for answer in (True, False):
                srv = await asyncio.start_server(server(answer), "127.0.0.1", 0)
                servers.append(srv)
                socks.append(dealer(f"tcp://127.0.0.1:{srv.sockets[0].getsockname()[1]}"))
                if answer:
                    idle = dealer(router.endpoint, b"idle")
                    socks.append(idle)
                    assert await request(idle, [b"x"]) == [b"x"]
                    for _ in range(40):  # 40 PINGs 10 ms apart: several 100 ms timeouts
                        assert await waitfor(pings.get()) == Ping(20, b"")  # TTL 2000 ms, in tenths
                    assert ended.empty() and drops.empty()
                    assert router.routes == [b"idle"]
                    socks.pop(0).close(0)
                    assert await waitfor(ended.get()) >= 40  # closed by us, not by libzmq
                else:
                    assert await waitfor(ended.get()) >= 1  # unanswered: libzmq gave up
        finally:
            for s in socks:
                s.close(0)
            ctx.term()
            await router.aclose()
            for listener in servers:
                listener.close()
                await listener.wait_closed()

    run(main())


async def read_some(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.read(65536)
    except ConnectionResetError:
        return b""
