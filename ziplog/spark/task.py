"""What a Spark task runs (in a Python worker process): the records of one partition,
read through a :class:`ziplog.Client` of the shard's replicas named in the partition
(``Client.direct``: no ZooKeeper round trip), or, if none of them answers (a replica
moved or died), through a :class:`ziplog.Client` that finds the replicas in ZooKeeper,
from just past the last record returned."""

from __future__ import annotations

import logging
from typing import Iterator

from ziplog.client.blocking import Client
from ziplog.protocol.errors import TrimmedError, ZiplogError
from ziplog.protocol.gsna import epoch_of

log = logging.getLogger("ziplog.spark")

#: a replica named in the partition that does not answer within this long is passed over
DIRECT_TIMEOUT_S = 2.0

Row = tuple[int, int, int, bytes]


def read_partition(zk: str, shard: int, lo: int, hi: int, addrs: tuple[str, ...]) -> Iterator[Row]:
    """Rows ``(gsn, shard, epoch, data)`` of ``shard`` with ``lo <= gsn <= hi``, in gsn order."""
    start = lo
    if addrs:
        try:
            with Client.direct({shard: addrs}, timeout=DIRECT_TIMEOUT_S * len(addrs)) as direct:
                for rec in direct.read_range(shard, lo, hi):
                    g = rec.rid.gsn
                    start = g + 1
                    yield (g, shard, epoch_of(g), rec.data)
            return
        except TrimmedError:
            raise
        except ZiplogError as exc:
            log.info("shard %d: the replicas the plan named did not serve the range (%s); finding them in "
                     "ZooKeeper", shard, exc)
    with Client(zk) as client:
        for rec in client.read_range(shard, start, hi):
            yield (rec.rid.gsn, shard, epoch_of(rec.rid.gsn), rec.data)
