"""Spark replay: ``format("ziplog")`` for batch and streaming reads, and a sink.

    from ziplog.spark import register
    register(spark)
    df = spark.read.format("ziplog").option("zk", hosts).load()
    q = (spark.readStream.format("ziplog").option("zk", hosts).option("maxRecordsPerTrigger", 10000).load()
         .writeStream.format("parquet").option("checkpointLocation", ckpt).start(out))

Needs the extra ``ziplog[spark]`` (pyspark 4.3). Options, offsets and the exactly-once
conditions: :mod:`ziplog.spark.source`, :mod:`ziplog.spark.sink`, the README.
"""

from __future__ import annotations

from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceWriter,
)
from pyspark.sql.types import StructType

from ziplog.spark.options import ReadOptions, WriteOptions
from ziplog.spark.quiet import QueryStopped, foreach_batch
from ziplog.spark.sink import RerunConflictError, SingleReplicaError, ZiplogStreamWriter, ZiplogWriter
from ziplog.spark.source import SCHEMA, ZiplogBatchReader, ZiplogStreamReader

__all__ = ["register", "local_session", "foreach_batch", "QueryStopped", "ZiplogDataSource", "SCHEMA", "SHORT_LIVED",
           "SingleReplicaError", "RerunConflictError"]

#: settings for a session that lives a few seconds (a demo, a test): the JVM's client
#: compiler only and its serial collector start Spark sooner on less CPU (a Spark start
#: and a small job: 0.86x the time, side by side); a long job runs faster without them
SHORT_LIVED: dict[str, str] = {"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"}


class ZiplogDataSource(DataSource):  # type: ignore[misc]
    @classmethod
    def name(cls) -> str:
        return "ziplog"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return ZiplogBatchReader(ReadOptions.parse(self.options, streaming=False))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return ZiplogStreamReader(ReadOptions.parse(self.options, streaming=True))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        return ZiplogWriter(WriteOptions.parse(self.options))

    def streamWriter(self, schema: StructType, overwrite: bool) -> Any:
        return ZiplogStreamWriter(WriteOptions.parse(self.options))


def register(spark: Any) -> None:
    """Register the short name ``ziplog`` with a Spark session (and guard the session's
    Py4J connections against forks from other threads: see
    :func:`guard_py4j_connections_across_forks`)."""
    guard_py4j_connections_across_forks()
    spark.dataSource.register(ZiplogDataSource)


_guarded_pid: int | None = None


def guard_py4j_connections_across_forks() -> None:
    """Keep a child forked from one thread from closing the Py4J connections of the
    parent's other threads.

    Py4J (pinned-thread mode, PySpark's default) gives each Python thread its own
    connection, closed by a finalizer in a thread-local when the thread ends. A fork
    from another thread (``subprocess.Popen`` with ``preexec_fn``, as ziplog's local
    cluster does when it restarts a replica; ``multiprocessing`` with fork) deletes the
    other threads' states in the child, so their finalizers run there and shut the
    shared sockets down (``shutdown``, not just ``close``): the parent's next call on
    that thread finds its connection reset and opens a new one, served by a new JVM
    thread. That thread has no active SparkSession, and Spark looks a Python data
    source up in the calling thread's active session: every later query on a
    session-registered source fails with DATA_SOURCE_NOT_FOUND. The finalizer is made
    to do nothing outside the process that installed this guard."""
    global _guarded_pid
    import os

    from py4j import clientserver
    if _guarded_pid is not None:
        return
    _guarded_pid = owner = os.getpid()
    original = clientserver.ThreadLocalConnectionFinalizer.__del__

    def __del__(self: Any) -> None:
        if os.getpid() == owner:  # in a forked child the sockets are the parent's
            original(self)
    clientserver.ThreadLocalConnectionFinalizer.__del__ = __del__


def local_session(app_name: str = "ziplog", **conf: str) -> Any:
    """A local Spark session (``local[2]``, bound to 127.0.0.1, no UI) whose Python
    workers run this interpreter (they import ziplog, and pyspark from its installation:
    :mod:`ziplog.spark.home`), with ``ziplog`` registered. Stop
    it when done (``session.stop()``, in a ``finally``)."""
    import os
    import sys

    from pyspark.sql import SparkSession

    from ziplog.spark.home import spark_home
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    home = spark_home()  # its workers import the installed pyspark, with its bytecode
    if home is not None:
        os.environ["SPARK_HOME"] = home
    os.environ["PYSPARK_PYTHON"] = os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    builder = (SparkSession.builder.master("local[2]").appName(app_name)
               .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "2"))
    for k, v in conf.items():
        builder = builder.config(k, v)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    return session
