"""Malformed frames, unknown ops, wrong types, oversized records and unknown rids, sent
with raw pyzmq: each gets a clear error reply, and the server keeps serving."""

from __future__ import annotations

from typing import Any, Iterator

import msgpack
import pytest
import zmq

import ziplog
from ziplog.protocol import frames as wire
from tests.load import wait_status

V = wire.PROTOCOL_VERSION


@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=1, replicas=2) as c:
        yield c


@pytest.fixture()
def sock(cluster: ziplog.LocalCluster) -> Iterator[zmq.Socket]:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    addrs = cluster.topology.replica_addrs(0)
    assert addrs
    s.connect(addrs[0])
    yield s
    ctx.destroy(linger=0)


def ask(sock: zmq.Socket, *parts: bytes) -> list[Any]:
    sock.send_multipart(list(parts))
    assert sock.poll(10_000), "no reply: the server must answer bad input"
    return msgpack.unpackb(sock.recv(), raw=False)


def pk(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("frame, code", [
    (b"\xc1\xff not msgpack", wire.E_MALFORMED),
    (pk({"op": 1}), wire.E_MALFORMED),
    (pk([V]), wire.E_MALFORMED),
    (pk([V + 7, wire.INSERT, 1, 1, 1, 0, b"x"]), wire.E_VERSION),
    (pk([V, 99, 5]), wire.E_UNKNOWN_OP),
    (pk([V, "insert", 5]), wire.E_UNKNOWN_OP),
    (pk([V, wire.INSERT, 5, 1, 1, 0]), wire.E_MALFORMED),
    (pk([V, wire.INSERT, 5, 1, 1, 0, "text, not bytes"]), wire.E_BAD_ARGUMENT),
    (pk([V, wire.INSERT, 5, -1, 1, 0, b"x"]), wire.E_BAD_ARGUMENT),
    (pk([V, wire.READ, 5, "1"]), wire.E_BAD_ARGUMENT),
    (pk([V, wire.INSERT, 5, 1, 1, 0, b"x" * ((1 << 20) + 1)]), wire.E_TOO_LARGE),
    (pk([V, wire.READ, 5, 1 << 60]), wire.E_UNKNOWN_RID),
    (pk([V, wire.INSERT, 5, 1, 1, 1 << 60, b"x"]), wire.E_UNKNOWN_RID),
])
def test_bad_frame_gets_error_reply(sock: zmq.Socket, frame: bytes, code: str) -> None:
    reply = ask(sock, frame)
    assert reply[0] == V and reply[1] == wire.ERROR
    assert reply[3] == code, reply
    assert isinstance(reply[4], str) and reply[4]


def test_multipart_request_is_refused(sock: zmq.Socket) -> None:
    reply = ask(sock, pk([V, wire.STATUS, 1]), b"extra")
    assert reply[1] == wire.ERROR and reply[3] == wire.E_MALFORMED


def test_request_id_is_echoed_when_readable(sock: zmq.Socket) -> None:
    reply = ask(sock, pk([V, 99, 4242]))
    assert reply[2] == 4242


def test_server_keeps_serving_and_nothing_is_lost(cluster: ziplog.LocalCluster, sock: zmq.Socket) -> None:
    with cluster.client() as c:
        rid = c.insert_after(b"before the garbage")
        for junk in (b"", b"\x00" * 100, pk([V, wire.FORWARD, 0, [0, 0, [[0, 1, 0, 1, 1, b"forged"]]]])):
            sock.send(junk)
            sock.poll(2000)
            while sock.poll(0):
                sock.recv()
        after = c.insert_after(b"after the garbage", rid)
        assert after.gsn > rid.gsn
        assert c.read_record(rid) == b"before the garbage"
        assert c.read_record(after) == b"after the garbage"
        for reps in wait_status(c).values():
            for r in reps:
                assert r["records"] >= 2
    for p in cluster.servers.values():
        assert p.poll() is None, "a server died on bad input"
