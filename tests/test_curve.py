"""CurveZMQ (``ziplog/protocol/curve.py``) against libzmq's (pyzmq, the reference), both
ways, over a plain TCP socket carrying ZMTP 3.1 greetings and frames: a client of ours to
a libzmq CURVE ROUTER, a libzmq CURVE DEALER to a server of ours, and what either side
refuses (a wrong key, a tampered or truncated box, a replay), with every other input
property-tested to end in a result or a CurveError."""

from __future__ import annotations

import socket
import struct
from typing import Iterator

import nacl.utils
import pytest
import zmq
from zmq.utils import z85
from hypothesis import given, settings
from hypothesis import strategies as st

from ziplog.protocol import curve

MORE, COMMAND = 0x01, 0x04


def greeting(as_server: bool) -> bytes:
    return b"\xff" + bytes(8) + b"\x7f" + b"\x03\x01" + b"CURVE".ljust(20, b"\x00") + bytes((as_server,)) + bytes(31)


def frame(body: bytes, command: bool = False) -> bytes:
    flags = COMMAND if command else 0
    if len(body) < 256:
        return bytes((flags, len(body))) + body
    return bytes((flags | 0x02,)) + struct.pack(">Q", len(body)) + body


def metadata(**props: bytes) -> bytes:
    out = b""
    for name, value in props.items():
        key = name.replace("_", "-").encode()
        out += bytes((len(key),)) + key + struct.pack(">I", len(value)) + value
    return out


def read_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "the peer closed the connection"
        data += chunk
    return data


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
    flags = read_exact(sock, 1)[0]
    size = struct.unpack(">Q", read_exact(sock, 8))[0] if flags & 0x02 else read_exact(sock, 1)[0]
    return flags, read_exact(sock, size)


def raw_keys() -> tuple[bytes, bytes, bytes, bytes]:
    """A key pair as libzmq takes it (Z85) and the same as raw bytes."""
    public_z85, secret_z85 = zmq.curve_keypair()
    return public_z85, secret_z85, z85.decode(public_z85), z85.decode(secret_z85)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield c
    finally:
        c.destroy(linger=0)


def test_a_client_of_ours_talks_to_a_libzmq_curve_router(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    server_public_z85, server_secret_z85, server_public, _ = raw_keys()
    router = ctx.socket(zmq.ROUTER)
    router.curve_server = True
    router.curve_secretkey = server_secret_z85
    router.curve_publickey = server_public_z85
    router.rcvtimeo = 10_000
    port = router.bind_to_random_port("tcp://127.0.0.1")
    public, secret = curve.new_keypair(nacl.utils.random)
    client = curve.CurveClient(server_public, public, secret, nacl.utils.random)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(greeting(as_server=False) + frame(client.hello(), command=True))
        peer = read_exact(sock, 64)
        assert peer[12:17] == b"CURVE"  # the mechanism (libzmq leaves the as-server byte 0)
        flags, welcome = read_frame(sock)
        assert flags & COMMAND
        sock.sendall(frame(client.on_welcome(welcome, metadata(Socket_Type=b"DEALER", Identity=b"")), command=True))
        _, ready = read_frame(sock)
        server_meta, boxes = client.on_ready(ready)
        assert b"ROUTER" in server_meta
        sock.sendall(frame(boxes.seal(b"two", MORE)) + frame(boxes.seal(b"parts")))
        route, *parts = router.recv_multipart()
        assert parts == [b"two", b"parts"]
        router.send_multipart([route, b"pong"])
        _, message = read_frame(sock)
        assert boxes.open(message) == (0, b"pong")
        # a replayed message is refused, and so is a tampered one
        with pytest.raises(curve.CurveError, match="rise"):
            boxes.open(message)
    router.close(0)


def test_a_libzmq_curve_dealer_talks_to_a_server_of_ours(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    public, secret = curve.new_keypair(nacl.utils.random)
    client_public_z85, client_secret_z85, client_public, _ = raw_keys()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    dealer = ctx.socket(zmq.DEALER)
    dealer.curve_serverkey = z85.encode(public)
    dealer.curve_publickey = client_public_z85
    dealer.curve_secretkey = client_secret_z85
    dealer.rcvtimeo = 10_000
    dealer.connect(f"tcp://127.0.0.1:{listener.getsockname()[1]}")
    dealer.send_multipart([b"hi", b"there"])
    server = curve.CurveServer(public, secret, nacl.utils.random)
    conn, _ = listener.accept()
    with conn:
        conn.settimeout(10)
        conn.sendall(greeting(as_server=True))
        peer = read_exact(conn, 64)
        assert peer[12:17] == b"CURVE"
        _, hello = read_frame(conn)
        conn.sendall(frame(server.on_hello(hello), command=True))
        _, initiate = read_frame(conn)
        who, client_meta = server.on_initiate(initiate)
        assert who == client_public and b"DEALER" in client_meta
        ready, boxes = server.ready(metadata(Socket_Type=b"ROUTER"))
        conn.sendall(frame(ready, command=True))
        got = [boxes.open(read_frame(conn)[1]) for _ in range(2)]
        assert got == [(MORE, b"hi"), (0, b"there")]
        conn.sendall(frame(boxes.seal(b"ho")))
        assert dealer.recv() == b"ho"
    listener.close()
    dealer.close(0)


def handshake() -> tuple[curve.CurveClient, curve.CurveServer, curve.MessageBoxes, curve.MessageBoxes]:
    s_public, s_secret = curve.new_keypair(nacl.utils.random)
    c_public, c_secret = curve.new_keypair(nacl.utils.random)
    client = curve.CurveClient(s_public, c_public, c_secret, nacl.utils.random)
    server = curve.CurveServer(s_public, s_secret, nacl.utils.random)
    initiate = client.on_welcome(server.on_hello(client.hello()), metadata(Socket_Type=b"DEALER"))
    assert server.on_initiate(initiate)[0] == c_public
    ready, server_boxes = server.ready(metadata(Socket_Type=b"ROUTER"))
    _, client_boxes = client.on_ready(ready)
    return client, server, client_boxes, server_boxes


def test_each_side_refuses_what_does_not_check_out() -> None:
    s_public, s_secret = curve.new_keypair(nacl.utils.random)
    c_public, c_secret = curve.new_keypair(nacl.utils.random)
    other_public, _ = curve.new_keypair(nacl.utils.random)
    # a client that has the wrong server key: its HELLO does not open
    wrong = curve.CurveClient(other_public, c_public, c_secret, nacl.utils.random)
    with pytest.raises(curve.CurveError, match="HELLO"):
        curve.CurveServer(s_public, s_secret, nacl.utils.random).on_hello(wrong.hello())
    # a tampered WELCOME, a truncated INITIATE, an INITIATE with another connection's cookie
    client = curve.CurveClient(s_public, c_public, c_secret, nacl.utils.random)
    server = curve.CurveServer(s_public, s_secret, nacl.utils.random)
    welcome = server.on_hello(client.hello())
    with pytest.raises(curve.CurveError, match="WELCOME"):
        client.on_welcome(welcome[:-1] + bytes((welcome[-1] ^ 1,)), b"")
    initiate = client.on_welcome(welcome, b"")
    with pytest.raises(curve.CurveError, match="at least"):
        server.on_initiate(initiate[:200])
    other = curve.CurveServer(s_public, s_secret, nacl.utils.random)
    other.on_hello(curve.CurveClient(s_public, c_public, c_secret, nacl.utils.random).hello())
    with pytest.raises(curve.CurveError, match="cookie"):
        other.on_initiate(initiate)
    # a message: tampered, truncated, replayed, or sealed for the other direction
    _, _, client_boxes, server_boxes = handshake()
    sealed = client_boxes.seal(b"record")
    with pytest.raises(curve.CurveError, match="does not open"):
        server_boxes.open(sealed[:-1] + bytes((sealed[-1] ^ 0x80,)))
    with pytest.raises(curve.CurveError, match="too short"):
        server_boxes.open(sealed[:20])
    assert server_boxes.open(sealed) == (0, b"record")
    with pytest.raises(curve.CurveError, match="rise"):
        server_boxes.open(sealed)
    with pytest.raises(curve.CurveError, match="does not open"):
        client_boxes.open(client_boxes.seal(b"to myself"))


def test_a_public_key_of_low_order_is_refused() -> None:
    s_public, s_secret = curve.new_keypair(nacl.utils.random)
    client = curve.CurveClient(s_public, *curve.new_keypair(nacl.utils.random), nacl.utils.random)
    hello = bytearray(client.hello())
    hello[80:112] = bytes(32)  # C' = 0: every shared key with it is 0
    with pytest.raises(curve.CurveError):
        curve.CurveServer(s_public, s_secret, nacl.utils.random).on_hello(bytes(hello))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.sampled_from(["hello", "welcome", "initiate", "ready", "message"]))
def test_any_bytes_end_in_a_result_or_a_curve_error(data: bytes, step: str) -> None:
    client, server, client_boxes, server_boxes = handshake()
    fresh_client = curve.CurveClient(client.server_public, client.public, client.secret, nacl.utils.random)
    fresh_client.hello()
    fresh_server = curve.CurveServer(server.public, server.secret, nacl.utils.random)
    calls = {
        "hello": lambda: fresh_server.on_hello(data),
        "welcome": lambda: fresh_client.on_welcome(data, b""),
        "initiate": lambda: fresh_server.on_initiate(data),
        "ready": lambda: fresh_client.on_ready(data),
        "message": lambda: server_boxes.open(b"\x07MESSAGE" + data),
    }
    try:
        calls[step]()
    except curve.CurveError:
        pass
