"""Structure-aware junk (the decoders' property-test generators, ``tests/junk.py``) thrown
at every listening socket of a running cluster: each storage replica's ROUTER, the MMS
and failure handler PULLs, the LogDB coordinators' and KV shards' ROUTERs; bare, and
sealed with the cluster's own key, while writers insert and two subscribers read. Then:
no process exited or restarted, no recovery started, no leader changed, no traceback
and no contained failure in any log, every junk frame to a ROUTER answered with an
error, every acknowledged record delivered once in one order, and a fresh client
inserts and reads.

``ZIPLOG_FUZZ_EXAMPLES`` (default 150) sets how many generated frames go to every
socket; the suite's run is a smoke test, a larger run is one command away."""

from __future__ import annotations

import collections
import os
from typing import Any, Iterator

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings

import ziplog
from tests import junk
from tests.load import Load, leader_lines, recovery_generations, tracebacks
from ziplog.tools.logdb_local import local_logdb
from ziplog.io.zk_logdb import Directory
from ziplog.logdb.core import frames as ldb
from ziplog.protocol import frames as wire

EXAMPLES = int(os.environ.get("ZIPLOG_FUZZ_EXAMPLES", "150"))
#: what the driver logs when the handling of one message failed (ziplog/shell/inbound.py)
CONTAINED = "failed (message dropped, still serving)"


@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=2, replicas=2) as c:
        yield c


class Thrower:
    """An outsider's sockets to every listening socket the cluster registered."""

    def __init__(self, cluster: ziplog.LocalCluster) -> None:
        self.cluster = cluster
        self.ctx = zmq.Context()
        topo = cluster.topology
        #: (edge, DEALER, decoder a sealed frame is opened with) for every ROUTER
        self.routers: list[tuple[str, zmq.Socket, Any]] = []
        for shard in cluster.shard_ids:
            for addr in topo.replica_addrs(shard) or ():
                self.routers.append(("storage", self._sock(zmq.DEALER, addr), wire.decode_member_request))
        directory = Directory(cluster._zkc, "default")
        for addr in directory.coordinators():
            self.routers.append(("logdb-coordinator", self._sock(zmq.DEALER, addr), None))
        for i in range(directory.kv_shards):
            addr = directory.kv_addr(i)
            assert addr is not None
            self.routers.append(("logdb-kv", self._sock(zmq.DEALER, addr), None))
        #: (edge, PUSH, decoder a sealed frame is opened with) for every PULL
        self.pulls = [("mms", self._sock(zmq.PUSH, a), wire.decode_rate) for a in topo.mms_pulls()]
        self.pulls += [("failure-handler", self._sock(zmq.PUSH, a), wire.decode_suspect) for a in topo.fh_pulls()]
        self.sent: collections.Counter[str] = collections.Counter()
        self.answers: collections.Counter[str] = collections.Counter()
        self.unanswered = 0

    def _sock(self, kind: int, addr: str) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 2000)  # what was queued reaches the PULLs before close
        s.setsockopt(zmq.SNDHWM, 0)
        s.connect(addr)
        return s

    @staticmethod
    def _harmless(frame: bytes) -> bool:
        """Junk, or a request that only reads: a frame that decodes to a storage request
        with an effect (INSERT, TRIM, SUBSCRIBE...) is left out (a TRIM would rightly
        delete what the writers' checks look for)."""
        try:
            msg = wire.decode_request(frame)
        except wire.ProtocolError:
            return True
        return type(msg) in (wire.Status, wire.Read, wire.Count, wire.Range)

    def throw(self, frame: bytes) -> None:
        """``frame`` to every socket, bare; and sealed where it is junk to what opens it
        (a well-formed sealed SUSPECT would rightly start a recovery)."""
        harmless = self._harmless(frame)
        logdb_junk = _refused(ldb.decode_request, frame, ldb.BadFrame)
        for edge, sock, inner in self.routers:
            if (edge == "storage" and not harmless) or (edge.startswith("logdb") and not logdb_junk):
                continue  # a well-formed LogDB request may wait (20 s) for a position the log never reaches
            sock.send(frame)
            self.unanswered += 1
            self.sent[edge] += 1
            if inner is not None and _refused(inner, frame):
                sock.send(wire.seal(self.cluster.key, frame))
                self.unanswered += 1
                self.sent[edge + " sealed"] += 1
        for edge, sock, inner in self.pulls:
            sock.send(frame)
            self.sent[edge] += 1
            if _refused(inner, frame):
                sock.send(wire.seal(self.cluster.key, frame))
                self.sent[edge + " sealed"] += 1
        self.read_answers(0)

    def read_answers(self, timeout_ms: int) -> None:
        """Count the answers the ROUTERs sent, by code; wait up to ``timeout_ms`` for the
        next one while some are missing."""
        poller = zmq.Poller()
        for _, sock, _ in self.routers:
            poller.register(sock, zmq.POLLIN)
        while self.unanswered:
            ready = dict(poller.poll(timeout_ms))
            if not ready:
                return
            for edge, sock, _ in self.routers:
                while sock in ready and sock.poll(0):
                    self.answers[_code(edge, sock.recv())] += 1
                    self.unanswered -= 1

    def close(self) -> None:
        self.ctx.destroy(linger=2000)


def _refused(decode: Any, frame: bytes, error: type[Exception] = wire.ProtocolError) -> bool:
    try:
        decode(frame)
    except error:
        return True
    return False


def _code(edge: str, answer: bytes) -> str:
    """An answer's error code, or what it is."""
    if edge.startswith("logdb"):
        msg = ldb.decode_answer(answer)
        return f"logdb {msg.code}" if type(msg) is ldb.Failed else f"logdb {type(msg).__name__}"
    msg = wire.decode_reply(answer)
    return msg.code if type(msg) is wire.Error else type(msg).__name__


def _processes(cluster: ziplog.LocalCluster, ldb_: Any) -> dict[str, Any]:
    procs = {f"shard{s}-replica{r}": p for (s, r), p in cluster.servers.items()}
    procs.update({f"mms{i}": p for i, p in cluster.mms.items()})
    procs.update({f"fh{i}": p for i, p in cluster.fh.items()})
    procs.update({f"logdb-coordinator{i}": p for i, p in ldb_.coordinators.items()})
    procs.update({f"logdb-kv{i}": p for i, p in ldb_.kv.items()})
    return procs


def contained_failures(cluster: ziplog.LocalCluster) -> dict[str, int]:
    counts = {p.name: p.read_text(errors="replace").count(CONTAINED) for p in cluster.logs.glob("*.log")}
    return {name: n for name, n in counts.items() if n}


# The cluster's clients (other threads) use the module ``random`` while Hypothesis draws.
@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning")
def test_junk_at_every_listening_socket_changes_nothing(cluster: ziplog.LocalCluster) -> None:
    with local_logdb(cluster, coordinators=2, kv_shards=2) as ldb_:
        procs = _processes(cluster, ldb_)
        pids = {name: p.pid for name, p in procs.items()}
        gens, leaders, restarts = recovery_generations(cluster), leader_lines(cluster), len(cluster.restarts)
        load = Load(cluster)
        thrower = Thrower(cluster)
        try:
            load.wait_acked(50)

            @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                      suppress_health_check=list(HealthCheck))
            @given(frame=junk.frames)
            def throw(frame: bytes) -> None:
                thrower.throw(frame)

            throw()
            thrower.read_answers(60_000)
            load.wait_acked(50)  # the writers go on after the junk
            load.finish()
        finally:
            thrower.close()
            load.stop_writing.set()
            load.stop_reading()
        print(f"\nframes sent by edge: {dict(thrower.sent)}\nanswers by code: {dict(thrower.answers)}")
        assert thrower.unanswered == 0, f"{thrower.unanswered} junk frames to a ROUTER got no answer"
        assert set(thrower.answers) <= {
            wire.E_MALFORMED, wire.E_VERSION, wire.E_UNKNOWN_OP, wire.E_BAD_ARGUMENT, wire.E_UNAUTHENTICATED,
            wire.E_NOT_FOUND, wire.E_UNKNOWN_RID, wire.E_TRIMMED, wire.E_TIMEOUT, "StatusOk", "ReadOk", "CountOk",
            wire.E_OVERLOADED, "RangeOk", f"logdb {ldb.BAD_REQUEST}",
        }, thrower.answers
        assert {name: p.pid for name, p in _processes(cluster, ldb_).items()} == pids, "a process was replaced"
        assert [name for name, p in procs.items() if p.poll() is not None] == [], "a process exited"
        assert len(cluster.restarts) == restarts, "a replica restarted"
        assert recovery_generations(cluster) == gens, "a recovery started"
        assert leader_lines(cluster) == leaders, "a leader changed"
        assert tracebacks(cluster) == []
        assert contained_failures(cluster) == {}, "handling a junk frame failed past its decoder"
        with cluster.client() as c:
            rid = c.insert_after(b"after the fuzz")
            assert c.read_record(rid) == b"after the fuzz"


def test_the_thrower_covers_every_listening_edge(cluster: ziplog.LocalCluster) -> None:
    """What the fuzz reaches: every ROUTER and PULL the cluster and a LogDB register."""
    with local_logdb(cluster, coordinators=2, kv_shards=2):
        thrower = Thrower(cluster)
        try:
            edges = {e for e, _, _ in thrower.routers} | {e for e, _, _ in thrower.pulls}
            assert edges == {"storage", "logdb-coordinator", "logdb-kv", "mms", "failure-handler"}
            assert len(thrower.routers) == 4 + 2 + 2 and len(thrower.pulls) == 6
            thrower.throw(msgpack.packb([1, [1], 5]))  # the 5-byte frame that once killed them
            thrower.read_answers(60_000)
            assert thrower.unanswered == 0 and set(thrower.answers) <= {wire.E_UNKNOWN_OP, "logdb BAD_REQUEST"}
        finally:
            thrower.close()
