"""Trim deletes records everywhere; a restarted cluster recovers its log from disk."""

from __future__ import annotations

from pathlib import Path

import pytest

import ziplog
from ziplog import RID_GENESIS


def test_segments_below_a_trim_are_deleted(tmp_path: Path) -> None:
    from ziplog.io.segments import SegmentLog
    from ziplog.protocol.events import RecordEvent, SnapshotEvent
    log = SegmentLog(tmp_path, fsync="never", segment_bytes=2000)
    list(log.load())
    log.start(SnapshotEvent([], 0, 0, 0))
    for g in range(1, 101):
        log.append([RecordEvent(g, 0, 1, g, b"x" * 100)], SnapshotEvent([], g, g, 0))
    before = len(log.segments())
    assert before > 3
    log.drop_below(60)
    kept = log.segments()
    assert len(kept) < before
    log.close()
    gsns = [ev.gsn for ev in SegmentLog(tmp_path).load() if isinstance(ev, RecordEvent)]
    assert gsns and min(gsns) < 60 <= max(gsns) and gsns == sorted(gsns)
    assert set(range(60, 101)) <= set(gsns), "nothing at or above the cut is lost"


def test_trim_then_restart_from_disk(tmp_path: Path) -> None:
    data_dir = tmp_path / "cluster"
    with ziplog.local_cluster(shards=2, replicas=2, data_dir=data_dir) as cluster:
        with cluster.client() as c:
            rid = RID_GENESIS
            rids = []
            for i in range(60):
                rid = c.insert_after(b"rec-%d" % i, rid)
                rids.append(rid)
            with c.subscribe(rids[0]) as sub:  # delivered = stable on every replica
                seen = [sub.next(timeout=30) for _ in rids]
            assert [r.rid for r in seen if r] == rids
            cut = rids[20]
            c.trim(cut)
            for r in rids[:20]:
                with pytest.raises(ziplog.TrimmedError):
                    c.read_record(r)
            assert c.read_record(cut) == b"rec-20"
            with pytest.raises(ziplog.TrimmedError):
                c.subscribe(rids[5]).next(timeout=30)
            with c.subscribe(RID_GENESIS) as sub:  # genesis after a trim: starts at the cut
                first = sub.next(timeout=30)
                assert first is not None and first.rid == cut
            last = rids[-1]
    # Every process is gone; bring the same cluster back on the same data directory.
    with ziplog.local_cluster(shards=2, replicas=2, data_dir=data_dir) as cluster:
        with cluster.client() as c:
            for i, r in enumerate(rids[20:], start=20):
                assert c.read_record(r) == b"rec-%d" % i
            with pytest.raises(ziplog.TrimmedError):
                c.read_record(rids[3])
            new = c.insert_after(b"after restart", last)
            assert new.gsn > last.gsn
            with c.subscribe(RID_GENESIS) as sub:
                got = []
                while not got or got[-1].rid != new:
                    rec = sub.next(timeout=30)
                    assert rec is not None
                    got.append(rec)
            assert [r.rid for r in got] == rids[20:] + [new]
