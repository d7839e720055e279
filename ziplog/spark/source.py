"""``spark.read.format("ziplog")`` and ``spark.readStream.format("ziplog")``.

Rows: ``gsn LONG, shard INT, epoch LONG, data BINARY``, in gsn order within a partition
(a partition is one shard's gsn range), handed to Spark as Arrow record batches (one per
page a replica answers, no Python object per row). Offsets are ``{"gsn": W}``, W at or below the
log's stable-prefix watermark, exclusive as a start (the first row has a gsn above it)
and inclusive as an end; an idle log yields no batch (the offset stays put until a
record lies past it).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Iterator, Sequence

import pyarrow as pa

from pyspark.sql.datasource import (
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from ziplog.spark import plan
from ziplog.spark.options import ReadOptions
from ziplog.spark.task import read_partition

log = logging.getLogger("ziplog.spark")

SCHEMA = "gsn LONG, shard INT, epoch LONG, data BINARY"


class _Planner:
    """A driver-side client, opened when first needed and never pickled to tasks."""

    opts: ReadOptions
    _client: Any = None

    def client(self) -> Any:
        if self._client is None:
            from ziplog.client.blocking import Client
            self._client = Client(self.opts.zk, key_file=self.opts.key_file)
        return self._client

    def close_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None
        return state

    def _start_gsn(self) -> int:
        c = self.client()
        if self.opts.starting == "earliest":
            return plan.trim_floor(c)
        if self.opts.starting == "latest":
            return int(c.watermark())
        assert isinstance(self.opts.starting, int)
        return self.opts.starting


class ZiplogBatchReader(_Planner, DataSourceReader):  # type: ignore[misc]
    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts

    def partitions(self) -> Sequence[InputPartition]:
        try:
            c = self.client()
            start = self._start_gsn()
            w = int(c.watermark())
            end = w if self.opts.ending == "latest" else min(int(self.opts.ending), w)
            if end <= start:
                return []
            per_shard, start = plan.counts(c, start, end, self.opts.fail_on_data_loss)
            return plan.partitions(c, self.opts.zk, start, end, per_shard, self.opts.records_per_partition,
                                   self.opts.min_partitions, self.opts.key_file)
        finally:
            self.close_client()

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, plan.ZiplogPartition)
        yield from read_partition(partition.zk, partition.shard, partition.lo, partition.hi, partition.addrs,
                                  partition.key_file)


class ZiplogStreamReader(_Planner, DataSourceStreamReader, SupportsTriggerAvailableNow):  # type: ignore[misc]
    #: what maxTriggerDelay is measured with (a test passes a clock it moves itself)
    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts
        #: Trigger.AvailableNow: no offset beyond the watermark when the query started
        self._target: int | None = None
        self._last_batch_at = self.clock()

    # -- offsets ----------------------------------------------------------------------------------
    def initialOffset(self) -> dict[str, int]:
        return {"gsn": self._start_gsn()}

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = int(self.client().watermark())

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_records_per_trigger:
            return ReadMaxRows(self.opts.max_records_per_trigger)
        return ReadAllAvailable()

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, int]:
        c = self.client()
        after = _gsn(start)
        w = int(c.watermark())
        if self._target is not None:
            w = min(w, self._target)
        if w <= after:
            return {"gsn": after}
        per_shard, counted_from = plan.counts(c, after, w, self.opts.fail_on_data_loss)
        total = sum(per_shard.values())
        if total == 0:
            return {"gsn": after}  # nothing new: no batch (the watermark alone moved)
        least = self.opts.min_records_per_trigger
        if (least and total < least and self._target is None
                and self.clock() - self._last_batch_at < self.opts.max_trigger_delay_s):
            return {"gsn": after}  # wait for more, up to maxTriggerDelay
        end = w
        if isinstance(limit, ReadMaxRows) and total > limit.max_rows:
            end = plan.nth_record(c, counted_from, w, limit.max_rows)
        self._last_batch_at = self.clock()
        return {"gsn": end}

    def reportLatestOffset(self) -> dict[str, int] | None:
        try:
            return {"gsn": int(self.client().watermark())}
        except Exception:
            return None

    # -- batches ----------------------------------------------------------------------------------
    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        after, upto = _gsn(start), _gsn(end)
        if upto <= after:
            return []
        c = self.client()
        per_shard, after = plan.counts(c, after, upto, self.opts.fail_on_data_loss)
        return plan.partitions(c, self.opts.zk, after, upto, per_shard, self.opts.records_per_partition,
                               self.opts.min_partitions, self.opts.key_file)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, plan.ZiplogPartition)
        yield from read_partition(partition.zk, partition.shard, partition.lo, partition.hi, partition.addrs,
                                  partition.key_file)

    def commit(self, end: dict[str, Any]) -> None:
        pass  # the log keeps everything until it is trimmed; nothing to release

    def stop(self) -> None:
        self.close_client()


def _gsn(offset: Any) -> int:
    if isinstance(offset, str):
        offset = json.loads(offset)
    gsn = offset["gsn"]
    if type(gsn) is not int or gsn < 0:
        raise ValueError(f"not a ziplog offset: {offset!r}")
    return gsn
