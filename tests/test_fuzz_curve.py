"""The CURVE handshake and boxes under junk, at a running cluster that speaks CURVE: every
storage replica's ROUTER (the native codec) and the MMS and failure handler PULLs
(libzmq behind the members-only ZAP handler) get, over raw TCP, a CURVE greeting
followed by anything at each stage: junk instead of HELLO, a HELLO with bytes flipped,
junk instead of INITIATE, an INITIATE with bytes flipped or cut, and, after a good
handshake, junk frames, replayed boxes, truncated and flipped boxes, and boxed junk
(the decoders' generators, ``tests/junk.py``) from a key nobody registered. Then: no
process exited or restarted, no recovery began, no leader changed, no traceback, every
request boxed by the stranger answered FORBIDDEN or a decoder's code, and a client with
the cluster's key inserts and reads.

``ZIPLOG_FUZZ_EXAMPLES`` (default 150) sets how many examples each stage draws."""

from __future__ import annotations

import collections
import os
import socket
from typing import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ziplog
from tests import junk
from tests.load import leader_lines, recovery_generations, tracebacks
from ziplog.io.keys import new_keypair
from ziplog.protocol import frames as wire
from ziplog.protocol.zmtp import (
    CurveKeys,
    HandshakeReply,
    Handshaken,
    Message,
    ProtocolViolation,
    ZmtpConnection,
    encode_frame,
    parse_endpoint,
)

EXAMPLES = int(os.environ.get("ZIPLOG_FUZZ_EXAMPLES", "150"))
STAGES = ("hello", "initiate", "traffic")
STRANGER = new_keypair()
WAIT_S = 10.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=1, replicas=2, data_dir=tmp_path_factory.mktemp("fuzz-curve"), curve=True) as c:
        yield c


class Refused(Exception):
    """The server ended a handshake the peer played well (a members-only socket does, to
    a stranger's key, at INITIATE)."""


class Peer:
    """One raw TCP connection speaking as a CURVE client, through ziplog's own codec up to
    the stage the junk replaces."""

    def __init__(self, addr: str, server_public: bytes) -> None:
        host, port = parse_endpoint(addr)
        self.sock = socket.create_connection((host, port), timeout=WAIT_S)
        self.codec = ZmtpConnection("DEALER", curve=CurveKeys(STRANGER.public, STRANGER.secret, os.urandom,
                                                              server_public))
        self.greeting_and_hello = self.codec.start()

    def until(self, stage: str) -> bytes:
        """Play the handshake up to ``stage`` and return the bytes that would come next
        (the HELLO, the INITIATE; b"" once in traffic)."""
        if stage == "hello":
            self.sock.sendall(self.greeting_and_hello[:64])
            return self.greeting_and_hello[64:]
        self.sock.sendall(self.greeting_and_hello)
        while True:
            for ev in self.codec.receive(self._recv()):
                if isinstance(ev, HandshakeReply):
                    if stage == "initiate":
                        return ev.data
                    self.sock.sendall(ev.data)
                elif isinstance(ev, Handshaken):
                    return b""
                elif isinstance(ev, ProtocolViolation):
                    raise Refused(ev.reason)

    def _recv(self) -> bytes:
        data = self.sock.recv(65536)
        if not data:
            raise Refused("the server closed the connection")
        return data

    def answers(self, silence: float = 0.5) -> list[bytes]:
        """The messages that arrive until the server is silent for ``silence`` seconds (or
        closes)."""
        out: list[bytes] = []
        self.sock.settimeout(silence)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    break
                out += [m.parts[-1] for m in self.codec.receive(data) if isinstance(m, Message)]
        except (TimeoutError, OSError):
            pass
        return out

    def close(self) -> None:
        self.sock.close()


def flip(data: bytes, flips: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for pos, xor in flips:
        if out:
            out[pos % len(out)] ^= xor
    return bytes(out)


def _harmless(frame: bytes) -> bool:
    """A frame with no effect if it were served (the stranger is FORBIDDEN anyway)."""
    try:
        msg = wire.decode_request(frame)
    except wire.ProtocolError:
        return True
    return type(msg) in (wire.Status, wire.Read, wire.Count, wire.Range)


@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning")
def test_curve_junk_at_every_listening_socket_changes_nothing(cluster: ziplog.LocalCluster) -> None:
    server_public = cluster.key.curve_server().public
    topo = cluster.topology
    storage = [a for s in cluster.shard_ids for a in topo.replica_addrs(s) or ()]
    pulls = list(topo.mms_pulls()) + list(topo.fh_pulls())
    gens, leaders, restarts = recovery_generations(cluster), leader_lines(cluster), len(cluster.restarts)
    pids = {k: p.pid for k, p in cluster.servers.items()}
    answers: collections.Counter[str] = collections.Counter()

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(stage=st.sampled_from(STAGES), junk_bytes=st.binary(max_size=600),
           flips=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(1, 255)), max_size=3),
           cut=st.integers(0, 400), frame=junk.frames, replay=st.booleans(),
           addr=st.one_of(st.sampled_from(storage), st.sampled_from(pulls)))
    def throw(stage: str, junk_bytes: bytes, flips: list[tuple[int, int]], cut: int, frame: bytes, replay: bool,
              addr: str) -> None:
        peer = Peer(addr, server_public)
        try:
            next_bytes = peer.until(stage)
            if stage != "traffic":
                # the next handshake command, flipped and cut, or junk in its place
                peer.sock.sendall(flip(next_bytes, flips)[:cut] if flips else junk_bytes)
                return
            if addr in pulls:
                peer.sock.sendall(junk_bytes)  # a PULL answers nothing: junk on a good connection
                return
            # a request the stranger's key may not make, then the junk, each in its box
            peer.sock.sendall(peer.codec.send_message([wire.encode(wire.Status(req_id=1))]))
            boxed = peer.codec.send_message([frame])
            if not _harmless(frame):
                peer.sock.sendall(flip(boxed, flips or [(9, 1)]))  # never opens: refused, unread
                return
            peer.sock.sendall(boxed)
            replies = peer.answers(0.2)
            # then a replay, a flipped or cut box, junk: the connection ends, unanswered
            peer.sock.sendall((boxed if replay else b"") + flip(boxed, flips)[:cut] + junk_bytes[:1])
            for reply in replies:
                try:
                    msg = wire.decode_reply(reply)
                except wire.ProtocolError:
                    answers["undecodable"] += 1
                    continue
                answers[msg.code if isinstance(msg, wire.Error) else type(msg).__name__] += 1
        except Refused:
            # a stranger's good handshake is refused by the members-only PULLs, never by a
            # storage replica (which answers its requests FORBIDDEN)
            assert addr in pulls, f"{addr} refused a good handshake"
        except OSError:
            pass  # the server closed on us: what it should do with junk
        finally:
            peer.close()

    throw()
    print(f"\nanswers: {dict(answers)}")
    assert answers[wire.E_FORBIDDEN] > 0, "no boxed request from the stranger reached a replica"
    assert set(answers) <= {wire.E_FORBIDDEN, wire.E_MALFORMED, wire.E_VERSION, wire.E_UNKNOWN_OP,
                            wire.E_BAD_ARGUMENT, wire.E_UNAUTHENTICATED}, answers
    assert {k: p.pid for k, p in cluster.servers.items()} == pids and all(
        p.poll() is None for p in cluster.servers.values()), "a storage process exited"
    assert all(p.poll() is None for p in [*cluster.mms.values(), *cluster.fh.values()]), "a control process exited"
    assert len(cluster.restarts) == restarts, "a replica restarted"
    assert recovery_generations(cluster) == gens, "a recovery started"
    assert leader_lines(cluster) == leaders, "a leader changed"
    assert tracebacks(cluster) == []
    with cluster.client() as c:
        rid = c.insert_after(b"after the CURVE fuzz")
        assert c.read_record(rid) == b"after the CURVE fuzz"


def test_the_peer_speaks_a_handshake_the_cluster_takes(cluster: ziplog.LocalCluster) -> None:
    """The thrower's own handshake is good (or the fuzz would test nothing past HELLO):
    a replica answers the stranger's boxed STATUS with FORBIDDEN."""
    addrs = cluster.topology.replica_addrs(cluster.shard_ids[0])
    assert addrs
    addr = addrs[0]
    peer = Peer(addr, cluster.key.curve_server().public)
    try:
        assert peer.until("traffic") == b""
        peer.sock.sendall(peer.codec.send_message([wire.encode(wire.Status(req_id=9))]))
        replies = [wire.decode_reply(r) for r in peer.answers()]
        assert len(replies) == 1 and isinstance(replies[0], wire.Error) and replies[0].code == wire.E_FORBIDDEN
        assert replies[0].req_id == 9
    finally:
        peer.close()


def test_a_frame_not_boxed_after_the_handshake_ends_the_connection(cluster: ziplog.LocalCluster) -> None:
    addrs = cluster.topology.replica_addrs(cluster.shard_ids[0])
    assert addrs
    addr = addrs[0]
    peer = Peer(addr, cluster.key.curve_server().public)
    try:
        peer.until("traffic")
        peer.sock.sendall(encode_frame(wire.encode(wire.Status(req_id=1))))
        assert peer.answers() == []
        peer.sock.settimeout(WAIT_S)
        assert peer.sock.recv(1) == b"", "the connection stayed open"
    finally:
        peer.close()
