"""LogBook on real processes (a local cluster, 2 shards x 2 replicas): Boki's API with
engines that keep a complete local index. Every answer a session got equals the answer
a full genesis subscription gives at the cut it was served at, cuts never go below the
session's position, appends are read at once (read-your-writes, also from a child on
another engine), tags, trims and aux data."""

from __future__ import annotations

import asyncio
import random
from typing import Iterator

import pytest

import ziplog
import ziplog.aio
from tests.logbook_oracle import check_served, random_ops
from ziplog.logbook import LogBook
from ziplog.logbook.core import records as r


@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=2, replicas=2) as c:
        yield c


def test_append_then_read_at_once_with_tags_trim_and_aux(cluster: ziplog.LocalCluster) -> None:
    with LogBook(cluster.zk_hosts, 1) as lb:
        a = lb.append(b"a", tags=[5])
        b = lb.append(b"b", tags=[5, "user:42"])
        c = lb.append(b"c")
        assert a < b < c and lb.position >= c
        got = lb.read_next(0, tag=5)
        assert got is not None and (got.seqnum, got.data, got.tags) == (a, b"a", (5,))
        named = lb.read_next(0, tag="user:42")
        assert named is not None and named.seqnum == b and named.names == {r.tag_of("user:42"): "user:42"}
        tail = lb.check_tail()
        assert tail is not None and tail.seqnum == c
        prev = lb.read_prev(c - 1, tag=5)
        assert prev is not None and prev.seqnum == b
        assert lb.read_next(c + 1) is None and lb.read_prev(a - 1) is None
        lb.set_aux_data(b, b"view")
        again = lb.read_prev(b)
        assert again is not None and again.aux_data == b"view"
        lb.trim(b)  # a is gone, b and c stay
        first = lb.read_next(0)
        assert first is not None and first.seqnum == b
        # another book sees none of it
        other = LogBook("", 2, _engine=lb._engine, _position=lb.position)
        assert other.check_tail() is None


@pytest.mark.parametrize("record_bytes", [1 << 20, 0])
def test_an_engine_answers_with_the_records_its_subscription_delivered(cluster: ziplog.LocalCluster,
                                                                        record_bytes: int) -> None:
    from ziplog.logbook.client import Engine
    engine = Engine(cluster.zk_hosts, record_bytes=record_bytes)
    reads: list[object] = []
    read_record = engine.client.read_record

    def counted(rid: object) -> bytes:
        reads.append(rid)
        return read_record(rid)  # type: ignore[arg-type]

    engine.client.read_record = counted  # type: ignore[method-assign]
    try:
        lb = LogBook("", 9, _engine=engine)
        s = [lb.append(bytes([i]) * 100, tags=["kept"]) for i in range(3)]
        got = [lb.read_next(s[i], tag="kept") for i in range(3)] + [lb.read_prev(s[1])]
        assert [(g.seqnum, g.data) for g in got if g is not None] == [
            (s[0], bytes([0]) * 100), (s[1], bytes([1]) * 100), (s[2], bytes([2]) * 100), (s[1], bytes([1]) * 100)]
        # kept: nothing read from the log; not kept: each read ends with a read_record
        assert len(reads) == (0 if record_bytes else 4)
    finally:
        engine.close()


def test_a_child_on_another_engine_reads_its_parents_append_at_once(cluster: ziplog.LocalCluster) -> None:
    with LogBook(cluster.zk_hosts, 3) as parent, LogBook(cluster.zk_hosts, 3) as elsewhere:
        s = parent.append(b"x", tags=[1])
        # a session elsewhere handed the parent's position (as Boki hands a child its
        # parent's) reads the append at once: its engine's index waits until it reached it
        child = LogBook("", 3, _engine=elsewhere._engine, _position=parent.position)
        got = child.read_next(s, tag=1)
        assert got is not None and got.seqnum == s
        assert parent.child().position == parent.position


def test_every_answer_equals_a_full_replay_at_its_cut(cluster: ziplog.LocalCluster) -> None:
    """Random appends, trims and reads from sessions on two engines; afterwards a genesis
    subscription replays the log, and each answer must be what the log up to the cut it
    was served at says."""
    rng = random.Random(20)
    books, tags = [10, 11], [1, 2, 3]
    engines = [LogBook(cluster.zk_hosts, books[0]), LogBook(cluster.zk_hosts, books[0])]
    try:
        sessions = [LogBook("", b, _engine=e._engine) for e in engines for b in books]
        served = random_ops(rng, sessions, 300, tags)
        end = max(lb.position for lb in sessions)
    finally:
        for e in engines:
            e.close()
    reads_with_answers = check_served(cluster.zk_hosts, served, end)
    assert reads_with_answers > 50, "too few reads found a record: the check is vacuous"


def test_a_subscription_catches_up_to_a_position_without_waiting_for_a_record(cluster: ziplog.LocalCluster) -> None:
    """What an engine's index feed rests on: ``next_until`` returns what is there, then
    None as soon as the position reached the target (an idle log has no record to wait for)."""
    with ziplog.Client(cluster.zk_hosts) as c:
        rid = c.insert_after(b"marker")
        with c.subscribe(ziplog.RID_GENESIS) as sub:
            seen = []
            while (rec := sub.next_until(rid.gsn, 30)) is not None:
                seen.append(rec.rid)
            assert rid in seen and sub.position >= rid.gsn

    async def main() -> None:
        async with ziplog.AsyncClient(cluster.zk_hosts) as ac:
            async with ac.subscribe(ziplog.RID_GENESIS) as sub:
                got = []
                while (rec := await sub.next_until(rid.gsn, 30)) is not None:
                    got.append(rec.rid)
                assert rid in got and sub.position >= rid.gsn

    ziplog.aio.run(main())


def test_the_asyncio_twin_answers_as_the_blocking_one(cluster: ziplog.LocalCluster) -> None:
    from ziplog.logbook.aio import AsyncLogBook

    async def main() -> tuple[list[int], int]:
        async with AsyncLogBook(cluster.zk_hosts, 40) as lb:
            kids = [lb.child() for _ in range(4)]
            # concurrent tasks on one engine, each appending and reading its own tag
            async def work(i: int, kid: AsyncLogBook) -> int:
                s = await kid.append(b"%d" % i, tags=[i])
                rec = await kid.read_next(0, tag=i)
                assert rec is not None and rec.seqnum == s and rec.data == b"%d" % i
                return s
            seqnums = list(await asyncio.gather(*(work(i, k) for i, k in enumerate(kids))))
            await lb.set_aux_data(seqnums[0], b"aux")
            again = await lb.read_next(seqnums[0], tag=0)
            assert again is not None and again.aux_data == b"aux"
            await lb.trim(max(seqnums))
            first = await lb.read_next(0)
            assert first is not None and first.seqnum == max(seqnums)
            tail = await lb.check_tail()
            assert tail is not None and tail.seqnum == max(seqnums)
            return seqnums, max(k.position for k in [lb, *kids])

    seqnums, position = ziplog.aio.run(main())
    # a blocking session handed that position sees the same book
    with LogBook(cluster.zk_hosts, 40) as lb:
        child = LogBook("", 40, _engine=lb._engine, _position=position)
        tail = child.check_tail()
        assert tail is not None and tail.seqnum == max(seqnums) and child.read_next(0) == tail


def test_the_command_line_appends_and_reads_a_book(cluster: ziplog.LocalCluster) -> None:
    import subprocess
    import sys

    def book(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ziplog.tools.cli", "book", *args, "--zk", cluster.zk_hosts],
                              capture_output=True, text=True, timeout=120)

    a = book("append", "50", "first", "--tag", "7", "--tag", "user:1")
    assert a.returncode == 0, a.stderr
    b = book("append", "50", "second", "--tag", "7")
    assert b.returncode == 0, b.stderr
    s1, s2 = int(a.stdout), int(b.stdout)
    assert s1 < s2
    nxt = book("read-next", "50", "0", "--tag", "user:1")
    assert nxt.returncode == 0 and nxt.stdout.split("\t") == [str(s1), "7,user:1", "first\n"], nxt
    prev = book("read-prev", "50", str(s2), "--tag", "7")
    assert prev.returncode == 0 and prev.stdout.startswith(f"{s2}\t"), prev
    tail = book("tail", "50")
    assert tail.returncode == 0 and tail.stdout.endswith("second\n"), tail
    none = book("read-next", "50", str(s2 + 1))
    assert none.returncode == 1 and "no record" in none.stderr
