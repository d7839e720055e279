"""Analysis of the sequential-access experiment: pure functions that turn what a phase
collected (acks, deliveries, the EPOCH broadcasts heard) into summary rows and step curves.

No I/O, no processes, no printing; :mod:`bench.experiments.sequential` runs the phases and
:mod:`bench.experiments.sequential_report` writes the results.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..report import histogram


@dataclass
class PhaseData:
    """What one phase produced: per-insert acks and per-record deliveries (arrays with the
    columns of ``sequential_worker.ACK_COLUMNS`` / ``DELIVERY_COLUMNS``) and what the machine did."""

    phase: int
    start_ns: int
    duration_s: float
    acks: np.ndarray
    deliveries: np.ndarray
    scheduled: int
    not_issued: int
    errors: dict[str, int]
    first_errors: list[str]
    lag_ns: np.ndarray
    client_stats: dict[str, int]
    undelivered: int
    cpu_cores: float          # cluster, writers and subscriber together, during the phase
    announced: float | None   # mean per-shard rate the MMS announced during the measured window
    announced_spread: float | None  # EpochLog.rate_spread over the measured window
    #: the primaries' STATUS counters of NOTICEs over the phase, summed (ziplog only)
    notices: dict[str, int] = field(default_factory=dict)


@dataclass
class EpochLog:
    """Every EPOCH broadcast the MMS sent, as heard on its PUB socket: (t_ns, epoch, shards, rates)."""

    entries: list[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)

    def rate_of(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """(times, announced rate of ``shard``) for every broadcast that lists it."""
        ts = [t for t, _, sh, _ in self.entries if shard in sh]
        rs = [r[sh.index(shard)] for _, _, sh, r in self.entries if shard in sh]
        return np.asarray(ts, dtype=np.int64), np.asarray(rs, dtype=np.int64)

    def mean_rate(self, t_from: int, t_to: int) -> float | None:
        rates = [float(np.mean(r)) for t, _, _, r in list(self.entries) if t_from <= t < t_to and r]
        return float(np.mean(rates)) if rates else None

    def next_heard(self, gsns: np.ndarray) -> np.ndarray:
        """Per gsn, when the epoch after its own was first heard (the largest int64 where
        it never was): its epoch closed then."""
        from ziplog.protocol.gsna import epoch_of
        first: dict[int, int] = {}
        for t, e, _, _ in list(self.entries):
            if e not in first or t < first[e]:
                first[e] = t
        never = np.iinfo(np.int64).max
        return np.asarray([first.get(epoch_of(int(g)) + 1, never) for g in gsns], dtype=np.int64)

    def rate_spread(self, t_from: int, t_to: int) -> float | None:
        """How far apart the MMS puts shards that run at the same rate: the mean over
        broadcasts of (std / mean) of the announced rates, in percent."""
        cv = [float(np.std(r) / np.mean(r)) for t, _, _, r in list(self.entries) if t_from <= t < t_to and len(r) > 1]
        return 100.0 * float(np.mean(cv)) if cv else None


def pct(a: np.ndarray, q: float) -> float | None:
    return float(np.percentile(a, q)) / 1e3 if a.size else None


def us(v: float | None) -> float | None:
    return None if v is None or not np.isfinite(v) else round(float(v), 1)


def window(d: PhaseData, warmup_s: float) -> tuple[np.ndarray, np.ndarray, float]:
    """Acks and deliveries of calls made after the warm-up, and the window's length (s)."""
    t_from = d.start_ns + int(warmup_s * 1e9)
    t_to = d.start_ns + int(d.duration_s * 1e9)
    a = d.acks[d.acks[:, 1] >= t_from] if len(d.acks) else d.acks
    v = d.deliveries[d.deliveries[:, 6] >= t_from] if len(d.deliveries) else d.deliveries
    return a, v, max((t_to - t_from) / 1e9, 1e-9)


def ack_times(acks: np.ndarray, gsns: np.ndarray) -> np.ndarray:
    """Per gsn, when its InsertAfter was acknowledged (``t_ack``); the largest int64 for a
    gsn with no ack in ``acks`` (then no lead to the close is counted for it)."""
    never = np.iinfo(np.int64).max
    if not len(acks) or not len(gsns):
        return np.full(len(gsns), never, dtype=np.int64)
    order = np.argsort(acks[:, 3], kind="stable")
    by_gsn, t_ack = acks[order, 3], acks[order, 2]
    i = np.minimum(np.searchsorted(by_gsn, gsns), len(by_gsn) - 1)
    return np.where(by_gsn[i] == gsns, t_ack[i], never)


def slot_lead(dl: np.ndarray, epochs: EpochLog) -> np.ndarray:
    """Per delivered record: when its slot was *expected* (the epoch's broadcast, as heard
    here, plus the slot's place in the schedule of 4.2.3) minus when InsertAfter was called,
    in ns; NaN where the epoch was not heard. Positive: the record got a slot in the future
    and its gsn is covered by the other shards only once their schedule reaches that time
    (a record or a no-op each), or their epoch closes."""
    from ziplog.protocol.gsna import EpochConfig, EpochSchedule, epoch_of
    heard = {e: (t, EpochSchedule(EpochConfig(e, sh, r))) for t, e, sh, r in list(epochs.entries)}
    out = np.full(len(dl), np.nan)
    for i in range(len(dl)):
        g, shard = int(dl[i, 7]), int(dl[i, 2])
        h = heard.get(epoch_of(g))
        if h is None or shard not in h[1].config.shards:
            continue
        t_e, sched = h
        k = sched.first_slot_after(shard, g - 1)
        out[i] = t_e + sched.expected_ns(shard, k) - int(dl[i, 6])
    return out


def summary(d: PhaseData, p: dict[str, Any], rate: float, epochs: EpochLog | None = None) -> dict[str, Any]:
    """One row: latencies (us) from the call, where the sequential latency went, rates."""
    from ziplog.protocol.gsna import EPOCH_SPAN
    acks, dl, span = window(d, p["warmup_s"])
    empty = np.empty(0)
    ins = acks[:, 2] - acks[:, 1] if len(acks) else empty
    seq = dl[:, 0] - dl[:, 6] if len(dl) else empty
    seq_int = dl[:, 0] - dl[:, 5] if len(dl) else empty
    # where the subscriber could see batches (not on the Scalog-style log: those columns are 0)
    seen = dl[dl[:, 8] > 0] if len(dl) else dl
    own = seen[:, 8] - seen[:, 6] if len(seen) else empty          # call -> its shard's batch at the subscriber
    wait = seen[:, 9] - seen[:, 8] if len(seen) else empty         # that -> the batch that released it
    held = (seen[:, 10] != seen[:, 2]) & (seen[:, 9] > seen[:, 8]) if len(seen) else np.empty(0, dtype=bool)
    at_end = (seen[:, 11] % EPOCH_SPAN == 0) if len(seen) else np.empty(0, dtype=bool)  # released up to an epoch's end
    # Up to an epoch's end is where a NOTICE takes a shard with no slot left above the
    # record's gsn, as well as where its close does: only a release after the next epoch
    # was broadcast (as heard here) can have waited for the close.
    next_heard = epochs.next_heard(seen[:, 7]) if epochs is not None and len(seen) else None
    at_close = held & at_end & (seen[:, 9] >= next_heard) if next_heard is not None else None
    # Of those, the ones acknowledged more than an insert round (this phase's insert p50)
    # before the close was heard: a NOTICE round had time to release them first, so the
    # close, not the round's own length, is what they waited for.
    close_lead = (next_heard - ack_times(acks, seen[:, 7])) if next_heard is not None else None
    per_shard = [int(np.count_nonzero(acks[:, 4] == s)) / span for s in range(p["shards"])] if len(acks) else []
    fast = d.client_stats.get("fast_path", 0)
    slow = d.client_stats.get("slow_path", 0)
    seq50, ins50 = pct(seq, 50), pct(ins, 50)
    in_time = (at_close & (close_lead > ins50 * 1e3)) if at_close is not None and close_lead is not None \
        and ins50 is not None else None
    lead = slot_lead(seen, epochs) if epochs is not None and len(seen) else np.empty(0)
    known = np.isfinite(lead)
    ahead = known & (lead > 0)
    behind = known & (lead <= 0)
    return {
        "rate_per_shard": round(rate, 1),
        "achieved_per_shard": round(float(np.mean(per_shard)), 1) if per_shard else 0.0,
        "achieved_min_shard": round(float(np.min(per_shard)), 1) if per_shard else 0.0,
        "announced_rate": us(d.announced),
        "announced_spread_pct": us(d.announced_spread),
        "seq_p50_us": us(seq50), "seq_p90_us": us(pct(seq, 90)), "seq_p99_us": us(pct(seq, 99)),
        "seq_p999_us": us(pct(seq, 99.9)), "seq_max_us": us(float(seq.max()) / 1e3 if seq.size else None),
        "seq_from_intended_p50_us": us(pct(seq_int, 50)), "seq_from_intended_p99_us": us(pct(seq_int, 99)),
        "insert_p50_us": us(ins50), "insert_p99_us": us(pct(ins, 99)),
        "seq_over_insert": round(seq50 / ins50, 2) if seq50 and ins50 else None,
        "own_path_p50_us": us(pct(own, 50)), "own_path_p99_us": us(pct(own, 99)),
        "merge_wait_p50_us": us(pct(wait, 50)), "merge_wait_p99_us": us(pct(wait, 99)),
        "held_by_other_pct": round(100.0 * float(np.mean(held)), 1) if held.size else None,
        "held_by_shard": {int(s): int(c) for s, c in zip(*np.unique(seen[held][:, 10], return_counts=True))}
        if held.size and held.any() else {},
        "released_at_epoch_end_pct": round(100.0 * float(np.mean(at_end)), 1) if at_end.size else None,
        "released_at_close_pct": round(100.0 * float(np.mean(at_close)), 1)
        if at_close is not None and at_close.size else None,
        "released_at_close_after_round_pct": round(100.0 * float(np.mean(in_time)), 1)
        if in_time is not None and in_time.size else None,
        "ack_after_close_p50_us": us(pct(-close_lead[at_close], 50))
        if at_close is not None and close_lead is not None and at_close.any() else None,
        "seq_p99_over_p50": round(float(np.percentile(seq, 99) / np.percentile(seq, 50)), 2) if seq.size else None,
        "slot_ahead_pct": round(100.0 * float(np.count_nonzero(ahead)) / max(int(np.count_nonzero(known)), 1), 1)
        if known.any() else None,
        "slot_lead_p50_us": us(float(np.median(lead[known])) / 1e3) if known.any() else None,
        "merge_wait_ahead_p50_us": us(pct(wait[ahead], 50)) if ahead.any() else None,
        "merge_wait_behind_p50_us": us(pct(wait[behind], 50)) if behind.any() else None,
        "issue_lag_p50_us": us(pct(d.lag_ns, 50)), "issue_lag_p99_us": us(pct(d.lag_ns, 99)),
        "fast_path_pct": round(100.0 * fast / (fast + slow), 1) if fast + slow else None,
        # NOTICEs that reached a primary after it had closed their epoch (the close released
        # their record), and announcements the close overtook in the notice interval
        "late_notices_pct": round(100.0 * d.notices.get("late_notices", 0) / d.notices["received_notice"], 1)
        if d.notices.get("received_notice") else None,
        "announcements_closed": d.notices.get("announcements_closed", 0) if d.notices else None,
        "cpu_cores": round(d.cpu_cores, 2),
        "records": int(len(dl)), "acked": int(len(d.acks)), "undelivered": d.undelivered,
        "acked_pct": round(100.0 * len(d.acks) / d.scheduled, 1) if d.scheduled else 0.0,
        "not_issued": d.not_issued, "errors": d.errors, "errors_total": sum(d.errors.values()),
        "first_errors": d.first_errors,
        "histogram": histogram(seq.astype(np.int64)) if seq.size else {"edges_us": [], "counts": []},
        "insert_histogram": histogram(ins.astype(np.int64)) if ins.size else {"edges_us": [], "counts": []},
    }


def capacity_choice(rows: list[dict[str, Any]], p: dict[str, Any]) -> int:
    """The rate the capacity probe chooses from its ``rows`` (``p["rate_per_shard"]`` when
    there are none): see :func:`bench.experiments.sequential._capacity`."""
    chosen = int(p["rate_per_shard"])
    if rows:
        ins0 = rows[0]["insert_p50_us"] or 1.0
        seq0 = rows[0]["seq_p50_us"] or 1.0
        ok = [r for r in rows if r["acked_pct"] >= 99.0 and r["achieved_per_shard"] >= 0.9 * r["rate_per_shard"]
              and (r["insert_p50_us"] or 1e9) <= 1.5 * ins0 and (r["seq_p50_us"] or 1e9) <= 2.0 * seq0
              and r["not_issued"] == 0 and r["errors_total"] == 0]
        chosen = int(max((r["rate_per_shard"] for r in ok), default=rows[0]["rate_per_shard"]))
    return chosen


def pooled(bins: list[list[np.ndarray]], b: int, half: int) -> np.ndarray:
    parts = [x for bb in range(max(b - half, 0), min(b + half + 1, len(bins))) for x in bins[bb]]
    return np.concatenate(parts) if parts else np.empty(0)


def step_analysis(d: PhaseData, p: dict[str, Any], rate: int, levels: list[float], epochs: EpochLog,
                   label: str) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Superpose every step of one kind on its instant t0 and bin S1's and the other
    shards' sequential latency by call time (``bin_ms``). Returns a row per kind and the
    curves to plot."""
    L = p["step_segment_s"]
    bin_ns = p["bin_ms"] * 1_000_000
    # Before the step: the second half of the segment at R (its first half may still show
    # the previous step settling).
    pre_ns = int(min(0.3, 0.5 * L) * 1e9)
    post_ns = int(L * 1e9)
    nb_pre, nb_post = pre_ns // bin_ns, post_ns // bin_ns
    nb = nb_pre + nb_post
    dl = d.deliveries
    seq = dl[:, 0] - dl[:, 6]
    is_s1 = dl[:, 2] == p["step_shard"]
    t_rate, r_rate = epochs.rate_of(p["step_shard"])
    rows: list[dict[str, Any]] = []
    curves: dict[str, dict[str, Any]] = {}
    for kind, factor in (("up", p["step_up"]), ("down", p["step_down"])):
        t0s = [d.start_ns + int(i * L * 1e9) for i in range(2, len(levels))
               if levels[i - 1] == 1.0 and levels[i] == factor]
        if not t0s:
            continue
        s1_bins: list[list[np.ndarray]] = [[] for _ in range(nb)]
        ot_bins: list[list[np.ndarray]] = [[] for _ in range(nb)]
        announced = np.full((len(t0s), nb), np.nan)
        updates: list[float] = []  # until S1's announced rate is half way to the new one
        changes: list[float] = []  # until S1's announced rate first changes at all
        for k, t0 in enumerate(t0s):
            rel = dl[:, 6] - t0
            idx = (rel + pre_ns) // bin_ns
            sel = (rel >= -pre_ns) & (rel < post_ns)
            for b in range(nb):
                m = sel & (idx == b)
                s1_bins[b].append(seq[m & is_s1])
                ot_bins[b].append(seq[m & ~is_s1])
            if t_rate.size:
                centers = t0 - pre_ns + (np.arange(nb) * bin_ns + bin_ns // 2)
                j = np.searchsorted(t_rate, centers, side="right") - 1
                announced[k] = np.where(j >= 0, r_rate[np.clip(j, 0, None)], np.nan)
                # When the MMS first announced S1 at least half way to its new rate (steps
                # where the announced rate already was past that mark, by noise, say nothing).
                half = rate * (1.0 + factor) / 2.0
                j0 = int(np.searchsorted(t_rate, t0, side="right")) - 1
                pre = r_rate[j0] if j0 >= 0 else None
                past = (lambda r: r >= half) if factor > 1 else (lambda r: r <= half)
                after = (t_rate >= t0) & past(r_rate)
                if pre is not None and not past(pre) and after.any():
                    updates.append((int(t_rate[after][0]) - t0) / 1e6)
                changed = (t_rate >= t0) & (r_rate != pre) if pre is not None else np.zeros(0, dtype=bool)
                if changed.any():
                    changes.append((int(t_rate[changed][0]) - t0) / 1e6)

        def stat(bins: list[list[np.ndarray]], fn: Any, half: int = 0) -> np.ndarray:
            out = np.full(len(bins), np.nan)
            for b in range(len(bins)):
                v = pooled(bins, b, half)
                if v.size:
                    out[b] = fn(v) / 1e3
            return out

        s1_p50, s1_max = stat(s1_bins, np.median), stat(s1_bins, np.max)
        ot_p50, ot_max = stat(ot_bins, np.median), stat(ot_bins, np.max)
        ot_p50_w = stat(ot_bins, np.median, 1)
        # Recovery is judged on 30 ms windows (a bin and its neighbours): at these rates a
        # 10 ms bin of one shard holds only a few records.
        s1_p50_w = stat(s1_bins, np.median, 1)
        x_ms = (np.arange(nb) - nb_pre) * p["bin_ms"] + p["bin_ms"] / 2
        before = np.concatenate([x for bb in s1_bins[:nb_pre] for x in bb]) if nb_pre else np.empty(0)
        base = float(np.median(before)) / 1e3 if before.size else float("nan")
        ot_before = np.concatenate([x for bb in ot_bins[:nb_pre] for x in bb]) if nb_pre else np.empty(0)
        ot_base = float(np.median(ot_before)) / 1e3 if ot_before.size else float("nan")
        thr = max(1.25 * base, base + 200.0)
        after_w = s1_p50_w[nb_pre:]
        # Above its level from the first window over the threshold until the first 5
        # windows in a row (50 ms) back under it; 0 when it never rose.
        run_len = 5
        over = np.flatnonzero(np.isfinite(after_w) & (after_w > thr))
        rises = int(over[0]) * p["bin_ms"] if over.size else None
        elevated: int | None = 0
        if over.size:
            elevated = None
            for b in range(int(over[0]) + 1, len(after_w) - run_len + 1):
                w = after_w[b:b + run_len]
                if np.all(np.isfinite(w)) and np.all(w <= thr):
                    elevated = b * p["bin_ms"]
                    break
        after_p50 = s1_p50_w[nb_pre:]
        peak_i = int(np.nanargmax(after_p50)) if np.isfinite(after_p50).any() else None
        ot_after = ot_p50_w[nb_pre:]
        rows.append({
            "part": "step", "stage": label, "step": kind, "from_rate": rate, "to_rate": round(rate * factor),
            "steps": len(t0s), "base_p50_us": us(base),
            "peak_p50_us": us(float(after_p50[peak_i]) if peak_i is not None else None),
            "peak_at_ms": None if peak_i is None else float(x_ms[nb_pre + peak_i]),
            "rises_at_ms": rises, "elevated_for_ms": elevated, "threshold_us": us(thr),
            "others_base_p50_us": us(ot_base),
            "others_peak_p50_us": us(float(np.nanmax(ot_after)) if np.isfinite(ot_after).any() else None),
            "mms_update_ms": round(float(np.mean(updates)), 1) if updates else None,
            "mms_first_change_ms": round(float(np.mean(changes)), 1) if changes else None,
            "mms_update_each_ms": [round(u, 1) for u in updates],
        })
        curves[kind] = {"x_ms": x_ms, "s1_p50": s1_p50, "s1_p50_30ms": s1_p50_w, "s1_max": s1_max,
                        "ot_p50": ot_p50, "ot_p50_30ms": ot_p50_w, "ot_max": ot_max,
                        "announced": np.nanmedian(announced, axis=0) if np.isfinite(announced).any() else None,
                        "factor": factor, "threshold": thr, "elevated": elevated}
    return rows, curves
