"""Experiment ``idle``: what an idle cluster costs. A ``local_cluster()`` (2 shards x 2
replicas, 3 MMS and 3 failure handler replicas, and its 3-node ZooKeeper) with no client
at all, then with one subscriber following the log, measured from /proc as CPU (in % of
one core) per kind of process, and ZooKeeper's writes per second (from the zxid its
``srvr`` reports), in two settings, each on a fresh cluster, in one run:

* **shipped**: slots pass on NOTICEs and at the epoch's close; an idle cluster's epochs
  lengthen up to 200 ms;
* **clock** (how it worked before): every slot becomes a no-op 1 ms after its expected
  arrival, no NOTICEs, 10 ms epochs always (``--noop-timeout-us 1000 --no-notices``,
  MMS ``--idle-interval-ms 10``).

    python -m bench idle [--quick] [--out DIR]
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from ..cpu import cpu_seconds
from ..report import Results, progress
from .sequential import CLOCK_MMS_ARGS, CLOCK_SERVER_ARGS

NAME = "idle"
COLUMNS = ["setting", "subscribers", "replicas_pct", "mms_pct", "failure_handler_pct", "zookeeper_pct", "total_pct",
           "epochs_per_s", "zk_writes_per_s"]
SETTINGS = {
    "shipped": ([], []),
    "clock": (CLOCK_SERVER_ARGS, CLOCK_MMS_ARGS),
}


def _epoch(cluster: Any) -> int:
    import ziplog
    with ziplog.Client(cluster.zk_hosts) as c:
        return max(int(r.get("epoch", -1)) for reps in c.status(wait=5).values() for r in reps)


def _zk_writes(cluster: Any) -> int:
    """The transactions the ensemble's leader committed in its term so far: the counter
    of the zxid ``srvr`` reports (its low 32 bits; every write, every session opened or
    closed takes one; a new leader starts again from 0, which an idle cluster does not
    see). ``srvr`` and ``ruok`` are the only four-letter words the ensemble answers."""
    from ziplog.tools.zk_ensemble import four_letter_word
    leader = cluster.zk.leader()
    if leader is None:
        return 0
    host, port = cluster.zk.node_hosts(leader).rsplit(":", 1)
    m = re.search(r"^Zxid:\s*0x([0-9a-fA-F]+)", four_letter_word(host, int(port), "srvr") or "", re.M)
    return int(m.group(1), 16) & 0xFFFFFFFF if m else 0


def _measure(cluster: Any, seconds: float) -> dict[str, float]:
    groups = {"replicas": [p.pid for p in cluster.servers.values()], "mms": [p.pid for p in cluster.mms.values()],
              "failure_handler": [p.pid for p in cluster.fh.values()], "zookeeper": cluster.zk.started_pids}
    e0, w0 = _epoch(cluster), _zk_writes(cluster)
    before = {k: cpu_seconds(v) for k, v in groups.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    el = time.monotonic() - t0
    out = {f"{k}_pct": round(100 * (cpu_seconds(v) - before[k]) / el, 2) for k, v in groups.items()}
    out["total_pct"] = round(sum(out.values()), 2)
    out["epochs_per_s"] = round((_epoch(cluster) - e0) / el, 1)
    out["zk_writes_per_s"] = round((_zk_writes(cluster) - w0) / el, 1)
    return out


def run(quick: bool, out: Path | None) -> list[dict[str, Any]]:
    import ziplog
    p = {"quick": quick, "settle_s": 3.0, "measure_s": 10.0 if quick else 30.0, "shards": 2, "replicas": 2}
    res = Results(NAME, out, p)
    rows: list[dict[str, Any]] = []
    for setting in progress(NAME, list(SETTINGS), lambda s: f"{s}: idle, then with a subscriber"):
        server_args, mms_args = SETTINGS[setting]
        with ziplog.local_cluster(shards=p["shards"], replicas=p["replicas"], server_args=server_args,
                                  mms_args=mms_args) as cluster:
            time.sleep(p["settle_s"])  # elections done, epochs settled into their idle pace
            rows.append({"setting": setting, "subscribers": 0, **_measure(cluster, p["measure_s"])})
            res.log(f"  {rows[-1]}")
            with ziplog.Client(cluster.zk_hosts) as c, c.subscribe() as sub:
                sub.next(timeout=0.5)  # positioned
                import threading
                stop = threading.Event()

                def follow() -> None:
                    while not stop.is_set():
                        sub.next(timeout=0.2)
                t = threading.Thread(target=follow, daemon=True)
                t.start()
                try:
                    rows.append({"setting": setting, "subscribers": 1, **_measure(cluster, p["measure_s"])})
                finally:
                    stop.set()
                    t.join()
            res.log(f"  {rows[-1]}")
    res.note("CPU of every process of a kind together, in % of one core, over the measured window; "
             "the subscriber is a thread of this process (not counted). ZooKeeper: its three JVMs; its writes "
             "are what its leader counted (each one logged, and fsynced, by all three nodes).")
    res.write(rows, COLUMNS, "An idle cluster: CPU by process kind",
              intro="`local_cluster()` with no writer: shipped settings (slots pass on NOTICEs and at the epoch's "
                    "close, idle epochs lengthen to 200 ms) against the clock-driven settings of before "
                    "(1 ms no-op timeout, no NOTICEs, 10 ms epochs), each on a fresh cluster in one run.")
    return rows
