"""A streaming query stopped in the middle of a batch ends without a stack trace: a
foreachBatch function cut short by ``query.stop()`` (through
:func:`ziplog.spark.foreach_batch`), and the Spark demo of ``make run`` (no ERROR line
either). Each runs in a
process of its own, whose whole output (the JVM's included) is checked."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

#: what a Java or Python stack trace prints
TRACE_MARKS = ("Exception in thread", "StackOverflowError", "Traceback (most recent call last)", "\tat ")

STOP_MID_BATCH = textwrap.dedent("""
    import threading
    from ziplog.spark import SHORT_LIVED, foreach_batch, local_session

    spark = local_session("stop-mid-batch", **SHORT_LIVED)
    try:
        in_batch = threading.Event()

        def batch(df, batch_id):
            in_batch.set()
            # a job that runs until the stop cancels it
            spark.range(1).rdd.map(lambda _: threading.Event().wait()).collect()

        q = spark.readStream.format("rate").load().writeStream.foreachBatch(foreach_batch(batch)).start()
        try:
            assert in_batch.wait(120), "no batch started"
        finally:
            q.stop()
        print("stopped, exception:", q.exception(), flush=True)
        tracker = spark.sparkContext.statusTracker()
        while tracker.getActiveJobsIds():  # the cancelled job ends before the session stops
            q.awaitTermination(0.1)
        # ... and so does its killed task, whose last status update would otherwise reach a
        # scheduler that spark.stop() already shut (Spark then logs a rejected execution).
        # The task scheduler's own count, not the status store's: that one drops to 0 when
        # the cancelled stage ends, before the kill's status update arrives.
        scheduler = spark.sparkContext._jsc.sc().taskScheduler()
        while scheduler.rootPool().runningTasks():
            q.awaitTermination(0.1)
        scheduler.runningTasksByExecutors()  # its lock: the update's hand-off is done

    finally:
        spark.stop()
""")


def _run(argv: list[str], env: dict[str, str] | None = None) -> str:
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout
    return done.stdout


def _no_trace(output: str) -> None:
    found = [line for line in output.splitlines() if any(mark in line for mark in TRACE_MARKS)]
    assert not found, "\n".join(found[:20])


def test_a_query_stopped_in_the_middle_of_foreach_batch_ends_quietly(tmp_path: Path) -> None:
    script = tmp_path / "stop_mid_batch.py"
    script.write_text(STOP_MID_BATCH)
    out = _run([sys.executable, str(script)])
    assert "stopped, exception: None" in out, out
    _no_trace(out)


def test_the_spark_demo_passes_and_prints_no_stack_trace_and_no_error(shared_zookeeper: str) -> None:
    # its local cluster under a root of this worker's ensemble rather than three JVMs more
    env = {**os.environ, "ZIPLOG_LOCAL_ZOOKEEPER": shared_zookeeper}
    out = _run([sys.executable, "-m", "ziplog.tools.spark_demo", "--seconds", "1"], env)
    assert "Spark demo: all checks passed" in out, out
    _no_trace(out)
    # nor an ERROR line of Spark's (log4j's "yy/MM/dd HH:mm:ss ERROR Logger: ..."): its
    # queries are stopped between batches, so no stop interrupts a shuffle or a broadcast
    errors = [line for line in out.splitlines() if re.search(r"\bERROR\b", line)]
    assert not errors, "\n".join(errors[:20])
