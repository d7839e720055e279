"""``insert_many`` in both clients on real processes: every record once, each with a gsn
above the rid given, ids in the order of the records; across a SIGKILL of a primary in
the middle of a batch, every acknowledged record is in the log exactly once."""

from __future__ import annotations

import threading
from typing import Iterator

import pytest

import ziplog
import ziplog.aio


@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=2, replicas=2) as c:
        yield c


def _log_payloads(cluster: ziplog.LocalCluster, end: int) -> list[bytes]:
    with ziplog.Client(cluster.zk_hosts) as c, c.subscribe(ziplog.RID_GENESIS, end=end) as sub:
        return [rec.data for rec in sub]


def test_both_clients_insert_many_exactly_once_in_the_order_given(cluster: ziplog.LocalCluster) -> None:
    with ziplog.Client(cluster.zk_hosts) as c:
        first = c.insert_after(b"before")
        blocking = [b"b-%05d" % i for i in range(1000)]
        rids = c.insert_many(blocking, first, window=64)
        assert len(rids) == len(blocking) and all(r.gsn > first.gsn for r in rids)
        assert [c.read_record(rids[i]) for i in (0, 500, 999)] == [blocking[0], blocking[500], blocking[999]]
        with pytest.raises(TypeError):
            c.insert_many([b"ok", "not bytes"])  # type: ignore[list-item]

    async def main() -> list[ziplog.RecordId]:
        async with ziplog.AsyncClient(cluster.zk_hosts) as ac:
            got = await ac.insert_many([b"a-%05d" % i for i in range(1000)], window=100)
            assert await ac.read_record(got[10]) == b"a-00010"
            return got

    arids = ziplog.aio.run(main())
    end = max(r.gsn for r in [*rids, *arids])
    seen = [p for p in _log_payloads(cluster, end) if p[:2] in (b"b-", b"a-")]
    assert sorted(seen) == sorted([*blocking, *(b"a-%05d" % i for i in range(1000))])  # each once


def test_insert_many_across_a_primary_killed_mid_batch(cluster: ziplog.LocalCluster) -> None:
    records = [b"k-%05d" % i for i in range(3000)]
    result: list[object] = []
    started = threading.Event()

    def write() -> None:
        with ziplog.Client(cluster.zk_hosts) as c:
            started.set()
            try:
                result.append(c.insert_many(records, window=32))
            except ziplog.ZiplogError as exc:  # the batch may fail as a whole; what was acked stays once
                result.append(exc)

    t = threading.Thread(target=write)
    t.start()
    started.wait(60)
    with ziplog.Client(cluster.zk_hosts) as watcher:
        # once some of the batch is in the log, kill shard 0's primary
        with watcher.subscribe(ziplog.RID_GENESIS) as sub:
            n = 0
            while n < 500:
                rec = sub.next(60)
                assert rec is not None, "the batch did not start"
                n += rec.data.startswith(b"k-")
        cluster.kill_replica(0, 0)
        t.join(180)
        assert not t.is_alive()
        cluster.restart_replica(0, 0)
        # every acknowledged record is at or below its own gsn: read the log that far
        end = max(r.gsn for r in result[0]) if isinstance(result[0], list) else watcher.watermark()
    seen = [p for p in _log_payloads(cluster, end) if p.startswith(b"k-")]
    assert len(seen) == len(set(seen)), "a record of the batch is in the log twice"
    if isinstance(result[0], list):
        assert sorted(seen) == sorted(records)  # every one acknowledged, every one there once
