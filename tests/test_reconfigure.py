"""Adding and removing a shard on a running local cluster."""

from __future__ import annotations

import ziplog
from ziplog import RID_GENESIS, Policy


def test_add_then_remove_shard() -> None:
    with ziplog.local_cluster(shards=1, replicas=2) as cluster:
        with cluster.client() as c, cluster.client() as reader:
            sub = reader.subscribe(RID_GENESIS)
            first = c.insert_after(b"one shard")
            new = cluster.add_shard()
            assert new == 1
            assert c.topology.wait(lambda: 1 in c.live_shards(), 30)
            c.set_policy(Policy.fixed(new))
            on_new = c.insert_after(b"on the new shard", first)
            assert on_new.shard == new and on_new.gsn > first.gsn
            cluster.remove_shard(new)
            # this client's ZooKeeper view may trail the cluster's by a watch round trip
            assert c.topology.wait(lambda: new not in c.live_shards(), 30)
            c.set_policy(Policy.random())
            after = c.insert_after(b"after removal", on_new)
            assert after.shard == 0 and after.gsn > on_new.gsn
            assert c.read_record(on_new) == b"on the new shard"  # a removed shard stays readable
            got: list[ziplog.Record] = []
            while not got or got[-1].rid != after:
                rec = sub.next(timeout=30)
                assert rec is not None, "subscription stalled across the membership changes"
                got.append(rec)
            assert [r.rid for r in got] == [first, on_new, after]
            sub.close()
