"""Report of the sequential-access experiment: the Markdown tables and notes, the plots
(matplotlib) and ``sequential_extra.json``, from the rows of
:mod:`bench.experiments.sequential_analyse`, written through :class:`bench.report.Results`.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ..report import Results
from .sequential_analyse import EpochLog

NAME = "sequential"
#: The paper's per-shard target (records/s).
PAPER_RATE = 10_000
#: The MMS's default floor rate (mms/planner.py PlannerSettings.min_rate).
MMS_DEFAULT_MIN_RATE = 200
#: The no-op timeout of the clock-driven stage (the storage servers' default is 0: slots
#: pass on NOTICEs and at the epoch's close).
CLOCK_NOOP_TIMEOUT_US = 1000

COLUMNS = ["T_us", "clients_per_shard", "rate_per_shard", "achieved_per_shard", "seq_p50_us", "seq_p90_us",
           "seq_p99_us", "seq_p999_us", "seq_max_us", "insert_p50_us", "insert_p99_us", "seq_over_insert",
           "own_path_p50_us", "merge_wait_p50_us", "held_by_other_pct", "issue_lag_p50_us", "errors_total",
           "cpu_cores"]
PROBE_COLUMNS = ["rate_per_shard", "achieved_per_shard", "acked_pct", "insert_p50_us", "insert_p99_us",
                 "seq_p50_us", "seq_p99_us", "not_issued", "errors_total", "fast_path_pct", "cpu_cores"]
STEP_COLUMNS = ["stage", "step", "from_rate", "to_rate", "steps", "base_p50_us", "peak_p50_us", "peak_at_ms",
                "rises_at_ms", "elevated_for_ms", "others_base_p50_us", "others_peak_p50_us", "mms_first_change_ms",
                "mms_update_ms"]
VARIANT_COLUMNS = ["stage", "settings", "T_us", "announced_rate", "seq_p50_us", "seq_p99_us", "insert_p50_us",
                   "seq_over_insert", "own_path_p50_us", "merge_wait_p50_us", "held_by_other_pct",
                   "released_at_epoch_end_pct", "released_at_close_pct", "released_at_close_after_round_pct",
                   "ack_after_close_p50_us", "seq_p99_over_p50", "late_notices_pct",
                   "announcements_closed", "announced_spread_pct", "slot_ahead_pct", "merge_wait_ahead_p50_us",
                   "merge_wait_behind_p50_us", "idle_cpu_cores", "cpu_cores"]


def write_report(res: Results, p: dict[str, Any], rate: int, samples: list[tuple[str, np.ndarray, np.ndarray]],
                 vsamples: list[tuple[str, np.ndarray, np.ndarray]], curves: dict[str, dict[str, Any]],
                 fast_curves: dict[str, dict[str, Any]] | None, probe_rows: list[dict[str, Any]],
                 paper: dict[str, Any] | None, sweep_rows: list[dict[str, Any]], step_rows: list[dict[str, Any]],
                 variant_rows: list[dict[str, Any]], health: dict[str, Any], step_epochs: EpochLog) -> None:
    """The plots, the notes, ``sequential_extra.json`` and the main results (JSON, Markdown)."""
    _plot_cdf(res, samples, rate, "", f"Sequential access latency (Figure 4.6): {p['shards']} shards x "
              f"{p['replicas']} replicas, {rate} records/s per shard, 4 KiB records",
              "CDF of sequential access latency per T (Figure 4.6); dashed: insert latency of the same phase")
    if vsamples:
        _plot_cdf(res, samples[:1] + vsamples, rate, "_variants",
                  f"Smallest T ({round(1e6 / rate)} us) under other settings, {rate} records/s per shard",
                  "CDF of sequential latency at the smallest T: shipped settings, MMS floor lowered below the "
                  "rate, shorter no-op timeout, fine slots (MMS floor 20x the rate); dashed: insert latency of the "
                  "same phase")
    _plot_step(res, curves, rate, p, fast_curves, "MMS commits every epoch")
    _conclude(res, p, rate, probe_rows, paper, sweep_rows, step_rows, variant_rows, health)
    _write_extra(res, probe_rows, paper, step_rows, variant_rows, curves, fast_curves, step_epochs)
    extra: list[tuple[str, list[dict[str, Any]], list[str]]] = []
    if probe_rows or paper:
        extra.append(("Capacity (one client per shard; a last row at 10000/s is the paper's target)",
                      probe_rows + ([paper] if paper else []), PROBE_COLUMNS))
    extra.append(("Rate step of one shard (steps superposed)", step_rows, STEP_COLUMNS))
    if len(variant_rows) > 1:
        extra.append(("Smallest T under other settings (evidence for what bounds the latency)", variant_rows,
                      VARIANT_COLUMNS))
    res.write(sweep_rows, COLUMNS, "Sequential access latency (Figure 4.6) and a one-shard rate step (4.4.4)",
              intro=(f"{p['shards']} shards x {p['replicas']} replicas on one machine, {p['record_bytes']}-byte "
                     f"records, open-loop clients pinned to shards calling InsertAfter every t ~ U(0, 2T) us; "
                     f"clients per shard = rate x T, so every row runs {rate} records/s per shard. Latencies "
                     f"from the call of InsertAfter; the first {p['warmup_s']} s of each phase are not counted. "
                     f"own_path: call to the record's batch reaching the subscriber; merge_wait: from there until "
                     f"the batch of the shard it waited for; cpu_cores: CPU the cluster, writers and subscriber "
                     f"used during the phase."),
              extra_tables=extra)


def _write_extra(res: Results, probe_rows: list[dict[str, Any]], paper: dict[str, Any] | None,
                 step_rows: list[dict[str, Any]], variant_rows: list[dict[str, Any]],
                 curves: dict[str, dict[str, Any]], fast_curves: dict[str, dict[str, Any]] | None,
                 epochs: EpochLog) -> None:
    """``sequential_extra.json``: the capacity, step and variant rows, the step curves and
    the rates the MMS announced (the main JSON holds the sweep)."""
    def clean(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            return [None if not np.isfinite(x) else round(float(x), 1) for x in v]
        return v

    def curve_doc(cs: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
        return {k: {kk: clean(vv) for kk, vv in c.items()} for k, c in (cs or {}).items()}
    doc = {
        "capacity": probe_rows, "paper_rate": paper, "step": step_rows, "variants": variant_rows,
        "step_curves": curve_doc(curves), "step_curves_commit_every_epoch": curve_doc(fast_curves),
        "step_stage_epochs": [[t, e, list(s), list(r)] for t, e, s, r in epochs.entries],
    }
    path = res.dir / f"{NAME}_extra.json"
    path.write_text(json.dumps(doc, default=str) + "\n")
    res.log(f"wrote {path}")


def _conclude(res: Results, p: dict[str, Any], rate: int, probe_rows: list[dict[str, Any]],
              paper: dict[str, Any] | None, sweep_rows: list[dict[str, Any]], step_rows: list[dict[str, Any]],
              variant_rows: list[dict[str, Any]], health: dict[str, Any]) -> None:
    """Notes for the report, computed from the rows."""
    idle = p.get("idle_cpu_cores") or {}
    if idle:
        cluster = sum(v for k, v in idle.items() if k != "writers_and_subscriber")
        res.note(f"With no inserts at all the cluster (replicas, MMS, failure handler) keeps {cluster:.3f} of "
                 f"{res.machine.get('cpu_count')} cores busy ({', '.join(f'{k} {v}' for k, v in idle.items())}): "
                 f"with nobody needing a gsn passed, shards pass time only at an epoch's close, and the MMS "
                 f"lengthens an idle cluster's epochs (up to 200 ms). The variants table gives the clock-driven "
                 f"settings of before, measured the same way.")
    if probe_rows:
        top = max(probe_rows, key=lambda r: r["achieved_per_shard"])
        res.note(f"Capacity: with one client per shard the cluster took at most {top['achieved_per_shard']:.0f} "
                 f"records/s per shard ({top['achieved_per_shard'] * p['shards']:.0f}/s in all; offered "
                 f"{top['rate_per_shard']:.0f}/s, {top['cpu_cores']} cores busy). Rate used: {rate}/s per shard, the "
                 f"highest offered rate whose calls were all acknowledged with the insert p50 within 1.5x and the "
                 f"sequential "
                 f"p50 within 2x the lightest load's ({probe_rows[0]['insert_p50_us']} us and "
                 f"{probe_rows[0]['seq_p50_us']} us at {probe_rows[0]['rate_per_shard']:.0f}/s).")
    else:
        res.note(f"Rate used: {rate} records/s per shard (fixed: no capacity probe in this run; "
                 f"ZIPLOG_BENCH_SEQ_RATE sets it).")
    if paper:
        res.note(f"The paper's {PAPER_RATE} records/s per shard, offered for {p['paper_rate_try_s']} s: the cluster "
                 f"acknowledged {paper['achieved_per_shard']:.0f}/s per shard, {paper['not_issued']} calls were not "
                 f"issued (at most {p['max_in_flight']} outstanding per writer process), insert p50 "
                 f"{paper['insert_p50_us']} us: saturated, as expected with a Python process per replica on "
                 f"{res.machine.get('cpu_count')} cores.")
    if sweep_rows:
        first, last = sweep_rows[0], sweep_rows[-1]
        ratio = first["seq_over_insert"]
        res.note(f"Smallest T ({first['T_us']} us, 1 client per shard): sequential p50 {first['seq_p50_us']} us = "
                 f"{ratio} x the insert p50 ({first['insert_p50_us']} us); the target (under 2x) is "
                 f"{'met' if ratio is not None and ratio < 2 else 'not met'}. The record's own path (call until "
                 f"its shard's batch reached the subscriber: insert, replication until stable, push) took p50 "
                 f"{first['own_path_p50_us']} us; the merge then waited p50 {first['merge_wait_p50_us']} us "
                 f"(p99 {first['merge_wait_p99_us']} us) for the other shards: {first['held_by_other_pct']} % of "
                 f"records waited for another shard's progress, {first['released_at_close_pct']} % were released "
                 f"only after the next epoch began, at that shard's close of theirs ("
                 f"{first['released_at_close_after_round_pct']} % although acknowledged more than an insert p50 "
                 f"before the close was heard; they were acknowledged p50 {first['ack_after_close_p50_us']} us "
                 f"after it, negative: before) "
                 f"({first['released_at_epoch_end_pct']} % by a batch up to an epoch's end, where a NOTICE also takes a "
                 f"shard with no slot left above the record); delivery p99 {first['seq_p99_over_p50']} x its p50. The MMS announced {first['announced_rate']}/s per shard "
                 f"(offered {rate}/s; the planner's floor is {MMS_DEFAULT_MIN_RATE}/s), a slot every "
                 f"{1e3 / (first['announced_rate'] or rate):.1f} ms per shard: {first['slot_ahead_pct']} % of records "
                 f"got a slot expected after their call (median lead {first['slot_lead_p50_us']} us) and waited p50 "
                 f"{first['merge_wait_ahead_p50_us']} us in the merge, against {first['merge_wait_behind_p50_us']} us "
                 f"for "
                 f"records whose slot was already due. Shards offered the same rate were announced rates "
                 f"{first['announced_spread_pct']} % apart (std / mean per broadcast): at a few records per 10 ms "
                 f"epoch "
                 f"each report is a noisy count, and the planner weighs the newest one 1/2.")
        res.note(f"Variance: from T = {first['T_us']} us to T = {last['T_us']} us at the same rate, sequential p99 "
                 f"went from {first['seq_p99_us']} to {last['seq_p99_us']} us and the max from {first['seq_max_us']} "
                 f"to {last['seq_max_us']} us (insert p99 {first['insert_p99_us']} -> {last['insert_p99_us']} us).")
    for r in variant_rows[1:]:
        res.note(f"Smallest T with {r['settings']} ({r['stage']}): sequential p50 {r['seq_p50_us']} us, ratio "
                 f"{r['seq_over_insert']}, merge wait p50 {r['merge_wait_p50_us']} us, announced "
                 f"{r['announced_rate']}/s, {r['slot_ahead_pct']} % of records on a slot expected after their call; "
                 f"{r['cpu_cores']} cores busy under load, {r['idle_cpu_cores']} idle.")
    for r in step_rows:
        if r["rises_at_ms"] is None:
            back = f"never above {r['threshold_us']} us (its level + 25 %, 30 ms windows)"
        elif r["elevated_for_ms"] is None:
            back = f"above {r['threshold_us']} us from {r['rises_at_ms']} ms and not back within the segment"
        else:
            back = (f"above {r['threshold_us']} us from {r['rises_at_ms']} ms, back under it (5 windows in a row) "
                    f"{r['elevated_for_ms']} ms after the step")
        res.note(f"Step {r['step']} ({r['stage']}: {r['from_rate']} -> {r['to_rate']}/s on shard {p['step_shard']}, "
                 f"{r['steps']} steps superposed): its p50 went from {r['base_p50_us']} us to a peak of "
                 f"{r['peak_p50_us']} us at {r['peak_at_ms']} ms, {back}; the MMS first changed S1's announced rate "
                 f"{r['mms_first_change_ms']} ms after the step and had it half way to the new rate after "
                 f"{r['mms_update_ms']} ms (means over the steps); the other shards' p50 {r['others_base_p50_us']} "
                 f"-> at most {r['others_peak_p50_us']} us.")
    if step_rows:
        res.note(f"At {rate}/s a shard takes {rate / 100:g} record(s) per 10 ms epoch (the paper: 100). The paper's "
                 f"linear growth of S1's latency after the step is S1 running ahead of its schedule within an "
                 f"epoch: after time t it has used 1.5x the slots the schedule allots to t, so its records wait "
                 f"for the other shards' schedules to catch up, up to a third of the epoch at the epoch's end. With "
                 f"one or two records per shard and epoch, most records wait for the next slot or the epoch's close "
                 f"before and after the step alike, so the step hardly shows here; what the step does show is when "
                 f"the MMS announces the new rate.")
    res.note("What bounds the step's recovery (mms/planner.py, mms/server.py): a primary reports its count once "
             "per 10 ms epoch, the planner smooths each report with weight 1/2, and the MMS commits rates to "
             "ZooKeeper in blocks of 10 epochs (--epochs-per-commit) that keep one rate, so a new rate is announced "
             "only at the next block boundary: up to 100 ms after the step, and a step late in a block first gets a "
             "partly smoothed rate. Meanwhile the shard running ahead of its schedule delays only its own records, "
             "and only within an epoch: each epoch restarts the schedule, so at 1.5x the excess is at most a third "
             "of the 10 ms epoch. A shard with no record near another's passes it when that shard's NOTICE arrives "
             "(one message delay, plus replicating the no-ops); in the clock-driven stage it passed it "
             f"{CLOCK_NOOP_TIMEOUT_US} us after the slot's expected arrival.")
    bad = {k: v for k, v in health.items() if v.get("recoveries") or v.get("suspicions")}
    if bad:
        res.note(f"Failure suspicions / recoveries during the run (replicas stalled past the 500 ms suspicion timeout: "
                 f"the machine was overloaded; inserts refused meanwhile are in errors): {bad}")


# -- plots ------------------------------------------------------------------------------------------------

def _cdf(ax: Any, ns: np.ndarray, **kw: Any) -> None:
    if ns.size:
        xs = np.sort(ns) / 1e3
        ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, **kw)


def _plot_cdf(res: Results, samples: list[tuple[str, np.ndarray, np.ndarray]], rate: int, suffix: str,
              title: str, caption: str) -> None:
    if not samples:
        return
    fig, path = res.figure(suffix)
    ax = fig.add_subplot(1, 1, 1)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    for i, (label, seq, ins) in enumerate(samples):
        c = colors[i % len(colors)]
        _cdf(ax, seq, color=c, lw=1.6, label=f"sequential, {label}")
        _cdf(ax, ins, color=c, lw=0.9, ls="--", alpha=0.7,
             label="insert (ack) latency, dashed, same colour" if i == 0 else None)
    ax.set_xscale("log")
    ax.set_xlabel("latency from the call of InsertAfter (us)")
    ax.set_ylabel("CDF")
    ax.set_ylim(0, 1.0)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(title, fontsize=9)
    res.save_figure(fig, path, caption)


def _plot_step(res: Results, curves: dict[str, dict[str, Any]], rate: int, p: dict[str, Any],
               compare: dict[str, dict[str, Any]] | None, compare_label: str) -> None:
    if not curves:
        return
    fig, path = res.figure("_step")
    fig.set_size_inches(8.0, 3.6 * len(curves))
    s1 = p["step_shard"]
    for i, (kind, c) in enumerate(curves.items()):
        ax = fig.add_subplot(len(curves), 1, i + 1)
        x = c["x_ms"]
        ax.plot(x, c["s1_p50"] / 1e3, color="tab:red", lw=0.6, alpha=0.6, label=f"shard {s1} p50")
        ax.plot(x, c["s1_p50_30ms"] / 1e3, color="tab:red", lw=1.8, label=f"shard {s1} p50, 30 ms window")
        ax.plot(x, c["s1_max"] / 1e3, color="tab:red", lw=0.5, ls=":", alpha=0.6, label=f"shard {s1} max")
        ax.plot(x, c["ot_p50_30ms"] / 1e3, color="tab:blue", lw=1.6, ls="--", label="other shards p50, 30 ms window")
        ax.plot(x, c["ot_max"] / 1e3, color="tab:blue", lw=0.5, ls=":", alpha=0.6, label="other shards max")
        ax.axhline(c["threshold"] / 1e3, color="gray", lw=0.6, ls="--")
        if compare and kind in compare:
            ax.plot(x, compare[kind]["s1_p50_30ms"] / 1e3, color="black", lw=1.0, ls="-.",
                    label=f"shard {s1} p50 (30 ms), {compare_label}")
        ax.axvline(0, color="black", lw=1.0)
        if c["elevated"] is not None and c["elevated"] > 0:
            ax.axvline(c["elevated"], color="gray", lw=1.0, ls="-.", label=f"back to level (+{c['elevated']} ms)")
        ax.set_yscale("log")
        ax.set_ylabel("sequential latency (ms)")
        ax.set_title(f"shard {s1}: {rate} -> {round(rate * c['factor'])} records/s at t = 0 "
                     f"(others stay at {rate}/s)", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        if c["announced"] is not None and np.isfinite(c["announced"]).any():
            ax2 = ax.twinx()
            ax2.step(x, c["announced"], where="mid", color="tab:green", lw=1.2,
                     label=f"rate the MMS announces for shard {s1}")
            ax2.set_ylabel("announced rate (records/s)", color="tab:green")
            ax2.set_ylim(0, max(rate * 2.0, float(np.nanmax(c["announced"])) * 1.1))
            ax2.legend(fontsize=7, loc="upper right")
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.axes[-1].set_xlabel(f"call time relative to the step (ms); {p['bin_ms']} ms bins, all steps superposed")
    res.save_figure(fig, path, "Sequential latency across a rate step of one shard (per 10 ms bin)")
