"""Experiment 1: single-client InsertAfter latency vs. the raw ZeroMQ floor.

One closed-loop client inserts 4 KiB records into ziplog, each InsertAfter the previous
record's id, and we compare its latency with the cheapest possible "send to two replicas
and wait for both" on the same stack (:mod:`bench.floor`). Both are measured in the same
run, in alternating rounds (the order flips every round), so machine noise hits both.

    python -m bench latency [--quick] [--out DIR]
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path

from .floor import EchoPair
from .machine import machine_info
from .stats import format_table, summarize

COLUMNS = ["system", "clients", "offered_load", "p50_us", "p99_us", "p999_us", "ratio_to_floor", "fast_path_ratio"]


def _params(quick: bool) -> dict:
    return {
        "quick": quick,
        "rounds": 5,
        "inserts_per_round": 2000 if quick else 10000,  # ziplog, per round
        "floor_per_round": 2000 if quick else 10000,    # floor round trips, per round
        "record_bytes": 4096,
        "ziplog_warmup": 300 if quick else 1000,
        "floor_warmup": 200 if quick else 1000,
        "shards": 2,
        "replicas": 2,
        "policy": "fixed(0)",
    }


def _log(msg: str) -> None:
    print(f"[latency] {msg}", file=sys.stderr, flush=True)


def _import_ziplog():
    try:
        import ziplog
    except Exception as e:  # ImportError, or a half-written package failing at import time
        raise RuntimeError(
            f"cannot import ziplog ({type(e).__name__}: {e}); the ziplog side of the latency "
            "benchmark cannot run. The floor alone: "
            "python -c 'from bench.floor import run_floor; print(run_floor(2000)[:5])'"
        ) from e
    missing = [name for name in ("local_cluster", "Client") if not hasattr(ziplog, name)]
    if missing:
        raise RuntimeError(
            f"ziplog has no {', '.join(missing)} yet (the API this benchmark codes against: "
            "ziplog.local_cluster(shards, replicas, data_dir) and ziplog.Client(zk_hosts)); "
            "the ziplog side of the latency benchmark cannot run"
        )
    return ziplog


def _counters(client) -> tuple[int | None, int | None]:
    try:
        st = dict(client.stats)
    except Exception:
        return None, None
    fast, slow = st.get("fast_path"), st.get("slow_path")
    return (int(fast) if fast is not None else None, int(slow) if slow is not None else None)


def _pin_shard(ziplog, client, shard: int) -> str:
    try:
        client.set_policy(ziplog.Policy.fixed(shard))
        return f"fixed({shard})"
    except AttributeError:
        _log("Policy.fixed / Client.set_policy unavailable; using the client's default policy")
        return "default"


class _Chain:
    """The ziplog side: one client inserting an InsertAfter chain."""

    def __init__(self, client, size: int) -> None:
        self.client = client
        self.payload = os.urandom(size)
        self.last = None
        self.fast = 0
        self.slow = 0
        self.counters_ok = True

    def _insert(self):
        if self.last is None:
            self.last = self.client.insert_after(self.payload)
        else:
            self.last = self.client.insert_after(self.payload, self.last)

    def warmup(self, n: int) -> None:
        for _ in range(n):
            self._insert()

    def measure(self, n: int) -> list[int]:
        insert, clock = self._insert, time.perf_counter_ns
        out = [0] * n
        f0, s0 = _counters(self.client)
        gc.collect()
        for i in range(n):
            t0 = clock()
            insert()
            out[i] = clock() - t0
        f1, s1 = _counters(self.client)
        if None in (f0, s0, f1, s1):
            self.counters_ok = False
        else:
            self.fast += f1 - f0
            self.slow += s1 - s0
        return out


def _row(system: str, samples: list[int], per_round_p50: list[float], **extra) -> dict:
    s = summarize(samples)
    return {"system": system, "clients": 1, "offered_load": "closed-loop", **s,
            "rounds_p50_us": per_round_p50, **extra}


def run(quick: bool, out: Path | None) -> list[dict]:
    params = _params(quick)
    ziplog = _import_ziplog()
    out = Path(out) if out is not None else Path("results") / (
        "latency-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    rounds, size = params["rounds"], params["record_bytes"]

    floor_all: list[int] = []
    zip_all: list[int] = []
    floor_p50: list[float] = []
    zip_p50: list[float] = []
    t_start = time.monotonic()
    with contextlib.ExitStack() as stack:
        _log(f"starting ziplog local cluster (shards={params['shards']}, replicas={params['replicas']})")
        cluster = stack.enter_context(
            ziplog.local_cluster(shards=params["shards"], replicas=params["replicas"], data_dir=None))
        client = stack.enter_context(ziplog.Client(cluster.zk_hosts))
        params["policy"] = _pin_shard(ziplog, client, 0)
        _log("starting 2 echo servers for the floor")
        pair = stack.enter_context(EchoPair())

        chain = _Chain(client, size)
        _log(f"warming up: {params['ziplog_warmup']} ziplog inserts, {params['floor_warmup']} floor round trips")
        chain.warmup(params["ziplog_warmup"])
        pair.measure(0, size=size, warmup=params["floor_warmup"])

        def do_floor() -> None:
            s = pair.measure(params["floor_per_round"], size=size, warmup=0)
            floor_all.extend(s)
            floor_p50.append(summarize(s)["p50_us"])

        def do_ziplog() -> None:
            s = chain.measure(params["inserts_per_round"])
            zip_all.extend(s)
            zip_p50.append(summarize(s)["p50_us"])

        for r in range(rounds):
            order = (do_floor, do_ziplog) if r % 2 == 0 else (do_ziplog, do_floor)
            for step in order:
                step()
            _log(f"round {r + 1}/{rounds}: floor p50 {floor_p50[-1]:.1f} us, "
                 f"ziplog p50 {zip_p50[-1]:.1f} us")
    _log(f"done in {time.monotonic() - t_start:.1f} s")

    floor_row = _row("floor", floor_all, floor_p50, ratio_to_floor=1.0, fast_path_ratio=None)
    fp_total = chain.fast + chain.slow
    fp_ratio = (chain.fast / fp_total) if chain.counters_ok and fp_total > 0 else None
    zip_p50_all = summarize(zip_all)["p50_us"]
    ratio = zip_p50_all / floor_row["p50_us"] if zip_p50_all is not None and floor_row["p50_us"] else None
    zip_row = _row("ziplog", zip_all, zip_p50,
                   ratio_to_floor=ratio,
                   fast_path_ratio=fp_ratio,
                   fast_path=chain.fast if chain.counters_ok else None,
                   slow_path=chain.slow if chain.counters_ok else None)
    rows = [floor_row, zip_row]

    machine = machine_info()
    for row in rows:
        row["params"] = params
        row["machine"] = machine

    table = format_table(rows, COLUMNS)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "latency.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "latency_meta.json").write_text(json.dumps({"machine": machine, "params": params}, indent=2) + "\n")
    md = [
        "# InsertAfter latency vs. raw ZeroMQ floor",
        "",
        f"One closed-loop client, {size}-byte records, {rounds} alternating rounds "
        f"({params['inserts_per_round']} ziplog inserts and {params['floor_per_round']} floor round trips "
        f"per round); ziplog: {params['shards']} shards x {params['replicas']} replicas, policy {params['policy']}. "
        "Floor: msgpack-packed record sent to two ZeroMQ echo processes, wait for both replies.",
        "",
        table,
        f"Per-round p50 (us): floor {', '.join(f'{v:.1f}' for v in floor_p50)}; "
        f"ziplog {', '.join(f'{v:.1f}' for v in zip_p50)}",
        "",
        f"Machine: {machine['cpu_count']} x {machine['cpu_model']}, Python {machine['python']}, "
        f"pyzmq {machine['pyzmq']} / libzmq {machine['libzmq']}, {machine['platform']}, {machine['date']}",
        "",
    ]
    (out / "latency.md").write_text("\n".join(md))
    _log(f"wrote {out / 'latency.json'}, {out / 'latency.md'}")
    return rows
