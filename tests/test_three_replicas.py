"""Shards of three replicas (f = 2) on real processes: two replicas of one shard SIGKILLed
at once, again and again (the primary among them, then two backups), while writers
insert and two subscribers read. Each time the supervisor starts them again after the
suspicion timeout, failure recovery makes the shard whole, and writes go on; at the end
the recorded history is checked (``tests/history.py``): every acknowledged record
delivered exactly once at its rid, one order for both subscribers, reads that agree."""

from __future__ import annotations

from typing import Iterator

import pytest

import ziplog
from tests.load import Load, next_recovery_gen, wait_recovery, wait_status


@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=2, replicas=3) as c:
        # Killed replicas come back only after the suspicion timeout: each double kill
        # goes through a recovery with two of the shard's three replicas gone.
        c.restart_delay_s = 1.0
        yield c


def test_two_replicas_of_a_shard_killed_at_once_again_and_again_lose_nothing(cluster: ziplog.LocalCluster) -> None:
    load = Load(cluster)
    try:
        load.wait_acked(100)
        for shard, pair in ((0, (0, 1)), (1, (1, 2)), (0, (0, 2)), (1, (0, 1))):
            gen = next_recovery_gen(cluster, shard)
            for replica in pair:
                cluster.kill_replica(shard, replica)
            wait_recovery(cluster, shard, "done", min_gen=gen)
            with cluster.client() as c:
                wait_status(c, [shard], until=lambda st: all(
                    r.get("answer") == "ok" and not r["frozen"] and r["recovery_gen"] >= gen for r in st[shard]))
            load.wait_acked(100)
        load.finish()
    finally:
        load.stop_writing.set()
        load.stop_reading()
    assert sum(1 for _, s, _ in cluster.restarts) >= 8
