"""A storage replica killed with SIGKILL and restarted (as an operator or supervisor
would) catches up from its primary; nothing acknowledged is lost and writes resume."""

from __future__ import annotations

import os
import signal
import threading
import time

import ziplog
from ziplog import RID_GENESIS, Policy
from ziplog.tools import procs
from tests.load import delivered_until, wait_status


def test_backup_sigkill_and_restart() -> None:
    with ziplog.local_cluster(shards=1, replicas=2) as cluster:
        with cluster.client() as c, cluster.client() as reader:
            sub = reader.subscribe(RID_GENESIS)
            c.set_policy(Policy.fixed(0))
            rid = RID_GENESIS
            acked = []
            for i in range(100):
                rid = c.insert_after(b"before-%d" % i, rid)
                acked.append(rid)
            cluster.kill_replica(0, 1)
            # An insert now cannot complete (the backup is gone) until the backup is back.
            result: list = []
            t = threading.Thread(target=lambda: result.append(c.insert_after(b"during", rid)))
            t.start()
            cluster.restart_replica(0, 1)
            cluster.wait_ready([0])
            t.join(60)
            assert result, "the insert issued while the backup was down never completed"
            acked.append(result[0])
            rid = result[0]
            for i in range(100):
                rid = c.insert_after(b"after-%d" % i, rid)
                acked.append(rid)
            for r in acked[::10]:
                c.read_record(r)
            delivered_until(sub, acked)
            # both replicas hold everything acknowledged
            wait_status(c, [0], until=lambda st: all(r["frontier"] >= acked[-1].gsn for r in st[0]))
            sub.close()


def test_primary_sigkill_and_restart_never_forks_the_log() -> None:
    """A primary that comes back with less than its backup holds must not decide again
    (that would fork the shard): it reports itself blocked, and writers go elsewhere."""
    with ziplog.local_cluster(shards=2, replicas=2) as cluster:
        with cluster.client() as c:
            c.set_policy(Policy.fixed(0))
            rid = RID_GENESIS
            acked = []
            for i in range(200):
                rid = c.insert_after(b"p-%d" % i, rid)
                acked.append(rid)
            cluster.kill_replica(0, 0)
            cluster.restart_replica(0, 0)
            c.set_policy(Policy.random())
            # Writers keep writing: a blocked shard 0 redirects them to shard 1.
            more = [c.insert_after(b"q-%d" % i) for i in range(50)]
            assert all(r.shard in (0, 1) for r in more)
            # The restarted primary settles one way or the other: blocked (its backup is
            # ahead), or deciding again (it lost nothing, or failure recovery rolled it
            # forward). Until then it waits for its backup's HELLO or is frozen.
            st = wait_status(c, [0], until=lambda st: st[0][0]["blocked"] is not None
                             or (st[0][0]["qualified"] and not st[0][0]["frozen"]))[0]
            if st[0]["blocked"] is None:
                # It holds everything that was acknowledged: all that every replica held
                # (the backup's stable point) and every record read back below. The two
                # replicas answer a status at different moments and the shard moves on
                # between them: the primary's frontier is compared from a later status.
                later = wait_status(c, [0])[0]
                assert later[0]["frontier"] >= st[1]["stable"]
                for r in acked[::20]:
                    assert c.read_record(r).startswith(b"p-")
            else:
                assert "failure recovery" in st[0]["blocked"]
                assert all(r.shard == 1 for r in more[-10:])


def test_subscribers_follow_a_restarted_serving_replica() -> None:
    """Both clients' subscriptions resubscribe when the replica they read from moves."""
    import asyncio

    from ziplog.client import aio
    with ziplog.local_cluster(shards=2, replicas=2) as cluster:
        with cluster.client() as c, cluster.client() as reader:
            sub = reader.subscribe(RID_GENESIS)
            rid = c.insert_after(b"first")
            assert sub.next(timeout=30).rid == rid
            later: list = []
            started, restarted = threading.Event(), threading.Event()
            async_seen: list = []
            errors: list = []
            abort = threading.Event()  # the test failed: the async reader stops too

            async def follow() -> None:
                async with aio.AsyncClient(cluster.zk_hosts) as ac:
                    async with ac.subscribe(RID_GENESIS) as asub:
                        rec = await asyncio.wait_for(asub.next(), 60)
                        assert rec is not None
                        async_seen.append(rec.rid)
                        started.set()
                        while not abort.is_set() and not (restarted.is_set() and later
                                                          and set(later) <= set(async_seen)):
                            rec = await asub.next(timeout=1.0)
                            if rec is not None:
                                async_seen.append(rec.rid)

            def run() -> None:
                try:
                    aio.run(follow())
                except BaseException as exc:  # surfaced below
                    errors.append(exc)

            t = threading.Thread(target=run)
            t.start()
            try:
                assert started.wait(60)
                # Restart shard 1's primary (the replica subscriptions read from) gracefully,
                # so it comes back with everything it had and resumes deciding.
                cluster.restart_replica(1, 0)
                cluster.wait_ready([0, 1])
                c.set_policy(Policy.fixed(1))
                # The shard may leave the membership for a few epochs while its primary is
                # away (the view wait_ready saw can predate that): an insert pinned to it is
                # then refused for good (NOT_MEMBER, no copy anywhere) and fails; the next
                # one, a new record, goes in once the shard is back.
                deadline = time.monotonic() + 30
                while len(later) < 20:
                    try:
                        later.append(c.insert_after(b"later-%d" % len(later)))
                    except ziplog.NoShardAvailableError:
                        assert time.monotonic() < deadline, "shard 1 did not take inserts again"
                restarted.set()
                seen: list[ziplog.RecordId] = []
                while not set(later) <= set(seen):
                    rec = sub.next(timeout=60)
                    assert rec is not None, "the subscription did not follow the restarted replica"
                    seen.append(rec.rid)
                assert seen == sorted(seen)
            except BaseException:
                abort.set()  # the async reader stops too: no session outlives the test
                raise
            finally:
                t.join(90)
            assert not errors, errors
            assert async_seen == sorted(async_seen) and set(later) <= set(async_seen)
            sub.close()


def test_status_lists_a_replica_while_it_is_silent_gone_and_restarting() -> None:
    """status() names every replica the topology names: a paused one as unreachable, one
    whose registration is gone as not registered, and the restarted one again once it
    answers; never a shard or replica left out."""
    with ziplog.local_cluster(shards=1, replicas=2) as cluster:
        cluster.restart_delay_s = 3600.0  # the test brings the replica back itself
        with cluster.client() as c:
            wait_status(c)
            backup = cluster.servers[(0, 1)]
            os.kill(backup.pid, signal.SIGSTOP)
            try:
                st = c.status(wait=0.3)[0]
            finally:
                os.kill(backup.pid, signal.SIGCONT)
            assert [r["replica"] for r in st] == [0, 1]
            assert st[1]["answer"] == "unreachable" and st[1]["addr"] == c.topology.replicas[0][1]
            procs.stop(backup)  # a clean exit closes its ZooKeeper session: the registration goes at once
            assert c.topology.wait(lambda: 1 not in c.topology.replicas.get(0, {}), 30)
            st = c.status(wait=0.3)[0]
            assert [r["replica"] for r in st] == [0, 1]
            assert st[1] == {"shard": 0, "replica": 1, "addr": None, "answer": "not registered"}
            cluster.restart_replica(0, 1)
            back = wait_status(c, [0])[0]
            assert [(r["replica"], r["answer"]) for r in back] == [(0, "ok"), (1, "ok")]
            # the primary SIGKILLed and restarted at once: every status taken meanwhile lists it
            cluster.restart_delay_s = 0.0
            restarts = len(cluster.restarts)
            cluster.kill_replica(0, 0)
            deadline = time.monotonic() + 60
            while True:
                st = c.status(wait=0.3)
                assert sorted(st) == [0] and [r["replica"] for r in st[0]] == [0, 1], st
                if len(cluster.restarts) > restarts and st[0][0]["answer"] == "ok":
                    break
                assert time.monotonic() < deadline, f"the restarted primary never answered: {st}"
