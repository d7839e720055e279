"""CURVE in the native ZMTP transports, against libzmq's (pyzmq, the reference) both ways:
the blocking, asyncio and poll-loop DEALERs to a libzmq CURVE ROUTER, a libzmq CURVE
DEALER to the asyncio and poll-loop ROUTERs (which learn its key), a libzmq CURVE PUB
to the native SUB and PUSH to PULL as a cluster's runtime builds them (members only,
through pyzmq's ZAP handler), the refusals a client reports (no keys, the wrong server
key), and the codec's CURVE states property-tested: any bytes, flipped bytes, replays
and truncated boxes end in events or one violation, never an exception."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Iterator

import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

import ziplog.aio
from ziplog.io.keys import client_keys, new_keypair, server_keys
from ziplog.io.zmq_runtime import ZmqRuntime
from ziplog.io.zmtp_asyncio import ZmtpDealer, ZmtpRouter
from ziplog.io.zmtp_blocking import BlockingDealer
from ziplog.protocol.keys import Credentials, KeyPair
from ziplog.protocol.zmtp import (
    CurveKeys,
    HandshakeReply,
    Handshaken,
    Message,
    Ping,
    Pong,
    ProtocolViolation,
    ZmtpConnection,
)

WAIT_S = 20
BIG = b"\x07" * (100 << 10)  # above the poll transport's gather size: boxed all the same
MESSAGES = ([b"one"], [b"", b""], [b"x", b"", b"y" * 1000, b"z"], [BIG])


def fixed_random(seed: int) -> Any:
    import random
    rng = random.Random(seed)
    return lambda n: bytes(rng.getrandbits(8) for _ in range(n))


@pytest.fixture
def server_pair() -> KeyPair:
    return new_keypair()


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield c
    finally:
        c.destroy(linger=0)


def libzmq_router(ctx: zmq.Context[zmq.Socket[bytes]], server: KeyPair) -> tuple[zmq.Socket[bytes], str]:
    r = ctx.socket(zmq.ROUTER)
    r.setsockopt(zmq.LINGER, 0)
    r.curve_server = True
    r.curve_publickey = server.public
    r.curve_secretkey = server.secret
    r.rcvtimeo = WAIT_S * 1000
    port = r.bind_to_random_port("tcp://127.0.0.1")
    return r, f"tcp://127.0.0.1:{port}"


def libzmq_dealer(ctx: Any, endpoint: str, client: KeyPair, server_public: bytes) -> Any:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.curve_serverkey = server_public
    d.curve_publickey = client.public
    d.curve_secretkey = client.secret
    d.connect(endpoint)
    return d


def echo(router: zmq.Socket[bytes], n: int) -> None:
    for _ in range(n):
        router.send_multipart(router.recv_multipart())


# -- our clients, libzmq's server --------------------------------------------------------------------------


def test_blocking_dealer_to_a_libzmq_curve_router(ctx: zmq.Context[zmq.Socket[bytes]], server_pair: KeyPair) -> None:
    router, endpoint = libzmq_router(ctx, server_pair)
    cred = Credentials(client=new_keypair(), server_public=server_pair.public)
    with BlockingDealer(endpoint, identity=b"bd", curve=client_keys(cred)) as d:
        for msg in MESSAGES:
            d.send(msg)
            got = router.recv_multipart()
            assert got == [b"bd", *msg]
            router.send_multipart(got)
            assert d.recv(WAIT_S) == msg
        assert d.handshake is not None and d.handshake.peer_key == server_pair.public


def test_asyncio_dealer_to_a_libzmq_curve_router(ctx: zmq.Context[zmq.Socket[bytes]], server_pair: KeyPair) -> None:
    router, endpoint = libzmq_router(ctx, server_pair)
    cred = Credentials(client=new_keypair(), server_public=server_pair.public)
    echoer = threading.Thread(target=echo, args=(router, len(MESSAGES) + 1))
    echoer.start()

    async def main() -> None:
        inbox: asyncio.Queue[list[bytes]] = asyncio.Queue()
        d = ZmtpDealer(endpoint, inbox.put_nowait, curve=client_keys(cred))
        try:
            assert d.send([b"queued before the handshake"])  # boxed when it leaves
            d.start()
            assert await asyncio.wait_for(inbox.get(), WAIT_S) == [b"queued before the handshake"]
            for msg in MESSAGES:
                d.send(msg)
                assert await asyncio.wait_for(inbox.get(), WAIT_S) == msg
        finally:
            await d.aclose()

    try:
        ziplog.aio.run(main())
    finally:
        echoer.join(WAIT_S)


def test_poll_loop_dealer_and_sub_to_libzmq_curve_sockets(server_pair: KeyPair) -> None:
    """The runtime a cluster process runs: its DEALER to a libzmq CURVE ROUTER, its SUB
    to its own libzmq PUB (ZAP: members only), its PUSH to its own PULL."""
    member = Credentials.member(server_pair)
    rt = ZmqRuntime(native=True, credentials=member)
    router, endpoint = libzmq_router(rt.ctx, server_pair)
    got: list[bytes] = []
    pulled: list[bytes] = []
    published: list[bytes] = []
    try:
        dealer = rt.dealer(endpoint, got.append)
        dealer.send(b"before the handshake")
        puller = rt.puller(pulled.append)
        pusher = rt.pusher(puller.addr)
        pub = rt.publisher()
        sub = rt.subscriber(pub.addr, published.append)
        assert _poll(rt, lambda: _echoed(router))
        assert _poll(rt, lambda: bool(got))
        assert got == [b"before the handshake"]
        dealer.send(BIG)
        assert _poll(rt, lambda: _echoed(router))
        assert _poll(rt, lambda: len(got) == 2)
        assert got[1] == BIG
        pusher.send(b"rate")
        assert _poll(rt, lambda: bool(pulled))
        assert pulled == [b"rate"]

        def published_one() -> bool:
            pub.send(b"epoch")  # a SUB sees only what follows its subscription
            return bool(published)
        assert _poll(rt, published_one)
        assert published[0] == b"epoch"
        sub.close()
    finally:
        rt.close()


def _echoed(router: zmq.Socket[bytes]) -> bool:
    try:
        router.send_multipart(router.recv_multipart(zmq.NOBLOCK))
        return True
    except zmq.Again:
        return False


def _poll(rt: ZmqRuntime, done: Any) -> bool:
    for _ in range(200):
        if done():
            return True
        rt.run_once(50)
    return False


def test_a_stranger_is_refused_by_a_members_only_pub(server_pair: KeyPair) -> None:
    """A client key that is not the cluster's does not pass the ZAP handler of a
    cluster's libzmq socket: it hears nothing."""
    rt = ZmqRuntime(native=True, credentials=Credentials.member(server_pair))
    stranger = ZmqRuntime(native=True, credentials=Credentials(client=new_keypair(), server_public=server_pair.public))
    heard: list[bytes] = []
    try:
        pub = rt.publisher()
        sub = stranger.subscriber(pub.addr, heard.append)
        link = next(iter(sub.links.values()))
        for _ in range(40):
            pub.send(b"epoch")
            rt.run_once(10)
            stranger.run_once(10)
            if link.refused:
                break
        assert not heard
        assert link.refused is not None
    finally:
        stranger.close()
        rt.close()


# -- libzmq's client, our servers ------------------------------------------------------------------------


def test_libzmq_curve_dealer_to_the_asyncio_router(server_pair: KeyPair) -> None:
    client = new_keypair()

    async def main() -> None:
        seen: asyncio.Queue[tuple[bytes, list[bytes]]] = asyncio.Queue()

        def on_message(route: bytes, parts: list[bytes]) -> None:
            seen.put_nowait((route, parts))
            router.send_to(route, parts)

        router = ZmtpRouter(on_message, curve=server_keys(Credentials.member(server_pair)))
        await router.start()
        ctx = zmq.asyncio.Context()
        d = libzmq_dealer(ctx, router.endpoint, client, server_pair.public)
        try:
            for msg in MESSAGES:
                await d.send_multipart(msg)
                assert await asyncio.wait_for(d.recv_multipart(), WAIT_S) == msg
                route, parts = await asyncio.wait_for(seen.get(), WAIT_S)
                assert parts == msg
                assert router.peer_key(route) == client.public
        finally:
            d.close(0)
            ctx.term()
            await router.aclose()

    ziplog.aio.run(main())


def test_libzmq_curve_dealer_to_the_poll_loop_router(ctx: zmq.Context[zmq.Socket[bytes]], server_pair: KeyPair) -> None:
    client = new_keypair()
    rt = ZmqRuntime(native=True, credentials=Credentials.member(server_pair))
    seen: list[tuple[bytes, bytes]] = []
    router: Any = None

    def on_frame(route: bytes, frame: bytes) -> None:
        seen.append((route, frame))
        router.send_to(route, frame)

    try:
        router = rt.router(on_frame, lambda route, n: None)
        d = libzmq_dealer(ctx, router.addr, client, server_pair.public)
        d.setsockopt(zmq.HEARTBEAT_IVL, 20)  # libzmq's PINGs, boxed, answered boxed
        d.rcvtimeo = 50
        for body in (b"one", b"", BIG):
            d.send(body)
            reply = None
            for _ in range(400):
                rt.run_once(5)
                try:
                    reply = d.recv()
                    break
                except zmq.Again:
                    continue
            assert reply == body
        assert {router.peer_key(route) for route, _ in seen} == {client.public}
        d.close(0)
    finally:
        rt.close()


# -- refusals a client reports ---------------------------------------------------------------------------


def test_no_keys_and_a_wrong_server_key_are_reported_not_waited_on(server_pair: KeyPair) -> None:
    rt = ZmqRuntime(native=True, credentials=Credentials.member(server_pair))
    bare = ZmqRuntime(native=True)
    wrong = ZmqRuntime(native=True, credentials=Credentials(client=new_keypair(), server_public=new_keypair().public))
    try:
        router = rt.router(lambda route, frame: None, lambda route, n: None)
        without = bare.dealer(router.addr, lambda frame: None)
        mistaken = wrong.dealer(router.addr, lambda frame: None)
        for _ in range(400):
            rt.run_once(5)
            bare.run_once(5)
            wrong.run_once(5)
            if without.refused and mistaken.refused:
                break
        assert without.refused is not None and "CURVE" in without.refused
        assert mistaken.refused is not None and "HELLO" in mistaken.refused
        assert not router.routes
    finally:
        for r in (wrong, bare, rt):
            r.close()


# -- the codec's CURVE states, property-tested -------------------------------------------------------------

SERVER = new_keypair()
CLIENT = new_keypair()


def pair(seed: int) -> tuple[ZmtpConnection, ZmtpConnection]:
    rnd = fixed_random(seed)
    server = ZmtpConnection("ROUTER", curve=CurveKeys(SERVER.public, SERVER.secret, rnd), max_message=1 << 16)
    client = ZmtpConnection("DEALER", identity=b"c", curve=CurveKeys(CLIENT.public, CLIENT.secret, rnd, SERVER.public),
                            max_message=1 << 16)
    return server, client


def reply(events: list[Any], i: int = 0) -> bytes:
    """The bytes of the HandshakeReply at ``events[i]``."""
    ev = events[i]
    assert isinstance(ev, HandshakeReply), events
    return ev.data


def handshaken_event(events: list[Any], i: int) -> Handshaken:
    ev = events[i]
    assert isinstance(ev, Handshaken), events
    return ev


def test_a_handshake_in_memory_and_traffic_both_ways() -> None:
    server, client = pair(7)
    s_events = server.receive(client.start())
    assert [type(e) for e in s_events] == [HandshakeReply]  # WELCOME
    c_events = client.receive(server.start() + reply(s_events))
    assert [type(e) for e in c_events] == [HandshakeReply]  # INITIATE
    s_events = server.receive(reply(c_events))
    assert [type(e) for e in s_events] == [HandshakeReply, Handshaken]  # READY, then the client's key
    assert handshaken_event(s_events, 1).peer_key == CLIENT.public
    assert handshaken_event(s_events, 1).peer_identity == b"c"
    c_events = client.receive(reply(s_events))
    assert handshaken_event(c_events, 0).peer_key == SERVER.public
    wire = client.send_message([b"a", b"b" * 300]) + client.send_ping(10, b"ctx")
    assert b"b" * 300 not in wire
    got = server.receive(wire)
    assert got == [Message([b"a", b"b" * 300]), Ping(10, b"ctx")]
    assert client.receive(server.send_pong(b"ctx") + server.send_message([b"back"])) == [Pong(b"ctx"), Message([b"back"])]


def _handshaken() -> tuple[ZmtpConnection, ZmtpConnection]:
    server, client = pair(3)
    s1 = server.receive(client.start())
    c1 = client.receive(server.start() + reply(s1))
    s2 = server.receive(reply(c1))
    client.receive(reply(s2))
    assert server.handshaken and client.handshaken
    return server, client


def test_a_replayed_message_and_a_truncated_box_are_refused() -> None:
    server, client = _handshaken()
    first = client.send_message([b"pay me"])
    assert server.receive(first) == [Message([b"pay me"])]
    replay = server.receive(first)
    assert len(replay) == 1 and isinstance(replay[0], ProtocolViolation) and "replay" in replay[0].reason
    server, client = _handshaken()
    boxed = client.send_message([b"hello there"])
    cut = bytes((0, boxed[1] - 5)) + boxed[2:-5]
    refused = server.receive(cut)
    assert len(refused) == 1 and isinstance(refused[0], ProtocolViolation)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=400), at=st.lists(st.integers(0, 400), max_size=4), server_side=st.booleans())
def test_any_bytes_in_a_curve_handshake(data: bytes, at: list[int], server_side: bool) -> None:
    server, client = pair(5)
    me = server if server_side else client
    # the peer's greeting is valid; what follows is anything
    peer_greeting = (client if server_side else server).send_greeting()
    events = me.receive(peer_greeting)
    cuts = sorted({min(a, len(data)) for a in at}) + [len(data)]
    prev = 0
    for c in cuts:
        events += me.receive(data[prev:c])
        prev = c
    ends = [e for e in events if isinstance(e, ProtocolViolation)]
    assert len(ends) <= 1 and (not ends or events[-1] is ends[0])
    assert not me.handshaken


@settings(max_examples=300, deadline=None)
@given(flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), min_size=1, max_size=4),
       stage=st.sampled_from(["hello", "initiate", "traffic"]))
def test_flipped_bytes_in_a_curve_conversation(flips: list[tuple[int, int]], stage: str) -> None:
    server, client = pair(11)
    wire = bytearray(client.start())
    if stage != "hello":
        welcome = reply(server.receive(bytes(wire)))
        initiate = reply(client.receive(server.start() + welcome))
        wire = bytearray(initiate)
        if stage == "traffic":
            ready = reply(server.receive(bytes(wire)))
            client.receive(ready)
            wire = bytearray(client.send_message([b"record", b"x" * 100]))
    for pos, xor in flips:
        wire[pos % len(wire)] ^= xor
    events = server.receive(bytes(wire))
    ends = [e for e in events if isinstance(e, ProtocolViolation)]
    assert len(ends) <= 1
    # a flipped box never opens as something else: the message arrives intact or not at all
    assert all(e == Message([b"record", b"x" * 100]) for e in events if isinstance(e, Message))


def test_os_random_is_what_the_drivers_hand_in(server_pair: KeyPair) -> None:
    keys = server_keys(Credentials.member(server_pair))
    assert keys is not None and keys.random_bytes is os.urandom and keys.is_server
