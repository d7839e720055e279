"""Experiment ``rolling``: a rolling restart under a live writer and subscriber.

A local cluster (3 ZooKeeper nodes, 3 MMS and 3 failure handler replicas, 2 shards x 2
storage replicas) has every process restarted one at a time
(``LocalCluster.rolling_restart``: ZooKeeper followers then leader, MMS, failure
handlers, then each shard's backup then primary), while writer threads insert
InsertAfter chains (default policy) and a subscriber follows the log. Per process kind:
how many were restarted, the longest time no insert was acknowledged and no record was
delivered while one of that kind was down or coming back, and the longest time one took
to be back (a storage replica's successor starts up while the old one still serves:
``--take-over``); how many failure recoveries the restarts started (none is the aim: a
primary stopped gracefully vouches for its log); and the check: every acknowledged record
delivered exactly once.

    python -m bench rolling [--quick] [--out DIR]
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from ..report import Results

COLUMNS = ["kind", "restarts", "write_stall_ms", "subscriber_stall_ms", "back_in_s"]


def _gap(times: list[float], start: float, end: float) -> float:
    inside = [start] + [t for t in times if start < t < end] + [end]
    return max(b - a for a, b in zip(inside, inside[1:]))


def _recovery_generations(cluster: Any) -> dict[int, int]:
    """Each shard's latest failure recovery generation in ZooKeeper (-1: none yet)."""
    from ziplog.io.zk_recovery import read_record

    out = {}
    for shard in cluster.shard_ids:
        rec = read_record(cluster._zkc, cluster.key, shard)[0]
        out[shard] = int(rec["gen"]) if rec else -1
    return out


def run(quick: bool, out: Path | None) -> list[dict[str, Any]]:
    import ziplog

    p = {"quick": quick, "shards": 2, "replicas": 2, "writers": 2, "rounds": 1 if quick else 3, "record_bytes": 100}
    res = Results("rolling", out, p)
    acked: list[tuple[float, bytes]] = []
    delivered: list[tuple[float, bytes]] = []
    lock = threading.Lock()
    stop = threading.Event()
    rows: list[dict[str, Any]] = []
    with ziplog.local_cluster(shards=p["shards"], replicas=p["replicas"]) as cluster:
        with cluster.client() as c:
            start = ziplog.RecordId(c.watermark() + 1, -1)

        def writer(i: int) -> None:
            with cluster.client(timeout=30) as c:
                prev, n = ziplog.RID_GENESIS, 0
                while not stop.is_set():
                    data = b"w%d-%d-" % (i, n) + b"x" * p["record_bytes"]
                    try:
                        prev = c.insert_after(data, prev)
                    except ziplog.ZiplogError:
                        continue  # not acknowledged: may or may not be in the log, never twice
                    n += 1
                    with lock:
                        acked.append((time.monotonic(), data))
                    stop.wait(0.002)

        def subscriber() -> None:
            with cluster.client(timeout=30) as c, c.subscribe(start) as sub:
                while not stop.is_set() or len(delivered) < len(acked):
                    rec = sub.next(timeout=0.2)
                    if rec is not None:
                        with lock:
                            delivered.append((time.monotonic(), rec.data))

        threads = [threading.Thread(target=subscriber)] + [threading.Thread(target=writer, args=(i,))
                                                           for i in range(p["writers"])]
        for t in threads:
            t.start()
        steps = []
        gens_before = _recovery_generations(cluster)
        try:
            time.sleep(1.0)  # the load runs before the first restart
            for r in range(p["rounds"]):
                res.log(f"round {r + 1}/{p['rounds']}")
                steps += cluster.rolling_restart()
            time.sleep(1.0)
        finally:
            stop.set()
            for t in threads:
                t.join(120)
        recoveries = sum(g - gens_before[s] for s, g in _recovery_generations(cluster).items())
    ack_times = [t for t, _ in acked]
    got = [d for _, d in delivered]
    missing = len({d for _, d in acked} - set(got))
    twice = len(got) - len(set(got))
    sub_times = [t for t, _ in delivered]
    for kind in ("zookeeper", "mms", "failure_handler", "storage"):
        mine = [s for s in steps if s.kind == kind]
        rows.append({"kind": kind, "restarts": len(mine),
                     "write_stall_ms": round(1000 * max(_gap(ack_times, s.stopped_at, s.back_at) for s in mine)),
                     "subscriber_stall_ms": round(1000 * max(_gap(sub_times, s.stopped_at, s.back_at) for s in mine)),
                     "back_in_s": round(max(s.back_at - s.stopped_at for s in mine), 2)})
    res.note(f"{len(acked)} inserts acknowledged, {len(got)} delivered; acknowledged but not delivered: "
             f"{missing}; delivered twice: {twice}")
    res.note(f"failure recoveries the restarts started: {recoveries}")
    res.write(rows, COLUMNS, "Rolling restart under load: longest stall per process kind",
              intro=f"{p['shards']} shards x {p['replicas']} replicas, 3 ZooKeeper, 3 MMS, 3 failure handlers; "
                    f"{p['writers']} writers (InsertAfter chains, default policy) and a subscriber; "
                    f"{p['rounds']} round(s) of restarting every process one at a time.")
    assert missing == 0 and twice == 0, (missing, twice)
    return rows
