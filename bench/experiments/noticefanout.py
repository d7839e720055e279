"""What a NOTICE costs a process that serves replicas of several shards (a process per
CPU, ``ziplog.server --serve``): sent once per process told, which hands it to every
replica it serves (the default), against once per replica (``--notice-fanout replica``,
how it worked before), side by side. Two clusters of a process per CPU per shard count,
one per mode, every load on each in turn (the order rotated every round), all on one
ZooKeeper ensemble (the harness of :mod:`bench.experiments.epochstamp`). Per run: NOTICE
frames and all messages the replicas sent per append, the storage servers' CPU per
append, the fast path. Medians over the rounds; ``cpu_ratio``: per process / per replica
within each round, then their median.

    python -m bench noticefanout [--quick] [--out DIR]
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from ..report import Results, progress
from . import epochstamp, shardcost

MODES = {"per process": [], "per replica": ["--notice-fanout", "replica"]}
LAYOUTS = {"a process per CPU": True}
COLUMNS = ["shards", "layout", "load", "mode", "rounds", "total_rate", "notices", "server_msgs", "server_cpu_us",
           "cpu_ratio", "fast_path"]


def params_for(quick: bool) -> dict[str, Any]:
    return {**epochstamp.params_for(quick), "modes": MODES, "layouts": LAYOUTS,
            "loads": [("pipelined 4 x 8", 4, "saturate", 8), ("pipelined 8 x 16", 8, "saturate", 16),
                      ("250/s open loop", 4, "open", 62.5), ("500/s open loop", 4, "open", 125.0)]}


def _plot(res: Results, rows: list[dict[str, Any]]) -> None:
    fig, path = res.figure()
    ax = fig.add_subplot(1, 1, 1)
    groups = sorted({(r["shards"], r["load"]) for r in rows})
    width = 0.4
    for i, mode in enumerate(MODES):
        ys = []
        for g in groups:
            row = next((r for r in rows if (r["shards"], r["load"], r["mode"]) == (*g, mode)), None)
            ys.append(row["server_cpu_us"] if row and row["server_cpu_us"] is not None else 0)
        ax.bar([x + (i - 0.5) * width for x in range(len(groups))], ys, width, label=f"a NOTICE {mode}")
    ax.set_xticks(range(len(groups)), [f"{n} shards\n{load.replace('pipelined ', '')}" for n, load in groups],
                  fontsize=7)
    ax.set_ylabel("storage servers' CPU per append (us)")
    ax.set_title("A process per CPU: a NOTICE once per process against once per replica (medians)", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    res.save_figure(fig, path, "servers' CPU per append with a NOTICE sent once per process and once per replica")


def run(quick: bool, out: Path | None) -> list[dict[str, Any]]:
    from ziplog.tools.zk_ensemble import ZooKeeperEnsemble
    p = params_for(quick)
    res = Results("noticefanout", out, p)
    rows: list[dict[str, Any]] = []
    loads = shardcost.load_names(p)
    with tempfile.TemporaryDirectory(prefix="noticefanout-") as tmp, \
            ZooKeeperEnsemble(Path(tmp) / "zookeeper", size=3) as ensemble:
        for n in progress("noticefanout", p["shard_counts"], lambda n: f"{n} shards, a process per CPU, both modes"):
            runs = epochstamp._count(n, p, res, ensemble.hosts, Path(tmp))
            rows += epochstamp.summarize_runs(n, runs, loads, list(MODES), list(LAYOUTS))
    _plot(res, rows)
    for r in rows:
        if r["mode"] == "per process":
            res.note(f"{r['shards']} shards, {r['load']}: servers' CPU per append {r['cpu_ratio']}x with a NOTICE "
                     f"per process (rounds {r['cpu_ratio_rounds']})")
    res.write(rows, COLUMNS, "A process per CPU: a NOTICE once per process told against once per replica",
              intro=(f"{p['rounds']} rounds; in each, every load runs on both clusters in turn (order rotated), "
                     f"{p['seconds']} s measured after {p['warmup_s']} s of warm-up, {p['record_bytes']}-byte "
                     f"records, {p['replicas']} replicas per shard; loads are per shard. notices: NOTICE frames the "
                     "primaries sent per append; server_msgs: every message the replicas sent per append; "
                     "server_cpu_us: the storage servers' CPU per append; cpu_ratio: per process / per replica "
                     "within each round, then their median; fast_path: the inserts settled in two message delays."))
    return rows
