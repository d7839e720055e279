"""Micro-benchmarks of the hot paths (pytest-benchmark).

    .venv/bin/python -m pytest bench/micro.py --benchmark-only

Not part of ``make test``: numbers, not verdicts. Compare runs side by side
(``--benchmark-save`` / ``--benchmark-compare``), never a lone figure.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from ziplog.cores.merge import SubscriberMerge
from ziplog.cores.replica import ReplicaCore, ReplicaSettings
from ziplog.protocol import frames as wire
from ziplog.protocol.gsna import EpochConfig, EpochSchedule, SlotCursor, epoch_base

V = wire.PROTOCOL_VERSION
DATA = b"x" * 4096


@pytest.mark.parametrize("shards", [2, 100])
def test_slot_walk(benchmark: Any, shards: int) -> None:
    cfg = EpochConfig(1, tuple(range(shards)), tuple(1000 + 7 * i for i in range(shards)))

    def walk() -> None:
        cur = SlotCursor(EpochSchedule(cfg), 0)
        for k in range(200):
            cur.gsn(k)
    benchmark(walk)


def test_first_slot_after(benchmark: Any) -> None:
    sched = EpochSchedule(EpochConfig(1, (0, 1, 2, 3), (5000, 3000, 200, 200)))
    benchmark(sched.first_slot_after, 2, epoch_base(1) + 123_456)


def test_decode_insert(benchmark: Any) -> None:
    frame = wire.encode(wire.Insert(req_id=1, client_id=2, seq=3, after=4, data=DATA))
    benchmark(wire.decode_request, frame)


@pytest.mark.parametrize("replica", [0, 1])
def test_replica_insert(benchmark: Any, replica: int) -> None:
    core = ReplicaCore(ReplicaSettings(0, replica, 2))
    if replica == 0:
        core.on_request(b"b", wire.Hello(shard=0, replica=1, frontier=0, guessed_top=0), 0)
    core.on_epoch(EpochConfig(0, (0, 1), (1_000_000, 1_000_000)), 0)
    core.ready()
    seq = itertools.count(1)

    def insert() -> None:
        n = next(seq)
        core.on_request(b"c", wire.Insert(req_id=n, client_id=9, seq=n, after=0, data=DATA), 0)
        core.flush(0)
        core.ready()
    benchmark(insert)


def test_merge_two_shards(benchmark: Any) -> None:
    def run() -> None:
        m = SubscriberMerge(1)
        b = epoch_base(0)
        m.on_batch(0, [], [[0, 0, [0, 1]]], 0)
        for i in range(0, 200, 2):
            m.on_batch(0, [[b + i, DATA]], [], b + i)
            m.on_batch(1, [[b + i + 1, DATA]], [], b + i + 1)
            while m.pop() is not None:
                pass
    benchmark(run)


@pytest.mark.parametrize("records", [1, 20])
def test_segment_append(benchmark: Any, tmp_path: Any, records: int) -> None:
    """A batch of 4 KiB records written by the segment log (encoded, written, its index
    entry kept; no sync): the replica loop's disk cost per batch."""
    from ziplog.io.segments import SegmentLog
    from ziplog.protocol.events import FrontierEvent, RecordEvent, SnapshotEvent

    log = SegmentLog(tmp_path, fsync="never", segment_bytes=1 << 40, background=False)
    list(log.load())
    snap = SnapshotEvent([], 0, 0, 0)
    log.start(snap)
    gsn = itertools.count(1)

    def append() -> None:
        first = next(gsn)
        for _ in range(records - 1):
            next(gsn)
        evs: list[Any] = [RecordEvent(first + i, 0, 1, first + i, DATA) for i in range(records)]
        evs.append(FrontierEvent(first + records - 1, 1, 0))
        log.append(evs, snap)
    try:
        benchmark(append)
    finally:
        log.close()
