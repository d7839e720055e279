"""What shards add to one another's work: an N-shard cluster against N one-shard
clusters, the control, with the same replicas, CPUs, clients and load per shard.

``bench throughput`` compares N shards with one, and on two shared cores that ratio
mixes two things: what the shards do for one another (NOTICEs, the no-ops they pass and
replicate, a schedule of N shards) and what N times the processes cost any machine
(more wake-ups and context switches on the same cores, smaller batches per turn). The
control has every process of the N-shard cluster but none of the first: each of its
shards is a cluster of its own, so no shard waits for, tells or passes for another. Per
shard count, five configurations run in turn, their order rotated every round:

- **cluster**: one cluster of N shards, a process per replica (as shipped);
- **cluster, a process per CPU**: the same with the replicas that share a CPU served by
  one process (``LocalCluster(process_per_cpu=True)``, ``ziplog.server --serve``), as a
  machine with more replicas than CPUs runs them: what N shards cost there;
- **cluster, no NOTICEs**: the first with ``--no-notices`` (slots pass only at epochs'
  closes, a record waits up to an epoch at a subscriber): what the shards cost one
  another apart from telling one another of their records;
- **independent**: N one-shard clusters, shard i's replicas on the CPUs shard i of the
  cluster has (``LocalCluster(cpu_shift=i)``);
- **one shard**: the first of those alone, at the same load per shard.

Every cluster runs for the whole shard count and shares one ZooKeeper ensemble (one
membership replica and one failure handler each: the control runs N of them, not N x 3).
A configuration's costs are its own storage servers' CPU time over the window, per
append (the idle clusters' servers are not counted), its context switches and the
messages its replicas sent (STATUS counters). cluster/independent within each round,
then the median of those ratios, is what the shards add to one another; cluster/one
shard is what ``bench throughput`` reports.

    python -m bench shardcost [--quick] [--out DIR]
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ziplog.tools.stats import summarize

from ..costs import ctx_switches, frames_per_append, replica_frames
from ..cpu import cpu_seconds
from ..loadgen import ClientPool, ClientSpec, LoadResult, fast_path_ratio
from ..report import Results, progress

CLUSTER, PER_CPU, INDEPENDENT, ONE = "cluster", "cluster, a process per CPU", "independent", "one shard"
NO_NOTICES = "cluster, no NOTICEs"
CONFIGS = (CLUSTER, PER_CPU, NO_NOTICES, INDEPENDENT, ONE)
COLUMNS = ["of", "shards", "load", "config", "rounds", "total_rate", "p50_us", "server_cpu_us", "ctx_switches",
           "server_msgs", "notices", "fast_path", "vs_independent", "vs_one_shard"]


def params_for(quick: bool) -> dict[str, Any]:
    return {
        "quick": quick,
        "record_bytes": 4096,
        "replicas": 2,
        "shard_counts": [2, 4] if quick else [2, 3, 4],
        "rounds": 3 if quick else 5,
        "seconds": 2.0 if quick else 4.0,
        "warmup_s": 0.5 if quick else 1.0,
        "workers_per_shard": 2,
        # per shard: (name, clients, "saturate" with that many in flight each | "open" at that many appends/s each)
        "loads": [("pipelined 4 x 8", 4, "saturate", 8), ("pipelined 8 x 16", 8, "saturate", 16),
                  ("250/s open loop", 4, "open", 62.5), ("500/s open loop", 4, "open", 125.0)],
    }


def load_names(p: dict[str, Any]) -> list[str]:
    return [name for name, *_ in p["loads"]]


def _spec(cluster: Any, shard: int) -> ClientSpec:
    return ClientSpec("bench.systems.ziplog_system", {"zk_hosts": cluster.zk_hosts, "shard": shard})


def _server_pids(clusters: list[Any]) -> list[int]:
    return sorted({proc.pid for c in clusters for proc in c.servers.values()})


def _frames(clients: list[Any]) -> dict[str, dict[str, int]]:
    """Every replica's STATUS counters of the configuration's clusters, summed by kind
    (their shards' numbers may repeat: each one-shard cluster has a shard 0)."""
    return replica_frames(dict(enumerate(replicas for client in clients
                                         for replicas in client.status(wait=2.0).values())))


def measure(targets: list[tuple[Any, int]], status_clients: list[Any], load: tuple[str, int, str, float],
            p: dict[str, Any]) -> dict[str, Any]:
    """``load`` on every (cluster, shard) of ``targets``: the costs of those clusters'
    storage servers over the measured window, per append."""
    import psutil
    _, clients, kind, arg = load
    clusters = list({id(c): c for c, _ in targets}.values())
    pids = _server_pids(clusters)
    procs = [psutil.Process(pid) for pid in pids]
    pools = [ClientPool(_spec(c, shard), clients, f"shardcost-{i}", max_workers=p["workers_per_shard"], seed=i + 1)
             for i, (c, shard) in enumerate(targets)]
    try:
        start_wall = time.time() + 0.3
        for pool in pools:
            pool.begin(kind, arg, p["seconds"], p["warmup_s"], p["record_bytes"], 0.0 if kind == "saturate" else 2.0,
                       start_wall)
        time.sleep(max(0.0, start_wall - time.time() + p["warmup_s"]))
        frames0 = _frames(status_clients)
        cpu0, cs0 = cpu_seconds(pids), ctx_switches(procs)
        time.sleep(p["seconds"])
        cpu1, cs1 = cpu_seconds(pids), ctx_switches(procs)
        frames1 = _frames(status_clients)
        total = LoadResult()  # every pool's clients together
        for pool in pools:
            total.add(pool.finish())
    finally:
        for pool in pools:
            pool.close()
    rate = total.rate
    appends = max(1, round(rate * p["seconds"]))
    inserts = frames1.get("primary", {}).get("inserts", 0) - frames0.get("primary", {}).get("inserts", 0)
    fr = frames_per_append(frames0, frames1, inserts)
    return {"total_rate": round(rate, 1), "p50_us": summarize(list(total.samples_ns)).get("p50_us"),
            "server_cpu_us": round((cpu1 - cpu0) * 1e6 / appends, 1), "ctx_switches": round((cs1 - cs0) / appends, 2),
            "server_msgs": round(sum(k.get("sent", 0.0) for k in fr.values()), 2),
            "notices": fr.get("primary", {}).get("sent_notice", 0.0), "frames": fr,
            "fast_path": fast_path_ratio(total.counters), "errors": total.errors}


def _one_count(n: int, p: dict[str, Any], res: Results, zk_hosts: str, base: Path) -> dict[str, list[dict[str, Any]]]:
    """Per load and configuration, every round's measurement at ``n`` shards."""
    import ziplog
    from ziplog.tools.cluster import LocalCluster
    kw = {"replicas": p["replicas"], "mms_replicas": 1, "fh_replicas": 1, "zookeeper": zk_hosts}
    runs: dict[str, list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        def started(c: Any) -> Any:
            stack.callback(c.stop)
            c.start()
            return c
        cluster = started(LocalCluster(base / f"n{n}-cluster", shards=n, **kw))
        per_cpu = started(LocalCluster(base / f"n{n}-per-cpu", shards=n, process_per_cpu=True, **kw))
        quiet = started(LocalCluster(base / f"n{n}-no-notices", shards=n, server_args=["--no-notices"], **kw))
        alone = [started(LocalCluster(base / f"n{n}-alone{i}", shards=1, cpu_shift=i, **kw)) for i in range(n)]
        status = {c: stack.enter_context(ziplog.Client(c.zk_hosts, timeout=10.0))
                  for c in [cluster, per_cpu, quiet, *alone]}
        targets = {CLUSTER: [(cluster, s) for s in cluster.shard_ids], PER_CPU: [(per_cpu, s) for s in per_cpu.shard_ids],
                   NO_NOTICES: [(quiet, s) for s in quiet.shard_ids],
                   INDEPENDENT: [(c, 0) for c in alone], ONE: [(alone[0], 0)]}
        for r in range(p["rounds"]):
            for load in p["loads"]:
                k = r % len(CONFIGS)
                order = list(CONFIGS[k:] + CONFIGS[:k])  # each configuration first in turn
                for config in order:
                    m = measure(targets[config], [status[c] for c, _ in targets[config]], load, p)
                    m.update(round=r, order=order.index(config))
                    runs.setdefault(f"{load[0]}|{config}", []).append(m)
                    res.log(f"  {n} shards, {load[0]}, {config}: {m['total_rate']:.0f}/s, "
                            f"{m['server_cpu_us']} us of servers' CPU per append")
    return runs


def summarize_runs(n: int, runs: dict[str, list[dict[str, Any]]], loads: list[str]) -> list[dict[str, Any]]:
    """Rows: per load and configuration the medians over the rounds; ``vs_independent`` and
    ``vs_one_shard``: the median over the rounds of the CPU ratio within each round."""
    rows: list[dict[str, Any]] = []
    for load in loads:
        by = {config: runs.get(f"{load}|{config}", []) for config in CONFIGS}
        for config in CONFIGS:
            mine = by[config]
            if not mine:
                continue
            row: dict[str, Any] = {"shards": 1 if config == ONE else n, "of": n, "load": load, "config": config,
                                   "rounds": len(mine), "runs": mine}
            for key in ("total_rate", "p50_us", "server_cpu_us", "ctx_switches", "server_msgs", "notices", "fast_path"):
                values = [m[key] for m in mine if m.get(key) is not None]
                row[key] = round(statistics.median(values), 2) if values else None
            for ratio, base in (("vs_independent", INDEPENDENT), ("vs_one_shard", ONE)):
                pairs = [a["server_cpu_us"] / b["server_cpu_us"] for a, b in zip(mine, by[base])
                         if b["server_cpu_us"] > 0]
                row[ratio] = round(statistics.median(pairs), 2) if pairs and config != base else None
                row[ratio + "_rounds"] = [round(x, 2) for x in pairs] if config != base else None
            rows.append(row)
    return rows


def _plot(res: Results, rows: list[dict[str, Any]]) -> None:
    fig, path = res.figure()
    ax = fig.add_subplot(1, 1, 1)
    labels, width = sorted({(r["load"], r["of"]) for r in rows}), 0.16
    for i, config in enumerate(CONFIGS):
        ys = []
        for load, n in labels:
            row = next((r for r in rows if (r["load"], r["of"], r["config"]) == (load, n, config)), None)
            ys.append(row["server_cpu_us"] if row else 0)
        ax.bar([x + (i - (len(CONFIGS) - 1) / 2) * width for x in range(len(labels))], ys, width, label=config)
    short = {load: load.replace(" open loop", " open").replace("pipelined ", "") for load, _ in labels}
    ax.set_xticks(range(len(labels)), [f"{n} shards\n{short[load]}" for load, n in labels], fontsize=7)
    ax.set_ylabel("storage servers' CPU per append (us)")
    ax.set_title("N shards in one cluster, as N clusters, and one shard alone (medians)", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    res.save_figure(fig, path, "servers' CPU per append: one cluster of N shards, N one-shard clusters, one shard")


def run(quick: bool, out: Path | None) -> list[dict[str, Any]]:
    from ziplog.tools.zk_ensemble import ZooKeeperEnsemble
    p = params_for(quick)
    res = Results("shardcost", out, p)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="shardcost-") as tmp, \
            ZooKeeperEnsemble(Path(tmp) / "zookeeper", size=3) as ensemble:
        for n in progress("shardcost", p["shard_counts"], lambda n: f"{n} shards against {n} one-shard clusters"):
            rows += summarize_runs(n, _one_count(n, p, res, ensemble.hosts, Path(tmp)), load_names(p))
    _plot(res, rows)
    for r in rows:
        if r["config"] in (CLUSTER, PER_CPU, NO_NOTICES):
            res.note(f"{r['config']}, {r['shards']} shards, {r['load']}: {r['vs_independent']}x the CPU per append of "
                     f"{r['shards']} one-shard clusters (rounds {r['vs_independent_rounds']}), "
                     f"{r['vs_one_shard']}x one shard's")
    res.write(rows, COLUMNS, "What shards add to one another: one cluster of N shards against N one-shard clusters",
              intro=(f"{p['rounds']} rounds; in each, every load runs on the five configurations in turn (order "
                     f"rotated), {p['seconds']} s measured after {p['warmup_s']} s of warm-up, "
                     f"{p['record_bytes']}-byte records, {p['replicas']} replicas per shard. Loads are per shard. "
                     "server_cpu_us: the configuration's own storage servers' CPU per append; ctx_switches and "
                     "server_msgs (messages its replicas sent) per append; fast_path: the inserts settled in two message delays; vs_*: the CPU ratio within each round, "
                     "then their median. of: the shard count compared; 'one shard' is the first independent "
                     "cluster alone (its shards column is 1)."))
    return rows
