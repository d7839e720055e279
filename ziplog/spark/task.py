"""What a Spark task runs (in a Python worker process): the records of one partition,
read through a :class:`ziplog.Client` of the shard's replicas named in the partition
(``Client.direct``: no ZooKeeper round trip), or, if none of them answers (a replica
moved or died), through a :class:`ziplog.Client` that finds the replicas in ZooKeeper,
from just past the last record returned.

Records leave as Arrow record batches, one per RANGE page the replica answered (up to
about 1 MiB of data): Spark takes them as they are, without a Python row per record."""

from __future__ import annotations

import logging
from typing import Iterator

import numpy as np
import pyarrow as pa

from ziplog.client.blocking import Client
from ziplog.protocol.errors import TrimmedError, ZiplogError
from ziplog.protocol.gsna import EPOCH_BITS

log = logging.getLogger("ziplog.spark")

#: a replica named in the partition that does not answer within this long is passed over
DIRECT_TIMEOUT_S = 2.0

#: the rows' Arrow schema (SCHEMA in Spark's terms: gsn LONG, shard INT, epoch LONG, data BINARY)
ARROW_SCHEMA = pa.schema([("gsn", pa.int64()), ("shard", pa.int32()), ("epoch", pa.int64()),
                          ("data", pa.binary())])

Page = list[tuple[int, bytes]]


def read_pages(zk: str, shard: int, lo: int, hi: int, addrs: tuple[str, ...],
               key_file: str | None = None) -> Iterator[Page]:
    """Pages of ``(gsn, data)`` of ``shard`` with ``lo <= gsn <= hi``, in gsn order."""
    start = lo
    if addrs:
        try:
            with Client.direct({shard: addrs}, timeout=DIRECT_TIMEOUT_S * len(addrs), key_file=key_file) as direct:
                for page in direct.read_range_pages(shard, lo, hi):
                    start = page[-1][0] + 1
                    yield page
            return
        except TrimmedError:
            raise
        except ZiplogError as exc:
            log.info("shard %d: the replicas the plan named did not serve the range (%s); finding them in "
                     "ZooKeeper", shard, exc)
    with Client(zk, key_file=key_file) as client:
        yield from client.read_range_pages(shard, start, hi)


def record_batch(shard: int, page: Page) -> pa.RecordBatch:
    """One page as an Arrow record batch of ARROW_SCHEMA; the epoch column is computed
    from the gsns in numpy, with the integer arithmetic of ``gsna.epoch_of``."""
    gsns = np.fromiter((g for g, _ in page), dtype=np.int64, count=len(page))
    epochs = (gsns - 1) >> EPOCH_BITS
    data = pa.array([d for _, d in page], type=pa.binary())
    shards = pa.array(np.full(len(page), shard, dtype=np.int32))
    return pa.RecordBatch.from_arrays([pa.array(gsns), shards, pa.array(epochs), data], schema=ARROW_SCHEMA)


def read_partition(zk: str, shard: int, lo: int, hi: int, addrs: tuple[str, ...],
                   key_file: str | None = None) -> Iterator[pa.RecordBatch]:
    """The rows of ``shard`` with ``lo <= gsn <= hi`` as Arrow record batches, in gsn order."""
    for page in read_pages(zk, shard, lo, hi, addrs, key_file):
        yield record_batch(shard, page)


def rows_of(batch: pa.RecordBatch) -> list[tuple[int, int, int, bytes]]:
    """A batch's rows as ``(gsn, shard, epoch, data)`` tuples (tests, and readers that want
    Python objects)."""
    cols = [batch.column(i).to_pylist() for i in range(4)]
    return list(zip(*cols))

