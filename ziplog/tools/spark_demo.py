"""``python -m ziplog.tools.spark_demo``: a streaming word count over a live writer, stopped and
restarted from its checkpoint.

Starts a local cluster and a local Spark (local[2], bound to 127.0.0.1); a writer
thread inserts sentences; a streaming query counts the words per trigger
(``format("ziplog")`` -> split -> groupBy -> count, state in its checkpoint); halfway
the query is stopped and started again on the same checkpoint; at the end the counts
must equal the words written (nothing lost, nothing counted twice). Exits non-zero if
they do not.

The query is stopped between batches: the writer pauses, the query takes what is there
(``processAllAvailable``), then ``stop()``. ``stop()`` interrupts the stream's thread and
cancels its jobs, and a batch cut short that way makes Spark log ERROR lines for what
the interruption broke (a shuffle fetch, a broadcast being stored) although nothing
failed; a query with no batch running has nothing to break.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any

WORDS = ["log", "shard", "epoch", "replica", "gsn", "spark", "stream", "order"]


class Writer:
    """Inserts sentences until stopped; :meth:`pause` returns once no insert is in
    flight and the log's watermark is past the last record, so a query that then
    catches up sees every record written."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.written: Counter[str] = Counter()
        self.stop = threading.Event()
        self.writing = threading.Event()  # cleared while paused
        self.writing.set()
        self.pen = threading.Lock()  # held through each insert
        self.last_gsn = 0

    def run(self) -> None:
        rng = random.Random(1)
        with self.cluster.client() as w:
            while not self.stop.is_set():
                if not self.writing.wait(0.05):
                    continue
                with self.pen:
                    if not self.writing.is_set():
                        continue
                    sentence = [rng.choice(WORDS) for _ in range(rng.randint(2, 6))]
                    self.last_gsn = w.insert_after(" ".join(sentence).encode()).gsn
                    self.written.update(sentence)
                time.sleep(0.002)

    def pause(self) -> None:
        self.writing.clear()
        with self.pen:  # no insert in flight
            pass
        with self.cluster.client() as c:
            while c.watermark() < self.last_gsn:
                time.sleep(0.01)

    def resume(self) -> None:
        self.writing.set()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ziplog.tools.spark_demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=6.0, help="how long each of the two runs follows the writer")
    args = ap.parse_args(argv)

    from pyspark.sql import functions as F

    import ziplog
    from ziplog.spark import SHORT_LIVED, foreach_batch, local_session

    print("starting a local cluster and a local Spark...", flush=True)
    with ziplog.local_cluster(shards=2, replicas=2) as cluster, tempfile.TemporaryDirectory() as tmp:
        spark = local_session("ziplog-demo", **SHORT_LIVED)
        try:
            with cluster.client() as c:
                start = c.watermark()
            writer = Writer(cluster)

            counts: dict[str, int] = {}

            def show(batch: object, batch_id: int) -> None:
                rows = batch.collect()  # type: ignore[attr-defined]
                counts.update({r.word: r["count"] for r in rows})
                print(f"  batch {batch_id}: {sum(counts.values())} words counted so far", flush=True)

            def run(label: str) -> None:
                words = (spark.readStream.format("ziplog").option("zk", cluster.zk_hosts)
                         .option("startingOffsets", f'{{"gsn": {start}}}').option("maxRecordsPerTrigger", "2000")
                         .load().select(F.explode(F.split(F.col("data").cast("string"), " ")).alias("word"))
                         .groupBy("word").count())
                q = (words.writeStream.outputMode("update").foreachBatch(foreach_batch(show))
                     .option("checkpointLocation", os.path.join(tmp, "ckpt")).trigger(processingTime="500 milliseconds")
                     .start())
                try:
                    print(f"{label}: following the writer for {args.seconds:g} s", flush=True)
                    deadline = time.monotonic() + 120
                    while not any(p["numInputRows"] for p in q.recentProgress):  # Spark's start takes a while
                        if time.monotonic() > deadline:
                            raise RuntimeError("the query processed nothing in two minutes")
                        q.awaitTermination(0.2)  # type: ignore[arg-type]  # seconds; a float works
                    q.awaitTermination(args.seconds)  # type: ignore[arg-type]
                    # stop between batches (the module's documentation): the writer
                    # pauses, the query catches up and starts no batch after that
                    writer.pause()
                    if label == "second run":
                        writer.stop.set()
                        th.join()
                    q.processAllAvailable()
                finally:
                    q.stop()
                    writer.resume()

            th = threading.Thread(target=writer.run)
            th.start()
            try:
                run("first run")
                print("query stopped; starting it again from its checkpoint", flush=True)
                run("second run")
            finally:
                writer.stop.set()
                th.join()
            written = writer.written
            ok = counts == dict(written)
            print(f"words written {sum(written.values())}, counted {sum(counts.values())}: "
                  f"{'exact' if ok else 'DIFFERENT'}")
            for w in WORDS:
                print(f"  {w:8s} written {written[w]:6d}  counted {counts.get(w, 0):6d}")
        finally:
            spark.stop()
    print("Spark demo: all checks passed" if ok else "Spark demo: A CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the query, Spark and the cluster were stopped on the way out
        print("Spark demo: interrupted", file=sys.stderr)
        sys.exit(130)
