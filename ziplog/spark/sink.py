"""``df.write.format("ziplog")`` and ``df.writeStream.format("ziplog")``: each row's
``data`` becomes a record; rows of one partition keep their order in the log
(InsertAfter chains); an optional ``key`` column sends a row to the shard of its key.

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
  the id then comes from the job's stage).
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass
from typing import Any, Iterator

from pyspark.sql.datasource import (
    DataSourceStreamWriter,
    DataSourceWriter,
    WriterCommitMessage,
)

from ziplog.spark.options import WriteOptions


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


def write_rows(opts: WriteOptions, rows: Iterator[Any]) -> ZiplogCommitMessage:
    from ziplog.client.blocking import Client
    from ziplog.protocol.types import RID_GENESIS, Policy
    identity, partition = _task_identity(opts.write_id)
    n = 0
    with Client(opts.zk, client_id=client_id_of(identity)) as client:
        shards = client.topology.shards()
        if not shards:
            raise RuntimeError("the log has no shards")
        home = shards[zlib.crc32(identity.encode()) % len(shards)]
        client.set_policy(Policy.fixed(home))
        after = RID_GENESIS
        for row in rows:
            d = row.asDict() if hasattr(row, "asDict") else dict(row)
            data = d.get("data")
            if data is None:
                raise ValueError("the ziplog sink needs a 'data' column (binary or string)")
            if isinstance(data, str):
                data = data.encode()
            key = d.get("key")
            if key is not None:
                kb = key.encode() if isinstance(key, str) else bytes(key)
                client.set_policy(Policy.fixed(shards[zlib.crc32(kb) % len(shards)]))
            after = client.insert_after(bytes(data), after)
            if key is not None:
                client.set_policy(Policy.fixed(home))
            n += 1
    return ZiplogCommitMessage(partition, n)


class ZiplogWriter(DataSourceWriter):  # type: ignore[misc]
    def __init__(self, opts: WriteOptions) -> None:
        self.opts = opts

    def write(self, iterator: Iterator[Any]) -> ZiplogCommitMessage:
        return write_rows(self.opts, iterator)


class ZiplogStreamWriter(DataSourceStreamWriter):  # type: ignore[misc]
    def __init__(self, opts: WriteOptions) -> None:
        self.opts = opts

    def write(self, iterator: Iterator[Any]) -> ZiplogCommitMessage:
        return write_rows(self.opts, iterator)

    def commit(self, messages: list[Any], batchId: int) -> None:
        pass  # every record is in the log once its task returned

    def abort(self, messages: list[Any], batchId: int) -> None:
        pass  # a re-run of the batch writes the same records under the same ids: no duplicates
