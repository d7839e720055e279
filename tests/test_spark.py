"""``format("ziplog")`` on a real local cluster and a real local Spark (local[2], bound to
127.0.0.1), one session and one cluster for the module: batch reads exact against a
subscription and bounded by their offsets; availableNow in limited batches across a
restart of the same checkpoint; an idle log that plans no batch; failOnDataLoss both
ways, for a batch start and for a checkpoint trimmed past; the sink writing each row
once when a write runs again, and when a streaming sink fails at commit and restarts;
key-routed rows; a task whose planned replica is gone; processingTime under a live
writer with a replica SIGKILLed; workers that import the installed pyspark. Without
Spark or a cluster: the sink refusing a shard of one replica unless allowed, and the
failure of a re-run that finds a row below the row before it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

# pyspark comes with the spark extra, which `make setup` installs: no skip when it is missing
from pyspark import cloudpickle
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.datasource import DataSourceStreamArrowWriter

import ziplog
from ziplog import RID_GENESIS, RecordId
from ziplog.spark import SHORT_LIVED, ZiplogDataSource, local_session
from ziplog.spark.options import ReadOptions
from ziplog.spark.source import ZiplogStreamReader


@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=2, replicas=2) as c:
        yield c


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    session = local_session("ziplog-tests", **SHORT_LIVED, **{"spark.sql.streaming.noDataProgressEventInterval": "0"})
    try:
        # a sink that fails once at commit (registered before any query starts; its
        # classes travel to the workers by value, not by a module they could not import)
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        session.dataSource.register(FailingSink)
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

        def run() -> list[int]:
            """One availableNow run on the checkpoint: the rows of each of its batches."""
            q = _stream(spark, cluster, out, ckpt, maxRecordsPerTrigger="60",
                        startingOffsets=json.dumps({"gsn": w0})).trigger(availableNow=True).start()
            try:
                q.awaitTermination(120)
                return [p["numInputRows"] for p in q.recentProgress]
            finally:
                q.stop()

        sizes = run()
        assert sum(sizes) == 250 and max(sizes) <= 60, sizes
        second = [c.insert_after(b"an2-%d" % i) for i in range(130)]
        watermark_past(c, max(r.gsn for r in second))
        sizes = run()
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


def _sink_records(c: ziplog.Client, after: int, prefix: bytes, want: int) -> list[bytes]:
    """The records starting with ``prefix`` past gsn ``after``, in gsn order, once at
    least ``want`` of them are stable."""
    w = c.watermark()
    while True:
        with c.subscribe(RecordId(after + 1, -1), end=w) as sub:
            got = [r.data for r in sub if r.data.startswith(prefix)]
        if len(got) >= want:
            return got
        w = c.watermark()


@pytest.mark.parametrize("ordered", ["true", "false"])
def test_the_sink_writes_each_row_once_when_a_write_runs_again(cluster: ziplog.LocalCluster, spark: SparkSession,
                                                              ordered: str) -> None:
    prefix = b"sink-%s-" % ordered.encode()
    # unordered: more than one chunk per partition; ordered (one insert in flight, the
    # slow way): more than one Arrow batch per partition (200 rows, batches of 100)
    rows = [(prefix + b"%05d" % i,) for i in range(13_000 if ordered == "false" else 600)]
    df = spark.createDataFrame(rows, "data binary").repartition(3)
    with cluster.client() as c:
        before = watermark_past(c, 0)
    conf = "spark.sql.execution.arrow.maxRecordsPerBatch"
    try:
        # the same write, run twice (a job re-run after a failure), with Spark cutting its
        # Arrow batches differently each time
        for per_batch in ("700" if ordered == "false" else "100", "10000"):
            spark.conf.set(conf, per_batch)
            (df.write.format("ziplog").option("zk", cluster.zk_hosts).option("writeId", f"sink-test-{ordered}")
             .option("ordered", ordered).mode("append").save())
    finally:
        spark.conf.unset(conf)
    with cluster.client() as c:
        got = _sink_records(c, before, prefix, len(rows))
    assert sorted(got) == sorted(r[0] for r in rows), "each row exactly once"


def test_an_ordered_sink_keeps_a_partitions_order(cluster: ziplog.LocalCluster, spark: SparkSession) -> None:
    rows = [(b"in-order-%03d" % i,) for i in range(300)]
    df = spark.createDataFrame(rows, "data binary").coalesce(1)
    with cluster.client() as c:
        before = watermark_past(c, 0)
    df.write.format("ziplog").option("zk", cluster.zk_hosts).option("writeId", "in-order").mode("append").save()
    with cluster.client() as c:
        got = _sink_records(c, before, b"in-order-", len(rows))
    assert got == [r[0] for r in rows], "the partition's rows in their order, by gsn"


def test_workers_import_the_installed_pyspark_not_the_zip_spark_puts_first(spark: SparkSession) -> None:
    import pyspark
    installed = str(Path(pyspark.__file__).resolve().parent)
    where: str = spark.sparkContext.parallelize([0], 1).map(lambda _: str(__import__("pyspark").__file__)).collect()[0]
    assert ".zip" not in where and str(Path(where).resolve().parent) == installed, where


def test_a_set_spark_home_stands_and_the_made_one_has_what_a_jvm_needs(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    from ziplog.spark.home import PARTS, spark_home
    monkeypatch.setenv("SPARK_HOME", "/somewhere/else")
    assert spark_home() is None
    monkeypatch.delenv("SPARK_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    home = spark_home()
    assert home is not None and home == spark_home()  # made once
    assert sorted(p.name for p in Path(home).iterdir()) == sorted(PARTS)
    assert (Path(home) / "bin" / "spark-submit").exists() and not (Path(home) / "python").exists()
    assert [p.name for p in (tmp_path / "ziplog").iterdir()] == [Path(home).name]  # no staging left


def test_a_page_becomes_an_arrow_batch_of_the_rows_schema() -> None:
    import random

    from ziplog.protocol.gsna import EPOCH_BITS, epoch_of
    from ziplog.spark.task import ARROW_SCHEMA, record_batch, rows_of
    rnd = random.Random(7)
    page = sorted((rnd.randrange(1, 1 << (EPOCH_BITS + 30)), rnd.randbytes(rnd.randrange(0, 300)))
                  for _ in range(500))
    batch = record_batch(5, page)
    assert batch.schema == ARROW_SCHEMA
    assert rows_of(batch) == [(g, 5, epoch_of(g), d) for g, d in page]


class _FailFirstCommitWriter(DataSourceStreamArrowWriter):  # type: ignore[misc]
    """A stream writer whose first commit fails (a sink failure between a batch's write
    and its commit); a marker file remembers that it failed."""

    def __init__(self, inner: Any, marker: str) -> None:
        self.inner = inner
        self.marker = marker

    def write(self, iterator: Any) -> Any:
        return self.inner.write(iterator)

    def commit(self, messages: Any, batchId: int) -> None:
        if not os.path.exists(self.marker):
            Path(self.marker).write_text("failed once")
            raise RuntimeError("injected sink failure at commit")
        self.inner.commit(messages, batchId)

    def abort(self, messages: Any, batchId: int) -> None:
        self.inner.abort(messages, batchId)


class FailingSink(ZiplogDataSource):  # type: ignore[misc]
    """format("ziplog_failing_commit"): the ziplog sink whose first commit fails (the
    option ``failMarker`` names the file that remembers it failed)."""

    @classmethod
    def name(cls) -> str:
        return "ziplog_failing_commit"

    def streamWriter(self, schema: Any, overwrite: bool) -> Any:
        inner = super().streamWriter(schema, overwrite)
        return _FailFirstCommitWriter(inner, self.options["failMarker"])


def test_a_sink_failure_at_commit_replays_the_batch_and_the_log_holds_one_copy(
        cluster: ziplog.LocalCluster, spark: SparkSession, tmp_path: Path) -> None:
    marker = str(tmp_path / "failed")
    with cluster.client() as c:
        w0 = watermark_past(c, 0)
        src = [c.insert_after(b"src-%d" % i) for i in range(200)]
        upto = watermark_past(c, max(r.gsn for r in src))

    def start() -> Any:
        return (spark.readStream.format("ziplog").option("zk", cluster.zk_hosts)
                .option("startingOffsets", json.dumps({"gsn": w0})).load()
                .where(F.col("gsn") <= upto).where(F.col("data").cast("string").startswith("src-"))
                .select(F.concat(F.lit("copy-"), F.col("data").cast("string")).cast("binary").alias("data"))
                .writeStream.format("ziplog_failing_commit").option("zk", cluster.zk_hosts).option("failMarker", marker)
                .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(availableNow=True).start())

    q = start()
    with pytest.raises(Exception, match="injected sink failure"):
        q.awaitTermination(120)
    assert os.path.exists(marker)
    q = start()  # the same checkpoint: the failed batch runs again, under the same ids
    try:
        q.awaitTermination(120)
        rerun = sum(p["numInputRows"] for p in q.recentProgress)
    finally:
        q.stop()
    assert rerun >= 200, "the failed batch was not run again: the check would prove nothing"
    with cluster.client() as c:
        w = watermark_past(c, 0)
        with c.subscribe(RecordId(upto + 1, -1), end=w) as sub:
            copies = [r.data for r in sub if r.data.startswith(b"copy-src-")]
    assert sorted(copies) == sorted(b"copy-src-%d" % i for i in range(200)), "each row once in the log"



def test_fail_on_data_loss_after_a_checkpoint_is_trimmed_past(cluster: ziplog.LocalCluster, spark: SparkSession,
                                                              tmp_path: Path) -> None:
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    with cluster.client() as c:
        w0 = watermark_past(c, 0)
        first = [c.insert_after(b"sl-%d" % i) for i in range(30)]
        watermark_past(c, max(r.gsn for r in first))

        def run(**opts: str) -> Any:
            return _stream(spark, cluster, out, ckpt, startingOffsets=json.dumps({"gsn": w0}), **opts) \
                .trigger(availableNow=True).start()
        q = run()
        try:
            q.awaitTermination(120)
        finally:
            q.stop()
        second = [c.insert_after(b"sl2-%d" % i) for i in range(30)]
        cut = max(r.gsn for r in second[:10]) + 1
        c.trim(RecordId(cut, -1))  # past the checkpoint: sl2 records below cut are gone unread
        watermark_past(c, max(r.gsn for r in second))
    q = run()
    with pytest.raises(Exception, match="trim point"):
        q.awaitTermination(120)
    q.stop()
    q = run(failOnDataLoss="false")
    try:
        q.awaitTermination(120)
    finally:
        q.stop()
    got = sorted(bytes(r.data) for r in spark.read.parquet(str(out)).collect())
    want = sorted([b"sl-%d" % i for i in range(30)] + [b"sl2-%d" % i for i, r in enumerate(second) if r.gsn >= cut])
    assert got == want


def test_the_sink_routes_rows_with_a_key_to_one_shard(cluster: ziplog.LocalCluster, spark: SparkSession) -> None:
    rows = [(b"k%d" % (i % 5), b"keyed-%03d" % i) for i in range(100)]
    with cluster.client() as c:
        before = watermark_past(c, 0)
    spark.createDataFrame(rows, "key binary, data binary").repartition(2) \
        .write.format("ziplog").option("zk", cluster.zk_hosts).option("writeId", "keyed-1").mode("append").save()
    with cluster.client() as c:
        w = c.watermark()
        while c.count_range(0, before + 1, w)[0] + c.count_range(1, before + 1, w)[0] < 100:
            w = c.watermark()
        with c.subscribe(RecordId(before + 1, -1), end=w) as sub:
            shard_of = {r.data: r.rid.shard for r in sub if r.data.startswith(b"keyed-")}
    assert len(shard_of) == 100
    for k in range(5):
        assert len({shard_of[b"keyed-%03d" % i] for i in range(k, 100, 5)}) == 1, "one key, one shard"


def test_a_task_finds_moved_replicas_through_zookeeper(cluster: ziplog.LocalCluster) -> None:
    from ziplog.spark.task import read_partition, rows_of
    with cluster.client() as c:
        rids = [c.insert_after(b"moved-%d" % i) for i in range(40)]
        w = watermark_past(c, max(r.gsn for r in rids))
        lo = min(r.gsn for r in rids)
        want = [(r.rid.gsn, 0, r.data) for r in c.read_range(0, lo, w)]
    # the partition names a replica address where nothing listens any more
    got = [(g, s, d) for batch in read_partition(cluster.zk_hosts, 0, lo, w, ("tcp://127.0.0.1:9",))
           for g, s, _, d in rows_of(batch)]
    assert got == want and got

def test_processing_time_under_a_live_writer_and_a_replica_kill(cluster: ziplog.LocalCluster, spark: SparkSession,
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "out"
    with cluster.client() as c:
        w0 = watermark_past(c, 0)
    written: list[RecordId] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            with cluster.client() as w:
                while not stop.is_set() or len(written) < 1000:
                    written.append(w.insert_after(b"live-%d" % len(written)))
        except BaseException as exc:
            errors.append(exc)

    q = _stream(spark, cluster, out, tmp_path / "ckpt", startingOffsets=json.dumps({"gsn": w0})) \
        .trigger(processingTime="200 milliseconds").start()
    th = threading.Thread(target=writer)
    th.start()
    try:
        deadline = time.monotonic() + 120
        while sum(p["numInputRows"] for p in q.recentProgress) < 300:
            assert time.monotonic() < deadline and q.isActive, "the query read nothing"
            q.awaitTermination(0.2)
        cluster.kill_replica(0, 0)  # the primary of shard 0, SIGKILLed mid-run (started again)
        while sum(p["numInputRows"] for p in q.recentProgress) < 700:
            assert time.monotonic() < deadline and q.isActive, "the query stalled after the kill"
            q.awaitTermination(0.2)
        stop.set()
        th.join()
        assert not errors, errors
        q.processAllAvailable()
    finally:
        stop.set()
        th.join()
        q.stop()
    got = sorted((r.gsn, r.shard, bytes(r.data)) for r in spark.read.parquet(str(out)).collect())
    want = sorted((r.gsn, r.shard, b"live-%d" % i) for i, r in enumerate(written))
    assert len(want) >= 1000 and got == want


def test_a_fork_from_another_thread_keeps_the_session_and_its_sources(cluster: ziplog.LocalCluster,
                                                                       spark: SparkSession, tmp_path: Path) -> None:
    """A child forked from a thread other than the one calling Spark (the local cluster's
    supervisor restarting a replica; here a Popen with preexec_fn) must not close that
    thread's Py4J connection: a new one would be served by a JVM thread without the
    active session, where Spark finds no session-registered source (DATA_SOURCE_NOT_FOUND)."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None

    def jvm_thread() -> tuple[str, bool]:
        return (jvm.java.lang.Thread.currentThread().getName(),
                jvm.org.apache.spark.sql.SparkSession.getActiveSession().isDefined())

    before = jvm_thread()
    th = threading.Thread(target=lambda: subprocess.Popen(["true"], preexec_fn=lambda: None).wait())
    th.start()
    th.join()
    assert jvm_thread() == before and before[1]
    with cluster.client() as c:
        w = watermark_past(c, 0)
    q = (spark.readStream.format("ziplog").option("zk", cluster.zk_hosts).option("startingOffsets", json.dumps({"gsn": w}))
         .load().writeStream.format("ziplog").option("zk", cluster.zk_hosts)
         .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(availableNow=True).start())
    try:
        q.awaitTermination(120)
        assert q.exception() is None
    finally:
        q.stop()


def _rows_in(batches: Iterator[Any]) -> int:
    """Rows in the Arrow record batches a reader's read() yields."""
    return sum(batch.num_rows for batch in batches)


class _ClockedReader(ZiplogStreamReader):
    """The stream reader with a clock the test moves (maxTriggerDelay without waiting)."""
    now = 1000.0

    def clock(self) -> float:  # type: ignore[override]
        return self.now


def test_min_records_per_trigger_waits_until_max_trigger_delay(cluster: ziplog.LocalCluster) -> None:
    from pyspark.sql.streaming.datasource import ReadAllAvailable
    with cluster.client() as c:
        start = {"gsn": watermark_past(c, 0)}
        opts = {"zk": cluster.zk_hosts, "minRecordsPerTrigger": "50", "maxTriggerDelay": "60s"}
        reader = _ClockedReader(ReadOptions.parse(opts, streaming=True))
        try:
            few = [c.insert_after(b"min-%d" % i) for i in range(10)]
            w = watermark_past(c, max(r.gsn for r in few))
            assert reader.latestOffset(start, ReadAllAvailable()) == start, "10 < 50 records, delay not passed"
            reader.now += 59
            assert reader.latestOffset(start, ReadAllAvailable()) == start
            reader.now += 2  # maxTriggerDelay passed: a batch of what there is
            end = reader.latestOffset(start, ReadAllAvailable())
            assert end["gsn"] >= w
            # the delay counts again from that batch; enough records plan one at once
            more = [c.insert_after(b"min2-%d" % i) for i in range(10)]
            watermark_past(c, max(r.gsn for r in more))
            assert reader.latestOffset(end, ReadAllAvailable()) == end
            rest = [c.insert_after(b"min3-%d" % i) for i in range(40)]
            w = watermark_past(c, max(r.gsn for r in rest))
            end2 = reader.latestOffset(end, ReadAllAvailable())
            assert end2["gsn"] >= w
            assert sum(_rows_in(reader.read(p)) for p in reader.partitions(end, end2)) == 50
        finally:
            reader.stop()


def test_real_time_mode_is_refused_for_a_python_source(cluster: ziplog.LocalCluster, spark: SparkSession,
                                                      tmp_path: Path) -> None:
    """Spark 4.3's real-time trigger runs only sources that implement its JVM interface for
    it (Kafka's); a Python data source is refused when the query starts. If a Spark release
    lifts that, this fails: then ziplog should support it."""
    df = spark.readStream.format("ziplog").option("zk", cluster.zk_hosts).load()
    q = None
    try:
        with pytest.raises(Exception, match="REAL_TIME_MODE.INPUT_STREAM_NOT_SUPPORTED"):
            q = (df.writeStream.format("console").outputMode("update").trigger(realTime="5 seconds")  # type: ignore[call-overload]
                 .option("checkpointLocation", str(tmp_path / "ckpt")).start())
            q.processAllAvailable()
    finally:
        if q is not None:
            q.stop()


def test_reader_and_sink_with_a_client_key_on_a_curve_cluster(spark: SparkSession, tmp_path: Path) -> None:
    """A cluster that speaks CURVE: the sink writes with a key holding append and read,
    the reader reads with one holding read and admin (the plan asks STATUS for the trim
    points), each given as option keyFile; a reader without one is refused, typed."""
    with ziplog.local_cluster(shards=1, replicas=2, data_dir=tmp_path / "curve", curve=True,
                              mms_replicas=1, fh_replicas=1) as secure:
        writer = secure.add_client("spark-writer", "append,read")
        reader = secure.add_client("spark-reader", "read,admin")
        rows = [(b"keyed-%03d" % i,) for i in range(50)]
        (spark.createDataFrame(rows, "data binary").repartition(2).write.format("ziplog")
         .option("zk", secure.zk_hosts).option("keyFile", str(writer)).option("writeId", "keyed").mode("append").save())
        got = rows_of(spark.read.format("ziplog").option("zk", secure.zk_hosts).option("keyFile", str(reader)).load())
        assert sorted(d for _, _, d in got) == sorted(r[0] for r in rows)
        with pytest.raises(Exception, match="refused the connection|UnauthenticatedError"):
            spark.read.format("ziplog").option("zk", secure.zk_hosts).load().collect()


class _SinkClient:
    """What the sink asks of a ``Client``, with no cluster behind it: a topology whose
    shards have ``replicas`` each, and inserts that answer from ``answers``."""

    def __init__(self, replicas: dict[int, int], answers: list[Any]) -> None:
        from ziplog.protocol.topology import TopologyView
        self.topology = TopologyView()
        self.topology.replica_counts = dict(replicas)
        self.answers = list(answers)
        self.inserted: list[tuple[bytes, RecordId]] = []

    def __enter__(self) -> "_SinkClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def set_policy(self, policy: Any) -> None:
        pass

    def insert_after(self, data: bytes, after: RecordId) -> RecordId:
        self.inserted.append((data, after))
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        assert isinstance(answer, RecordId)
        return answer

    def insert_many(self, records: list[bytes]) -> list[RecordId]:
        return [RecordId(i + 1, 0) for i in range(len(records))]


def _arrow_rows(n: int) -> Iterator[Any]:
    import pyarrow as pa
    yield pa.record_batch([pa.array([b"row-%d" % i for i in range(n)], pa.binary())], names=["data"])


@pytest.mark.parametrize("ordered", [True, False])
def test_the_sink_refuses_a_shard_of_one_replica_unless_told_to_allow_it(monkeypatch: pytest.MonkeyPatch,
                                                                          ordered: bool) -> None:
    """A re-run of a task is exactly once only when each shard keeps what it acknowledged
    (two replicas or more): a task checks the topology's replicas per shard before it
    writes a row, and writes to a shard of one replica only with allowSingleReplica."""
    import ziplog.client.blocking
    from ziplog.spark.options import OptionError, WriteOptions
    from ziplog.spark.sink import SingleReplicaError, check_replicas, write_batches
    assert WriteOptions.parse({"zk": "h"}).allow_single_replica is False
    assert WriteOptions.parse({"zk": "h", "allowsinglereplica": "true"}).allow_single_replica is True
    with pytest.raises(OptionError, match="allowSingleReplica"):
        WriteOptions.parse({"zk": "h", "allowSingleReplica": "maybe"})
    check_replicas({0: 2, 1: 3}, [0, 1], allow_single=False)
    check_replicas({0: 2, 1: 1}, [0, 1], allow_single=True)
    with pytest.raises(SingleReplicaError, match=r"2 replicas or more per shard \(shard 1 has 1\).*allowSingleReplica"):
        check_replicas({0: 2, 1: 1}, [0, 1], allow_single=False)

    clients: list[_SinkClient] = []

    def connect(*args: Any, **kw: Any) -> _SinkClient:
        clients.append(_SinkClient({0: 1}, [RecordId(10 + i, 0) for i in range(3)]))
        return clients[-1]
    monkeypatch.setattr(ziplog.client.blocking, "Client", connect)
    refused = WriteOptions(zk="h", write_id="one-replica", ordered=ordered)
    with pytest.raises(SingleReplicaError) as err:
        write_batches(refused, _arrow_rows(3))
    assert "shard 0 has 1" in str(err.value) and err.value.replicas == {0: 1}
    assert clients[-1].inserted == []  # refused before any row
    allowed = WriteOptions(zk="h", write_id="one-replica", ordered=ordered, allow_single_replica=True)
    assert write_batches(allowed, _arrow_rows(3)).records == 3


def test_a_rerun_that_finds_a_row_below_the_row_before_it_fails_with_a_clear_message() -> None:
    """A task run again under the same identity on a shard that lost part of its first
    run: row 1 was lost and is placed anew (gsn 500), row 2 survived at gsn 300. The
    client's typed error becomes a task failure that says what happened and why."""
    from ziplog.spark.sink import RerunConflictError, write_ordered
    lost = ziplog.ReusedIdentityError(77, 2, RecordId(300, 0), 500)
    client = _SinkClient({0: 1}, [RecordId(500, 0), lost])
    rows = iter([(b"a", None), (b"b", None), (b"c", None)])
    with pytest.raises(RerunConflictError) as err:
        write_ordered(client, rows, lambda key: 0, "write w/partition 0")
    text = str(err.value)
    assert ("task 'write w/partition 0' cannot run again in order: its row 2 is already in the log at gsn 300 "
            "(shard 0), not above the gsn 500 of the row before it") in text
    assert "every retry" in text and "reused identity" in text  # the client's own words follow
    assert "allowSingleReplica" in text and err.value.__cause__ is lost
    assert client.inserted == [(b"a", RID_GENESIS), (b"b", RecordId(500, 0))]
