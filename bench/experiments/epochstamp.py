"""Where a turn takes an epoch broadcast among its inserts: at the stamp the membership
service's leader sent it with (the default) against the moment each replica read it
(``--epoch-stamp read``, how it worked before), side by side.

A backup's guess is the primary's decision only when both take a turn's inserts and the
next epoch in the same order. Taken at the moment each read it, a replica whose process
came to the broadcast later than its peer's (a process serving several replicas, a busy
CPU) put the inserts sent in between in the old epoch where its peer put them in the
new: slow-path inserts, and a re-ACK each. Per shard count and layout (a process per
replica, as shipped, and a process per CPU, ``LocalCluster(process_per_cpu=True)``), two
clusters run, one per mode, every load on each in turn (the order rotated every round);
all clusters share one ZooKeeper ensemble. Per run: the fast path (the clients' count),
the backups' guesses in the wrong epoch, their other wrong guesses and their re-ACKs
per insert (STATUS counters), and the storage servers' CPU per append. Medians over the
rounds; ``cpu_ratio``: sent / read within each round, then their median.

    python -m bench epochstamp [--quick] [--out DIR]
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable

from ..costs import replica_frames
from ..report import Results, progress
from . import shardcost

MODES = {"sent": [], "read": ["--epoch-stamp", "read"]}
LAYOUTS = {"a process per replica": False, "a process per CPU": True}
#: the backups' counters of how their guesses went (``BackupFollower``)
GUESS_COUNTERS = ("wrong_guesses_epoch", "wrong_guesses_ahead", "wrong_guesses_behind", "guesses_displaced", "reacks")
COLUMNS = ["shards", "layout", "load", "mode", "rounds", "total_rate", "fast_path", "wrong_guesses_epoch",
           "other_wrong_guesses", "reacks", "server_cpu_us", "cpu_ratio"]


def params_for(quick: bool) -> dict[str, Any]:
    return {**shardcost.params_for(quick), "shard_counts": [4] if quick else [2, 4],
            "loads": [("pipelined 4 x 8", 4, "saturate", 8), ("pipelined 8 x 16", 8, "saturate", 16),
                      ("500/s open loop", 4, "open", 125.0)],
            # the setting compared: the default first, then the way it was before
            "modes": MODES, "layouts": LAYOUTS}


def guess_counters(client: Any) -> dict[str, int]:
    """Every backup's guess counters summed, and the primaries' inserts."""
    kinds = replica_frames(client.status(wait=2.0), (*GUESS_COUNTERS, "inserts"))
    backups = kinds.get("backup", {})
    return {**{k: backups.get(k, 0) for k in GUESS_COUNTERS}, "inserts": kinds.get("primary", {}).get("inserts", 0)}


def per_insert(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """Each guess counter's growth per primary insert over a window."""
    inserts = max(1, after["inserts"] - before["inserts"])
    return {k: round((after[k] - before[k]) / inserts, 4) for k in GUESS_COUNTERS}


def _count(n: int, p: dict[str, Any], res: Results, zk_hosts: str, base: Path) -> dict[str, list[dict[str, Any]]]:
    """Per (layout, load, mode), every round's measurement at ``n`` shards."""
    import ziplog
    from ziplog.tools.cluster import LocalCluster
    runs: dict[str, list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        clusters: dict[tuple[str, str], tuple[Any, Any]] = {}
        for layout, per_cpu in p["layouts"].items():
            for mode, args in p["modes"].items():
                c = LocalCluster(base / f"n{n}-{'cpu' if per_cpu else 'replica'}-{mode}", shards=n,
                                 replicas=p["replicas"], mms_replicas=1, fh_replicas=1, zookeeper=zk_hosts,
                                 process_per_cpu=per_cpu, server_args=list(args))
                stack.callback(c.stop)
                c.start()
                clusters[(layout, mode)] = (c, stack.enter_context(ziplog.Client(c.zk_hosts, timeout=10.0)))
        order = list(clusters)
        for r in range(p["rounds"]):
            for load in p["loads"]:
                k = r % len(order)
                for layout, mode in order[k:] + order[:k]:
                    c, client = clusters[(layout, mode)]
                    before = guess_counters(client)
                    m = shardcost.measure([(c, s) for s in c.shard_ids], [client], load, p)
                    m.update(per_insert(before, guess_counters(client)), round=r)
                    runs.setdefault(f"{layout}|{load[0]}|{mode}", []).append(m)
                    res.log(f"  {n} shards, {layout}, {load[0]}, {mode}: fast path {m['fast_path']:.3f}, "
                            f"{m['wrong_guesses_epoch']} guesses in the wrong epoch and {m['notices']} NOTICE "
                            f"frames per insert, {m['server_cpu_us']} us of servers' CPU per append")
    return runs


def summarize_runs(n: int, runs: dict[str, list[dict[str, Any]]], loads: list[str],
                   modes: list[str] | None = None, layouts: list[str] | None = None) -> list[dict[str, Any]]:
    """Rows: medians over the rounds per (layout, load, mode); ``cpu_ratio`` on the first
    mode's row (the default): it over the second within each round, then their median."""
    modes = modes or list(MODES)
    rows: list[dict[str, Any]] = []
    for layout in layouts or LAYOUTS:
        for load in loads:
            by = {mode: runs.get(f"{layout}|{load}|{mode}", []) for mode in modes}
            for mode, mine in by.items():
                if not mine:
                    continue
                row: dict[str, Any] = {"shards": n, "layout": layout, "load": load, "mode": mode,
                                       "rounds": len(mine), "runs": mine, "cpu_ratio": None}
                for key in ("total_rate", "fast_path", "wrong_guesses_epoch", "reacks", "server_cpu_us", "notices",
                            "server_msgs"):
                    values = [m[key] for m in mine if m.get(key) is not None]
                    row[key] = round(statistics.median(values), 4) if values else None
                row["other_wrong_guesses"] = round(statistics.median(
                    m["wrong_guesses_ahead"] + m["wrong_guesses_behind"] + m["guesses_displaced"] for m in mine), 4)
                if mode == modes[0]:
                    pairs = [a["server_cpu_us"] / b["server_cpu_us"] for a, b in zip(mine, by[modes[1]])
                             if b["server_cpu_us"] > 0]
                    row["cpu_ratio"] = round(statistics.median(pairs), 3) if pairs else None
                    row["cpu_ratio_rounds"] = [round(x, 3) for x in pairs]
                rows.append(row)
    return rows


def bars(res: Results, rows: list[dict[str, Any]], group: tuple[str, ...], value: Callable[[dict[str, Any]], float],
         label: Callable[[str], str], tick: Callable[..., str], ylabel: str, title: str, caption: str) -> None:
    """One bar per mode (the row's ``mode``) in each group of rows alike in ``group``."""
    fig, path = res.figure()
    ax = fig.add_subplot(1, 1, 1)
    groups = sorted({tuple(r[k] for k in group) for r in rows})
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        ys = []
        for g in groups:
            row = next((r for r in rows if tuple(r[k] for k in group) == g and r["mode"] == mode), None)
            ys.append(value(row) if row is not None else 0)
        ax.bar([x + (i - (len(modes) - 1) / 2) * width for x in range(len(groups))], ys, width, label=label(mode))
    ax.set_xticks(range(len(groups)), [tick(*g) for g in groups], fontsize=6)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    res.save_figure(fig, path, caption)


def rounds_intro(p: dict[str, Any], clusters: str) -> str:
    """The first sentence of a paired bench's report: how its rounds ran."""
    return (f"{p['rounds']} rounds; in each, every load runs on {clusters} in turn (order rotated), "
            f"{p['seconds']} s measured after {p['warmup_s']} s of warm-up, {p['record_bytes']}-byte "
            f"records, {p['replicas']} replicas per shard; loads are per shard. ")


def paired_run(name: str, p: dict[str, Any], out: Path | None, what: str) -> tuple[Results, list[dict[str, Any]]]:
    """Every shard count of ``p``: its clusters (one per layout and mode) started on one
    ZooKeeper ensemble, measured (:func:`_count`) and summarized."""
    from ziplog.tools.zk_ensemble import ZooKeeperEnsemble
    res = Results(name, out, p)
    rows: list[dict[str, Any]] = []
    loads = shardcost.load_names(p)
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp, \
            ZooKeeperEnsemble(Path(tmp) / "zookeeper", size=3) as ensemble:
        for n in progress(name, p["shard_counts"], lambda n: f"{n} shards, {what}"):
            runs = _count(n, p, res, ensemble.hosts, Path(tmp))
            rows += summarize_runs(n, runs, loads, list(p["modes"]), list(p["layouts"]))
    return res, rows


def run(quick: bool, out: Path | None) -> list[dict[str, Any]]:
    res, rows = paired_run("epochstamp", params_for(quick), out, "both layouts, both modes")
    p = res.params
    bars(res, rows, ("shards", "layout", "load"),
         lambda r: 100 * r["fast_path"] if r["fast_path"] is not None else 0,
         lambda mode: f"epoch taken at the stamp it was {mode}",
         lambda n, layout, load: f"{n} shards\n{layout.replace('a process ', '')}\n{load.replace('pipelined ', '')}",
         "fast path (% of inserts)", "Where a turn takes an epoch: the leader's stamp against each replica's arrival "
         "(medians)", "fast path with epochs taken at the leader's stamp and at each replica's arrival")
    for r in rows:
        if r["mode"] == "sent":
            res.note(f"{r['shards']} shards, {r['layout']}, {r['load']}: servers' CPU per append {r['cpu_ratio']}x "
                     f"with epochs at the leader's stamp (rounds {r['cpu_ratio_rounds']})")
    res.write(rows, COLUMNS, "Where a turn takes an epoch: the leader's stamp (sent) against each replica's arrival (read)",
              intro=(rounds_intro(p, "every cluster") + "fast_path: the inserts "
                     "settled in two message delays; wrong_guesses_epoch, other_wrong_guesses (ahead, behind, "
                     "displaced) and reacks: the backups' counts per insert; server_cpu_us: the storage servers' "
                     "CPU per append; cpu_ratio: sent / read within each round, then their median."))
    return rows
