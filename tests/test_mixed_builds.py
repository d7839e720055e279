"""A rolling upgrade runs servers of two builds side by side: what this build added to
EPOCH, EPOCH_SAME and NOTICE (the leader's stamp, ``hosted``) is sent only to servers
whose registration says they read it (``frames.READS``); without it the frames are those
of the build before, field for field, which a server of that build takes."""

from __future__ import annotations

from typing import Any

import msgpack

from tests.harness import links_over
from ziplog.protocol import frames as f
from ziplog.protocol.topology import TopologyView

#: how many fields (version and op included) each frame had in the build before
BEFORE = {f.EPOCH: 6, f.EPOCH_SAME: 5, f.NOTICE: 6}


def _fields(frame: bytes) -> list[Any]:
    msg = msgpack.unpackb(frame, raw=False)
    assert isinstance(msg, list)
    return msg


def test_without_the_new_fields_each_frame_is_as_long_as_the_build_before_made_it() -> None:
    enc = f.EpochEncoder(2)
    plain = [enc.encode(5, (0, 1), (100, 200)), enc.encode(6, (0, 1), (100, 200)), enc.encode_same(7, 5),
             f.encode_compact(f.Notice(shard=1, epoch=5, gsn=9, stamp=123))]
    for frame in plain:
        msg = _fields(frame)
        assert len(msg) <= BEFORE[msg[1]], msg
    stamped = [enc.encode(8, (0, 1), (100, 200), stamp=77), enc.encode_same(9, 8, stamp=77)]
    for frame in stamped:
        got = f.decode_epoch(frame)
        assert got.stamp == 77 and len(_fields(frame)) == BEFORE[got.op] + 1
    hosted = f.encode_compact(f.Notice(shard=1, epoch=5, gsn=9, stamp=123, hosted=True))
    assert len(_fields(hosted)) == BEFORE[f.NOTICE] + 1
    assert f.decode_member_request(hosted).hosted is True
    assert f.decode_epoch(plain[0]).stamp == 0 and f.decode_epoch(plain[2]).leader == 2


def _topology(reads: dict[tuple[int, int], int], pids: dict[tuple[int, int], int]) -> TopologyView:
    topo = TopologyView()
    topo.replicas = {s: {r: f"tcp://10.0.0.{1 + (s + r) % 2}:{5000 + 10 * s + r}" for r in range(2)} for s in range(3)}
    topo.replica_counts = {s: 2 for s in range(3)}
    topo.replica_reads = {s: {r: reads.get((s, r), f.READS) for r in range(2)} for s in range(3)}
    topo.replica_pids = {s: {r: pids[(s, r)] for r in range(2) if (s, r) in pids} for s in range(3)}
    topo.changed()
    return topo


def test_the_leader_stamps_epochs_once_every_replica_reads_the_stamp() -> None:
    topo = _topology({}, {})
    assert topo.every_replica_reads() == f.READS
    topo.replica_reads = {**topo.replica_reads, 2: {0: f.READS, 1: 0}}  # one replica of the build before
    topo.changed()
    assert topo.every_replica_reads() == 0


def test_a_notice_goes_once_per_process_only_where_every_replica_told_reads_hosted() -> None:
    # two processes (hosts 10.0.0.1 and .2, one pid each) serve shards 1 and 2
    pids = {(s, r): 100 + (s + r) % 2 for s in range(3) for r in range(2)}
    peers, hosted = links_over(_topology({}, pids))[0].notice_endpoints([1, 2])
    assert hosted and len(peers) == 2, peers
    peers, hosted = links_over(_topology({(2, 1): 0}, pids))[0].notice_endpoints([1, 2])
    assert not hosted and len(peers) == 4, "a replica of the build before: one each, not hosted"
    no_pid = {k: v for k, v in pids.items() if k != (1, 0)}
    peers, hosted = links_over(_topology({}, no_pid))[0].notice_endpoints([1, 2])
    assert not hosted and len(peers) == 4


def test_a_cluster_of_this_build_gets_stamped_epochs() -> None:
    """Every replica of a local cluster registers what it reads, so the leader stamps
    its broadcasts (the fast path under load depends on it: README, "An epoch at the
    same place on both replicas")."""
    import zmq

    import ziplog
    with ziplog.local_cluster(shards=1, replicas=2) as cluster, cluster.client() as c:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            for pub in c.topology.mms_pubs():
                sub.connect(pub)
            heard: list[Any] = []
            while len(heard) < 3:
                assert sub.poll(10_000), "no epoch broadcast"
                heard.append(f.decode_epoch(sub.recv()))
            assert all(e.stamp > 0 for e in heard), heard
        finally:
            sub.close(linger=0)
            ctx.term()


# -- incarnations (frames.READS_FENCE) ------------------------------------------------------------
#: how many fields HELLO, FORWARD, PREFIX and ACK had in the builds before incarnations
BEFORE_FENCE = {f.HELLO: 6, f.FORWARD: 4, f.PREFIX: 4, f.ACK: 8}


def test_a_backup_sends_a_primary_of_the_build_before_the_frames_it_knows() -> None:
    from ziplog.server.fences import to_primary

    hello = f.Hello(shard=0, replica=1, frontier=5, guessed_top=9, to_inc=11, inc=22)
    prefix = f.Prefix(replica=1, frontier=5, to_inc=11)
    for msg in (hello, prefix):
        old = _fields(to_primary(msg, fences=False))
        assert len(old) == BEFORE_FENCE[old[1]], old
        assert len(_fields(to_primary(msg, fences=True))) == BEFORE_FENCE[old[1]] + (2 if msg is hello else 1)


def test_a_forward_to_a_backup_that_named_no_incarnation_is_the_frame_of_the_build_before() -> None:
    from ziplog.server.fences import to_backup

    body = f.ForwardBody(0, -1, [])
    assert len(_fields(to_backup(f.Forward(stable=0, body=body)))) == BEFORE_FENCE[f.FORWARD]
    fenced = f.decode_from_primary(to_backup(f.Forward(stable=0, body=body, to_inc=3, inc=4)))
    assert isinstance(fenced, f.Forward) and (fenced.to_inc, fenced.inc) == (3, 4)
    # an ACK of the build before decodes, naming no incarnation
    old_ack = f.encode([1, f.ACK, 7, 5, 0, 4, True, False])
    ack = f.decode_reply(old_ack)
    assert isinstance(ack, f.Ack) and ack.inc == 0


def test_an_unfenced_hello_is_taken_only_from_a_backup_of_the_build_before() -> None:
    """A primary of this build takes a HELLO that names no incarnation as meant for it only
    from a backup whose registration reads below READS_FENCE (it cannot name one); from a
    backup of this build (which names it to every primary that reads it), or one the view
    does not show, it stays unfenced and the core refuses it."""
    from ziplog.server.fences import MemberGate

    class Coord:
        def __init__(self, topology: TopologyView) -> None:
            self.topology = topology

    hello = f.Hello(shard=0, replica=1, frontier=5, guessed_top=0)
    # (its registration's reads: None, it says none; "gone": ZooKeeper shows no backup 1)
    for reads, taken in ((1, True), (None, True), (f.READS_FENCE, False), ("gone", False)):
        topo = TopologyView()
        if reads != "gone":
            topo.replicas = {0: {0: "tcp://10.0.0.1:1", 1: "tcp://10.0.0.2:1"}}
        if type(reads) is int:
            topo.replica_reads = {0: {1: reads}}
        topo.changed()
        got = MemberGate(0, 42, Coord(topo)).admit(hello)  # type: ignore[arg-type]
        assert isinstance(got, f.Hello) and got.to_inc == (42 if taken else 0), (reads, got)
