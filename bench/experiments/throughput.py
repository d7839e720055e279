"""Experiment ``throughput``: appends per second with pipelined asyncio clients
(dissertation 4.4.2, Scalog 3.5).

1. **ziplog, shards added one by one** (1, 2, ... up to ``max_shards``, with
   ``cluster.add_shard()`` on one running cluster): every shard gets its own pool of
   clients, each keeping ``depth`` inserts of 4 KiB in flight; per-shard and total
   throughput, latency at that load, and where the CPU went (servers, clients,
   ZooKeeper, MMS; in cores) and how much was written to disk, to say what saturates.
2. **ziplog with a process per CPU** (every shard count above one, each on a cluster
   of its own started with that many shards and ``process_per_cpu``): the replicas
   that share a CPU share one storage process (``ziplog.server --serve``), as on a
   machine hosting more replicas than CPUs.
3. **Every system, one shard**, the same pipelined load, one system at a time (each
   gets the whole machine); among them ziplog whose storage servers poll before they
   sleep (``ziplog-poll``, ``--poll-us 200``, one shard): what that costs under load.

    python -m bench throughput [--quick] [--out DIR]
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from ziplog.tools.stats import summarize

from .. import systems as sysreg
from ..costs import CostMeter, frames_per_append, per_append, replica_frames
from ..cpu import CpuMeter, disk_written_bytes
from ..loadgen import ClientPool, LoadResult, fast_path_ratio
from ..report import Results, progress
from ..systems.base import Unavailable

COLUMNS = ["system", "shards", "clients_per_shard", "depth", "per_shard_rate", "total_rate", "p50_us", "p99_us",
           "fast_path_ratio", "cpu_servers", "cpu_clients", "cpu_machine", "server_cpu_us", "server_syscalls",
           "server_msgs", "disk_mb_s", "saturates"]
#: the columns of the per-append cost table (ziplog's series: one row per shard count and load)
COST_COLUMNS = ["system", "shards", "clients_per_shard", "depth", "total_rate", "p50_us", "knee", "server_cpu_us",
                "server_cpu_ratio", "server_syscalls", "server_ctx_switches", "server_msgs", "primary_sent",
                "backup_sent", "notices_sent", "mms_cpu_us", "zk_cpu_us", "client_cpu_us"]
#: ziplog's series with the load raised until the servers are the limit
RAMP = "ziplog, load raised"
#: ziplog's series with one total load, open loop, spread over the shards: what each
#: append costs when the work is the same and only the shard count changes
EQUAL = "ziplog, same total load"
#: the rows of ziplog with a storage process per CPU
PER_CPU = "ziplog, process per CPU"
RIVALS = ["ziplog-poll", "floor", "floor-zmtp", "floor-tcp", "nopaxos", "scalog", "zookeeper", "nats", "nats-r3", "redis",
          "redis-replica"]


def params_for(quick: bool) -> dict[str, Any]:
    return {
        "quick": quick,
        "record_bytes": 4096,
        "replicas": 2,
        "shard_counts": [1, 2, 4] if quick else [1, 2, 3, 4, 6],
        "clients_per_shard": 4,
        "depth": 8,                      # appends in flight per client
        "workers_per_shard": 2,          # load generator processes per shard
        "seconds": 2.0 if quick else 5.0,
        "warmup_s": 0.5 if quick else 1.0,
        "rivals": RIVALS,
        # (clients per shard, appends in flight per client), raised until the total stops growing
        "ramp": [(1, 4), (4, 8), (8, 16)] if quick else [(1, 4), (2, 8), (4, 8), (8, 16), (16, 32)],
        "knee_within": 0.95,             # the knee: the lightest load within 5 % of the series' best
        "equal_total_rate": 2000,        # appends/s in all for the same-load series, open loop
    }


def _saturates(cpu: dict[str, float], clients_cores: float, server_cores: float) -> str:
    """A plain verdict: which resource ran out."""
    n = cpu.get("machine_cores", 2.0) or 2.0
    if cpu.get("machine", 0.0) >= 0.9 * n:
        if clients_cores >= server_cores:
            return f"CPU ({cpu['machine']:.1f}/{n:.0f} cores busy; clients use more than servers)"
        return f"CPU ({cpu['machine']:.1f}/{n:.0f} cores busy; servers use most)"
    return f"not CPU ({cpu.get('machine', 0):.1f}/{n:.0f} cores): latency-bound clients or the system"


def _measure(pools: list[ClientPool], p: dict[str, Any], depth: int | None = None, status: Any = None,
             open_rate: float | None = None) -> tuple[list[LoadResult], dict[str, float], float, dict[str, Any]]:
    """Run the pools' saturating load (or, given ``open_rate``, that many appends/s per
    client, open loop); CPU, disk and (given ``status``, a ziplog client's STATUS of
    every replica) each append's costs over the measured window."""
    meter, costs = CpuMeter(), CostMeter()
    start_wall = time.time() + 0.3
    kind, arg = ("open", open_rate) if open_rate is not None else ("saturate", depth or p["depth"])
    for pool in pools:
        pool.begin(kind, arg, p["seconds"], p["warmup_s"], p["record_bytes"], 0.0 if kind == "saturate" else 2.0,
                   start_wall)
    time.sleep(max(0.0, start_wall - time.time() + p["warmup_s"]))  # CPU counted over the measured window
    frames0 = replica_frames(status()) if status is not None else None
    meter.start()
    costs.start()
    d0 = disk_written_bytes()
    time.sleep(p["seconds"])
    cpu = meter.stop()
    counts = costs.stop()
    disk = (disk_written_bytes() - d0) / p["seconds"] / 1e6
    frames1 = replica_frames(status()) if status is not None else None
    results = [pool.finish() for pool in pools]
    appends = round(sum(r.rate for r in results) * p["seconds"])
    extra: dict[str, Any] = {"per_append": per_append(cpu, p["seconds"], counts, appends)}
    if frames0 is not None and frames1 is not None:
        # per insert the primaries took between the two snapshots (the same window, give
        # or take a STATUS round trip)
        inserts = frames1.get("primary", {}).get("inserts", 0) - frames0.get("primary", {}).get("inserts", 0)
        extra["frames_per_append"] = frames_per_append(frames0, frames1, inserts)
    return results, cpu, disk, extra


def _row(name: str, shards: int, results: list[LoadResult], cpu: dict[str, float], disk: float,
         p: dict[str, Any], server_roles: tuple[str, ...]) -> dict[str, Any]:
    total = sum(r.rate for r in results)
    samples: list[int] = []
    for r in results:
        samples.extend(r.samples_ns)
    s = summarize(samples)
    servers = sum(v for k, v in cpu.items() if k in server_roles)
    clients = cpu.get("load generator", 0.0)
    counts: dict[str, int] = {}
    for r in results:
        for k, v in r.counters.items():
            counts[k] = counts.get(k, 0) + v
    return {"system": name, "shards": shards, "clients_per_shard": p["clients_per_shard"], "depth": p["depth"],
            "per_shard_rate": round(total / shards, 1), "total_rate": round(total, 1),
            "per_shard_rates": [round(r.rate, 1) for r in results], **s,
            "fast_path_ratio": fast_path_ratio(counts), "counters": counts,
            "errors": sum(r.errors for r in results), "cpu_cores": cpu, "cpu_servers": round(servers, 2),
            "cpu_clients": round(clients, 2), "cpu_machine": cpu.get("machine"), "disk_mb_s": round(disk, 1),
            "saturates": _saturates(cpu, clients, servers)}


ZIPLOG_ROLES = ("storage servers", "membership service", "failure handlers", "ZooKeeper")


def _cost_columns(extra: dict[str, Any]) -> dict[str, Any]:
    """The per-append columns of a row from :func:`_measure`'s costs."""
    pa = extra.get("per_append", {})
    fr = extra.get("frames_per_append", {})
    server = pa.get("storage servers", {})
    prim, back = fr.get("primary", {}), fr.get("backup", {})
    msgs = round(prim.get("sent", 0.0) + back.get("sent", 0.0), 2) if fr else None
    return {"server_cpu_us": server.get("cpu_us"), "server_syscalls": server.get("syscalls"),
            "server_ctx_switches": server.get("ctx_switches"), "server_msgs": msgs,
            "primary_sent": prim.get("sent"), "backup_sent": back.get("sent"),
            "notices_sent": prim.get("sent_notice", 0.0) if fr else None,
            "mms_cpu_us": pa.get("membership service", {}).get("cpu_us"),
            "zk_cpu_us": pa.get("ZooKeeper", {}).get("cpu_us"),
            "client_cpu_us": pa.get("load generator", {}).get("cpu_us"), **extra}


def _ziplog_row(name: str, shards: int, pools: list[ClientPool], p: dict[str, Any], res: Results,
                depth: int | None = None, status: Any = None, open_rate: float | None = None) -> dict[str, Any]:
    results, cpu, disk, extra = _measure(pools, p, depth, status, open_rate)
    row = _row(name, shards, results, cpu, disk, p, ZIPLOG_ROLES)
    row.update(_cost_columns(extra))
    if depth is not None:
        row["depth"] = depth
    row["storage_server_cores"] = cpu.get("storage servers", 0.0)
    res.log(f"  {name}, {shards} shard(s): {row['total_rate']:.0f}/s total, {row['per_shard_rate']:.0f}/s per shard; "
            f"cpu {cpu}; {row['saturates']}")
    return row


def _ziplog_per_cpu(p: dict[str, Any], res: Results) -> list[dict[str, Any]]:
    """Every shard count above one on a fresh cluster whose replicas sharing a CPU share
    a process (one shard has a replica per CPU either way)."""
    rows: list[dict[str, Any]] = []
    for target in progress("throughput", [n for n in p["shard_counts"] if n > 1],
                           lambda n: f"ziplog with {n} shards, a process per CPU"):
        system = sysreg.make("ziplog", shards=target, replicas=p["replicas"], process_per_cpu=True)
        pools: list[ClientPool] = []
        try:
            system.start()
            pools = _pools(system, system.cluster.shard_ids, p["clients_per_shard"], p)  # type: ignore[attr-defined]
            rows.append(_ziplog_row(PER_CPU, target, pools, p, res))
        except Unavailable as e:
            res.not_started(PER_CPU, str(e))
            return rows
        finally:
            for pool in pools:
                pool.close()
            system.stop()
    return rows


def _pools(system: Any, shards: list[int], clients: int, p: dict[str, Any]) -> list[ClientPool]:
    return [ClientPool(system.client_spec(shard), clients, f"ziplog-s{shard}", max_workers=p["workers_per_shard"],
                       seed=shard + 1) for shard in shards]


def _ziplog_scaling(p: dict[str, Any], res: Results) -> list[dict[str, Any]]:
    """Shards added one by one to one cluster; at each count the load is raised through
    ``p["ramp"]`` (the shipped load, ``clients_per_shard`` x ``depth``, is the row named
    "ziplog"; the others are :data:`RAMP`)."""
    import ziplog
    rows: list[dict[str, Any]] = []
    system = sysreg.make("ziplog", shards=1, replicas=p["replicas"])
    try:
        system.start()
    except Unavailable as e:
        res.not_started("ziplog", str(e))
        system.stop()
        return rows
    levels = list(dict.fromkeys([*p["ramp"], (p["clients_per_shard"], p["depth"])]))
    try:
        cluster: Any = system.cluster  # type: ignore[attr-defined]
        with ziplog.Client(cluster.zk_hosts, timeout=10.0) as client:
            for target in progress("throughput", p["shard_counts"], lambda n: f"ziplog with {n} shard(s)"):
                while len(cluster.shard_ids) < target:
                    cluster.add_shard()
                shards = list(cluster.shard_ids[:target])
                for clients, depth in sorted(levels, key=lambda cd: cd[0] * cd[1]):
                    pools = _pools(system, shards, clients, p)
                    try:
                        shipped = (clients, depth) == (p["clients_per_shard"], p["depth"])
                        row = _ziplog_row("ziplog" if shipped else RAMP, target, pools, p, res, depth,
                                          lambda: client.status(wait=2.0))
                        row["clients_per_shard"] = clients
                        rows.append(row)
                    finally:
                        for pool in pools:
                            pool.close()
                rows.append(_equal_load_row(system, shards, p, res, lambda: client.status(wait=2.0)))
    finally:
        system.stop()
    _mark_knees(rows, p)
    return rows


def _equal_load_row(system: Any, shards: list[int], p: dict[str, Any], res: Results, status: Any) -> dict[str, Any]:
    """``equal_total_rate`` appends/s in all, open loop, spread evenly over ``shards``
    (``clients_per_shard`` clients each)."""
    clients = p["clients_per_shard"]
    pools = _pools(system, shards, clients, p)
    try:
        per_client = p["equal_total_rate"] / len(shards) / clients
        row = _ziplog_row(EQUAL, len(shards), pools, p, res, 1, status, open_rate=per_client)
        row["clients_per_shard"] = clients
        row["depth"] = None
        return row
    finally:
        for pool in pools:
            pool.close()


def _mark_knees(rows: list[dict[str, Any]], p: dict[str, Any]) -> None:
    """Per shard count, the knee of the load series: the lightest load whose total is
    within ``knee_within`` of the best one's (past it more load buys no appends, only
    latency); ``server_cpu_ratio``: servers' CPU per append over one shard's at its knee
    (the same-load series: over one shard's at the same load)."""
    series = [r for r in rows if r["system"] in ("ziplog", RAMP)]
    knees: dict[int, dict[str, Any]] = {}
    for n in sorted({r["shards"] for r in series}):
        mine = sorted((r for r in series if r["shards"] == n), key=lambda r: r["clients_per_shard"] * r["depth"])
        best = max(r["total_rate"] for r in mine)
        knee = next(r for r in mine if r["total_rate"] >= p["knee_within"] * best)
        for r in mine:
            r["knee"] = r is knee
        knees[n] = knee
    one = knees.get(min(knees)) if knees else None
    for r in series:
        base = one.get("server_cpu_us") if one else None
        r["server_cpu_ratio"] = (round(r["server_cpu_us"] / base, 2)
                                 if base and r.get("server_cpu_us") is not None and r.get("knee") else None)
    equal = sorted((r for r in rows if r["system"] == EQUAL), key=lambda r: r["shards"])
    for r in equal:
        base = equal[0].get("server_cpu_us")
        r["server_cpu_ratio"] = round(r["server_cpu_us"] / base, 2) if base and r.get("server_cpu_us") else None


def _rivals(p: dict[str, Any], res: Results) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for key in progress("throughput", p["rivals"], lambda k: f"rival {k}"):
        # ziplog's polling variant on one shard, like the scaling series' first point
        system = sysreg.make(key, shards=1, replicas=p["replicas"]) if key == "ziplog-poll" else sysreg.make(key)
        try:
            with contextlib.ExitStack() as stack:
                try:
                    stack.enter_context(system)
                    pool = stack.enter_context(ClientPool(system.client_spec(0), p["clients_per_shard"], system.name,
                                                          max_workers=p["workers_per_shard"]))
                except Unavailable as e:
                    res.not_started(system.name, str(e))
                    continue
                results, cpu, disk, _ = _measure([pool], p)
                server_roles = tuple(k for k in cpu if k not in ("load generator", "harness", "total", "machine",
                                                                  "machine_cores", "other"))
                row = _row(system.name, 1, results, cpu, disk, p, server_roles)
                if "storage servers" in cpu:
                    row["storage_server_cores"] = cpu["storage servers"]
                row.update(system.describe())
                rows.append(row)
                res.log(f"  {system.name}: {row['total_rate']:.0f}/s, p50 {row['p50_us'] or 0:.0f} us; {row['saturates']}")
        except Exception as e:  # one rival's failure must not end the run
            res.not_started(system.name, f"{type(e).__name__}: {e}")
    return rows


def _plot(res: Results, rows: list[dict[str, Any]]) -> None:
    z = [r for r in rows if r["system"] == "ziplog"]
    if not z:
        return
    fig, path = res.figure()
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([r["shards"] for r in z], [r["total_rate"] for r in z], marker="o", label="ziplog total, a process per replica")
    ax.plot([r["shards"] for r in z], [r["per_shard_rate"] for r in z], marker="s", label="ziplog per shard")
    # the process-per-CPU series starts from the one-shard point: one shard is the same cluster either way
    per_cpu = z[:1] + [r for r in rows if r["system"] == PER_CPU]
    if len(per_cpu) > 1:
        ax.plot([r["shards"] for r in per_cpu], [r["total_rate"] for r in per_cpu], marker="^",
                label="ziplog total, a process per CPU")
    for r in rows:
        if not r["system"].startswith("ziplog"):  # ziplog's own rows are the lines above
            ax.axhline(r["total_rate"], linestyle=":", linewidth=1)
            ax.annotate(r["system"], (z[-1]["shards"], r["total_rate"]), fontsize=7, ha="right", va="bottom")
    ax.set_xlabel("shards (ziplog); dotted: other systems, one shard")
    ax.set_ylabel("appends/s (4 KiB)")
    ax.set_title("Throughput with pipelined clients on this machine")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    res.save_figure(fig, path, "throughput as shards are added")


def run(quick: bool, out: Path | None) -> list[dict[str, Any]]:
    p = params_for(quick)
    res = Results("throughput", out, p)
    rows = _ziplog_scaling(p, res) + _ziplog_per_cpu(p, res) + _rivals(p, res)
    _plot(res, rows)
    z1 = next((r for r in rows if r["system"] == "ziplog" and r["shards"] == 1), None)
    if z1 is not None:
        res.note(f"ziplog, one shard: {z1['per_shard_rate']:.0f} inserts/s of 4 KiB "
                 f"(the dissertation's SSD-bound figure: 16.8K/s); {z1['saturates']}; "
                 f"storage servers used {z1.get('storage_server_cores', 0):.2f} cores, "
                 f"clients {z1['cpu_clients']:.2f}, disk {z1['disk_mb_s']:.0f} MB/s"
                 + (f"; fast path {z1['fast_path_ratio']:.0%} of its inserts at this load."
                    if z1.get("fast_path_ratio") is not None else "."))
    costs = [r for r in rows if r["system"] in ("ziplog", RAMP, EQUAL)]
    for r in costs:
        if r.get("knee"):
            res.note(f"knee at {r['shards']} shard(s): {r['clients_per_shard']} clients x {r['depth']} in flight per "
                     f"shard, {r['total_rate']:.0f}/s; storage servers {r['server_cpu_us']} us of CPU, "
                     f"{r['server_syscalls']} system calls and {r['server_msgs']} messages sent per append"
                     + (f" ({r['server_cpu_ratio']}x one shard's CPU)" if r.get("server_cpu_ratio") else ""))
        elif r["system"] == EQUAL:
            res.note(f"{p['equal_total_rate']} appends/s in all over {r['shards']} shard(s): storage servers "
                     f"{r['server_cpu_us']} us of CPU ({r['server_cpu_ratio']}x one shard's), {r['server_syscalls']} "
                     f"system calls and {r['server_msgs']} messages sent per append ({r['notices_sent']} NOTICEs)")
    res.write(rows, COLUMNS, "Throughput: pipelined clients, ziplog as shards are added (a process per replica, and a "
              "process per CPU), and every system on one shard",
              extra_tables=[("What each append costs, ziplog as shards are added and the load raised (per append: "
                             "CPU us, system calls, context switches and messages sent by the storage servers; "
                             "knee: the lightest load within 5 % of the series' best total)", costs, COST_COLUMNS)],
              intro=(f"{p['clients_per_shard']} asyncio clients per shard over {p['workers_per_shard']} processes, "
                     f"each keeping {p['depth']} appends of {p['record_bytes']} bytes in flight, "
                     f"{p['seconds']} s measured after {p['warmup_s']} s of warm-up. cpu_* columns are cores "
                     "(CPU seconds per second) over the measured window; cpu_machine counts every process; "
                     "fast_path_ratio: ziplog's inserts settled in two message delays."))
    return rows
