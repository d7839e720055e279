"""LogDB's garbage collection on real processes: the coordinator leader trims the log
below what every KV shard and coordinator replica has in a durable snapshot; every
committed key still reads its latest value (from the KV shards once its record is
gone), transactions on trimmed keys commit, and replicas restarted after the trim
resume from their snapshots."""

from __future__ import annotations

import time
from typing import Any, Iterator

import pytest

import ziplog
from ziplog import RecordId, TrimmedError
from ziplog.logdb import LogDB
from ziplog.tools.logdb_local import local_logdb
from ziplog.tools.logdb_local import LocalLogDB


@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=2, replicas=2) as c:
        yield c


@pytest.fixture(scope="module")
def ldb(cluster: ziplog.LocalCluster) -> Iterator[LocalLogDB]:
    with local_logdb(cluster, coordinators=2, kv_shards=3,
                     coordinator_args=["--gc-every", "0.3", "--snapshot-every", "0.5"],
                     kv_args=["--snapshot-every", "0.5"]) as l:
        yield l


def wait_trimmed(c: Any, rid: RecordId, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            c.read_record(rid)
        except TrimmedError:
            return
        assert time.monotonic() < deadline, f"the log was not trimmed past {rid}"
        time.sleep(0.1)


def test_after_trims_every_committed_key_reads_its_latest_value(ldb: LocalLogDB, cluster: ziplog.LocalCluster) -> None:
    keys = [b"gc%d" % i for i in range(20)]
    latest: dict[bytes, bytes | None] = {}
    with LogDB(ldb.zk_hosts) as db, cluster.client() as c:
        for version in range(3):
            for k in keys:
                def write(t: Any, k: bytes = k, version: int = version) -> None:
                    t.put(k, b"%s-v%d" % (k, version))
                db.run(write)
                latest[k] = b"%s-v%d" % (k, version)
        with db.transaction() as t:
            t.delete(keys[0])
        latest[keys[0]] = None
        assert t.commit_rid is not None
        # the newest records are trimmed too once everything moved past them
        wait_trimmed(c, t.commit_rid)
        for k in keys:
            assert db.get(k) == latest[k], k
        # a transaction on trimmed keys: its reads come from the KV shards
        def move(t: Any) -> None:
            a, b = t.get(keys[1]), t.get(keys[2])
            t.put(keys[1], b)
            t.put(keys[2], a)
        db.run(move)
        latest[keys[1]], latest[keys[2]] = latest[keys[2]], latest[keys[1]]
        # replicas restarted after the trim resume from their snapshots
        ldb.kill_coordinator_leader()
        ldb.restart_kv_shard(0)
        ldb.wait_ready()
        for k in keys:
            assert db.get(k) == latest[k], k
        db.run(lambda t: t.put(keys[3], b"after-restarts"))
        assert db.get(keys[3]) == b"after-restarts"
    for p in [*ldb.coordinators.values(), *ldb.kv.values()]:
        assert p.poll() is None, "a LogDB process died after the trims"
