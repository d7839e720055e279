"""``format("ziplog")`` on a real local cluster and a real local Spark (local[2], bound to
127.0.0.1): batch reads exact against a subscription and bounded by their offsets,
availableNow in limited batches across a restart of the same checkpoint, an idle log
that runs no batch, failOnDataLoss both ways, and the sink writing each row once when a
write runs again."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

import ziplog
from ziplog import RID_GENESIS, RecordId

pyspark = pytest.importorskip("pyspark")

from pyspark.sql import SparkSession  # noqa: E402

from ziplog.spark import register  # noqa: E402


@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=2, replicas=2) as c:
        yield c


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYSPARK_PYTHON"] = os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable  # the workers import ziplog
    session = (SparkSession.builder.master("local[2]").appName("ziplog-tests")
               .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.pyspark.python", sys.executable).config("spark.pyspark.driver.python", sys.executable)
               .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
               .config("spark.sql.streaming.noDataProgressEventInterval", "0")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    try:
        register(session)
        yield session
    finally:
        session.stop()


def watermark_past(c: Any, gsn: int) -> int:
    w = c.watermark()
    while w < gsn:
        w = c.watermark()
    return int(w)


def rows_of(df: Any) -> list[tuple[int, int, bytes]]:
    return sorted((r.gsn, r.shard, bytes(r.data)) for r in df.collect())


def test_batch_read_is_exact_and_bounded(cluster: ziplog.LocalCluster, spark: SparkSession) -> None:
    with cluster.client() as c:
        rids = [c.insert_after(b"batch-%d" % i) for i in range(500)]
        w = watermark_past(c, max(r.gsn for r in rids))
        with c.subscribe(RID_GENESIS, end=w) as sub:
            log = [(r.rid.gsn, r.rid.shard, r.data) for r in sub]
    df = (spark.read.format("ziplog").option("zk", cluster.zk_hosts)
          .option("endingOffsets", json.dumps({"gsn": w})).option("maxRecordsPerPartition", "100").load())
    assert df.schema.simpleString() == "struct<gsn:bigint,shard:int,epoch:bigint,data:binary>"
    got = rows_of(df)
    assert got == log and len(got) >= 500
    assert df.rdd.getNumPartitions() >= 5  # split by maxRecordsPerPartition
    # bounds: the start is exclusive, the end inclusive
    a, b = log[100][0], log[300][0]
    part = rows_of(spark.read.format("ziplog").option("ZK", cluster.zk_hosts)  # option names ignore case
                   .option("startingOffsets", json.dumps({"gsn": a}))
                   .option("endingOffsets", json.dumps({"gsn": b})).option("minPartitions", "7").load())
    assert part == log[101:301]


def _stream(spark: SparkSession, cluster: ziplog.LocalCluster, out: Path, ckpt: Path, **opts: str) -> Any:
    reader = spark.readStream.format("ziplog").option("zk", cluster.zk_hosts).option("startingOffsets", "earliest")
    for k, v in opts.items():
        reader = reader.option(k, v)
    return reader.load().writeStream.format("parquet").option("checkpointLocation", str(ckpt)).option("path", str(out))


def test_available_now_in_limited_batches_across_a_restart(cluster: ziplog.LocalCluster, spark: SparkSession,
                                                            tmp_path: Path) -> None:
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    with cluster.client() as c:
        w0 = watermark_past(c, 0)
        first = [c.insert_after(b"an-%d" % i) for i in range(250)]
        watermark_past(c, max(r.gsn for r in first))
        q = _stream(spark, cluster, out, ckpt, maxRecordsPerTrigger="60",
                    startingOffsets=json.dumps({"gsn": w0})).trigger(availableNow=True).start()
        try:
            q.awaitTermination(120)
            sizes = [p["numInputRows"] for p in q.recentProgress]
        finally:
            q.stop()
        assert sum(sizes) == 250 and max(sizes) <= 60, sizes
        second = [c.insert_after(b"an2-%d" % i) for i in range(130)]
        watermark_past(c, max(r.gsn for r in second))
        q = _stream(spark, cluster, out, ckpt, maxRecordsPerTrigger="60",
                    startingOffsets=json.dumps({"gsn": w0})).trigger(availableNow=True).start()
        try:
            q.awaitTermination(120)
            sizes = [p["numInputRows"] for p in q.recentProgress]
        finally:
            q.stop()
        assert sum(sizes) == 130 and max(sizes) <= 60, sizes
    got = sorted((r.gsn, r.shard, bytes(r.data)) for r in spark.read.parquet(str(out)).collect())
    want = sorted((r.gsn, r.shard, b"an-%d" % i) for i, r in enumerate(first))
    want += sorted((r.gsn, r.shard, b"an2-%d" % i) for i, r in enumerate(second))
    assert got == sorted(want), "the two runs together hold every record once"


def test_an_idle_log_runs_no_batch(cluster: ziplog.LocalCluster, spark: SparkSession, tmp_path: Path) -> None:
    with cluster.client() as c:
        w = watermark_past(c, 0)
    q = _stream(spark, cluster, tmp_path / "out", tmp_path / "ckpt", startingOffsets=json.dumps({"gsn": w})) \
        .trigger(processingTime="100 milliseconds").start()
    try:
        deadline = time.monotonic() + 60
        while len(q.recentProgress) < 10:
            assert time.monotonic() < deadline, "the query made no progress reports"
            q.awaitTermination(0.1)
        progress = q.recentProgress
        assert all(p["numInputRows"] == 0 for p in progress)
        # Spark runs the first batch of a new query once (start == end: no partition);
        # after it, triggers on an idle log plan nothing: the batch id stays put
        assert len({p["batchId"] for p in progress[-8:]}) == 1, [p["batchId"] for p in progress]
    finally:
        q.stop()


def test_fail_on_data_loss_both_ways(cluster: ziplog.LocalCluster, spark: SparkSession, tmp_path: Path) -> None:
    with cluster.client() as c:
        w0 = watermark_past(c, 0)
        kept_before = [c.insert_after(b"loss-%d" % i) for i in range(20)]
        mark = watermark_past(c, max(r.gsn for r in kept_before))
        later = [c.insert_after(b"later-%d" % i) for i in range(20)]
        cut = max(r.gsn for r in later[:10]) + 1
        c.trim(RecordId(cut, -1))
        watermark_past(c, max(r.gsn for r in later))
    start = json.dumps({"gsn": min(w0, mark)})
    failing = (spark.read.format("ziplog").option("zk", cluster.zk_hosts).option("startingOffsets", start).load())
    with pytest.raises(Exception, match="trim point"):
        failing.collect()
    skipped = rows_of(spark.read.format("ziplog").option("zk", cluster.zk_hosts).option("startingOffsets", start)
                      .option("failOnDataLoss", "false").load())
    kept = sorted(b"later-%d" % i for i, r in enumerate(later) if r.gsn >= cut)  # gsns need not follow insert order
    assert kept and sorted(d for _, _, d in skipped if d.startswith(b"later-")) == kept
    assert not any(d.startswith(b"loss-") for _, _, d in skipped)


def test_the_sink_writes_each_row_once_when_a_write_runs_again(cluster: ziplog.LocalCluster,
                                                              spark: SparkSession) -> None:
    rows = [(b"sink-%03d" % i,) for i in range(120)]
    df = spark.createDataFrame(rows, "data binary").repartition(3)
    with cluster.client() as c:
        before = watermark_past(c, 0)
    for _ in range(2):  # the same write, run twice (a job re-run after a failure)
        df.write.format("ziplog").option("zk", cluster.zk_hosts).option("writeId", "sink-test-1").mode("append").save()
    with cluster.client() as c:
        w = c.watermark()
        while True:
            with c.subscribe(RecordId(before + 1, -1), end=w) as sub:
                got = [r.data for r in sub if r.data.startswith(b"sink-")]
            if len(got) >= 120:
                break
            w = c.watermark()
    assert sorted(got) == sorted(r[0] for r in rows), "each row exactly once"
