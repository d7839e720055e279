"""What CURVE costs: ziplog with every connection encrypted and each request's rights
checked (``--curve``, a registered client key) against ziplog with NULL, on one shard of
two replicas, paired: each round starts a fresh cluster of each kind, in alternating
order, and measures on it one blocking client's append latency (closed loop) and the
shard's pipelined throughput with the storage servers' CPU per append. The figures are
medians over the rounds and CURVE/NULL ratios within a round (this machine is noisy:
ratios, not lone absolute times).

``python -m bench curve [--quick]``."""

from __future__ import annotations

import contextlib
import statistics
from pathlib import Path
from typing import Any

from ziplog.tools.stats import summarize

from .. import systems as sysreg
from ..loadgen import ClientPool, ClosedLoopClient
from ..report import Results, progress
from . import throughput

SYSTEMS = ("ziplog", "ziplog-curve")
COLUMNS = ["system", "rounds", "p50_us", "p99_us", "throughput", "server_us_per_append", "p50_ratio",
           "throughput_ratio", "cpu_ratio"]


def params_for(quick: bool) -> dict[str, Any]:
    return {**throughput.params_for(quick), "rounds": 2 if quick else 5, "appends": 1000 if quick else 3000,
            "warmup": 200 if quick else 500}


def _one(key: str, p: dict[str, Any], res: Results) -> dict[str, float]:
    """One fresh cluster of ``key``: (p50, p99, throughput, server CPU us per append)."""
    system = sysreg.make(key, shards=1, replicas=p["replicas"])
    with contextlib.ExitStack() as stack:
        stack.enter_context(system)
        client = stack.enter_context(ClosedLoopClient(system.client_spec(0), system.name))
        client.measure(0, p["record_bytes"], warmup=p["warmup"])
        samples, _ = client.measure(p["appends"], p["record_bytes"])
        client.close()
        lat = summarize(samples)
        pool = stack.enter_context(ClientPool(system.client_spec(0), p["clients_per_shard"], system.name,
                                              max_workers=p["workers_per_shard"]))
        results, cpu, _, _ = throughput._measure([pool], p)
        rate = sum(r.rate for r in results)
        servers = cpu.get("storage servers", 0.0)
    out = {"p50_us": lat["p50_us"], "p99_us": lat["p99_us"], "throughput": rate,
           "server_us_per_append": servers / rate * 1e6 if rate else float("nan")}
    res.log(f"  {system.name}: p50 {out['p50_us']:.0f} us, {rate:.0f}/s, servers {out['server_us_per_append']:.0f} "
            "us CPU per append")
    return out


def run(quick: bool, out: Path | None) -> list[dict[str, Any]]:
    p = params_for(quick)
    res = Results("curve", out, p)
    by: dict[str, list[dict[str, float]]] = {k: [] for k in SYSTEMS}
    for r in progress("curve", list(range(p["rounds"])), lambda r: f"round {r + 1}"):
        for key in (SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]):
            by[key].append(_one(key, p, res))
    rows: list[dict[str, Any]] = []
    null, curve = by["ziplog"], by["ziplog-curve"]
    ratios = {m: [c[m] / n[m] for n, c in zip(null, curve) if n[m]]
              for m in ("p50_us", "throughput", "server_us_per_append")}
    for key, name in (("ziplog", "ziplog, NULL"), ("ziplog-curve", "ziplog, CURVE")):
        runs = by[key]
        row: dict[str, Any] = {"system": name, "rounds": len(runs), "runs": runs}
        for m in ("p50_us", "p99_us", "throughput", "server_us_per_append"):
            row[m] = round(statistics.median(x[m] for x in runs), 1)
        if key == "ziplog-curve":
            row["p50_ratio"] = round(statistics.median(ratios["p50_us"]), 3)
            row["throughput_ratio"] = round(statistics.median(ratios["throughput"]), 3)
            row["cpu_ratio"] = round(statistics.median(ratios["server_us_per_append"]), 3)
            row["pair_ratios"] = ratios
        rows.append(row)
    _plot(res, by)
    res.write(rows, COLUMNS, "CURVE vs NULL: one shard, paired rounds",
              intro=(f"{p['rounds']} rounds; each starts a fresh one-shard cluster of each kind (alternating order) "
                     f"and measures one blocking client's latency over {p['appends']} appends of "
                     f"{p['record_bytes']} bytes, then {p['clients_per_shard']} pipelined clients (depth "
                     f"{p['depth']}) for {p['seconds']} s. Medians over the rounds; ratios are CURVE/NULL "
                     "within a round, then their median."))
    return rows


def _plot(res: Results, by: dict[str, list[dict[str, float]]]) -> None:
    """Per round: one-client p50 and one-shard throughput, NULL beside CURVE."""
    fig, path = res.figure()
    for i, (metric, label) in enumerate((("p50_us", "one client: p50 (us)"), ("throughput", "one shard: appends/s"))):
        ax = fig.add_subplot(1, 2, i + 1)
        for key, name in (("ziplog", "NULL"), ("ziplog-curve", "CURVE")):
            ax.plot(range(1, len(by[key]) + 1), [r[metric] for r in by[key]], marker="o", label=name)
        ax.set_xlabel("round")
        ax.set_title(label, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    res.save_figure(fig, path, "CURVE vs NULL, each round a fresh cluster of each kind")
