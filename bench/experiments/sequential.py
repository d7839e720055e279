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
3. **variants**: the smallest T again with shards passing slots by the clock, as before
   progress on demand (1 ms no-op timeout, no NOTICEs, 10 ms epochs: the before of this
   run), and on the Scalog-style log at the same load; in the full run also the clock with
   fine slots (the MMS's floor at 20 R) and the step with the MMS committing every epoch
   instead of blocks of 10; each with the CPU its idle cluster costs.

    python -m bench sequential [--quick] [--out DIR]

Latencies are measured from the call of InsertAfter (``t_call``); the writers' timers wake
up to ~1 ms late, so each call is also stamped with when the schedule meant it to happen
and that lag is reported (``issue_lag``). ``ZIPLOG_BENCH_SEQ_RATE`` fixes the per-shard rate
(no capacity probe). Every wait is bounded and every process is stopped in ``finally``.

The analysis of what the phases collect is in :mod:`bench.experiments.sequential_analyse`,
the tables, notes and plots in :mod:`bench.experiments.sequential_report`, and the writer
and subscriber processes in :mod:`bench.experiments.sequential_worker`.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..cpu import cpu_seconds
from ..loadgen import stop_processes
from ..report import Results, progress
from . import sequential_worker as sw
from .sequential_analyse import (
    EpochLog,
    PhaseData,
    capacity_choice,
    step_analysis,
    summary,
    us,
    window,
)
from .sequential_report import NAME, PAPER_RATE, write_report


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
        "fine_slots_x": 20,      # MMS floor = this x R in the fine-slots variants
        "max_in_flight": 400,    # per writer process
        "insert_timeout_s": 5.0,
        "drain_s": 5.0,
        "startup_timeout_s": 90.0,
        "seed": int.from_bytes(os.urandom(4), "big"),
    }


# -- cluster, processes and phases ------------------------------------------------------------

def _listen_epochs(pubs: list[str], log: EpochLog, stop: threading.Event) -> None:
    import zmq

    from ziplog.protocol import frames as wire
    from ziplog.protocol.epoch_feed import EpochFeed
    from ziplog.protocol.gsna import EpochConfig
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    try:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        for a in pubs:
            sock.connect(a)
        seen: set[int] = set()
        feed = EpochFeed()  # an EPOCH_SAME whose base came before we connected is left out
        while not stop.is_set():
            if not sock.poll(100):
                continue
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                t = time.monotonic_ns()
                cfg = feed.on_message(wire.decode_epoch(frame))
                if isinstance(cfg, EpochConfig) and cfg.epoch not in seen:  # the leader's; no duplicates
                    seen.add(cfg.epoch)
                    log.entries.append((t, cfg.epoch, cfg.shards, cfg.rates))
    finally:
        sock.close(0)
        ctx.term()


class Harness:
    """A local cluster with the writer processes, the subscriber and an EPOCH listener,
    running one phase at a time."""

    def __init__(self, p: dict[str, Any], res: Results, stack: contextlib.ExitStack, label: str,
                 server_args: list[str], mms_args: list[str], scalog: bool = False) -> None:
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
        self.cluster: Any = None
        self.scalog: Any = None
        if scalog:
            from ..systems.scalog import ScalogSystem
            res.log(f"[{label}] starting the Scalog-style log: {p['shards']} shards x {p['replicas']} servers")
            self.scalog = ScalogSystem(shards=p["shards"], replicas=p["replicas"])
            stack.callback(self.scalog.stop)
            self.scalog.start()
            #: what the writers and the subscriber connect to: ZooKeeper, or the servers
            self.target: Any = self.scalog.addrs
            self.logs: Any = self.scalog.dir
        else:
            args = " ".join(server_args + mms_args) or "shipped settings"
            res.log(f"[{label}] starting a local cluster: {p['shards']} shards x {p['replicas']} replicas ({args})")
            try:
                self.cluster = stack.enter_context(ziplog.local_cluster(
                    shards=p["shards"], replicas=p["replicas"], server_args=server_args, mms_args=mms_args))
            except Exception as e:
                raise RuntimeError(f"the local cluster could not start ({type(e).__name__}: {e})") from e
            self.target = self.cluster.zk_hosts
            self.logs = self.cluster.logs
        stack.callback(self._stop_children)
        res.log(f"[{label}] up in {time.monotonic() - t0:.1f} s")
        if self.cluster is not None:
            pubs = [m["pub"] for m in self.cluster.topology.mms.values() if m.get("pub")]
            self._listener = threading.Thread(target=_listen_epochs, args=(pubs, self.epochs, self._epoch_stop),
                                              name="epoch-listener", daemon=True)
            self._listener.start()
        self._start_children()

    def _start_children(self) -> None:
        p = self.p
        hosts = self.target
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
            raise RuntimeError(f"writer/subscriber processes could not connect ({why}); logs in {self.logs}")

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
        clients = [ch.pid for ch in self.children if ch.pid is not None]
        if c is None:
            groups = {"servers": [pr.pid for pr, _ in self.scalog.procs.values()], "writers_and_subscriber": clients}
        else:
            groups = {"replicas": [pr.pid for pr in c.servers.values()], "mms": [pr.pid for pr in c.mms.values()],
                      "failure_handler": [pr.pid for pr in c.fh.values()], "writers_and_subscriber": clients}
        before = {k: cpu_seconds(v) for k, v in groups.items()}
        t0 = time.monotonic()
        time.sleep(seconds)
        el = time.monotonic() - t0
        return {k: round((cpu_seconds(v) - before[k]) / el, 3) for k, v in groups.items()}

    def _pids(self) -> list[int]:
        c = self.cluster
        if c is None:
            procs = [pr for pr, _ in self.scalog.procs.values()]
        else:
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
        cpu0, t_cpu0 = cpu_seconds(self._pids()), time.monotonic()
        notices0 = self._notice_counters()
        results: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + duration_s + p["drain_s"] + p["insert_timeout_s"] + 10.0
        while len(results) < len(self.cmd_qs) and time.monotonic() < deadline:
            try:
                msg = self.res_q.get(timeout=0.5)
            except queue.Empty:
                if not all(c.is_alive() for c in self.children):
                    raise RuntimeError("a writer or the subscriber died; logs in " + str(self.logs))
                continue
            if msg[0] == "phase_done" and msg[2] == spec.phase:
                results[msg[1]] = msg[3]
            elif msg[0] == "failed":
                raise RuntimeError(f"{msg[1]} failed: {msg[2]}")
        if len(results) < len(self.cmd_qs):
            raise RuntimeError(f"writers did not finish phase {spec.phase} in time")
        cpu = (cpu_seconds(self._pids()) - cpu0) / max(time.monotonic() - t_cpu0, 1e-3)
        notices1 = self._notice_counters()
        notices = {k: v - notices0.get(k, 0) for k, v in notices1.items()}
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
                         len(acked_keys - got_keys), cpu, announced, spread, notices)

    def _notice_counters(self) -> dict[str, int]:
        """The primaries' NOTICE counters now, summed ({} on the Scalog-style log, or when
        STATUS cannot be had): received, late (after their epoch closed there), passed;
        NOTICE frames sent (``announced``) and announcements overtaken by a close."""
        if self.cluster is None:
            return {}
        try:
            with self.cluster.client() as c:
                status = c.status(wait=2.0)
        except Exception:
            return {}
        out: dict[str, int] = {}
        keys = ("received_notice", "late_notices", "passed_on_notice", "announcements_closed", "sent_notice")
        for replicas in status.values():
            for r in replicas:
                if r.get("primary"):
                    for k in keys:
                        out[k] = out.get(k, 0) + int(r.get(k, 0))
        out["announced"] = out.pop("sent_notice", 0)
        return out

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
        if self.cluster is None:
            return {}
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
           mms_args: list[str] | None = None, scalog: bool = False) -> Iterator[Harness]:
    with contextlib.ExitStack() as stack:
        yield Harness(p, res, stack, label, list(server_args or []), list(mms_args or []), scalog)


# -- the phases -----------------------------------------------------------------------------------------

def _segments(p: dict[str, Any], rate: float, duration_s: float, clients: int = 1) -> list[sw.Segment]:
    """Every shard at ``rate`` with ``clients`` clients each (T = clients / rate)."""
    T_us = clients * 1e6 / rate
    return [sw.Segment(s, 0.0, duration_s, clients, T_us) for s in range(p["shards"])]


def _capacity(h: Harness, p: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """Per-shard rates from light to heavy; returns the rows and the rate to use: the
    highest one at which every call was acknowledged (>= 99 %: one client's count over a
    short window varies by several percent, so the achieved rate itself is only checked
    to within 10 %), with no error, the insert p50 within 1.5x and the sequential p50
    within 2x the lightest load's (past that, latencies measure the machine's CPU)."""
    rows: list[dict[str, Any]] = []
    for rate in progress(NAME, p["probe_rates"], lambda r: f"capacity: {r} records/s per shard"):
        d = h.run_phase(_segments(p, rate, p["probe_s"]), p["probe_s"])
        rows.append({"part": "capacity", **summary(d, p, rate, h.epochs)})
        r = rows[-1]
        h.res.log(f"  achieved {r['achieved_per_shard']}/s per shard (min {r['achieved_min_shard']}), insert p50 "
                  f"{r['insert_p50_us']} us, seq p50 {r['seq_p50_us']} us, {r['cpu_cores']} cores busy")
        if r["acked_pct"] < 80.0 or r["achieved_per_shard"] < 0.8 * rate:
            break  # saturated: heavier rates only take longer to fail
    return rows, capacity_choice(rows, p)


def _paper_rate(h: Harness, p: dict[str, Any]) -> dict[str, Any]:
    h.res.log(f"[{h.label}] offering the paper's {PAPER_RATE} records/s per shard for {p['paper_rate_try_s']} s")
    d = h.run_phase(_segments(p, PAPER_RATE, p["paper_rate_try_s"]), p["paper_rate_try_s"])
    row = {"part": "paper_rate", **summary(d, dict(p, warmup_s=0.3), PAPER_RATE)}
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
               **summary(d, p, rate, h.epochs)}
        rows.append(row)
        h.res.log(f"  seq p50 {row['seq_p50_us']} / p99 {row['seq_p99_us']} us, insert p50 {row['insert_p50_us']} us, "
                  f"ratio {row['seq_over_insert']}, merge wait p50 {row['merge_wait_p50_us']} us, achieved "
                  f"{row['achieved_per_shard']}/s per shard, {row['cpu_cores']} cores busy")
        if samples is not None:
            acks, dl, _ = window(d, p["warmup_s"])
            samples.append((f"T = {row['T_us']} us ({n}/shard)", dl[:, 0] - dl[:, 6], acks[:, 2] - acks[:, 1]))
    return rows


#: how shards passed time before NOTICEs: a slot became a no-op 1 ms after its expected
#: arrival, and epochs were 10 ms also when idle
CLOCK_SERVER_ARGS = ["--noop-timeout-us", "1000", "--no-notices"]
CLOCK_MMS_ARGS = ["--idle-interval-ms", "10"]


def _variants(p: dict[str, Any], rate: int) -> list[tuple[str, list[str], list[str]]]:
    """(label, storage server args, MMS args): the smallest T again with other settings.

    * clock (before): shards pass slots by the clock (1 ms no-op timeout, no NOTICEs,
      10 ms epochs also when idle), as before progress on demand: the before of this run;
    * notices+clock: NOTICEs and the 1 ms no-op timeout both (does the timer still help?);
    * (full run) the clock with fine slots: an MMS floor far above the offered rate makes
      every shard's slots dense, so a record's slot is due soon after its call, at the
      price of more no-op expiries: the best the clock could do."""
    out = [("clock (before)", CLOCK_SERVER_ARGS, CLOCK_MMS_ARGS),
           ("notices+clock", ["--noop-timeout-us", "1000"], [])]
    if p["variants"]:
        fine = ["--min-rate", str(int(p["fine_slots_x"] * rate))]
        out.append(("clock+fine-slots", CLOCK_SERVER_ARGS, CLOCK_MMS_ARGS + fine))
    return out


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
    idle_by_stage = {"main": sum(v for k, v in idle.items() if k != "writers_and_subscriber")}
    with _stage(p, res, "step", mms_args=["--min-rate", str(step_floor)]) as h:
        if p["variants"]:
            idle_by_stage["step"] = sum(h.idle_cpu(p["idle_s"] / 2).values())
        step_data, levels = _step(h, p, rate)
        if p["variants"]:
            variant_rows += _sweep(h, p, rate, [1], vsamples)
        health["step"] = h.health()
        step_epochs = EpochLog(list(h.epochs.entries))
    step_rows, curves = step_analysis(step_data, p, rate, levels, step_epochs, "step")

    fast_curves: dict[str, dict[str, Any]] | None = None
    for label, sargs, margs in _variants(p, rate):
        settings[label] = " ".join(sargs + margs)
        with _stage(p, res, label, server_args=sargs, mms_args=margs) as h:
            idle_by_stage[label] = sum(v for k, v in h.idle_cpu(p["idle_s"]).items() if k != "writers_and_subscriber")
            variant_rows += _sweep(h, p, rate, [1], vsamples)
            health[label] = h.health()
    # The Scalog-style log at the same load (its delivery: a record is deliverable once a
    # cut orders it, every 0.1 ms), on the same two cores.
    settings["Scalog-style"] = "6 shards x 2 servers, cuts every 100 us"
    with _stage(p, res, "Scalog-style", scalog=True) as h:
        idle_by_stage["Scalog-style"] = sum(v for k, v in h.idle_cpu(p["idle_s"]).items()
                                            if k != "writers_and_subscriber")
        variant_rows += _sweep(h, p, rate, [1], vsamples)
    if p["variants"]:
        with _stage(p, res, "commit-every-epoch",
                    mms_args=["--min-rate", str(step_floor), "--epochs-per-commit", "1"]) as h:
            fast_data, fast_levels = _step(h, p, rate)
            health["commit-every-epoch"] = h.health()
            fast_epochs = EpochLog(list(h.epochs.entries))
        fast_rows, fast_curves = step_analysis(fast_data, p, rate, fast_levels, fast_epochs, "commit-every-epoch")
        step_rows += fast_rows
    first_main = [dict(sweep_rows[0], stage="main")] if sweep_rows else []
    variant_rows = first_main + variant_rows
    for r in variant_rows:
        r["settings"] = settings.get(r["stage"], "")
        r["idle_cpu_cores"] = us(idle_by_stage.get(r["stage"]))

    p["health"] = health
    write_report(res, p, rate, samples, vsamples, curves, fast_curves, probe_rows, paper, sweep_rows, step_rows,
                 variant_rows, health, step_epochs)
    return sweep_rows + step_rows + probe_rows + ([paper] if paper else []) + variant_rows[1:]
