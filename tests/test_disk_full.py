"""A full disk is a state, not a crash, against real processes: both replicas of shard 0
keep their segment files on one small tmpfs each (they write nearly the same bytes, so
they fill together, or within a few KiB of each other). Inserts fill it; the client gets DiskFullError when pinned
to the shard and moves to the other shard when it may; no replica crashes or restarts;
every acknowledged record is delivered once to two subscribers; a trim gives space back
and the shard takes inserts again by itself, also when every record sits in the one open
segment; no empty segment files are left behind.

Mounting needs root (these machines have it); elsewhere the test is skipped."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

import ziplog
from tests.load import Load, trim_and_resume, wait_status
from ziplog.protocol.types import Policy, RecordId

TMPFS_BYTES = 1 << 20
SEGMENT_BYTES = 64 << 10
RECORD = b"r" * (12 << 10)


def _mount(path: Path) -> str | None:
    """Mount a small tmpfs at ``path``; why not, or None."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(path)],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    return None if out.returncode == 0 else (out.stderr.strip() or f"mount exited {out.returncode}")


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


@pytest.fixture(scope="module", params=[SEGMENT_BYTES, None], ids=["small-segments", "one-segment"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ziplog.LocalCluster]:
    """Segments of 64 KiB (a trim deletes whole old ones), or the default 64 MiB: every
    record in the one open segment, which a trim must replace to free anything."""
    data = tmp_path_factory.mktemp("diskfull")
    small = [data / "segments" / f"shard0-replica{r}" for r in range(2)]
    mounted = []
    try:
        for path in small:
            why = _mount(path)
            if why is not None:
                pytest.skip(f"cannot mount a small tmpfs for a replica's data directory: {why}")
            mounted.append(path)
        args = [] if request.param is None else ["--segment-bytes", str(request.param)]
        with ziplog.local_cluster(shards=2, replicas=2, data_dir=data, server_args=args) as c:
            c.small_dirs = small  # type: ignore[attr-defined]
            c.one_segment = request.param is None  # type: ignore[attr-defined]
            yield c
    finally:
        for path in mounted:
            _umount(path)


def _disk_states(client: ziplog.Client, shard: int) -> list[str]:
    return [st["disk"] for st in wait_status(client, [shard])[shard]]


def test_a_full_disk_refuses_new_records_loses_none_and_recovers_after_a_trim(cluster: ziplog.LocalCluster) -> None:
    subs = Load(cluster, writers=0)  # two subscribers from genesis
    acked: dict[RecordId, bytes] = {}
    pinned = cluster.client(timeout=20, policy=Policy.fixed(0))
    roaming = cluster.client(timeout=20)
    try:
        # -- fill shard 0's disks ------------------------------------------------------------
        refused = None
        for n in range(4 * TMPFS_BYTES // len(RECORD)):
            data = RECORD + f"-{n}".encode()
            try:
                rid = pinned.insert_after(data)
            except ziplog.DiskFullError as exc:
                refused = exc
                break
            assert rid.shard == 0
            acked[rid] = data
        assert refused is not None, "a 1 MiB disk took 4 MiB of records"
        if cluster.one_segment:  # type: ignore[attr-defined]
            assert all(len(list(d.glob("seg-*.log"))) == 1 for d in cluster.small_dirs)  # type: ignore[attr-defined]
        states = _disk_states(pinned, 0)
        # the replica that refused is full; the other usually is too, but may still have a
        # few KiB (their files are not byte for byte the same: a backup also writes its
        # guesses), and no other disk error may show
        assert any("ENOSPC" in s for s in states) and all(s == "ok" or "ENOSPC" in s for s in states), states
        # -- the shard serves what it holds; writers that may choose go elsewhere ---------------
        some = sorted(acked)[len(acked) // 2]
        assert pinned.read_record(some) == acked[some]
        for n in range(20):
            data = f"elsewhere-{n}".encode()
            rid = roaming.insert_after(data)
            assert rid.shard == 1, "a full shard took a new record"
            acked[rid] = data
        assert not [r for r in cluster.restarts if r[1] == 0], "a replica of the full shard restarted"
        assert all(cluster.servers[(0, r)].poll() is None for r in range(2)), "a replica of the full shard died"
        # -- everything acknowledged reaches both subscribers -----------------------------------
        assert subs.wait_delivered(set(acked)), "acknowledged records not delivered while the disk was full"
        # -- a trim gives space back: the shard takes records again by itself -------------------
        top, resumed = trim_and_resume(pinned, acked, ziplog.DiskFullError, lambda: _disk_states(pinned, 0))
        deadline = time.monotonic() + 30
        assert resumed.shard == 0
        acked[resumed] = b"after the trim"
        # The primary took it; the backup, whose retry runs on its own clock, follows
        # (the insert needed only its ack of the primary's decision). Keep writing
        # until both say they write again.
        n, prev = 0, resumed
        while _disk_states(pinned, 0) != ["ok", "ok"] or n < 10:
            assert time.monotonic() < deadline, f"still full after the trim: {_disk_states(pinned, 0)}"
            prev = pinned.insert_after(f"again-{n}".encode(), prev)
            acked[prev] = f"again-{n}".encode()
            n += 1
        assert subs.wait_delivered({r for r in acked if r.gsn > top.gsn})
    finally:
        pinned.close()
        roaming.close()
        subs.stop_reading()
        got = subs.delivered
    # every acknowledged record once, at its rid, the same order for both
    for g in got:
        datas = [d for _, d in g]
        assert len(datas) == len(set(datas)), "a record delivered twice"
        by_rid = dict(g)
        assert all(by_rid[rid] == data for rid, data in acked.items()), "an acknowledged record lost or moved"
    assert got[0] == got[1][:len(got[0])] or got[1] == got[0][:len(got[1])]
    # restarts or retries never left empty segment files behind
    for d in cluster.small_dirs:  # type: ignore[attr-defined]
        empty = [p.name for p in d.glob("seg-*.log") if p.stat().st_size == 0]
        assert not empty, empty
