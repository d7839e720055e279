"""Experiment ``read``: ReadRecord latency (dissertation 4.4.3) for

* **stable** records: the client knows from earlier replies that every replica holds
  the record, so it asks one replica (stable-records confirmation, 4.2.4);
* **recent** records: read right after their insert, above the stable watermark the
  client knows, so it asks every replica and waits for a stable answer or all of them;

beside two floors on the same stack: a round trip to one echo process and to two.
One client in a process of its own; the four kinds take turns in rounds.

    python -m bench read [--quick] [--out DIR]
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import multiprocessing as mp
import os
import random
import time
from pathlib import Path
from typing import Any

from ziplog.tools.stats import summarize

from .. import systems as sysreg
from ..report import Results, histogram, progress
from ..systems.base import Unavailable

COLUMNS = ["kind", "replicas_asked", "count", "p50_us", "p99_us", "p999_us", "mean_us", "ratio_to_floor"]


def params_for(quick: bool) -> dict[str, Any]:
    return {"quick": quick, "record_bytes": 4096, "shards": 2, "replicas": 2, "preload": 2000 if quick else 10000,
            "rounds": 4 if quick else 8, "reads_per_round": 500 if quick else 2000}


def _reader_main(zk_hosts: str, floor_ports: list[int], p: dict[str, Any]) -> dict[str, Any]:
    """Runs in a worker process: preload, then alternate the four kinds of reads."""
    import ziplog

    from ..systems.floor import FloorAppender

    payload = os.urandom(p["record_bytes"])
    clock = time.perf_counter_ns
    out: dict[str, list[int]] = {"stable": [], "recent": [], "floor (1 process)": [], "floor (2 processes)": []}
    asked: dict[str, int] = {}
    with ziplog.Client(zk_hosts, policy=ziplog.Policy.fixed(0)) as client:
        rids = [client.insert_after(payload) for _ in range(p["preload"])]
        # one more insert after a pause: its ack carries a stable watermark above the preload
        deadline = time.monotonic() + 10
        while client.known_stable(0) < rids[-1].gsn and time.monotonic() < deadline:
            client.insert_after(payload)
        stable_upto = client.known_stable(0)
        old = [r for r in rids if r.gsn <= stable_upto]
        assert old, "no record became stable"
        one = FloorAppender(floor_ports[:1])
        two = FloorAppender(floor_ports)
        rng = random.Random(7)
        n = p["reads_per_round"]
        skipped = [0]

        def stable_reads() -> None:
            for _ in range(n):
                rid = old[rng.randrange(len(old))]
                t0 = clock()
                data = client.read_record(rid)
                out["stable"].append(clock() - t0)
                assert len(data) == len(payload)

        def recent_reads() -> None:
            last = ziplog.RID_GENESIS
            for _ in range(n):
                last = client.insert_after(payload, last)
                if last.gsn <= client.known_stable(0):
                    skipped[0] += 1  # the ack already reported it stable: not a recent read
                    continue
                t0 = clock()
                client.read_record(last)
                out["recent"].append(clock() - t0)

        def floor(name: str, app: FloorAppender) -> None:
            for _ in range(n):
                t0 = clock()
                app.append(payload)
                out[name].append(clock() - t0)

        steps = [stable_reads, recent_reads, lambda: floor("floor (1 process)", one),
                 lambda: floor("floor (2 processes)", two)]
        for r in range(p["rounds"]):
            gc.collect()
            for step in steps[r % 4:] + steps[:r % 4]:
                step()
        one.close()
        two.close()
        asked = {"stable": 1, "recent": p["replicas"], "floor (1 process)": 1, "floor (2 processes)": 2}
    return {"samples": out, "asked": asked, "stable_records": len(old), "recent_skipped": skipped[0]}


def run(quick: bool, out: Path | None) -> list[dict[str, Any]]:
    p = params_for(quick)
    res = Results("read", out, p)
    with contextlib.ExitStack() as stack:
        try:
            z = stack.enter_context(sysreg.make("ziplog", shards=p["shards"], replicas=p["replicas"]))
            f = stack.enter_context(sysreg.make("floor"))
        except Unavailable as e:
            res.not_started("ziplog", str(e))
            raise RuntimeError(f"cannot run the read experiment: {e}") from e
        res.log(f"preloading {p['preload']} records, then {p['rounds']} rounds of {p['reads_per_round']} reads per kind")
        pool = stack.enter_context(concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")))
        fut = pool.submit(_reader_main, z.cluster.zk_hosts, f.client_spec().params["ports"], p)  # type: ignore[attr-defined]
        for _ in progress("read", [0], lambda _: "reading"):
            got = fut.result(timeout=600)
    rows: list[dict[str, Any]] = []
    floors = {k: summarize(v)["p50_us"] for k, v in got["samples"].items() if k.startswith("floor")}
    for kind, samples in got["samples"].items():
        s = summarize(samples)
        ref = floors["floor (1 process)"] if got["asked"][kind] == 1 else floors["floor (2 processes)"]
        rows.append({"system": "ziplog" if not kind.startswith("floor") else "floor", "kind": kind,
                     "replicas_asked": got["asked"][kind], **s,
                     "ratio_to_floor": s["p50_us"] / ref if ref else None, "histogram": histogram(samples)})
    res.cdf_figure(rows, "kind", "ReadRecord latency (us), 4 KiB, one client",
                   "ReadRecord latency, stable vs recent, with floors")
    res.note(f"stable reads drew from {got['stable_records']} records the client knew to be stable; "
             "ratio_to_floor compares with the floor asking as many processes. "
             f"{got['recent_skipped']} recent reads were not made because the insert's own acks already "
             "reported the record stable.")
    res.write(rows, COLUMNS, "ReadRecord latency: stable (one replica) and recent (all replicas)",
              intro=f"ziplog {p['shards']} shards x {p['replicas']} replicas, records of {p['record_bytes']} bytes, "
                    "every record in memory (ziplog keeps records above the trim point in memory).")
    return rows
