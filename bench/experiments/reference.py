"""What forward by reference costs and saves: one shard of two replicas with
``--forward-by-reference`` against the default (FORWARDs carry every record), paired:
each round starts a fresh cluster of each kind, in alternating order, and runs on it
``bench throughput``'s one-shard series (the shipped pipelined load, then 2,000 appends/s
open loop), 4 KiB records. Per series: the storage servers' CPU per append, the FORWARDs
and HELLOs (catch-ups) per append from the replicas' STATUS counters, and the bytes the
primary's FORWARDs carry per record. Medians over the rounds and on/off ratios within a
round (this machine is noisy: ratios, not lone absolute times).

``python -m bench reference [--quick]``."""

from __future__ import annotations

import contextlib
import statistics
from pathlib import Path
from typing import Any, Callable

from ziplog.protocol.events import RECORD_EVENT_OVERHEAD, RECORD_REF_SIZE

from .. import systems as sysreg
from ..report import Results, progress
from . import throughput

MODES = {"off": [], "on": ["--forward-by-reference"]}
SERIES = ("pipelined", "2,000/s open loop")
COLUMNS = ["series", "mode", "rounds", "total_rate", "server_cpu_us", "cpu_ratio", "forwards", "hellos",
           "forward_bytes_per_record"]


def params_for(quick: bool) -> dict[str, Any]:
    return {**throughput.params_for(quick), "rounds": 3 if quick else 5}


def _one(mode: str, p: dict[str, Any], res: Results) -> dict[str, dict[str, float]]:
    """One fresh cluster with the flag ``mode``: per series, CPU and frames per append."""
    import ziplog
    system = sysreg.make("ziplog", shards=1, replicas=p["replicas"], server_args=MODES[mode])
    out: dict[str, dict[str, float]] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(system)
        client = stack.enter_context(ziplog.Client(system.cluster.zk_hosts, timeout=10.0))  # type: ignore[attr-defined]
        status: Callable[[], Any] = lambda: client.status(wait=2.0)
        for series in SERIES:
            pools = throughput._pools(system, [0], p["clients_per_shard"], p)
            try:
                if series == "pipelined":
                    row = throughput._ziplog_row(mode, 1, pools, p, res, p["depth"], status)
                else:
                    per_client = p["equal_total_rate"] / p["clients_per_shard"]
                    row = throughput._ziplog_row(mode, 1, pools, p, res, 1, status, open_rate=per_client)
            finally:
                for pool in pools:
                    pool.close()
            frames = row.get("frames_per_append") or {}
            prim = frames.get("primary", {})
            out[series] = {"total_rate": row["total_rate"], "server_cpu_us": row.get("server_cpu_us") or float("nan"),
                           "forwards": prim.get("sent_forward", 0.0), "hellos": prim.get("received_hello", 0.0)}
    return out


def run(quick: bool, out: Path | None) -> list[dict[str, Any]]:
    p = params_for(quick)
    res = Results("reference", out, p)
    by: dict[str, list[dict[str, dict[str, float]]]] = {m: [] for m in MODES}
    for r in progress("reference", list(range(p["rounds"])), lambda r: f"round {r + 1}"):
        for mode in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):
            by[mode].append(_one(mode, p, res))
    size = p["record_bytes"]
    rows: list[dict[str, Any]] = []
    for series in SERIES:
        ratios = [on[series]["server_cpu_us"] / off[series]["server_cpu_us"] for off, on in zip(by["off"], by["on"])]
        for mode in MODES:
            runs = [x[series] for x in by[mode]]
            row: dict[str, Any] = {"series": series, "mode": mode, "rounds": len(runs), "runs": runs,
                                   "forward_bytes_per_record": RECORD_REF_SIZE if mode == "on"
                                   else size + RECORD_EVENT_OVERHEAD}
            for m in ("total_rate", "server_cpu_us", "forwards", "hellos"):
                row[m] = round(statistics.median(x[m] for x in runs), 3)
            if mode == "on":
                row["cpu_ratio"] = round(statistics.median(ratios), 3)
                row["pair_ratios"] = [round(x, 3) for x in ratios]
            rows.append(row)
    _plot(res, by)
    res.write(rows, COLUMNS, "Forward by reference: one shard, paired rounds",
              intro=(f"{p['rounds']} rounds; each starts a fresh one-shard cluster with --forward-by-reference "
                     f"and one without (alternating order) and runs on it {p['clients_per_shard']} pipelined "
                     f"clients (depth {p['depth']}) for {p['seconds']} s, then {p['equal_total_rate']} appends/s "
                     f"open loop, {size}-byte records. Medians over the rounds; cpu_ratio is on/off within a "
                     "round, then their median. forward_bytes_per_record: what a FORWARD carries per record, "
                     "at most."))
    return rows


def _plot(res: Results, by: dict[str, list[dict[str, dict[str, float]]]]) -> None:
    """Per round and series: the servers' CPU per append, off beside on."""
    fig, path = res.figure()
    for i, series in enumerate(SERIES):
        ax = fig.add_subplot(1, 2, i + 1)
        for mode in MODES:
            ax.plot(range(1, len(by[mode]) + 1), [r[series]["server_cpu_us"] for r in by[mode]], marker="o",
                    label=f"by reference {mode}")
        ax.set_xlabel("round")
        ax.set_title(f"{series}: servers' CPU per append (us)", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    res.save_figure(fig, path, "Forward by reference on and off, each round a fresh cluster of each kind")
