"""Experiment: sequential access latency (the dissertation's Figure 4.6 and the rate step of 4.4.4).

Sequential access latency is the time from a client's call of InsertAfter to the moment a
subscriber receives that record in the log's order. The subscriber's merge may deliver gsn
g only when every shard of g's epoch has shown progress past g, so a record waits for the
*slowest* shard's schedule: its latency shows how well the epoch schedule (each shard's
expected rate, 4.2.3) matches when records really arrive.

Setup as in the paper: 6 shards x 2 replicas; every shard has its own open-loop clients
(``Policy.fixed``), each calling InsertAfter every t ~ U(0, 2T) us with 4 KiB records; for a
given T, clients are added until each shard takes the target rate (``clients = rate * T``),
so a larger T means the same rate with more variance. One subscriber follows the log and
records each record's latency, shard, and which shard's progress it waited for.

Stages, each on a fresh local cluster (about 5 s to start):

1. **main** (shipped settings): the CPU the idle cluster uses; in the full run a capacity
   probe (per-shard rates, one client per shard; the rate used is the highest one every
   shard takes in full with the insert p50 within 1.5x and the sequential p50 within 2x the
   lightest load's); the sweep over T; then (full run) the paper's 10K records/s per shard,
   which this machine cannot sustain.
2. **step**: all shards at R; shard S1 jumps to 1.5 R at t0, back to R, down to 0.5 R, back,
   repeated; superposed on t0, sequential latency per 10 ms for S1 and the others, the rate
   the MMS announced for S1 (heard on its PUB socket) and how long until latency is back
   to its level. The MMS's floor rate (``--min-rate``, 200/s) would hide a step among rates
   this low, so this stage lowers it to R/4; it also repeats the smallest T of the sweep.
3. **variants** (full run): the smallest T again with a shorter no-op timeout, with fine
   slots (the MMS's floor at 20 R, so each shard's slots are dense), and both; and the step
   with the MMS committing every epoch instead of blocks of 10: evidence for what bounds the
   latency, with the CPU each setting costs an idle cluster.

    python -m bench sequential [--quick] [--out DIR]

Latencies are measured from the call of InsertAfter (``t_call``); the writers' timers wake
up to ~1 ms late, so each call is also stamped with when the schedule meant it to happen
and that lag is reported (``issue_lag``). ``ZIPLOG_BENCH_SEQ_RATE`` fixes the per-shard rate
(no capacity probe). Every wait is bounded and every process is stopped in ``finally``.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..loadgen import stop_processes
from ..report import Results, histogram, progress
from . import sequential_worker as sw

NAME = "sequential"
#: The paper's per-shard target (records/s).
PAPER_RATE = 10_000
#: The MMS's default floor rate (mms/planner.py PlannerSettings.min_rate).
MMS_DEFAULT_MIN_RATE = 200
#: The storage servers' default no-op timeout (ziplog.server --noop-timeout-us).
DEFAULT_NOOP_TIMEOUT_US = 1000

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
                   "released_at_epoch_end_pct", "announced_spread_pct", "slot_ahead_pct", "merge_wait_ahead_p50_us",
                   "merge_wait_behind_p50_us", "idle_cpu_cores", "cpu_cores"]


def _params(quick: bool) -> dict[str, Any]:
    env_rate = os.environ.get("ZIPLOG_BENCH_SEQ_RATE")
    return {
        "quick": quick,
        "shards": 6,
        "replicas": 2,
        "record_bytes": sw.RECORD_BYTES,
        "writer_processes": 2,
        # Per-shard rates the capacity probe tries (one client per shard). The quick run,
        # or ZIPLOG_BENCH_SEQ_RATE, skips it and uses ``rate_per_shard``.
        "probe_rates": [] if quick or env_rate else [50, 100, 150, 200, 300, 450],
        "probe_s": 2.0,
        "rate_per_shard": int(env_rate) if env_rate else 100,
        "paper_rate_try_s": 0.0 if quick else 1.5,
        # Clients per shard in the sweep; T = clients / rate.
        "sweep_clients": [1, 16] if quick else [1, 4, 16, 64],
        "sweep_s": 3.0 if quick else 6.0,
        # Calls within this long of a phase's start are not counted: the MMS learns the
        # new rates from the first epochs' reports (and commits them in blocks of 100 ms).
        "warmup_s": 0.6,
        "step_shard": 1,
        "step_up": 1.5,
        "step_down": 0.5,
        "step_segment_s": 0.5,   # each level of S1 lasts this long: R, up, R, down, R, ...
        "step_cycles": 2 if quick else 8,
        "bin_ms": 10,
        "idle_s": 1.0 if quick else 2.0,
        "variants": not quick,
        "short_noop_timeout_us": 250,
        "fine_slots_x": 20,      # MMS floor = this x R in the fine-slots variants
        "max_in_flight": 400,    # per writer process
        "insert_timeout_s": 5.0,
        "drain_s": 5.0,
        "startup_timeout_s": 90.0,
        "seed": int.from_bytes(os.urandom(4), "big"),
    }


# -- cluster, processes and phases ------------------------------------------------------------

@dataclass
class PhaseData:
    """What one phase produced: per-insert acks and per-record deliveries (arrays with the
    columns of ``sw.ACK_COLUMNS`` / ``sw.DELIVERY_COLUMNS``) and what the machine did."""

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

    def rate_spread(self, t_from: int, t_to: int) -> float | None:
        """How far apart the MMS puts shards that run at the same rate: the mean over
        broadcasts of (std / mean) of the announced rates, in percent."""
        cv = [float(np.std(r) / np.mean(r)) for t, _, _, r in list(self.entries) if t_from <= t < t_to and len(r) > 1]
        return 100.0 * float(np.mean(cv)) if cv else None


def _listen_epochs(pubs: list[str], log: EpochLog, stop: threading.Event) -> None:
    import zmq

    from ziplog.protocol import frames as wire
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    try:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        for a in pubs:
            sock.connect(a)
        seen: set[int] = set()
        while not stop.is_set():
            if not sock.poll(100):
                continue
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                t = time.monotonic_ns()
                msg = wire.unpack(frame)
                if msg[1] == wire.EPOCH and msg[2] not in seen:  # the leader's; no duplicates
                    seen.add(msg[2])
                    log.entries.append((t, int(msg[2]), tuple(msg[3]), tuple(msg[4])))
    finally:
        sock.close(0)
        ctx.term()


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of ``pids`` (all their threads), from /proc; 0 where unreadable."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick


class Harness:
    """A local cluster with the writer processes, the subscriber and an EPOCH listener,
    running one phase at a time."""

    def __init__(self, p: dict[str, Any], res: Results, stack: contextlib.ExitStack, label: str,
                 server_args: list[str], mms_args: list[str]) -> None:
        import ziplog
        self.p = p
        self.res = res
        self.label = label
        self.phase_no = 0
        self.ctx = mp.get_context("spawn")
        self.res_q: Any = self.ctx.Queue()
        self.sub_q: Any = self.ctx.Queue()
        self.stop = self.ctx.Event()
        self.children: list[Any] = []
        self.cmd_qs: list[Any] = []
        self.epochs = EpochLog()
        self._epoch_stop = threading.Event()
        self._listener: threading.Thread | None = None
        t0 = time.monotonic()
        args = " ".join(server_args + mms_args) or "shipped settings"
        res.log(f"[{label}] starting a local cluster: {p['shards']} shards x {p['replicas']} replicas ({args})")
        try:
            self.cluster = stack.enter_context(ziplog.local_cluster(
                shards=p["shards"], replicas=p["replicas"], server_args=server_args, mms_args=mms_args))
        except Exception as e:
            raise RuntimeError(f"the local cluster could not start ({type(e).__name__}: {e})") from e
        stack.callback(self._stop_children)
        res.log(f"[{label}] cluster up in {time.monotonic() - t0:.1f} s")
        pubs = [m["pub"] for m in self.cluster.topology.mms.values() if m.get("pub")]
        self._listener = threading.Thread(target=_listen_epochs, args=(pubs, self.epochs, self._epoch_stop),
                                          name="epoch-listener", daemon=True)
        self._listener.start()
        self._start_children()

    def _start_children(self) -> None:
        p = self.p
        hosts = self.cluster.zk_hosts
        sp = self.ctx.Process(target=sw.subscriber_main, args=(hosts, self.sub_q, self.res_q, self.stop),
                              name="seq-subscriber", daemon=True)
        sp.start()
        self.children.append(sp)
        n = p["writer_processes"]
        shards = list(range(p["shards"]))
        for w in range(n):
            q = self.ctx.Queue()
            self.cmd_qs.append(q)
            wp = self.ctx.Process(target=sw.writer_main,
                                  args=(w, shards[w::n], hosts, q, self.res_q, p["insert_timeout_s"]),
                                  name=f"seq-writer-{w}", daemon=True)
            wp.start()
            self.children.append(wp)
        expected: set[Any] = set(range(n)) | {"sub"}
        ready: set[Any] = set()
        failures: list[str] = []
        deadline = time.monotonic() + p["startup_timeout_s"]
        while ready != expected and time.monotonic() < deadline and not failures:
            try:
                kind, who, info = self.res_q.get(timeout=0.5)[:3]
            except queue.Empty:
                dead = [c.name for c in self.children if not c.is_alive()]
                if dead:
                    failures.append(f"{', '.join(dead)} exited")
                continue
            if kind == "ready":
                ready.add(who)
            elif kind == "failed":
                failures.append(f"{who}: {info}")
        if ready != expected:
            why = "; ".join(failures) or "no answer in time"
            raise RuntimeError(f"writer/subscriber processes could not connect ({why}); logs in {self.cluster.logs}")

    def _stop_children(self) -> None:
        self._epoch_stop.set()
        for q in self.cmd_qs:
            with contextlib.suppress(Exception):
                q.put(("quit",))
        self.stop.set()
        stop_processes(self.children, 5.0)
        if self._listener is not None:
            self._listener.join(timeout=2.0)

    def idle_cpu(self, seconds: float) -> dict[str, float]:
        """CPU (in cores) the cluster uses with no inserts at all: epochs, no-op slots,
        heartbeats. On a small machine this is what the workload has to share."""
        c = self.cluster
        groups = {"replicas": [pr.pid for pr in c.servers.values()], "mms": [pr.pid for pr in c.mms.values()],
                  "failure_handler": [pr.pid for pr in c.fh.values()],
                  "writers_and_subscriber": [ch.pid for ch in self.children if ch.pid is not None]}
        before = {k: _cpu_seconds(v) for k, v in groups.items()}
        t0 = time.monotonic()
        time.sleep(seconds)
        el = time.monotonic() - t0
        return {k: round((_cpu_seconds(v) - before[k]) / el, 3) for k, v in groups.items()}

    def _pids(self) -> list[int]:
        c = self.cluster
        procs = list(c.servers.values()) + list(c.mms.values()) + list(c.fh.values())
        return [pr.pid for pr in procs] + [ch.pid for ch in self.children if ch.pid is not None]

    def run_phase(self, segments: list[sw.Segment], duration_s: float) -> PhaseData:
        """Run one phase (bounded: the writers' calls end after ``duration_s``, their inserts
        time out, the subscriber gets ``drain_s`` to deliver what was acknowledged)."""
        p = self.p
        self.phase_no += 1
        start_ns = time.monotonic_ns() + 300_000_000
        spec = sw.PhaseSpec(self.phase_no, start_ns, tuple(segments), p["max_in_flight"], p["drain_s"],
                            (p["seed"] + self.phase_no) & 0xFFFFFFFF)
        for q in self.cmd_qs:
            q.put(("phase", spec))
        time.sleep(max(start_ns - time.monotonic_ns(), 0) / 1e9)
        cpu0, t_cpu0 = _cpu_seconds(self._pids()), time.monotonic()
        results: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + duration_s + p["drain_s"] + p["insert_timeout_s"] + 10.0
        while len(results) < len(self.cmd_qs) and time.monotonic() < deadline:
            try:
                msg = self.res_q.get(timeout=0.5)
            except queue.Empty:
                if not all(c.is_alive() for c in self.children):
                    raise RuntimeError("a writer or the subscriber died; logs in " + str(self.cluster.logs))
                continue
            if msg[0] == "phase_done" and msg[2] == spec.phase:
                results[msg[1]] = msg[3]
            elif msg[0] == "failed":
                raise RuntimeError(f"{msg[1]} failed: {msg[2]}")
        if len(results) < len(self.cmd_qs):
            raise RuntimeError(f"writers did not finish phase {spec.phase} in time")
        cpu = (_cpu_seconds(self._pids()) - cpu0) / max(time.monotonic() - t_cpu0, 1e-3)
        acks = np.concatenate([r["acks"] for r in results.values()])
        stats: dict[str, int] = {}
        errors: dict[str, int] = {}
        for r in results.values():
            for per_shard in r["client_stats"].values():
                for k, v in per_shard.items():
                    stats[k] = stats.get(k, 0) + v
            for k, v in r["errors"].items():
                errors[k] = errors.get(k, 0) + v
        deliveries = self._collect(spec.phase, len(acks), time.monotonic() + p["drain_s"])
        ours = deliveries[deliveries[:, 1] == spec.phase] if len(deliveries) else deliveries
        acked_keys = set(zip(acks[:, 3].tolist(), acks[:, 4].tolist()))
        got_keys = set(zip(ours[:, 7].tolist(), ours[:, 2].tolist()))
        w_from, w_to = start_ns + int(p["warmup_s"] * 1e9), start_ns + int(duration_s * 1e9)
        announced = self.epochs.mean_rate(w_from, w_to)
        spread = self.epochs.rate_spread(w_from, w_to)
        return PhaseData(spec.phase, start_ns, duration_s, acks, ours,
                         sum(r["scheduled"] for r in results.values()),
                         sum(r["not_issued"] for r in results.values()), errors,
                         [e for r in results.values() for e in r["first_errors"]],
                         np.concatenate([r["lag_ns"] for r in results.values()]), stats,
                         len(acked_keys - got_keys), cpu, announced, spread)

    def _collect(self, phase: int, acked: int, deadline: float) -> np.ndarray:
        """Ask the subscriber for its deliveries until it has this phase's acknowledged
        records (or the deadline passes)."""
        parts: list[np.ndarray] = []
        have = 0
        k = 0
        while True:
            k += 1
            self.sub_q.put(("flush", k))
            got = None
            t_end = time.monotonic() + 5.0
            while got is None and time.monotonic() < t_end:
                try:
                    msg = self.res_q.get(timeout=0.5)
                except queue.Empty:
                    continue
                if msg[0] == "deliveries" and msg[1] == k:
                    got = msg[2]
                elif msg[0] == "failed":
                    raise RuntimeError(f"{msg[1]} failed: {msg[2]}")
            if got is None:
                raise RuntimeError("the subscriber stopped answering")
            if len(got):
                parts.append(got)
                have += int(np.count_nonzero(got[:, 1] == phase))
            if have >= acked or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        return np.concatenate(parts) if parts else np.empty((0, len(sw.DELIVERY_COLUMNS)), dtype=np.int64)

    def health(self) -> dict[str, Any]:
        """Failure suspicions and recoveries so far (a replica that stalls past the 500 ms
        suspicion timeout on a loaded machine is recovered like a dead one: its shard stops
        taking inserts for a while, and the numbers of that phase are not latency)."""
        import ziplog
        out: dict[str, Any] = {"suspicions": None, "recoveries": None, "restarts": len(self.cluster.restarts)}
        try:
            with ziplog.Client(self.cluster.zk_hosts, timeout=5.0) as c:
                st = c.status()
            reps = [r for rs in st.values() for r in rs]
            out["suspicions"] = sum(int(r.get("suspicions", 0)) for r in reps)
            out["recoveries"] = sum(max(int(r.get("recovery_gen", -1)), -1) + 1 for r in reps if r.get("primary"))
        except Exception as e:  # reported, not fatal: the measurements are already in
            out["error"] = f"{type(e).__name__}: {e}"
        return out


@contextlib.contextmanager
def _stage(p: dict[str, Any], res: Results, label: str, server_args: list[str] | None = None,
           mms_args: list[str] | None = None) -> Iterator[Harness]:
    with contextlib.ExitStack() as stack:
        yield Harness(p, res, stack, label, list(server_args or []), list(mms_args or []))


# -- analysis -----------------------------------------------------------------------------------------

def _pct(a: np.ndarray, q: float) -> float | None:
    return float(np.percentile(a, q)) / 1e3 if a.size else None


def _us(v: float | None) -> float | None:
    return None if v is None or not np.isfinite(v) else round(float(v), 1)


def _window(d: PhaseData, warmup_s: float) -> tuple[np.ndarray, np.ndarray, float]:
    """Acks and deliveries of calls made after the warm-up, and the window's length (s)."""
    t_from = d.start_ns + int(warmup_s * 1e9)
    t_to = d.start_ns + int(d.duration_s * 1e9)
    a = d.acks[d.acks[:, 1] >= t_from] if len(d.acks) else d.acks
    v = d.deliveries[d.deliveries[:, 6] >= t_from] if len(d.deliveries) else d.deliveries
    return a, v, max((t_to - t_from) / 1e9, 1e-9)


def _slot_lead(dl: np.ndarray, epochs: EpochLog) -> np.ndarray:
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


def _summary(d: PhaseData, p: dict[str, Any], rate: float, epochs: EpochLog | None = None) -> dict[str, Any]:
    """One row: latencies (us) from the call, where the sequential latency went, rates."""
    from ziplog.protocol.gsna import EPOCH_SPAN
    acks, dl, span = _window(d, p["warmup_s"])
    empty = np.empty(0)
    ins = acks[:, 2] - acks[:, 1] if len(acks) else empty
    seq = dl[:, 0] - dl[:, 6] if len(dl) else empty
    seq_int = dl[:, 0] - dl[:, 5] if len(dl) else empty
    own = dl[:, 8] - dl[:, 6] if len(dl) else empty          # call -> its shard's batch at the subscriber
    wait = dl[:, 9] - dl[:, 8] if len(dl) else empty         # that -> the batch that released it
    held = (dl[:, 10] != dl[:, 2]) & (dl[:, 9] > dl[:, 8]) if len(dl) else np.empty(0, dtype=bool)
    at_end = (dl[:, 11] % EPOCH_SPAN == 0) if len(dl) else np.empty(0, dtype=bool)  # released up to an epoch's last gsn
    per_shard = [int(np.count_nonzero(acks[:, 4] == s)) / span for s in range(p["shards"])] if len(acks) else []
    fast = d.client_stats.get("fast_path", 0)
    slow = d.client_stats.get("slow_path", 0)
    seq50, ins50 = _pct(seq, 50), _pct(ins, 50)
    lead = _slot_lead(dl, epochs) if epochs is not None and len(dl) else np.empty(0)
    known = np.isfinite(lead)
    ahead = known & (lead > 0)
    behind = known & (lead <= 0)
    return {
        "rate_per_shard": round(rate, 1),
        "achieved_per_shard": round(float(np.mean(per_shard)), 1) if per_shard else 0.0,
        "achieved_min_shard": round(float(np.min(per_shard)), 1) if per_shard else 0.0,
        "announced_rate": _us(d.announced),
        "announced_spread_pct": _us(d.announced_spread),
        "seq_p50_us": _us(seq50), "seq_p90_us": _us(_pct(seq, 90)), "seq_p99_us": _us(_pct(seq, 99)),
        "seq_p999_us": _us(_pct(seq, 99.9)), "seq_max_us": _us(float(seq.max()) / 1e3 if seq.size else None),
        "seq_from_intended_p50_us": _us(_pct(seq_int, 50)), "seq_from_intended_p99_us": _us(_pct(seq_int, 99)),
        "insert_p50_us": _us(ins50), "insert_p99_us": _us(_pct(ins, 99)),
        "seq_over_insert": round(seq50 / ins50, 2) if seq50 and ins50 else None,
        "own_path_p50_us": _us(_pct(own, 50)), "own_path_p99_us": _us(_pct(own, 99)),
        "merge_wait_p50_us": _us(_pct(wait, 50)), "merge_wait_p99_us": _us(_pct(wait, 99)),
        "held_by_other_pct": round(100.0 * float(np.mean(held)), 1) if held.size else None,
        "held_by_shard": {int(s): int(c) for s, c in zip(*np.unique(dl[held][:, 10], return_counts=True))}
        if held.size and held.any() else {},
        "released_at_epoch_end_pct": round(100.0 * float(np.mean(at_end)), 1) if at_end.size else None,
        "slot_ahead_pct": round(100.0 * float(np.count_nonzero(ahead)) / max(int(np.count_nonzero(known)), 1), 1)
        if known.any() else None,
        "slot_lead_p50_us": _us(float(np.median(lead[known])) / 1e3) if known.any() else None,
        "merge_wait_ahead_p50_us": _us(_pct(wait[ahead], 50)) if ahead.any() else None,
        "merge_wait_behind_p50_us": _us(_pct(wait[behind], 50)) if behind.any() else None,
        "issue_lag_p50_us": _us(_pct(d.lag_ns, 50)), "issue_lag_p99_us": _us(_pct(d.lag_ns, 99)),
        "fast_path_pct": round(100.0 * fast / (fast + slow), 1) if fast + slow else None,
        "cpu_cores": round(d.cpu_cores, 2),
        "records": int(len(dl)), "acked": int(len(d.acks)), "undelivered": d.undelivered,
        "acked_pct": round(100.0 * len(d.acks) / d.scheduled, 1) if d.scheduled else 0.0,
        "not_issued": d.not_issued, "errors": d.errors, "errors_total": sum(d.errors.values()),
        "first_errors": d.first_errors,
        "histogram": histogram(seq.astype(np.int64)) if seq.size else {"edges_us": [], "counts": []},
        "insert_histogram": histogram(ins.astype(np.int64)) if ins.size else {"edges_us": [], "counts": []},
    }


def _segments(p: dict[str, Any], rate: float, duration_s: float, clients: int = 1) -> list[sw.Segment]:
    """Every shard at ``rate`` with ``clients`` clients each (T = clients / rate)."""
    T_us = clients * 1e6 / rate
    return [sw.Segment(s, 0.0, duration_s, clients, T_us) for s in range(p["shards"])]


# -- the phases -----------------------------------------------------------------------------------------

def _capacity(h: Harness, p: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """Per-shard rates from light to heavy; returns the rows and the rate to use: the
    highest one at which every call was acknowledged (>= 99 %: one client's count over a
    short window varies by several percent, so the achieved rate itself is only checked
    to within 10 %), with no error, the insert p50 within 1.5x and the sequential p50
    within 2x the lightest load's (past that, latencies measure the machine's CPU)."""
    rows: list[dict[str, Any]] = []
    for rate in progress(NAME, p["probe_rates"], lambda r: f"capacity: {r} records/s per shard"):
        d = h.run_phase(_segments(p, rate, p["probe_s"]), p["probe_s"])
        rows.append({"part": "capacity", **_summary(d, p, rate, h.epochs)})
        r = rows[-1]
        h.res.log(f"  achieved {r['achieved_per_shard']}/s per shard (min {r['achieved_min_shard']}), insert p50 "
                  f"{r['insert_p50_us']} us, seq p50 {r['seq_p50_us']} us, {r['cpu_cores']} cores busy")
        if r["acked_pct"] < 80.0 or r["achieved_per_shard"] < 0.8 * rate:
            break  # saturated: heavier rates only take longer to fail
    chosen = int(p["rate_per_shard"])
    if rows:
        ins0 = rows[0]["insert_p50_us"] or 1.0
        seq0 = rows[0]["seq_p50_us"] or 1.0
        ok = [r for r in rows if r["acked_pct"] >= 99.0 and r["achieved_per_shard"] >= 0.9 * r["rate_per_shard"]
              and (r["insert_p50_us"] or 1e9) <= 1.5 * ins0 and (r["seq_p50_us"] or 1e9) <= 2.0 * seq0
              and r["not_issued"] == 0 and r["errors_total"] == 0]
        chosen = int(max((r["rate_per_shard"] for r in ok), default=rows[0]["rate_per_shard"]))
    return rows, chosen


def _paper_rate(h: Harness, p: dict[str, Any]) -> dict[str, Any]:
    h.res.log(f"[{h.label}] offering the paper's {PAPER_RATE} records/s per shard for {p['paper_rate_try_s']} s")
    d = h.run_phase(_segments(p, PAPER_RATE, p["paper_rate_try_s"]), p["paper_rate_try_s"])
    row = {"part": "paper_rate", **_summary(d, dict(p, warmup_s=0.3), PAPER_RATE)}
    h.res.log(f"  achieved {row['achieved_per_shard']}/s per shard of {PAPER_RATE}; {row['not_issued']} calls not "
              f"issued (at most {p['max_in_flight']} in flight per writer process)")
    return row


def _sweep(h: Harness, p: dict[str, Any], rate: int, clients: list[int],
           samples: list[tuple[str, np.ndarray, np.ndarray]] | None = None) -> list[dict[str, Any]]:
    """One phase per T; appends (label, sequential latencies, insert latencies) in ns to
    ``samples`` for the CDF plot."""
    rows: list[dict[str, Any]] = []
    for n in progress(NAME, clients, lambda n: f"[{h.label}] {n} client(s) per shard, T = {n * 1e6 / rate:.0f} us"):
        d = h.run_phase(_segments(p, rate, p["sweep_s"], n), p["sweep_s"])
        row = {"part": "sweep", "stage": h.label, "T_us": round(n * 1e6 / rate), "clients_per_shard": n,
               **_summary(d, p, rate, h.epochs)}
        rows.append(row)
        h.res.log(f"  seq p50 {row['seq_p50_us']} / p99 {row['seq_p99_us']} us, insert p50 {row['insert_p50_us']} us, "
                  f"ratio {row['seq_over_insert']}, merge wait p50 {row['merge_wait_p50_us']} us, achieved "
                  f"{row['achieved_per_shard']}/s per shard, {row['cpu_cores']} cores busy")
        if samples is not None:
            acks, dl, _ = _window(d, p["warmup_s"])
            samples.append((f"T = {row['T_us']} us ({n}/shard)", dl[:, 0] - dl[:, 6], acks[:, 2] - acks[:, 1]))
    return rows


def _variants(p: dict[str, Any], rate: int) -> list[tuple[str, list[str], list[str]]]:
    """(label, storage server args, MMS args): the smallest T again with one knob turned.

    * a shorter no-op timeout: a shard behind its schedule holds the others back for less;
    * fine slots: an MMS floor far above the offered rate makes every shard's slots dense,
      so a record's slot is due soon after its call (records land *behind* the schedule,
      where the no-op timeout bounds the wait) at the price of more no-op expiries;
    * both."""
    short = ["--noop-timeout-us", str(p["short_noop_timeout_us"])]
    fine = ["--min-rate", str(int(p["fine_slots_x"] * rate))]
    return [("noop-timeout", short, []), ("fine-slots", [], fine), ("fine-slots+noop-timeout", short, fine)]


def _step_levels(p: dict[str, Any]) -> list[float]:
    """S1's rate factor per segment: a lead-in at R (the MMS learns the rates), then R, up,
    R, down, repeated, then R."""
    return [1.0] + [1.0, p["step_up"], 1.0, p["step_down"]] * p["step_cycles"] + [1.0]


def _step(h: Harness, p: dict[str, Any], rate: int) -> tuple[PhaseData, list[float]]:
    L = p["step_segment_s"]
    levels = _step_levels(p)
    duration = L * len(levels)
    segs = [sw.Segment(s, 0.0, duration, 1, 1e6 / rate) for s in range(p["shards"]) if s != p["step_shard"]]
    for i, f in enumerate(levels):
        segs.append(sw.Segment(p["step_shard"], i * L, (i + 1) * L, 1, 1e6 / (rate * f)))
    h.res.log(f"[{h.label}] step: shard {p['step_shard']} at {'/'.join(f'{f:g}' for f in levels)} x {rate}/s, "
              f"{L:g} s each; the other shards at {rate}/s ({duration:.1f} s)")
    return h.run_phase(segs, duration), levels


def _pooled(bins: list[list[np.ndarray]], b: int, half: int) -> np.ndarray:
    parts = [x for bb in range(max(b - half, 0), min(b + half + 1, len(bins))) for x in bins[bb]]
    return np.concatenate(parts) if parts else np.empty(0)


def _step_analysis(d: PhaseData, p: dict[str, Any], rate: int, levels: list[float], epochs: EpochLog,
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
                v = _pooled(bins, b, half)
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
            "steps": len(t0s), "base_p50_us": _us(base),
            "peak_p50_us": _us(float(after_p50[peak_i]) if peak_i is not None else None),
            "peak_at_ms": None if peak_i is None else float(x_ms[nb_pre + peak_i]),
            "rises_at_ms": rises, "elevated_for_ms": elevated, "threshold_us": _us(thr),
            "others_base_p50_us": _us(ot_base),
            "others_peak_p50_us": _us(float(np.nanmax(ot_after)) if np.isfinite(ot_after).any() else None),
            "mms_update_ms": round(float(np.mean(updates)), 1) if updates else None,
            "mms_first_change_ms": round(float(np.mean(changes)), 1) if changes else None,
            "mms_update_each_ms": [round(u, 1) for u in updates],
        })
        curves[kind] = {"x_ms": x_ms, "s1_p50": s1_p50, "s1_p50_30ms": s1_p50_w, "s1_max": s1_max,
                        "ot_p50": ot_p50, "ot_p50_30ms": ot_p50_w, "ot_max": ot_max,
                        "announced": np.nanmedian(announced, axis=0) if np.isfinite(announced).any() else None,
                        "factor": factor, "threshold": thr, "elevated": elevated}
    return rows, curves


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


# -- the experiment --------------------------------------------------------------------------------------

def run(quick: bool, out: Path | None) -> list[dict[str, Any]]:
    p = _params(quick)
    res = Results(NAME, out, p)
    samples: list[tuple[str, np.ndarray, np.ndarray]] = []
    health: dict[str, Any] = {}
    paper: dict[str, Any] | None = None
    with _stage(p, res, "main") as h:
        idle: dict[str, float] = h.idle_cpu(p["idle_s"])
        p["idle_cpu_cores"] = idle
        res.log(f"[main] CPU with no inserts (cores): {idle}")
        probe_rows, rate = _capacity(h, p)
        p["rate_used"] = rate
        res.log(f"rate used: {rate} records/s per shard ({rate * p['shards']}/s in all)")
        sweep_rows = _sweep(h, p, rate, p["sweep_clients"], samples)
        if p["paper_rate_try_s"] > 0:
            paper = _paper_rate(h, p)
        health["main"] = h.health()

    # Below the MMS's floor every shard would be announced at the floor and a step hidden.
    step_floor = max(1, int(rate * p["step_down"] / 2))
    p["step_min_rate"] = step_floor
    settings = {"main": "shipped", "step": f"--min-rate {step_floor}"}
    variant_rows: list[dict[str, Any]] = []
    vsamples: list[tuple[str, np.ndarray, np.ndarray]] = []
    idle_by_stage = {"main": sum(idle.values())}
    with _stage(p, res, "step", mms_args=["--min-rate", str(step_floor)]) as h:
        if p["variants"]:
            idle_by_stage["step"] = sum(h.idle_cpu(p["idle_s"] / 2).values())
        step_data, levels = _step(h, p, rate)
        if p["variants"]:
            variant_rows += _sweep(h, p, rate, [1], vsamples)
        health["step"] = h.health()
        step_epochs = EpochLog(list(h.epochs.entries))
    step_rows, curves = _step_analysis(step_data, p, rate, levels, step_epochs, "step")

    fast_curves: dict[str, dict[str, Any]] | None = None
    if p["variants"]:
        for label, sargs, margs in _variants(p, rate):
            settings[label] = " ".join(sargs + margs)
            with _stage(p, res, label, server_args=sargs, mms_args=margs) as h:
                idle_by_stage[label] = sum(h.idle_cpu(p["idle_s"] / 2).values())
                variant_rows += _sweep(h, p, rate, [1], vsamples)
                health[label] = h.health()
        with _stage(p, res, "commit-every-epoch",
                    mms_args=["--min-rate", str(step_floor), "--epochs-per-commit", "1"]) as h:
            fast_data, fast_levels = _step(h, p, rate)
            health["commit-every-epoch"] = h.health()
            fast_epochs = EpochLog(list(h.epochs.entries))
        fast_rows, fast_curves = _step_analysis(fast_data, p, rate, fast_levels, fast_epochs, "commit-every-epoch")
        step_rows += fast_rows
    first_main = [dict(sweep_rows[0], stage="main")] if sweep_rows else []
    variant_rows = first_main + variant_rows
    for r in variant_rows:
        r["settings"] = settings.get(r["stage"], "")
        r["idle_cpu_cores"] = _us(idle_by_stage.get(r["stage"]))

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
    p["health"] = health
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
    return sweep_rows + step_rows + probe_rows + ([paper] if paper else []) + variant_rows[1:]


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
        res.note(f"With no inserts at all the cluster keeps {sum(idle.values()):.2f} of "
                 f"{res.machine.get('cpu_count')} cores busy ({', '.join(f'{k} {v}' for k, v in idle.items())}): "
                 f"every replica handles an epoch broadcast every 10 ms and, between them, the no-op expiry of "
                 f"slots the MMS's floor rate ({MMS_DEFAULT_MIN_RATE}/s) schedules. The workload gets what is left.")
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
                 f"records waited for another shard's progress, {first['released_at_epoch_end_pct']} % were released "
                 f"only when that shard closed the epoch. The MMS announced {first['announced_rate']}/s per shard "
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
             "of the 10 ms epoch. A shard slower than announced loses its slots to no-ops after --noop-timeout-us "
             f"({DEFAULT_NOOP_TIMEOUT_US} us), which is what the other shards' records then wait for.")
    bad = {k: v for k, v in health.items() if v.get("recoveries") or v.get("suspicions")}
    if bad:
        res.note(f"Failure suspicions / recoveries during the run (replicas stalled past the 500 ms suspicion timeout: "
                 f"the machine was overloaded; inserts refused meanwhile are in errors): {bad}")
