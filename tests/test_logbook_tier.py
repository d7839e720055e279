"""LogBook with the index tier on real processes (a local cluster, 2 shards x 2 replicas;
a feeder, 2 index nodes and an aggregator): engines with a small cache that ask the
tier, through the aggregator and asking the nodes themselves. Every answer equals a full
genesis subscription at the cut it was served at, across a kill -9 of an index node,
of the feeder and of a log replica, and a node added; a read waits for a stopped index
node rather than go back; a node drops what a trim hides; a node takes a Feed only
sealed by a member and serves on after bad frames."""

from __future__ import annotations

import os
import random
import signal
import threading
from typing import Any, Iterator

import pytest

import ziplog
from tests.logbook_oracle import check_served, random_ops
from ziplog.io.zmq_runtime import round_trip
from ziplog.logbook import LogBook, local_logbook
from ziplog.logbook.client import Engine
from ziplog.logbook.core import frames as tf
from ziplog.logbook.core.session import MAX_SEQNUM

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=2, replicas=2) as c:
        yield c


@pytest.fixture(scope="module")
def tier(cluster: ziplog.LocalCluster) -> Iterator[Any]:
    with local_logbook(cluster, index_nodes=2) as t:
        yield t


def _wait_fed(tier: Any, gsn: int) -> None:
    """Until every index node running now says it is fed up to ``gsn``."""
    tier.wait_ready(TIMEOUT, at_least=gsn)


def test_read_your_writes_on_another_engine_and_a_read_waits_for_a_stopped_node(tier: Any) -> None:
    with LogBook(tier.zk_hosts, 1, index="tier") as a, LogBook(tier.zk_hosts, 1, index="tier") as b:
        assert a._engine.mode == "tier"
        s = a.append(b"x", tags=["t"])
        b.observe(a.position)  # handed a's position, as a child on another engine is
        got = b.read_next(s, tag="t")
        assert got is not None and got.seqnum == s
        # node 1 stopped: a read that needs the tier at a cut past what node 1 has waits
        pid = tier.node_pid(1)
        os.kill(pid, signal.SIGSTOP)
        try:
            s2 = a.append(b"y", tags=["t"])
            _wait_node(tier, 0, s2)  # the rest of the tier is past the append
            result: list[Any] = []
            fresh = Engine(tier.zk_hosts, TIMEOUT, index="tier")  # its cache starts past both records
            try:
                c = LogBook("", 1, _engine=fresh)
                c.observe(s2)
                reader = threading.Thread(target=lambda: result.append(c.read_next(0, tag="t")))
                reader.start()
                _wait_until(lambda: fresh.tier is not None and fresh.tier.ask.core.pending == 1)
                assert reader.is_alive() and not result  # waiting for node 1, not answering below s2
            finally:
                os.kill(pid, signal.SIGCONT)
            reader.join(TIMEOUT)
            assert not reader.is_alive() and result[0] is not None and result[0].seqnum == s
            assert c.position >= s2
            assert c.read_prev(MAX_SEQNUM, tag="t").seqnum == s2  # type: ignore[union-attr]
            fresh.close()
        finally:
            os.kill(pid, signal.SIGCONT)


def _wait_node(tier: Any, i: int, gsn: int) -> None:
    _wait_until(lambda: (tier.node_state(i) or (0,))[0] >= gsn)


def _wait_until(ok: Any, timeout: float = TIMEOUT) -> None:
    done = threading.Event()
    deadline = threading.Event()
    timer = threading.Timer(timeout, deadline.set)
    timer.start()
    try:
        while not ok():
            if deadline.wait(0.02):
                raise AssertionError("not reached in time")
        done.set()
    finally:
        timer.cancel()


def test_auto_asks_a_few_nodes_itself_and_many_through_the_aggregator(tier: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from ziplog.logbook import client
    assert client.choose_mode("auto", tier.zk_hosts, TIMEOUT) == "nodes"  # the tier wants 2 nodes
    with LogBook(tier.zk_hosts, 1) as lb:
        assert lb._engine.mode == "nodes"
        s = lb.append(b"auto", tags=["auto"])
        got = lb.read_next(0, tag="auto")
        assert got is not None and got.seqnum == s
    monkeypatch.setattr(client, "DIRECT_NODES_MAX", 1)
    assert client.choose_mode("auto", tier.zk_hosts, TIMEOUT) == "tier"
    assert client.choose_mode("local", tier.zk_hosts, TIMEOUT) == "local"


@pytest.mark.parametrize("index", ["tier", "nodes"])
def test_a_tier_read_comes_with_its_record_unless_it_is_big(tier: Any, index: str) -> None:
    big = bytes(range(256)) * (tf.RECORD_IN_ANSWER_MAX // 256 + 1)  # over what a node keeps
    with LogBook(tier.zk_hosts, 11, index=index) as writer:
        small_s = writer.append(b"small", tags=[f"small-{index}"])
        big_s = writer.append(big, tags=[f"big-{index}"])
        _wait_fed(tier, writer.position)
    engine = Engine(tier.zk_hosts, TIMEOUT, index=index)  # its cache starts past both: it asks the tier
    reads: list[Any] = []
    read_record = engine.client.read_record

    def counted(rid: Any) -> bytes:
        reads.append(rid)
        return read_record(rid)

    engine.client.read_record = counted  # type: ignore[method-assign]
    try:
        lb = LogBook("", 11, _engine=engine)
        got = lb.read_next(0, tag=f"small-{index}")
        assert got is not None and (got.seqnum, got.data) == (small_s, b"small")
        assert reads == []  # one round: the node answered with the record
        got = lb.read_next(0, tag=f"big-{index}")
        assert got is not None and (got.seqnum, got.data) == (big_s, big)
        assert [rid.gsn for rid in reads] == [big_s]  # not kept at the node: read from the log
        engine.records_with_lookups = False
        got = lb.read_prev(MAX_SEQNUM, tag=f"small-{index}")
        assert got is not None and (got.seqnum, got.data) == (small_s, b"small")
        assert [rid.gsn for rid in reads] == [big_s, small_s]
        assert sum((tier.node_state(i) or (0, 0, 0, 0))[3] for i in range(2)) >= 1
    finally:
        engine.close()


def test_a_node_drops_what_a_trim_hides(tier: Any) -> None:
    with LogBook(tier.zk_hosts, 7, index="tier") as lb:
        seqnums = [lb.append(b"r", tags=[i % 3]) for i in range(120)]
        _wait_fed(tier, lb.position)
        before = [tier.node_state(i)[2] for i in range(2)]
        lb.trim(seqnums[-1])
        _wait_fed(tier, lb.position)
        after = [tier.node_state(i)[2] for i in range(2)]
        # 119 entries, each in its tag's row and the book's: at least 200 seqnums gone
        assert sum(before) - sum(after) >= 200, (before, after)
        first = lb.read_next(0)
        assert first is not None and first.seqnum == seqnums[-1]
        assert lb.read_prev(seqnums[-2]) is None
        # a replay's read (gapless) hears, through the aggregator, what the trim took of
        # its tag from either node, though the entries themselves are gone
        for tag in range(3):
            taken = max(s for i, s in enumerate(seqnums[:-1]) if i % 3 == tag)
            with pytest.raises(ziplog.TrimmedError, match=str(taken)):
                lb.read_next(0, tag=tag, gapless=True)
            with pytest.raises(ziplog.TrimmedError):
                lb.read_next(taken, tag=tag, gapless=True)
            got = lb.read_next(taken + 1, tag=tag, gapless=True)  # from past what it took: no gap
            assert got == lb.read_next(taken + 1, tag=tag)


def test_a_node_takes_a_feed_only_sealed_by_a_member_and_serves_on_after_junk(tier: Any) -> None:
    state = tier.node_state(0)
    addr = tier._registered("/ziplog/logbook/tier/nodes")[tier.node_pid(0)]
    feed = tf.encode(tf.Feed(gen=0, from_gsn=0, watermark=(1 << 63), history=[(0, 2)], entries=[], trims=[]))
    for frame, code in ((feed, tf.UNAUTHENTICATED), (tf.encode(tf.Signed(frame=feed, mac=b"\0" * 32)), tf.UNAUTHENTICATED),
                        (b"\x93\x01\x91\x01\x05", tf.UNAUTHENTICATED),  # a Feed's kind: authority first
                        (b"\x93\x03\x91\x01\x05", tf.BAD_REQUEST), (b"", tf.BAD_REQUEST)):
        got = round_trip(addr, frame, int(TIMEOUT * 1e9), tf.ANSWER_LIMIT)
        assert got is not None
        ans = tf.decode_answer(got)
        assert type(ans) is tf.Failed and ans.code == code, ans
    after = tier.node_state(0)
    assert after is not None and after[0] < (1 << 63) and after[0] >= state[0]


def test_every_answer_through_the_tier_equals_a_replay_across_kills(cluster: ziplog.LocalCluster, tier: Any) -> None:
    """Random appends, trims and reads from sessions on three engines with small caches
    (two asking the aggregator, one asking the nodes), while an index node, the feeder
    and a log replica are killed -9 and started again and a node is added; afterwards a
    genesis subscription replays the log, and each answer must be what the log up to its
    cut says. (Last in the module: it adds a node.)"""
    rng = random.Random(21)
    books, tags = [10, 11], [1, 2, 3]
    engines = [Engine(tier.zk_hosts, TIMEOUT, index=mode, cache_entries=16) for mode in ("tier", "tier", "nodes")]
    faults = {60: lambda: tier.restart_index_node(1), 120: tier.restart_feeder,
              180: lambda: cluster.kill_replica(0, 1), 200: lambda: cluster.restart_replica(0, 1),
              240: tier.add_index_node}
    try:
        sessions = [LogBook("", b, _engine=e) for e in engines for b in books]
        served = random_ops(rng, sessions, 360, tags, recent=30, from_zero=0.2, faults=faults)
        end = max(lb.position for lb in sessions)
        asked_tier = sum(e.cache.misses for e in engines if e.cache is not None)
        from_cache = sum(e.cache.hits for e in engines if e.cache is not None)
    finally:
        for e in engines:
            e.close()
    found = check_served(tier.zk_hosts, served, end)
    assert found > 50, "too few reads found a record: the check is vacuous"
    assert asked_tier > 50 and from_cache > 20, (asked_tier, from_cache)  # both paths were taken
    assert tier.node_state(2) is not None  # the added node serves


def test_the_asyncio_twin_asks_the_tier_too(tier: Any) -> None:
    import asyncio

    import ziplog.aio
    from ziplog.logbook.aio import AsyncLogBook

    with LogBook(tier.zk_hosts, 30, index="local") as writer:
        old = [writer.append(b"%d" % i, tags=[i % 2]) for i in range(10)]
        position = writer.position

    async def main() -> None:
        for mode in ("tier", "nodes"):
            async with AsyncLogBook(tier.zk_hosts, 30, index=mode) as lb:
                lb.observe(position)
                # records below the engine's start: only the tier knows them
                got = await asyncio.gather(lb.read_next(0, tag=0), lb.child().read_next(0, tag=1))
                assert [g.seqnum for g in got if g is not None] == [old[0], old[1]]
                assert lb._engine.cache is not None and lb._engine.cache.misses >= 2
                s = await lb.append(b"new", tags=[0])
                tail = await lb.check_tail(tag=0)
                assert tail is not None and tail.seqnum == s

    ziplog.aio.run(main())
