"""Planning on the driver, with a blocking :class:`ziplog.Client`: offsets, how many
records lie between two offsets, where the n-th of them is, and the partitions of a
range. Everything is counted with COUNT requests: planning moves no data.

Offsets are gsns: ``{"gsn": W}`` means every record with a gsn <= W was read; W is a
stable-prefix watermark (``Client.watermark()``) or the gsn of a record below it, so no
record can appear at or below an offset later.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import InputPartition

from ziplog.protocol.errors import TrimmedError, ZiplogError

log = logging.getLogger("ziplog.spark")


class DataLossError(ZiplogError):
    """The query's offset lies below the log's trim point: records it has not read are
    gone. Set failOnDataLoss=false to skip to the trim point instead."""


@dataclass
class ZiplogPartition(InputPartition):  # type: ignore[misc]
    """Records of ``shard`` with ``lo <= gsn <= hi``; ``addrs``: its replicas when
    planned (the task tries them before asking ZooKeeper)."""
    shard: int
    lo: int
    hi: int
    addrs: tuple[str, ...]
    zk: str
    #: the reader's client key (option keyFile; None: $ZIPLOG_CLIENT_KEY_FILE, or none)
    key_file: str | None = None


def shards(client: Any) -> list[int]:
    """Every shard ever registered (a removed shard keeps its records)."""
    return list(client.topology.shards())


def trim_floor(client: Any) -> int:
    """The highest trim point of any replica, minus one: the earliest offset whose
    records are all still there."""
    points = [r.get("trim_point", 0) for reps in client.status().values() for r in reps]
    return max([0, *[p - 1 for p in points if isinstance(p, int)]])


def counts(client: Any, after: int, upto: int, fail_on_data_loss: bool) -> tuple[dict[int, int], int]:
    """Records per shard with ``after < gsn <= upto``, and the offset they were counted
    from: ``after``, or (failOnDataLoss=false) the trim point when ``after`` lies below it."""
    while True:
        try:
            return {s: client.count_range(s, after + 1, upto)[0] for s in shards(client)}, after
        except TrimmedError as exc:
            floor = trim_floor(client)
            if fail_on_data_loss:
                raise DataLossError(
                    f"offset {{\"gsn\": {after}}} lies below the log's trim point (gsn {floor + 1}): records "
                    f"in ({after}, {floor}] are gone. Set failOnDataLoss=false to skip them") from exc
            log.warning("records with gsns in (%d, %d] were trimmed before they were read: skipped them "
                        "(failOnDataLoss=false)", after, floor)
            after = max(after, floor)


def nth_record(client: Any, after: int, upto: int, n: int) -> int:
    """The gsn of the n-th record (1-based) after ``after``, over every shard: the
    smallest g with n records in (after, g]. Each shard's own n-th bounds it above."""
    assert n >= 1
    hi = upto
    for s in shards(client):
        _, g, _ = client.count_range(s, after + 1, upto, nth=n)
        if g:
            hi = min(hi, g)
    lo = after  # count(after, lo] < n <= count(after, hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if sum(client.count_range(s, after + 1, mid)[0] for s in shards(client)) >= n:
            hi = mid
        else:
            lo = mid
    return hi


def partitions(client: Any, zk: str, after: int, upto: int, per_shard: dict[int, int], records_per_partition: int,
               min_partitions: int | None, key_file: str | None = None) -> list[ZiplogPartition]:
    """Per shard, the range (after, upto], split so that a partition holds at most
    ``records_per_partition`` records and there are at least ``min_partitions``."""
    total = sum(per_shard.values())
    if total == 0:
        return []
    per = max(1, records_per_partition)
    if min_partitions:
        per = min(per, max(1, -(-total // min_partitions)))
    out: list[ZiplogPartition] = []
    for s in sorted(per_shard):
        n = per_shard[s]
        if n == 0:
            continue
        addrs = client.topology.registered_addrs(s)
        lo = after + 1
        left = n
        while left > per:
            _, cut, _ = client.count_range(s, lo, upto, nth=per)
            out.append(ZiplogPartition(s, lo, cut, addrs, zk, key_file))
            lo, left = cut + 1, left - per
        out.append(ZiplogPartition(s, lo, upto, addrs, zk, key_file))
    return out
