"""Experiment ``spark``: replaying the log into Spark (``format("ziplog")``).

* **Batch replay**: records/s of ``spark.read.format("ziplog")`` reading every record
  (the sum of the data lengths forces the bytes through) against a plain
  ``Client.subscribe(start, end)`` reading the same records, in one run, after a warm-up
  read of each; at 20,000 records and at 200,000 (1,000,000 in a full run), beside
  what a Python data source of two rows costs Spark per job (the floor a small replay
  cannot go under).
* **Batch sink**: records/s of ``df.write.format("ziplog")`` writing generated rows from
  two partitions, with ``ordered`` true (each row after the one before it) and false
  (pipelined).
* **Streaming latency**: a writer inserts records carrying their insert time; a
  streaming query (``processingTime`` 0: one micro-batch after another) hands each batch
  to ``foreachBatch`` on the driver, which notes when each row arrived: insert to row in
  the sink, p50 and p99.

    python -m bench spark [--quick] [--out DIR]
"""

from __future__ import annotations

import asyncio
import struct
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from ziplog.tools.stats import summarize

from ..report import Results, histogram

COLUMNS = ["measure", "system", "records", "seconds", "records_per_s", "p50_ms", "p99_ms"]
STAMP = struct.Struct("<q")


def params_for(quick: bool) -> dict[str, Any]:
    return {"quick": quick, "small_records": 20_000, "records": 200_000 if quick else 1_000_000,
            "sink_records": 20_000 if quick else 100_000, "record_bytes": 100, "shards": 2,
            "replicas": 2, "stream_seconds": 8.0 if quick else 20.0, "stream_rate": 100}


class TwoRows(DataSource):  # type: ignore[misc]
    """A Python data source of two one-row partitions: Spark's cost per job, whatever the source."""

    @classmethod
    def name(cls) -> str:
        return "bench_two_rows"

    def schema(self) -> str:
        return "gsn LONG, data BINARY"

    def reader(self, schema: Any) -> "DataSourceReader":
        return _TwoRowsReader()


class _TwoRowsReader(DataSourceReader):  # type: ignore[misc]
    def partitions(self) -> list[InputPartition]:
        return [InputPartition(0), InputPartition(1)]

    def read(self, partition: InputPartition) -> Iterator[tuple[int, bytes]]:
        yield (partition.value, b"x")


async def _load(zk: str, n: int, size: int) -> None:
    from ziplog.client.aio import AsyncClient
    payload = b"x" * size
    async with AsyncClient(zk) as c:
        sem = asyncio.Semaphore(64)

        async def one() -> None:
            async with sem:
                await c.insert_after(payload)
        await asyncio.gather(*(one() for _ in range(n)))


def run(quick: bool, out: Path | None) -> list[dict[str, Any]]:
    p = params_for(quick)
    res = Results("spark", out, p)
    from pyspark.sql import functions as F

    import ziplog
    from ziplog.client.aio import run as arun
    from ziplog.spark import local_session

    rows: list[dict[str, Any]] = []
    with ziplog.local_cluster(shards=p["shards"], replicas=p["replicas"]) as cluster:
        spark = local_session("bench-spark")
        try:
            # -- batch replay, at two sizes: a small one shows Spark's fixed cost per job -------
            with cluster.client() as c:
                start = c.watermark()
            end = start
            loaded = 0
            for size in (p["small_records"], p["records"]):
                res.log(f"inserting {size - loaded} records of {p['record_bytes']} bytes")
                arun(_load(cluster.zk_hosts, size - loaded, p["record_bytes"]))
                loaded = size
                with cluster.client() as c:
                    end = c.watermark()
                    while sum(c.count_range(s, start + 1, end)[0] for s in range(p["shards"])) < size:
                        end = c.watermark()

                def spark_read() -> int:
                    df = (spark.read.format("ziplog").option("zk", cluster.zk_hosts)
                          .option("startingOffsets", f'{{"gsn": {start}}}')
                          .option("endingOffsets", f'{{"gsn": {end}}}').load())
                    got = df.agg(F.count("*").alias("n"), F.sum(F.length("data")).alias("b")).collect()[0]
                    return int(got["n"])

                def subscribe_read() -> int:
                    n = 0
                    with cluster.client() as c, c.subscribe(ziplog.RecordId(start + 1, -1), end=end) as sub:
                        for _ in sub:
                            n += 1
                    return n

                for name, fn in (("Spark format(\"ziplog\")", spark_read), ("Client.subscribe", subscribe_read)):
                    fn()  # warm-up: JVM, Python workers, connections
                    t0 = time.perf_counter()
                    n = fn()
                    dt = time.perf_counter() - t0
                    assert n == size, (name, n)
                    rows.append({"measure": "batch replay", "system": name, "records": n, "seconds": round(dt, 2),
                                 "records_per_s": round(n / dt)})
                    res.log(f"{name}: {n} records in {dt:.2f} s")

            # what any Python data source costs Spark per job: two partitions of one row each
            spark.dataSource.register(TwoRows)
            spark.read.format(TwoRows.name()).load().agg(F.count("*")).collect()
            t0 = time.perf_counter()
            spark.read.format(TwoRows.name()).load().agg(F.count("*"), F.sum(F.length("data"))).collect()
            dt = time.perf_counter() - t0
            rows.append({"measure": "batch replay", "system": "Spark job floor (a Python source of 2 rows)",
                         "records": 2, "seconds": round(dt, 2), "records_per_s": None})
            res.log(f"Spark job floor: {dt:.2f} s")

            # -- the sink ------------------------------------------------------------------------------
            def sink_write(n: int, ordered: bool, write_id: str) -> None:
                pad = "x" * (p["record_bytes"] - 8)
                df = spark.range(n, numPartitions=2).select(
                    F.concat(F.lit(pad), F.lpad(F.col("id").cast("string"), 8, "0")).cast("binary").alias("data"))
                (df.write.format("ziplog").option("zk", cluster.zk_hosts).option("writeId", write_id)
                 .option("ordered", str(ordered).lower()).mode("append").save())

            def settled(after: int, want: int) -> tuple[int, int]:
                """(records past ``after``, a watermark that covers ``want`` of them)."""
                with cluster.client() as c:
                    while True:
                        w = c.watermark()
                        n = sum(c.count_range(s, after + 1, w)[0] for s in range(p["shards"]))
                        if n >= want:
                            return n, w

            with cluster.client() as c:
                before = c.watermark()
            sink_write(200, True, "bench-warm-up")
            _, before = settled(before, 200)
            for ordered in (True, False):
                t0 = time.perf_counter()
                sink_write(p["sink_records"], ordered, f"bench-sink-{ordered}")
                dt = time.perf_counter() - t0
                n, before = settled(before, p["sink_records"])
                assert n == p["sink_records"], n
                name = f'df.write.format("ziplog"), ordered={str(ordered).lower()}'
                rows.append({"measure": "batch sink", "system": name, "records": n, "seconds": round(dt, 2),
                             "records_per_s": round(n / dt)})
                res.log(f"{name}: {n} records in {dt:.2f} s")

            # -- streaming latency ------------------------------------------------------------------
            arrivals: list[int] = []

            def sink(batch: Any, batch_id: int) -> None:
                now = time.time_ns()
                for r in batch.select("data").collect():
                    (t,) = STAMP.unpack_from(bytes(r.data))
                    arrivals.append(now - t)

            with cluster.client() as c:
                from_gsn = c.watermark()
            q = (spark.readStream.format("ziplog").option("zk", cluster.zk_hosts)
                 .option("startingOffsets", f'{{"gsn": {from_gsn}}}').load()
                 .writeStream.foreachBatch(sink).trigger(processingTime="0 seconds").start())
            stop = threading.Event()
            written = [0]

            def writer() -> None:
                with cluster.client() as w:
                    gap = 1.0 / p["stream_rate"]
                    while not stop.is_set():
                        w.insert_after(STAMP.pack(time.time_ns()) + b"y" * (p["record_bytes"] - STAMP.size))
                        written[0] += 1
                        time.sleep(gap)

            try:
                deadline = time.monotonic() + 120
                while not q.recentProgress:  # the query runs
                    if time.monotonic() > deadline:
                        raise RuntimeError("the streaming query did not start")
                    q.awaitTermination(0.2)  # type: ignore[arg-type]
                th = threading.Thread(target=writer)
                th.start()
                time.sleep(p["stream_seconds"])
                stop.set()
                th.join()
                q.processAllAvailable()
            finally:
                q.stop()
            s = summarize(arrivals)
            rows.append({"measure": "streaming insert -> sink", "system": "Spark format(\"ziplog\")",
                         "records": len(arrivals), "seconds": p["stream_seconds"], "records_per_s": None,
                         "p50_ms": round(s["p50_us"] / 1000, 1), "p99_ms": round(s["p99_us"] / 1000, 1),
                         "p50_us": s["p50_us"], "histogram": histogram(arrivals)})
            assert len(arrivals) == written[0], (len(arrivals), written[0])
        finally:
            spark.stop()
    res.cdf_figure([r for r in rows if "histogram" in r], "measure", "insert -> row in foreachBatch (us)",
                   "Streaming end-to-end latency")
    res.write(rows, COLUMNS, "Spark replay: batch records/s and streaming latency",
              intro=f"{p['shards']} shards x {p['replicas']} replicas; records of {p['record_bytes']} bytes; "
                    "local[2] Spark on the same two cores.")
    return rows
