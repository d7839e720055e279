"""Experiment ``latency``: append latency of ziplog beside the floor and its rivals
(dissertation 4.4.1, Figures 4.4 and 4.5), every system running during the whole run.

1. **One client** (the headline table): each system gets one blocking client in a
   process of its own, appending 4 KiB records in a closed loop. The systems take turns
   in rounds (the order rotates every round) so that machine noise falls on all of them;
   each round's p50 is kept, to show the spread.
2. **Open loop** (Figures 4.4, 4.5): per offered load per shard and clients per shard,
   ziplog's p50/p99/p99.9, mean and fast-path ratio; the rivals with one open-loop
   client at the same loads, as the paper ran NOPaxos and Scalog.

    python -m bench latency [--quick] [--out DIR] [--systems ziplog,floor,...]

``--systems`` takes keys of :data:`bench.systems.SYSTEMS`; the default is
:data:`ALL_SYSTEMS`: ziplog, ziplog whose storage servers poll before they sleep
(``ziplog-poll``, ``--poll-us 200``, a cluster of its own), the three floors (pyzmq
``floor``, ZeroMQ's wire protocol spoken natively ``floor-zmtp``, plain TCP ``floor-tcp``),
the NOPaxos- and Scalog-style baselines, ZooKeeper, NATS JetStream with one replica
(``nats``) and three (``nats-r3``), Redis Streams alone (``redis``) and with a replica
and ``WAIT 1 0`` (``redis-replica``).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from ziplog.tools.stats import summarize

from .. import systems as sysreg
from ..loadgen import ClientPool, ClosedLoopClient, fast_path_ratio
from ..report import Results, histogram, progress
from ..systems.base import System, Unavailable

ALL_SYSTEMS = ["ziplog", "ziplog-poll", "floor", "floor-zmtp", "floor-tcp", "nopaxos", "scalog", "zookeeper", "nats",
               "nats-r3", "redis", "redis-replica"]
#: the floors: echo processes, not logs (what ziplog's p50 is compared with, not a rival)
FLOORS = {"floor", "floor-zmtp", "floor-tcp"}
#: ziplog itself, as started by the harness (the default, and polling before sleeping)
ZIPLOGS = ("ziplog", "ziplog-poll")
#: the second ziplog client of the one-client rounds: a plain Client's default policy
DEFAULT_POLICY = "ziplog-default"
DEFAULT_POLICY_NAME = "ziplog, default policy"
COLUMNS = ["system", "clients", "offered_load", "p50_us", "p99_us", "p999_us", "mean_us", "ratio_to_floor",
           "fast_path_ratio", "replication", "durability"]
SWEEP_COLUMNS = ["system", "clients", "offered_load", "achieved_rate", "p50_us", "p99_us", "p999_us", "mean_us",
                 "fast_path_ratio", "lag_p50_us", "errors"]


def params_for(quick: bool) -> dict[str, Any]:
    return {
        "quick": quick,
        "record_bytes": 4096,
        "shards": 2,
        "replicas": 2,
        "rounds": 5 if quick else 8,
        "appends_per_round": 600 if quick else 3000,
        "warmup": 300 if quick else 1000,
        # open loop: offered appends/s on one shard, and clients on that shard
        "loads": [500, 2000] if quick else [250, 1000, 2000, 4000, 8000, 16800],
        "ziplog_clients": [1, 16] if quick else [1, 4, 16, 64, 256],
        "rival_clients": [1],
        "point_s": 1.5 if quick else 4.0,
        "point_warmup_s": 0.5 if quick else 1.0,
        "max_workers": 4,
    }


def _start_systems(keys: list[str], p: dict[str, Any], res: Results, stack: contextlib.ExitStack) -> dict[str, System]:
    started: dict[str, System] = {}
    for key in progress("latency", keys, lambda k: f"starting {k}"):
        kw = {"shards": p["shards"], "replicas": p["replicas"]} if key in ZIPLOGS else {}
        system = sysreg.make(key, **kw)
        try:
            stack.enter_context(system)
        except Unavailable as e:
            res.not_started(system.name, str(e))
            continue
        except Exception as e:  # a rival's own failure must not end the run: report it
            res.not_started(system.name, f"{type(e).__name__}: {e}")
            continue
        started[key] = system
    return started


def _one_client(started: dict[str, System], p: dict[str, Any], res: Results,
                stack: contextlib.ExitStack) -> list[dict[str, Any]]:
    clients: dict[str, ClosedLoopClient] = {}
    #: key -> (row name, its system); ziplog runs twice: pinned to shard 0 (the row the
    #: rivals are compared with) and with the default policy, on the same cluster
    entries: dict[str, tuple[str, System]] = {k: (system.name, system) for k, system in started.items()}
    if "ziplog" in started:
        entries[DEFAULT_POLICY] = (DEFAULT_POLICY_NAME, started["ziplog"])
    for key, (name, system) in entries.items():
        spec = system.client_spec(None) if key == DEFAULT_POLICY else system.client_spec(0)  # type: ignore[arg-type]
        try:
            clients[key] = stack.enter_context(ClosedLoopClient(spec, name))
        except Unavailable as e:
            res.not_started(name, f"client: {e}")
    samples: dict[str, list[int]] = {k: [] for k in clients}
    rounds_p50: dict[str, list[float]] = {k: [] for k in clients}
    counts: dict[str, dict[str, int]] = {k: {} for k in clients}
    failed: set[str] = set()
    for key, c in clients.items():
        try:
            c.measure(0, p["record_bytes"], warmup=p["warmup"])
        except Unavailable as e:
            res.not_started(entries[key][0], f"warm-up failed: {e}")
            failed.add(key)
    keys = [k for k in clients if k not in failed]
    for r in progress("latency", list(range(p["rounds"])), lambda r: f"one-client round {r + 1}"):
        order = keys[r % len(keys):] + keys[:r % len(keys)] if keys else []
        for key in order:
            if key in failed:
                continue
            try:
                s, k = clients[key].measure(p["appends_per_round"], p["record_bytes"])
            except Unavailable as e:
                res.not_started(entries[key][0], f"failed mid-run: {e}")
                failed.add(key)
                continue
            samples[key].extend(s)
            rounds_p50[key].append(round(summarize(s)["p50_us"], 1))
            for name, v in k.items():
                counts[key][name] = counts[key].get(name, 0) + v
        res.log("round p50s: " + ", ".join(f"{entries[k][0]} {rounds_p50[k][-1]:.0f}"
                                           for k in keys if k not in failed and rounds_p50[k]))
    rows: list[dict[str, Any]] = []
    floor_p50 = summarize(samples["floor"])["p50_us"] if samples.get("floor") else None
    for key in keys:
        if key in failed or not samples[key]:
            continue
        summary = summarize(samples[key])
        rows.append({"system": entries[key][0], "kind": "closed-loop", "clients": 1,
                     "offered_load": "closed-loop", **summary,
                     "ratio_to_floor": summary["p50_us"] / floor_p50 if floor_p50 else None,
                     "fast_path_ratio": fast_path_ratio(counts[key]), "counters": counts[key],
                     "rounds_p50_us": rounds_p50[key], "histogram": histogram(samples[key]),
                     **entries[key][1].describe()})
    rows.sort(key=lambda r: r["p50_us"])
    return rows


def _sweep(started: dict[str, System], p: dict[str, Any], res: Results) -> list[dict[str, Any]]:
    plan: list[tuple[str, int]] = []
    for key in started:
        for n in (p["ziplog_clients"] if key == "ziplog" else p["rival_clients"]):
            plan.append((key, n))
    rows: list[dict[str, Any]] = []
    for key, n in progress("latency", plan, lambda kn: f"open loop: {started[kn[0]].name}, {kn[1]} clients"):
        system = started[key]
        try:
            pool = ClientPool(system.client_spec(0), n, system.name, max_workers=p["max_workers"])
        except Unavailable as e:
            res.note(f"{system.name} with {n} clients could not start its clients: {e}")
            continue
        with pool:
            for load in p["loads"]:
                try:
                    r = pool.open_loop(load, p["point_s"], p["record_bytes"], warmup_s=p["point_warmup_s"])
                except Unavailable as e:
                    res.note(f"{system.name}, {n} clients, {load}/s failed: {e}")
                    break
                s = summarize(r.samples_ns)
                row = {"system": system.name, "kind": "open-loop", "clients": n, "offered_load": load,
                       "achieved_rate": round(r.rate, 1), **s,
                       "fast_path_ratio": fast_path_ratio(r.counters), "counters": r.counters,
                       "lag_p50_us": summarize(r.lag_ns)["p50_us"], "lag_p99_us": summarize(r.lag_ns)["p99_us"],
                       "errors": r.errors, "unfinished": r.unfinished, "error_examples": r.error_examples,
                       "histogram": histogram(r.samples_ns)}
                rows.append(row)
                res.log(f"  {system.name} x{n} @ {load}/s: achieved {r.rate:.0f}/s, p50 {s['p50_us'] or 0:.0f} us, "
                        f"p99 {s['p99_us'] or 0:.0f} us" + (f", fast path {row['fast_path_ratio']:.0%}"
                                                             if row["fast_path_ratio"] is not None else ""))
                if r.rate < 0.8 * load and r.unfinished:
                    res.log(f"  {system.name} x{n} saturated below {load}/s; higher loads skipped")
                    break
    return rows


def _plot(res: Results, one: list[dict[str, Any]], sweep: list[dict[str, Any]]) -> None:
    if one:
        res.cdf_figure(one, "system", "append latency (us), one closed-loop client, 4 KiB",
                       "one-client append latency, every system in one run", "_one_client")
    if sweep:
        fig, path = res.figure("_vs_load")
        ax = fig.add_subplot(1, 1, 1)
        curves: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for row in sweep:
            curves.setdefault((row["system"], row["clients"]), []).append(row)
        for (name, n), rows in curves.items():
            rows = [r for r in rows if r["mean_us"] is not None]
            ax.plot([r["achieved_rate"] for r in rows], [r["mean_us"] for r in rows], marker="o",
                    label=f"{name}, {n} client{'s' if n > 1 else ''}")
        ax.set_yscale("log")
        ax.set_xlabel("per-shard throughput (appends/s)")
        ax.set_ylabel("mean latency (us)")
        ax.set_title("Average write latency vs per-shard throughput (cf. Figure 4.5)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        res.save_figure(fig, path, "mean latency vs per-shard throughput")
        zrows = [r for r in sweep if r["fast_path_ratio"] is not None]
        if zrows:
            fig, path = res.figure("_fast_path")
            ax = fig.add_subplot(1, 1, 1)
            by_n: dict[int, list[dict[str, Any]]] = {}
            for r in zrows:
                by_n.setdefault(r["clients"], []).append(r)
            for n, rows in sorted(by_n.items()):
                ax.plot([r["achieved_rate"] for r in rows], [100 * r["fast_path_ratio"] for r in rows], marker="o",
                        label=f"{n} client{'s' if n > 1 else ''} per shard")
            ax.set_ylim(0, 105)
            ax.set_xlabel("per-shard throughput (inserts/s)")
            ax.set_ylabel("fast path (%)")
            ax.set_title("ziplog fast-path ratio vs per-shard throughput (cf. Figure 4.4)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
            res.save_figure(fig, path, "ziplog fast-path ratio vs per-shard throughput")


def run(quick: bool, out: Path | None, systems: list[str] | None = None) -> list[dict[str, Any]]:
    p = params_for(quick)
    keys = systems or ALL_SYSTEMS
    unknown = [k for k in keys if k not in sysreg.SYSTEMS]
    if unknown:
        raise RuntimeError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(sysreg.SYSTEMS)}")
    p["systems"] = keys
    res = Results("latency", out, p)
    with contextlib.ExitStack() as stack:
        started = _start_systems(keys, p, res, stack)
        if not started:
            raise RuntimeError("no system could be started: " + "; ".join(f"{k}: {v}" for k, v in res.unavailable.items()))
        one = _one_client(started, p, res, stack)
        sweep = _sweep(started, p, res)
    rows = one + sweep
    for name, why in res.unavailable.items():
        if not any(r["system"] == name for r in rows):
            rows.append({"system": name, "kind": "not started", "clients": None, "offered_load": None,
                         "p50_us": None, "p99_us": None, "status": f"not started: {why}"})
    _plot(res, one, sweep)
    floor_names = {started[k].name for k in FLOORS if k in started}
    ziplog_names = {started[k].name for k in ZIPLOGS if k in started} | {DEFAULT_POLICY_NAME}
    tcp = next((r for r in one if "floor-tcp" in started and r["system"] == started["floor-tcp"].name), None)
    for key in ZIPLOGS:
        z = next((r for r in one if key in started and r["system"] == started[key].name), None)
        if z is None or not z.get("ratio_to_floor"):
            continue
        others = [r for r in one if r["system"] not in ziplog_names and r["system"] not in floor_names]
        below_all = all(z["p50_us"] < r["p50_us"] for r in others)
        res.note(f"one client: {z['system']} p50 {z['p50_us']:.0f} us = {z['ratio_to_floor']:.2f} x the floor"
                 + (f", {z['p50_us'] / tcp['p50_us']:.2f} x the plain-TCP floor" if tcp and tcp["p50_us"] else "")
                 + f"; {'below' if below_all else 'NOT below'} every other system's p50.")
    z = next((r for r in one if r["system"] == "ziplog"), None)
    d = next((r for r in one if r["system"] == DEFAULT_POLICY_NAME), None)
    if z is not None and d is not None and z["p50_us"] and d["p50_us"]:
        res.note(f"one client with the default policy (a random shard per insert): p50 {d['p50_us']:.0f} us = "
                 f"{d['p50_us'] / z['p50_us']:.2f} x the pinned client's, in the same rounds.")
    fp16 = [r for r in sweep if r["system"] == "ziplog" and r["clients"] == 16 and r["fast_path_ratio"] is not None]
    if fp16:
        worst = min(fp16, key=lambda r: r["fast_path_ratio"])
        res.note(f"ziplog fast path with 16 clients per shard: lowest {worst['fast_path_ratio']:.0%} "
                 f"(at {worst['achieved_rate']:.0f} inserts/s per shard).")
    res.write(one, COLUMNS, "Append latency: ziplog, the floor and its rivals in one run",
              intro=(f"One closed-loop client per system, {p['record_bytes']}-byte records, {p['rounds']} rounds of "
                     f"{p['appends_per_round']} appends, systems taking turns (order rotating). Every system runs "
                     "during the whole run, so all share the same background. ziplog: "
                     f"{p['shards']} shards x {p['replicas']} replicas, client pinned to shard 0, each record "
                     "InsertAfter the previous; a second ziplog client, with the default policy, takes its turns "
                     "on the same cluster; a second cluster, the same but for its storage servers polling before "
                     "they sleep (--poll-us 200), has a pinned client of its own."),
              extra_tables=[("Open loop (offered load on one shard; latency from call to ack, lag = how late the call left)",
                             sweep, SWEEP_COLUMNS)])
    # the JSON holds every row (one-client, sweep, not started); the table shows the first kind
    import json
    (res.dir / "latency.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    return rows


if __name__ == "__main__":
    run("--quick" in sys.argv, None)
