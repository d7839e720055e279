"""The log's bounded reads on real processes: the stable-prefix watermark (no record ever
appears at or below one returned, while writers insert), COUNT and RANGE per shard
(exact against a subscription, trimmed starts refused), and a subscription that stops
at an end. Plus the watermark rule itself, without I/O."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import pytest

import ziplog
from ziplog import RecordId, TrimmedError
from ziplog.client.aio import AsyncClient, run
from ziplog.cores.client.watermark import stable_watermark
from ziplog.protocol.gsna import epoch_base, epoch_end


def test_the_watermark_rule() -> None:
    history = [[0, [0, 1]], [5, [0, 1, 2]], [9, [1, 2]]]
    # shard 2 has not reached epoch 5: the watermark stops at the end of epoch 4
    assert stable_watermark(history, {0: epoch_base(6) + 3, 1: epoch_base(6) + 9, 2: 0}) == epoch_end(4)
    # every member past epoch 8, and shard 0 (not a member from 9 on) no longer counts
    stables = {0: epoch_end(8), 1: epoch_base(10) + 7, 2: epoch_base(10) + 5}
    assert stable_watermark(history, stables) == epoch_base(10) + 5
    assert stable_watermark(history, {0: 10, 1: 4}) == 4
    assert stable_watermark([], {0: 100}) == 0
    assert stable_watermark(history, {1: 4}, floor=50) == 50


def test_a_watermark_never_goes_back_when_a_replica_answers_less() -> None:
    """A restarted replica reports the stable point it persisted, below what its peer
    reported before: the client keeps the best answer per shard and its last watermark."""
    import random

    from ziplog.cores.client.state import ClientState
    from ziplog.cores.client.watermark import WatermarkQuery
    from ziplog.protocol import frames as wire

    client = ClientState(1, None, random.Random(1), 10**9)
    history = [[0, [0, 1]]]

    def ask(uptos: dict[int, int]) -> int | None:
        query = WatermarkQuery(history, client)
        for s in query.to_ask():
            query.got(s, wire.CountOk(req_id=1, count=0, nth_gsn=0, upto=uptos[s]))
        return query.on_history(history)

    assert ask({0: 500, 1: 700}) == 500
    assert ask({0: 300, 1: 800}) == 500  # shard 0 answered by a replica behind the one before
    assert ask({0: 900, 1: 600}) == 800  # shard 1 counts with its best answer (800), not 600
    client.watermark = 10**6  # a floor it returned: never less
    assert ask({0: 1, 1: 1}) == 10**6


@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=2, replicas=2) as c:
        yield c


class WatermarkWatch:
    """A writer thread inserting while the test takes watermarks: every insert is kept
    with the highest watermark returned before it began; :meth:`check` asserts none landed
    at or below it."""

    def __init__(self, cluster: ziplog.LocalCluster) -> None:
        self.cluster = cluster
        self.stop = threading.Event()
        self.inserted: list[tuple[RecordId, int]] = []
        self.mark = 0
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._write)

    def _write(self) -> None:
        try:
            with self.cluster.client() as c:
                while not self.stop.is_set():
                    before = self.mark
                    self.inserted.append((c.insert_after(b"w"), before))
        except BaseException as exc:
            self.errors.append(exc)

    def take(self, c: ziplog.Client) -> None:
        w = c.watermark()
        assert w >= self.mark, "the watermark went back"
        self.mark = w

    def __enter__(self) -> "WatermarkWatch":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()

    def check(self) -> None:
        assert not self.errors, self.errors
        for rid, mark in self.inserted:
            assert rid.gsn > mark, f"{rid} appeared at or below watermark {mark} returned before its insert"


def test_nothing_appears_at_or_below_a_returned_watermark(cluster: ziplog.LocalCluster) -> None:
    with WatermarkWatch(cluster) as watch, cluster.client() as c:
        for _ in range(60):
            watch.take(c)
    watch.check()
    assert len(watch.inserted) > 20


def test_count_and_range_agree_with_a_subscription(cluster: ziplog.LocalCluster) -> None:
    with cluster.client() as c:
        rids = [c.insert_after(b"x%d" % i) for i in range(300)]
        lo = min(r.gsn for r in rids)
        w = c.watermark()
        while w < max(r.gsn for r in rids):
            w = c.watermark()
        with c.subscribe(RecordId(lo, -1), end=w) as sub:
            everything = list(sub)
        assert sub.ended and sub.position >= w
        assert set(rids) <= {r.rid for r in everything}
        assert all(lo <= r.rid.gsn <= w for r in everything)
        for shard in (0, 1):
            mine = [r for r in everything if r.rid.shard == shard]
            got = list(c.read_range(shard, lo, w))
            assert [(r.rid, r.data) for r in got] == [(r.rid, r.data) for r in mine]
            count, nth, upto = c.count_range(shard, lo, w, nth=7)
            assert (count, upto) == (len(mine), w)
            assert nth == mine[6].rid.gsn
            # a sub-range: exact bounds, inclusive
            a, b = mine[10].rid.gsn, mine[20].rid.gsn
            assert [r.rid for r in c.read_range(shard, a, b)] == [r.rid for r in mine[10:21]]
            assert c.count_range(shard, a, b)[0] == 11


def test_async_ranges_and_trimmed_starts(cluster: ziplog.LocalCluster) -> None:
    async def main() -> None:
        async with AsyncClient(cluster.zk_hosts) as c:
            rids = [await c.insert_after(b"a%d" % i) for i in range(50)]
            w = await c.watermark()
            while w < max(r.gsn for r in rids):
                w = await c.watermark()
            lo = min(r.gsn for r in rids)
            got = [r async for r in c.read_range(0, lo, w)] + [r async for r in c.read_range(1, lo, w)]
            assert set(rids) <= {r.rid for r in got}
            async with c.subscribe(RecordId(lo, -1), end=w) as sub:
                assert sorted(r.rid for r in got) == [r.rid async for r in sub]
            await c.trim(RecordId(lo + 1, -1))
            with pytest.raises(TrimmedError):
                await c.count_range(rids[0].shard, lo, w)
    run(main())
    with cluster.client() as c, pytest.raises(TrimmedError):
        list(c.read_range(0, 1, c.watermark()))
    with cluster.client() as c, c.subscribe(RecordId(1, -1)) as sub:
        with pytest.raises(TrimmedError):
            sub.next(timeout=10)


def test_watermarks_stay_safe_across_shard_changes_and_a_recovery(cluster: ziplog.LocalCluster) -> None:
    """Last in the module (it adds and removes a shard): while a writer inserts, a shard
    joins, a primary is SIGKILLed (failure recovery) and the new shard leaves; every
    watermark returned is at least the one before, and no record lands at or below a
    watermark returned before its insert began."""
    with WatermarkWatch(cluster) as watch, cluster.client() as c:
        inserted = watch.inserted

        def watch_until(until: Any, what: str) -> None:
            """Take watermarks until ``until()`` holds (a condition on the writer's inserts)."""
            deadline = time.monotonic() + 90
            while not until():
                assert time.monotonic() < deadline and not watch.errors, f"waited too long for {what}: {watch.errors}"
                watch.take(c)

        def landed_on(shard: int, after: int) -> Any:
            return lambda: sum(1 for r, _ in inserted[after:] if r.shard == shard) >= 20

        watch_until(lambda: len(inserted) >= 50, "the first inserts")
        added = cluster.add_shard()
        watch_until(landed_on(added, 0), "inserts on the new shard")
        n, restarts = len(inserted), len(cluster.restarts)
        cluster.kill_replica(0, 0)  # failure recovery of shard 0; the supervisor restarts it
        back = landed_on(0, n)
        watch_until(lambda: len(cluster.restarts) > restarts and back(),
                    "shard 0 to take inserts again after its restart and recovery")
        cluster.remove_shard(added)
        n = len(inserted)
        watch_until(lambda: len(inserted) >= n + 100, "inserts after the removal")
    watch.check()
