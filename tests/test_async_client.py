"""``ziplog.AsyncClient`` end to end on a real local cluster (ZooKeeper x3, MMS, 2 shards x 2
replicas). Coroutines run through ``ziplog.aio.run`` (uvloop when installed); no
pytest-asyncio. The tests share one cluster and pass in any order; the trim test runs
on a cluster of its own."""

from __future__ import annotations

import asyncio
import random
from typing import Any, Awaitable, Callable, Iterator

import pytest

import ziplog
import ziplog.aio
from ziplog import RID_GENESIS, RID_RECENT, AsyncClient, Policy, RecordId

WAIT_S = 60.0  # bound on every wait, so a stuck test fails instead of hanging


@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=2, replicas=2) as c:
        yield c


@pytest.fixture(scope="module")
def written() -> dict[RecordId, bytes]:
    """Every record the tests of this module inserted (only this module uses the cluster)."""
    return {}


def run(fn: Callable[[AsyncClient], Awaitable[Any]], cluster: ziplog.LocalCluster) -> Any:
    async def main() -> Any:
        async with AsyncClient(cluster.zk_hosts) as c:
            return await fn(c)
    return ziplog.aio.run(main())


async def insert_chains(c: AsyncClient, written: dict[RecordId, bytes], tasks: int, per_task: int,
                        tag: str) -> dict[RecordId, tuple[bytes, RecordId]]:
    """``tasks`` tasks of one client, each an InsertAfter chain of ``per_task`` records that
    sometimes hangs off another task's record."""
    out: dict[RecordId, tuple[bytes, RecordId]] = {}
    pool: list[RecordId] = []

    async def chain(t: int) -> None:
        rng = random.Random(f"{tag}-{t}")
        after = RID_GENESIS
        for i in range(per_task):
            if pool and rng.random() < 0.2:
                after = rng.choice(pool)
            data = f"{tag}-{t}-{i}".encode() * rng.randint(1, 20)
            rid = await c.insert_after(data, after)
            assert rid.gsn > after.gsn
            out[rid] = (data, after)
            written[rid] = data
            pool.append(rid)
            after = rid

    await asyncio.wait_for(asyncio.gather(*(chain(t) for t in range(tasks))), WAIT_S)
    return out


def test_run_prefers_uvloop_and_lazy_export() -> None:
    uvloop = pytest.importorskip("uvloop")

    async def loop_type() -> type:
        return type(asyncio.get_running_loop())

    assert issubclass(ziplog.aio.run(loop_type()), uvloop.Loop)
    assert ziplog.AsyncClient is ziplog.aio.AsyncClient


def test_concurrent_insert_chains(cluster: ziplog.LocalCluster, written: dict[RecordId, bytes]) -> None:
    async def body(c: AsyncClient) -> None:
        got = await insert_chains(c, written, tasks=20, per_task=10, tag="chains")
        assert len(got) == 200
        assert len({rid.gsn for rid in got}) == 200, "two records share a gsn"
        assert all(rid.gsn > after.gsn for rid, (_, after) in got.items())
        assert {rid.shard for rid in got} == {0, 1}, "the random policy spreads over both shards"
        assert c.stats["fast_path"] + c.stats["slow_path"] == 200
        assert c.stats["redirects"] == 0

    run(body, cluster)


def test_subscription_delivers_exactly_the_log_in_order(cluster: ziplog.LocalCluster,
                                                        written: dict[RecordId, bytes]) -> None:
    async def body(c: AsyncClient) -> None:
        got: list[ziplog.Record] = []
        seen: set[RecordId] = set()
        expected: set[RecordId] | None = None
        all_seen = asyncio.Event()
        sub = c.subscribe(RID_GENESIS)

        async def consume() -> None:
            async for rec in sub:  # ends when the subscription is closed
                got.append(rec)
                seen.add(rec.rid)
                if expected is not None and expected <= seen:
                    all_seen.set()

        consumer = asyncio.create_task(consume())
        # Records written before the subscription (earlier tests) and while it runs.
        await insert_chains(c, written, tasks=10, per_task=10, tag="live")
        expected = set(written)
        if expected <= seen:
            all_seen.set()
        await asyncio.wait_for(all_seen.wait(), WAIT_S)
        await sub.aclose()
        await asyncio.wait_for(consumer, WAIT_S)  # the iteration ended by itself on close
        assert consumer.result() is None

        gsns = [r.rid.gsn for r in got]
        assert gsns == sorted(set(gsns)), "gsns strictly increasing"
        assert {(r.rid.gsn, r.data) for r in got} == {(rid.gsn, d) for rid, d in written.items()}
        assert {r.rid for r in got} == set(written), "records come with the shard that stores them"

    run(body, cluster)


def test_read_record_round_trip(cluster: ziplog.LocalCluster, written: dict[RecordId, bytes]) -> None:
    async def body(c: AsyncClient) -> None:
        fresh = await c.insert_after(b"read me right away")
        written[fresh] = b"read me right away"
        assert await c.read_record(fresh) == b"read me right away"  # possibly not stable yet
        await insert_chains(c, written, tasks=5, per_task=10, tag="reads")  # 50 at least, whatever ran before
        sample = random.Random(7).sample(sorted(written), 50)
        for _ in range(2):  # the second round knows the stable watermarks: one replica each
            datas = await asyncio.wait_for(asyncio.gather(*(c.read_record(r) for r in sample)), WAIT_S)
            assert datas == [written[r] for r in sample]
        with pytest.raises(ziplog.NotFoundError):
            await c.read_record(RecordId(fresh.gsn, 1 - fresh.shard))  # the other shard's gsn
        with pytest.raises(ziplog.UnknownRecordError):
            await c.read_record(RecordId(5, 7))  # no such shard
        with pytest.raises(ziplog.RecordTooLargeError):
            await c.insert_after(b"x" * ((1 << 20) + 1))

    run(body, cluster)


def test_policies_and_status(cluster: ziplog.LocalCluster, written: dict[RecordId, bytes]) -> None:
    async def body(c: AsyncClient) -> None:
        c.set_policy(Policy.fixed(1))
        rids = await asyncio.gather(*(c.insert_after(b"fixed") for _ in range(10)))
        assert {r.shard for r in rids} == {1}
        c.set_policy(Policy.by_key())
        rids += await asyncio.gather(*(c.insert_after(b"keyed", key=b"user-42") for _ in range(10)))
        assert len({r.shard for r in rids[10:]}) == 1
        written.update({r: (b"fixed" if i < 10 else b"keyed") for i, r in enumerate(rids)})
        c.set_policy(Policy.fixed(99))
        with pytest.raises(ziplog.NoShardAvailableError):
            await c.insert_after(b"nowhere")
        with pytest.raises(TypeError):
            c.set_policy("random")  # type: ignore[arg-type]
        st = await c.status(wait=60)
        assert sorted(st) == [0, 1]
        for shard, reps in st.items():
            assert [r["replica"] for r in reps] == [0, 1]
            assert all(r["answer"] == "ok" for r in reps)
            assert all(r["shard"] == shard for r in reps)

    run(body, cluster)


def test_subscribe_recent(cluster: ziplog.LocalCluster, written: dict[RecordId, bytes]) -> None:
    async def body(c: AsyncClient) -> None:
        async with c.subscribe(RID_RECENT) as sub:
            later = await c.insert_after(b"after-recent")
            written[later] = b"after-recent"
            got: list[ziplog.Record] = []
            while not got or got[-1].rid != later:
                rec = await sub.next(timeout=WAIT_S)
                assert rec is not None, "subscription stalled"
                got.append(rec)
            assert got[-1].data == b"after-recent"
            assert all(a.rid.gsn < b.rid.gsn for a, b in zip(got, got[1:]))

    run(body, cluster)


def test_plain_asyncio_loop(cluster: ziplog.LocalCluster, written: dict[RecordId, bytes]) -> None:
    """The same client on the default event loop (asyncio.run), subscribing with ``await``."""
    async def main() -> None:
        c = await AsyncClient.connect(cluster.zk_hosts)
        try:
            sub = await c.subscribe(RID_GENESIS)
            rids = await insert_chains(c, written, tasks=5, per_task=4, tag="plain")
            assert [await c.read_record(r) for r in rids] == [d for d, _ in rids.values()]
            missing = set(rids)
            while missing:
                rec = await sub.next(timeout=WAIT_S)
                assert rec is not None, "subscription stalled"
                missing.discard(rec.rid)
            await sub.aclose()
        finally:
            await c.close()

    asyncio.run(main())


def test_close_leaves_no_task_pending(cluster: ziplog.LocalCluster, written: dict[RecordId, bytes]) -> None:
    async def main() -> None:
        me = asyncio.current_task()
        c = await AsyncClient.connect(cluster.zk_hosts)
        sub = c.subscribe(RID_GENESIS)
        left_open = c.subscribe(RID_GENESIS)  # closed by the client's close
        rid = await c.insert_after(b"close test")
        written[rid] = b"close test"
        assert await sub.next(timeout=WAIT_S) is not None
        assert await left_open.next(timeout=WAIT_S) is not None
        await sub.aclose()
        await sub.aclose()  # idempotent
        with pytest.raises(ziplog.ClientClosedError):
            await sub.next()
        assert [r async for r in sub] == []

        # An insert in flight while the client closes either completes or fails typed.
        inflight = asyncio.create_task(c.insert_after(b"racing the close"))
        await c.close()
        await c.close()  # idempotent
        done, _ = await asyncio.wait({inflight}, timeout=WAIT_S)
        assert inflight in done
        if inflight.exception() is None:
            written[inflight.result()] = b"racing the close"
        else:
            assert isinstance(inflight.exception(), ziplog.ClientClosedError)

        assert asyncio.all_tasks() == {me}, asyncio.all_tasks()
        with pytest.raises(ziplog.ClientClosedError):
            await left_open.next()
        with pytest.raises(ziplog.ClientClosedError):
            await c.insert_after(b"after close")
        with pytest.raises(ziplog.ClientClosedError):
            c.subscribe()

    ziplog.aio.run(main())


def test_trim() -> None:
    """On a cluster of its own: a trim deletes records the module's other tests read."""
    async def body(c: AsyncClient) -> None:
        written: dict[RecordId, bytes] = {}
        await insert_chains(c, written, tasks=4, per_task=5, tag="before-trim")
        a = await c.insert_after(b"trim-a", max(written))  # above everything written so far
        b = await c.insert_after(b"trim-b", a)
        d = await c.insert_after(b"trim-d", b)
        await c.trim(b)
        for old in (a, *random.Random(3).sample(sorted(written), 10)):
            with pytest.raises(ziplog.TrimmedError):
                await c.read_record(old)
        assert await c.read_record(b) == b"trim-b"
        assert await c.read_record(d) == b"trim-d"
        async with c.subscribe(a) as sub:  # an explicit start below the trim point
            with pytest.raises(ziplog.TrimmedError):
                await sub.next(timeout=WAIT_S)
        async with c.subscribe(RID_GENESIS) as sub:  # genesis after a trim: starts at the cut
            first = await sub.next(timeout=WAIT_S)
            assert first is not None and first.rid == b and first.data == b"trim-b"

    with ziplog.local_cluster(shards=2, replicas=2) as own:
        run(body, own)
