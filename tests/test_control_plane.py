"""Control-plane input from outside the cluster, against a real local cluster: every op
that carries authority is refused unless sealed with the cluster's key, a sealed
recovery step names only a generation the failure handler committed, junk of every
shape is refused without a traceback, a recovery, or a leader change, and a plain
ZooKeeper client cannot rewrite what the cluster owns."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Iterator

import msgpack
import pytest
import zmq
from kazoo.exceptions import NoAuthError

import ziplog
from ziplog.io import zk as discovery
from ziplog.protocol import frames as wire
from ziplog.protocol import layout
from ziplog.protocol.auth import ClusterKey
from tests.load import leader_lines, recovery_generations, tracebacks, wait_status

STRANGER = ClusterKey(b"not this cluster's secret at all")


@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=2, replicas=2) as c:
        yield c


@pytest.fixture
def client(cluster: ziplog.LocalCluster) -> Iterator[ziplog.Client]:
    c = cluster.client(timeout=20.0)
    try:
        yield c
    finally:
        c.close()


class Sender:
    """Sockets of an outsider who read every address from ZooKeeper (anyone may)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.socks: list[zmq.Socket] = []

    def dealer(self, addr: str) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.linger = 0
        s.rcvtimeo = 10_000
        s.connect(addr)
        self.socks.append(s)
        return s

    def push(self, addr: str) -> zmq.Socket:
        s = self.ctx.socket(zmq.PUSH)
        s.linger = 2000  # what was queued reaches the handler before close
        s.connect(addr)
        self.socks.append(s)
        return s

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.ctx.term()


@pytest.fixture
def outsider() -> Iterator[Sender]:
    s = Sender()
    try:
        yield s
    finally:
        s.close()


def ask(sock: zmq.Socket, frame: bytes) -> Any:
    sock.send(frame)
    return wire.decode_reply(sock.recv())


def primary_status(client: ziplog.Client, shard: int) -> dict[str, Any]:
    return wait_status(client, [shard])[shard][0]


RECOVERY_FRAMES = [
    wire.Probe(req_id=11, gen=2**64 - 1),
    wire.Acquired(req_id=12, gen=2**64 - 1),
    wire.Fetch(req_id=13, gen=2**64 - 1, lo=0, hi=10, max_bytes=1 << 20),
    wire.Install(req_id=14, gen=2**64 - 1, base=0, trim=0, events=[], end=0),
    wire.Resume(req_id=15, gen=2**64 - 1, stable=0, refused=[]),
]


@pytest.mark.parametrize("msg", RECOVERY_FRAMES, ids=lambda m: type(m).__name__)
def test_an_unauthenticated_recovery_step_is_refused_and_changes_nothing(
        cluster: ziplog.LocalCluster, client: ziplog.Client, outsider: Sender, msg: wire.Frame) -> None:
    gens = recovery_generations(cluster)
    for shard in cluster.shard_ids:
        before = primary_status(client, shard)
        sock = outsider.dealer(client.topology.replica_addrs(shard)[0])  # type: ignore[index]
        frame = wire.encode(msg)
        bare = ask(sock, frame)
        forged = ask(sock, wire.seal(STRANGER, frame))
        # sealed with the real key (a member with a bug, say), but a generation the
        # failure handler never committed
        uncommitted = ask(sock, wire.seal(cluster.key, frame))
        assert (type(bare), bare.code, bare.req_id) == (wire.Error, wire.E_UNAUTHENTICATED, msg.req_id)  # type: ignore[attr-defined]
        assert (type(forged), forged.code) == (wire.Error, wire.E_UNAUTHENTICATED)
        assert (type(uncommitted), uncommitted.code) == (wire.Error, wire.E_UNCOMMITTED)
        after = primary_status(client, shard)
        assert not after["frozen"] and after["recovery_gen"] == before["recovery_gen"]
        rid = client.insert_after(b"still serving", ziplog.RID_GENESIS)
        assert client.read_record(rid) == b"still serving"
    assert recovery_generations(cluster) == gens


def test_an_unauthenticated_peer_hello_is_refused(cluster: ziplog.LocalCluster, client: ziplog.Client,
                                                 outsider: Sender) -> None:
    sock = outsider.dealer(client.topology.replica_addrs(0)[0])  # type: ignore[index]
    for msg in (wire.Hello(shard=0, replica=1, frontier=2**64 - 1, guessed_top=2**64 - 1),
                wire.Prefix(replica=1, frontier=2**64 - 1)):
        reply = ask(sock, wire.encode(msg))
        assert (type(reply), reply.code) == (wire.Error, wire.E_UNAUTHENTICATED)
        reply = ask(sock, wire.seal(STRANGER, wire.encode(msg)))
        assert (type(reply), reply.code) == (wire.Error, wire.E_UNAUTHENTICATED)
    rid = client.insert_after(b"the real backup still follows")
    assert client.read_record(rid) == b"the real backup still follows"


def _junk_values(rng: random.Random) -> list[Any]:
    return [True, False, 1.0, -1, -(2**63), 2**64 - 1, "1", b"1", None, [], {}, [1, 2], {"a": 1}, "x" * 5000,
            b"\x00" * 5000, rng.randint(0, 2**63)]


def _junk_frames(rng: random.Random, ops: list[int], nfields: dict[int, int]) -> list[bytes]:
    """Frames of every control-plane op: wrong versions, arities, types and ranges."""
    values = _junk_values(rng)
    frames = []
    for op in ops:
        n = nfields[op]
        for _ in range(60):
            version = rng.choice([1, 1, 1, 0, 2, True, 1.0, "1", None])
            arity = rng.choice([n, n, n, n - 1, n + 1, 0])
            fields = [rng.choice(values) for _ in range(max(arity, 0))]
            frames.append(msgpack.packb([version, op, *fields], use_bin_type=True))
        frames.append(msgpack.packb([1, op, *([0] * n)], use_bin_type=True)[:-1])  # torn
    frames += [b"", b"\xc1", b"\x92\x01", msgpack.packb({"op": 41}), b"\x00" * 100]
    return frames


def test_junk_on_every_control_plane_edge_changes_nothing(cluster: ziplog.LocalCluster, client: ziplog.Client,
                                                          outsider: Sender) -> None:
    rng = random.Random(20261123)
    gens = recovery_generations(cluster)
    leaders = leader_lines(cluster)
    member_classes: dict[int, Any] = {**wire.MEMBER_REQUESTS, wire.SUSPECT: wire.Suspect, wire.RATE: wire.Rate,
                                      wire.SIGNED: wire.Signed}
    nfields = {op: len(cls.__struct_fields__) - 2 for op, cls in member_classes.items()}
    member_ops = sorted(wire.MEMBER_REQUESTS)
    storage_junk = _junk_frames(rng, [*member_ops, wire.SIGNED], nfields)
    # recovery steps sealed with this cluster's key but junk inside: a member's bug must
    # not be worse than an outsider's (a well-formed one names no committed generation)
    recovery_ops = [wire.PROBE, wire.ACQUIRED, wire.FETCH, wire.INSTALL, wire.RESUME]
    storage_junk += [wire.seal(cluster.key, f) for f in _junk_frames(rng, recovery_ops, nfields)[::3]]
    # well-formed SUSPECTs, sealed, of shards and replicas that do not exist
    suspects = [wire.seal(cluster.key, wire.encode(wire.Suspect(shard=s, replica=r, reason="x" * 100_000)))
                for s, r in ((10**9, 0), (0, 7))]
    pull_junk = _junk_frames(rng, [wire.SUSPECT, wire.RATE, wire.SIGNED], nfields)
    bare_suspects = [wire.encode(wire.Suspect(shard=s, replica=1, reason="forged")) for s in cluster.shard_ids]
    bare_rates = [wire.encode(wire.Rate(reports=[wire.RateEntry(shard=s, epoch=0, rate=2**40, busy=True)]))
                  for s in cluster.shard_ids]

    answered = 0
    for shard in cluster.shard_ids:
        for addr in client.topology.replica_addrs(shard) or ():
            sock = outsider.dealer(addr)
            for frame in storage_junk:
                reply = ask(sock, frame)
                assert type(reply) is wire.Error, reply
                answered += 1
    topo = client.topology
    for addr in topo.fh_pulls() + topo.mms_pulls():
        push = outsider.push(addr)
        for frame in pull_junk + suspects + bare_suspects + bare_rates:
            push.send(frame)
    assert answered == len(storage_junk) * 2 * len(cluster.shard_ids)
    # The cluster still takes inserts everywhere, and a subscription sees them: the
    # junk went through before these (each PUSH is ordered, and the status round trip
    # to every replica follows it).
    rids = [client.insert_after(f"after junk {i}".encode()) for i in range(20)]
    assert {r.shard for r in rids} == set(cluster.shard_ids)
    status = wait_status(client)
    for shard, replicas in status.items():
        for st in replicas:
            assert not st["frozen"] and st["recovery"] == "normal", (shard, st)
    assert recovery_generations(cluster) == gens, "no recovery started"
    assert leader_lines(cluster) == leaders, "no leader changed"
    assert tracebacks(cluster) == []
    # the flood is in the logs as a few throttled lines, not one per frame
    fh_lines = sum(p.read_text(errors="replace").count("\n") for p in cluster.logs.glob("fh*.log"))
    assert fh_lines < 200, fh_lines


def test_a_plain_zookeeper_client_reads_but_cannot_rewrite_the_cluster(cluster: ziplog.LocalCluster) -> None:
    zk = discovery.connect(cluster.zk_hosts)
    try:
        assert layout.dec(zk.get(layout.MEMBERSHIP_PATH)[0])  # reading is open
        for attempt in (lambda: zk.set(layout.MEMBERSHIP_PATH, layout.enc([[0, [99]]])),
                        lambda: zk.set(f"{layout.SHARDS}/0", layout.enc({"replicas": 1})),
                        lambda: zk.create(f"{layout.SHARDS}/0/5", layout.enc({"addr": "tcp://127.0.0.1:1"})),
                        lambda: zk.create(f"{layout.SHARDS}/77", b""),
                        lambda: zk.delete(f"{layout.SHARDS}/0/1"),
                        lambda: zk.create(f"{layout.RECOVERY}/0", layout.enc({"gen": 2**40})),
                        lambda: zk.set(layout.EPOCH_PATH, b"")):
            with pytest.raises(NoAuthError):
                attempt()
    finally:
        discovery.stop(zk)


def test_a_process_without_the_cluster_key_does_not_start(tmp_path: Path) -> None:
    import subprocess
    import sys

    for module in ("ziplog.server", "mms.server", "failure_handler.server"):
        args = ["--shard", "0", "--replica", "0"] if module == "ziplog.server" else ["--id", "0"]
        out = subprocess.run([sys.executable, "-m", module, "--zk", "127.0.0.1:1", *args], capture_output=True,
                             text=True, timeout=60, env={k: v for k, v in __import__("os").environ.items()
                                                         if k != "ZIPLOG_CLUSTER_KEY_FILE"})
        assert out.returncode != 0 and "no cluster key" in out.stderr, (module, out.stderr)
