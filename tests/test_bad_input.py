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


def _hwm_bytes(pid: int) -> int:
    """The process's peak resident memory (VmHWM)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_64_mib_frame_is_refused_unread_and_its_sender_disconnected(cluster: ziplog.LocalCluster) -> None:
    """libzmq reads the frame's size first and drops the connection: the replica never
    holds the 64 MiB, and a writer pinned to its shard goes on without a recovery."""
    import threading

    from zmq.utils.monitor import recv_monitor_message

    from tests.load import recovery_record
    primary = cluster.servers[(0, 0)]
    before_hwm = _hwm_bytes(primary.pid)
    gen_before = recovery_record(cluster, 0)
    addr = cluster.topology.replica_addrs(0)[0]  # type: ignore[index]
    stop, acked, errors = threading.Event(), [], []

    def write() -> None:
        try:
            with cluster.client(policy=ziplog.Policy.fixed(0)) as w:
                while not stop.is_set():
                    acked.append(w.insert_after(b"beside the flood"))
        except BaseException as exc:
            errors.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RECONNECT_IVL, 10)
        monitor = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        s.connect(addr)
        junk = b"\x00" * (64 << 20)
        for _ in range(8):
            s.send(junk, copy=False)
            assert monitor.poll(60_000), "the replica did not drop the connection of an oversized sender"
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        with cluster.client(policy=ziplog.Policy.fixed(0)) as c:
            assert c.insert_after(b"after the flood").shard == 0  # the shard serves
    finally:
        stop.set()
        writer.join()
        ctx.destroy(linger=0)
    assert not errors, errors
    assert primary.poll() is None, "the replica died"
    assert _hwm_bytes(primary.pid) < before_hwm + (32 << 20), "the replica read an oversized frame into memory"
    assert recovery_record(cluster, 0) == gen_before, "a healthy shard went through recovery"
