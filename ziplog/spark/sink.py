"""``df.write.format("ziplog")`` and ``df.writeStream.format("ziplog")``: each row's
``data`` becomes a record; an optional ``key`` column sends a row to the shard of its key.
Rows arrive as Arrow record batches.

**Order.** By default (``ordered`` true) the rows of one partition keep their order in
the log: each is inserted after the one before it (an InsertAfter chain, one insert in
flight per task). With ``ordered`` false a task pipelines its rows (``insert_many``, many
in flight: several times the records/s) and promises no order among them.

**Exactly once, and when.** Each task writes through a client whose id is derived from
(the streaming query's id, or the ``writeId`` option of a batch write; the micro-batch
id; the partition), whose sequence numbers start at 1, and whose rows go to shards fixed
by that id (or by their key), never moved to another shard: a task that cannot reach its
shard fails. A replica answers a resent (client id, sequence number) with the record it
already holds, so a task or a micro-batch that runs again writes nothing twice, provided
that:

* the input replays the same rows in the same order per partition (a deterministic
  plan over a replayable source, such as ziplog itself or files);
* the shard set did not change between the two runs (a key's shard and a partition's
  shard are chosen from the shards registered);
* the re-run comes while the replicas still hold the first run's records (not trimmed);
* a batch write sets ``writeId`` (without it, only retries within one job are covered:
  the id then comes from the job's stage);
* every shard holds what it acknowledged: two replicas or more per shard (f >= 1). A
  shard of one replica loses the records its replica had not written when that replica
  dies: a committed batch's rows are then gone for good, and a task that runs again
  finds some of its earlier run's rows and not others. It places a lost row anew, above
  the rows after it that survived (on another shard, or kept), and such a row then lies
  below the one written before it: an ordered write cannot keep the partition's order
  and fails with :class:`RerunConflictError`, each retry alike. So each task checks the
  replicas of every shard when it starts writing and refuses a shard of one replica
  with :class:`SingleReplicaError`, unless the write sets ``allowSingleReplica`` to true
  (a test cluster, a log whose loss is acceptable).
"""

from __future__ import annotations

import hashlib
import itertools
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)

from ziplog.protocol.errors import ReusedIdentityError, ZiplogError
from ziplog.spark.options import WriteOptions

#: replicas a shard needs for a re-run of a task to be exactly once (f >= 1)
MIN_REPLICAS = 2


class SingleReplicaError(ZiplogError):
    """The cluster has a shard of fewer than :data:`MIN_REPLICAS` replicas, and the write
    did not set ``allowSingleReplica``: a re-run of a task would not be exactly once."""

    def __init__(self, replicas: dict[int, int]) -> None:
        shards = ", ".join(f"shard {s} has {n}" for s, n in sorted(replicas.items()))
        super().__init__(
            f"the ziplog sink needs {MIN_REPLICAS} replicas or more per shard ({shards}): exactly-once for a task "
            f"that runs again relies on each shard holding what it acknowledged, and a shard of one replica loses "
            f"what that replica had not written when it dies; set the option allowSingleReplica to true to write "
            f"anyway, without that guarantee")
        self.replicas = replicas

    def __reduce__(self) -> tuple[type, tuple[dict[int, int]]]:
        return type(self), (self.replicas,)


class RerunConflictError(ZiplogError):
    """A task that runs again found one of its rows already in the log below the row
    written before it (:class:`ziplog.ReusedIdentityError`): the log lost part of what an
    earlier run of the task wrote, so the partition's order cannot be kept. Every retry
    fails alike."""


def check_replicas(replica_counts: dict[int, int], shards: list[int], allow_single: bool) -> None:
    """Refuse to write when one of ``shards`` has fewer than :data:`MIN_REPLICAS`
    replicas (``replica_counts``: the topology's), unless ``allow_single``."""
    few = {s: replica_counts.get(s, 0) for s in shards if replica_counts.get(s, 0) < MIN_REPLICAS}
    if few and not allow_single:
        raise SingleReplicaError(few)


@dataclass
class ZiplogCommitMessage(WriterCommitMessage):  # type: ignore[misc]
    partition: int
    records: int


def _task_identity(write_id: str | None) -> tuple[str, int]:
    from pyspark import TaskContext
    ctx = TaskContext.get()
    if ctx is None:  # outside Spark (a test calling write() directly)
        return f"{write_id or 'local'}/0", 0
    query = ctx.getLocalProperty("sql.streaming.queryId")
    batch = ctx.getLocalProperty("streaming.sql.batchId")
    if query is not None:
        basis = f"query {query}/batch {batch}"
    elif write_id is not None:
        basis = f"write {write_id}"
    else:
        basis = f"stage {ctx.stageId()}"
    return f"{basis}/partition {ctx.partitionId()}", ctx.partitionId()


def client_id_of(identity: str) -> int:
    return int.from_bytes(hashlib.blake2b(identity.encode(), digest_size=8).digest(), "big")


#: unordered writes go out in chunks of this many rows (counted from the partition's first
#: row, whatever Arrow batches Spark cut: a re-run numbers every row as the first run did)
UNORDERED_CHUNK = 4096


def _column(batch: Any, name: str) -> list[Any] | None:
    i = batch.schema.get_field_index(name)
    return None if i < 0 else batch.column(i).to_pylist()


def _rows(batches: Iterator[Any]) -> Iterator[tuple[Any, Any]]:
    """``(data, key)`` per row, from Arrow record batches; data as bytes (a string column
    is encoded as UTF-8)."""
    for batch in batches:
        datas = _column(batch, "data")
        if datas is None:
            raise ValueError("the ziplog sink needs a 'data' column (binary or string)")
        keys = _column(batch, "key") or [None] * len(datas)
        yield from zip(datas, keys)


def _as_bytes(value: Any, column: str) -> bytes:
    if value is None:
        raise ValueError(f"the ziplog sink got a null {column!r}")
    return value.encode() if isinstance(value, str) else bytes(value)


def write_batches(opts: WriteOptions, batches: Iterator[Any]) -> ZiplogCommitMessage:
    """Write one task's rows (Arrow record batches) to the log; see the module's
    documentation for order and exactly-once."""
    from ziplog.client.blocking import Client
    identity, partition = _task_identity(opts.write_id)
    with Client(opts.zk, client_id=client_id_of(identity), key_file=opts.key_file) as client:
        shards = client.topology.shards()
        if not shards:
            raise RuntimeError("the log has no shards")
        check_replicas(client.topology.replica_counts, shards, opts.allow_single_replica)
        home = shards[zlib.crc32(identity.encode()) % len(shards)]

        def shard_of(key: Any) -> int:
            return home if key is None else shards[zlib.crc32(_as_bytes(key, "key")) % len(shards)]

        write = write_ordered if opts.ordered else write_unordered
        n = write(client, _rows(batches), shard_of, identity)
    return ZiplogCommitMessage(partition, n)


def write_ordered(client: Any, rows: Iterator[tuple[Any, Any]], shard_of: Callable[[Any], int], identity: str) -> int:
    """Each row after the one before it, one insert in flight; the rows written. A row an
    earlier run left below the row before it fails the task (:class:`RerunConflictError`)."""
    from ziplog.protocol.types import RID_GENESIS, Policy
    after = RID_GENESIS
    current = None
    n = 0
    for data, key in rows:
        shard = shard_of(key)
        if shard != current:
            client.set_policy(Policy.fixed(shard))
            current = shard
        try:
            after = client.insert_after(_as_bytes(data, "data"), after)
        except ReusedIdentityError as exc:
            raise RerunConflictError(
                f"the ziplog sink's task {identity!r} cannot run again in order: its row {n + 1} is already in the "
                f"log at gsn {exc.rid.gsn} (shard {exc.rid.shard}), not above the gsn {exc.after_gsn} of the row "
                f"before it, because an earlier run of the task wrote it there and the log lost part of what that "
                f"run wrote (a shard of one replica loses what its replica had not written when it dies). This "
                f"partition's order cannot be kept, and every retry of the task fails alike; exactly-once re-runs "
                f"need {MIN_REPLICAS} replicas or more per shard (see the option allowSingleReplica). ({exc})"
            ) from exc
        n += 1
    return n


def write_unordered(client: Any, rows: Iterator[tuple[Any, Any]], shard_of: Callable[[Any], int],
                    identity: str) -> int:
    """A chunk's rows pipelined, a shard at a time in shard order, rows in their order;
    the rows written."""
    from ziplog.protocol.types import Policy
    chunk: list[tuple[Any, Any]] = []
    n = 0
    while True:
        chunk[:] = itertools.islice(rows, UNORDERED_CHUNK)
        if not chunk:
            break
        per_shard: dict[int, list[bytes]] = {}
        for data, key in chunk:
            per_shard.setdefault(shard_of(key), []).append(_as_bytes(data, "data"))
        for shard in sorted(per_shard):
            client.set_policy(Policy.fixed(shard))
            client.insert_many(per_shard[shard])
        n += len(chunk)
    return n


class ZiplogWriter(DataSourceArrowWriter):  # type: ignore[misc]
    def __init__(self, opts: WriteOptions) -> None:
        self.opts = opts

    def write(self, iterator: Iterator[Any]) -> ZiplogCommitMessage:
        return write_batches(self.opts, iterator)


class ZiplogStreamWriter(DataSourceStreamArrowWriter):  # type: ignore[misc]
    def __init__(self, opts: WriteOptions) -> None:
        self.opts = opts

    def write(self, iterator: Iterator[Any]) -> ZiplogCommitMessage:
        return write_batches(self.opts, iterator)

    def commit(self, messages: list[Any], batchId: int) -> None:
        pass  # every record is in the log once its task returned

    def abort(self, messages: list[Any], batchId: int) -> None:
        pass  # a re-run of the batch writes the same records under the same ids: no duplicates
