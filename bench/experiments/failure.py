"""Experiment: throughput across a storage replica failure (the dissertation's Figure 4.7).

A local cluster of 3 shards x 2 replicas runs under a paced write load: several writer
*processes*, each choosing a shard at random per record (``Policy.random``, so that writers
whose shard fails move to the live ones) and inserting 4 KiB records at a fixed rate, while one subscriber process follows the log from its start. One second into
the load the primary of shard 0 is SIGKILLed (``cluster.kill_replica(0, 0)``); the
cluster's supervisor starts it again, as an operator would. We record the time of every
acknowledgement (and the shard it landed on) and of every delivery, and report:

* records acknowledged per 100 ms (total and per shard) and delivered per 100 ms;
* the longest write stall (the largest gap between two consecutive acks of one writer,
  counting the gap from its last ack to the end of the load if it never recovered);
* the longest subscriber stall (the largest gap between two consecutive deliveries);
* the supervisor's restart delay after the kill;
* a sanity check: every acknowledged record delivered exactly once (missing, duplicated).

    python -m bench failure [--quick] [--out DIR]

Writes ``failure.json``, ``failure.md`` and ``failure.png`` to ``results/failure-<timestamp>/``.
Every wait is bounded: the run finishes whether or not the killed shard ever recovers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
import datetime
import json
import multiprocessing as mp
import os
import queue
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ziplog.tools.stats import summarize

from ..loadgen import stop_processes
from ..machine import machine_info
from ..stats import format_table

#: Storage servers' failure suspicion timeout (``--suspect-timeout-ms``), in ms.
SUSPECT_TIMEOUT_MS = 500
#: The supervisor (an operator's restart policy) starts a killed replica after this long.
#: Longer than the suspicion timeout, so the kill always goes through failure recovery
#: (a replica restarted sooner, having lost nothing, rejoins without one).
RESTART_DELAY_S = float(os.environ.get("ZIPLOG_BENCH_RESTART_DELAY_S", "0.6"))

#: what is killed at ``kill_at_s``: the shard's primary alone, or first the failure
#: handler's leader and then the primary (recovery waits for a new leader)
SCENARIOS = ("replica", "leader_and_replica")

COLUMNS = ["scenario", "suspect_timeout_ms", "longest_write_stall_ms", "longest_sub_stall_ms", "restart_delay_ms",
           "missing", "duplicated", "acked", "write_errors"]

MAGIC = b"ZLFB"
_HEADER = struct.Struct("<4sIII")  # magic, run id, writer, sequence number


def _params(quick: bool, scenario: str = "replica") -> dict:
    assert scenario in SCENARIOS, scenario
    return {
        "quick": quick,
        "scenario": scenario,
        "kill_fh_leader": scenario == "leader_and_replica",
        "shards": 3,
        "replicas": 2,
        "writers_per_shard": 2,          # writers = shards * this; each picks shards at random
        "rate_per_writer": 200,          # inserts/s, paced (a stalled writer does not catch up in a burst)
        "record_bytes": 4096,
        "duration_s": 5.0 if quick else 8.0,
        "kill_at_s": 1.0,
        "kill_shard": 0,
        "kill_replica": 0,               # replica 0 is the shard's primary
        "supervise": True,
        "restart_delay_s": RESTART_DELAY_S,  # the supervisor restarts a dead replica after this long
        "suspect_timeout_ms": SUSPECT_TIMEOUT_MS,
        "bin_ms": 100,
        "insert_timeout_s": 3.0,         # Client(timeout=...): one insert_after waits at most this long
        "error_backoff_s": 0.02,         # a writer sleeps this long after a failed insert
        "drain_s": 5.0 if quick else 10.0,  # after the load: how long the subscriber may catch up
        "startup_timeout_s": 90.0,       # writer/subscriber processes connecting
    }


def _log(msg: str) -> None:
    print(f"[failure] {msg}", file=sys.stderr, flush=True)


def _import_ziplog():
    try:
        import ziplog
    except Exception as e:  # ImportError, or a half-written package failing at import time
        raise RuntimeError(f"cannot import ziplog ({type(e).__name__}: {e}); the failure benchmark cannot run") from e
    missing = [name for name in ("local_cluster", "Client", "Policy", "ZiplogError") if not hasattr(ziplog, name)]
    if missing:
        raise RuntimeError(f"ziplog has no {', '.join(missing)}; the failure benchmark cannot run")
    return ziplog


def _server_accepts(flag: str) -> bool | None:
    """Whether ``python -m ziplog.server`` knows ``flag`` (None: could not tell)."""
    try:
        p = subprocess.run([sys.executable, "-m", "ziplog.server", "--help"], capture_output=True,
                           text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        return None
    return flag in p.stdout


def _payload(run_id: int, writer: int, seq: int, size: int) -> bytes:
    head = _HEADER.pack(MAGIC, run_id, writer, seq)
    fill = f"writer {writer} record {seq};".encode()
    n = max(size - len(head), 0)
    return head + (fill * (n // len(fill) + 1))[:n]


def _header(data: bytes) -> tuple[int, int, int] | None:
    if len(data) < _HEADER.size or not data.startswith(MAGIC):
        return None
    _, run_id, writer, seq = _HEADER.unpack_from(data)
    return run_id, writer, seq


# -- child processes (spawn context: these run in fresh interpreters) ---------------------------

def _writer_main(w: int, shard: int, zk_hosts: str, run_id: int, p: dict, start_at: Any, go: Any,
                 stop: Any, out_q: Any, acked: Any) -> None:
    """One paced writer pinned to ``shard``. Sends ("ready"|"failed", w, ...) and then
    ("result", w, {...}) on ``out_q``."""
    acks: list[tuple[float, int, int, int, float]] = []  # (t_ack, seq, shard, gsn, latency_s)
    errors: dict[str, int] = {}
    first_errors: list[str] = []
    t_stop = None
    result: dict[str, Any] = {"shard": shard, "acks": acks, "errors": errors, "first_errors": first_errors}
    try:
        import ziplog
        client = ziplog.Client(zk_hosts, timeout=p["insert_timeout_s"], policy=ziplog.Policy.random())
    except BaseException as e:
        out_q.put(("failed", w, f"{type(e).__name__}: {e}"))
        return
    try:
        out_q.put(("ready", w, None))
        if not go.wait(p["startup_timeout_s"]):
            result["error"] = "never told to start"
            return
        t0 = start_at.value
        end_at = t0 + p["duration_s"]
        interval = 1.0 / p["rate_per_writer"]
        size = p["record_bytes"]
        backoff = p["error_backoff_s"]
        # Spread the writers' sends over one interval so they do not all fire together.
        next_at = t0 + interval * (w % 7) / 7
        seq = 0
        while not stop.is_set():
            now = time.monotonic()
            if now >= end_at:
                break
            if next_at > now:
                time.sleep(min(next_at - now, end_at - now))
                continue
            # Behind schedule by more than 100 ms (a stall): drop the missed sends rather
            # than bursting to catch up, so the timeline shows throughput, not backlog.
            next_at = max(next_at + interval, now - 0.1)
            seq += 1
            data = _payload(run_id, w, seq, size)
            t_send = time.monotonic()
            try:
                rid = client.insert_after(data)
            except Exception as e:  # ziplog.ZiplogError expected; anything else counted too
                name = type(e).__name__ if isinstance(e, ziplog.ZiplogError) else f"other:{type(e).__name__}"
                errors[name] = errors.get(name, 0) + 1
                if len(first_errors) < 5:
                    first_errors.append(f"t={time.monotonic() - t0:.3f}s {name}: {e}")
                time.sleep(backoff)
                continue
            t_ack = time.monotonic()
            acks.append((t_ack, seq, rid.shard, rid.gsn, t_ack - t_send))
            if 0 <= rid.shard < len(acked):
                with acked.get_lock():
                    acked[rid.shard] += 1
        t_stop = time.monotonic()
        with contextlib.suppress(Exception):
            result["client_stats"] = dict(client.stats)
    except BaseException as e:
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        result["t_stop"] = t_stop if t_stop is not None else time.monotonic()
        out_q.put(("result", w, result))
        with contextlib.suppress(Exception):
            client.close()


def _subscriber_main(zk_hosts: str, run_id: int, out_q: Any, ctrl_q: Any, stop: Any) -> None:
    """Follows the log from its start, recording (t, writer, seq, gsn, shard) per record of
    this run. After ("drain", acked_keys, deadline) arrives on ``ctrl_q`` it stops once every
    acked record was seen or at the deadline; ``stop`` ends it at once."""
    deliveries: list[tuple[float, int, int, int, int]] = []
    result: dict[str, Any] = {"deliveries": deliveries, "errors": [], "others": 0, "order_violations": 0,
                              "resubscribes": 0}
    try:
        import ziplog
        client = ziplog.Client(zk_hosts, timeout=10.0)
        sub = client.subscribe(ziplog.RID_GENESIS)
    except BaseException as e:
        out_q.put(("failed", "sub", f"{type(e).__name__}: {e}"))
        return
    out_q.put(("ready", "sub", None))
    pending: set[tuple[int, int]] | None = None
    drain_deadline = float("inf")
    last_gsn = 0
    try:
        while not stop.is_set():
            if pending is None:
                with contextlib.suppress(queue.Empty):
                    msg = ctrl_q.get_nowait()
                    if msg[0] == "drain":
                        keys, drain_deadline = msg[1], msg[2]
                        pending = {(int(k[0]), int(k[1])) for k in keys} - {(d[1], d[2]) for d in deliveries}
            if pending is not None and (not pending or time.monotonic() > drain_deadline):
                break
            try:
                rec = sub.next(timeout=0.05)
            except Exception as e:
                if len(result["errors"]) < 20:
                    result["errors"].append(f"{type(e).__name__}: {e}")
                time.sleep(0.1)
                # Start over from the log's beginning; records already seen (gsn <= last_gsn) are skipped.
                with contextlib.suppress(Exception):
                    sub.close()
                with contextlib.suppress(Exception):
                    sub = client.subscribe(ziplog.RID_GENESIS)
                    result["resubscribes"] += 1
                continue
            if rec is None:
                continue
            t = time.monotonic()
            if rec.rid.gsn <= last_gsn:
                if result["resubscribes"]:
                    continue  # replay after our own re-subscription
                result["order_violations"] += 1
            last_gsn = max(last_gsn, rec.rid.gsn)
            h = _header(rec.data)
            if h is None or h[0] != run_id:
                result["others"] += 1
                continue
            deliveries.append((t, h[1], h[2], rec.rid.gsn, rec.rid.shard))
            if pending is not None:
                pending.discard((h[1], h[2]))
    except BaseException as e:
        result["errors"].append(f"{type(e).__name__}: {e}")
    finally:
        result["drained"] = pending is not None and not pending
        out_q.put(("result", "sub", result))
        with contextlib.suppress(Exception):
            client.close()


# -- analysis ------------------------------------------------------------------------------------

def _bins(times: list[float], t0: float, n: int, width: float) -> list[int]:
    out = [0] * n
    for t in times:
        i = int((t - t0) // width)
        if 0 <= i < n:
            out[i] += 1
    return out


def _max_gap(times: list[float], start: float, end: float | None) -> tuple[float, float | None, bool]:
    """Largest gap between consecutive times, counting the one from ``start`` to the first and,
    if ``end`` is given, from the last to ``end``. Returns (gap_s, where it began, open_at_end)."""
    ts = sorted(times)
    best, at, open_end = 0.0, None, False
    prev = start
    for t in ts:
        if t - prev > best:
            best, at = t - prev, prev
        prev = t
    if end is not None and end - prev > best:
        best, at, open_end = end - prev, prev, True
    return best, at, open_end


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 1)


def _plot(path: Path, timeline: dict, kill_s: float, restart_s: float | None, p: dict) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return f"no plot (matplotlib unavailable: {type(e).__name__}: {e})"
    w = timeline["bin_ms"] / 1000.0
    xs = [t + w / 2 for t in timeline["t_s"]]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.plot(xs, timeline["acks_total"], color="black", lw=1.8, label="acked, all shards")
    for s, ys in sorted(timeline["acks_by_shard"].items(), key=lambda kv: int(kv[0])):
        killed = int(s) == p["kill_shard"]
        ax.plot(xs, ys, lw=1.2, ls="-" if killed else "--",
                label=f"acked, shard {s}" + (" (killed replica)" if killed else ""))
    ax.plot(xs, timeline["deliveries"], color="tab:purple", lw=1.4, ls=":", label="delivered to subscriber")
    ax.axvline(kill_s, color="red", lw=1.2, label=("SIGKILL failure handler leader, " if p["kill_fh_leader"] else "SIGKILL ")
               + f"shard {p['kill_shard']} replica {p['kill_replica']}")
    if restart_s is not None:
        ax.axvline(restart_s, color="gray", lw=1.0, ls="-.", label="replica restarted")
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"records / {timeline['bin_ms']} ms")
    what = "the failure handler's leader and a replica" if p["kill_fh_leader"] else "a storage replica"
    ax.set_title(f"Throughput across a failure of {what} ({p['shards']} shards x {p['replicas']} replicas, "
                 f"suspicion timeout {p['suspect_timeout_ms']} ms)", fontsize=9)
    ax.set_xlim(0, max(xs[-1] + w / 2, kill_s + 1) if xs else kill_s + 1)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right", framealpha=0.85)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# -- the experiment ------------------------------------------------------------------------------

def run(quick: bool, out: Path | None) -> list[dict]:
    """Every scenario, one after the other, each on a fresh cluster: its files in a
    directory of its own, and one table of all in ``failure.md``."""
    out = Path(out) if out is not None else Path("results") / (
        "failure-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    rows = [_run(quick, out / scenario, scenario)[0] for scenario in SCENARIOS]
    table = format_table(rows, COLUMNS)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "failure.json").write_text(json.dumps(rows, indent=2, default=str) + "\n")
    (out / "failure.md").write_text("\n".join([
        "# Throughput across failures (Figure 4.7)", "",
        "`replica`: shard 0's primary is SIGKILLed. `leader_and_replica`: the failure handler's leader is "
        "SIGKILLed, then at once shard 0's primary: recovery waits for a new leader (deposed as soon as "
        "the next in line's connection to it closes, not when its ZooKeeper session expires). Each scenario's details and plot are in its directory.",
        "", table, ""]))
    return rows


def _server_args(p: dict) -> list[str]:
    """The storage servers' flags: a short suspicion timeout, where the server takes it."""
    flag = "--suspect-timeout-ms"
    accepted = _server_accepts(flag)
    p["suspect_timeout_flag_supported"] = accepted
    server_args = [flag, str(SUSPECT_TIMEOUT_MS)]
    if accepted is False:
        # The storage server predates failure suspicion; passing the flag would stop it from starting.
        _log(f"ziplog.server does not accept {flag} yet: running without it (recorded in the parameters)")
        server_args = []
    p["server_args"] = server_args
    return server_args


@dataclass
class _Observed:
    """What one scenario's live phase saw (times are ``time.monotonic()``; ``t0`` is the
    load's start)."""

    t0: float = 0.0
    kill_t: float | None = None
    kill_error: str | None = None
    writer_results: dict[int, dict] = field(default_factory=dict)
    sub_result: dict | None = None
    restarts: list[tuple[float, int, int]] = field(default_factory=list)
    fh_alive: list[bool] = field(default_factory=list)


class _LoadRun:
    """One scenario's live phase: a local cluster, a subscriber and writer processes, the
    kill, then the writers stopped and the subscriber drained (every wait bounded)."""

    def __init__(self, p: dict, server_args: list[str]) -> None:
        self.p = p
        self.server_args = server_args
        self.n_writers = p["shards"] * p["writers_per_shard"]
        self.run_id = int.from_bytes(os.urandom(4), "big")
        ctx = self.ctx = mp.get_context("spawn")
        self.out_q = ctx.Queue()
        self.ctrl_q = ctx.Queue()
        self.stop = ctx.Event()
        self.go = ctx.Event()
        self.start_at = ctx.Value("d", 0.0)
        self.acked_live = ctx.Array("q", p["shards"])
        self.children: list[Any] = []
        self.obs = _Observed()

    def collect(self, until: float, want: set) -> None:
        """Read ("result", who, r) messages until every one in ``want`` arrived or ``until``."""
        o = self.obs
        while want and time.monotonic() < until:
            try:
                kind, who, payload = self.out_q.get(timeout=min(0.5, max(until - time.monotonic(), 0.01)))
            except queue.Empty:
                continue
            if kind == "result":
                if who == "sub":
                    o.sub_result = payload
                else:
                    o.writer_results[who] = payload
                want.discard(who)

    def run(self, ziplog: Any) -> _Observed:
        p, server_args, o = self.p, self.server_args, self.obs
        with contextlib.ExitStack() as stack:
            _log(f"starting ziplog local cluster (shards={p['shards']}, replicas={p['replicas']}, supervise=True, "
                 f"server_args={server_args})")
            try:
                cluster = stack.enter_context(ziplog.local_cluster(
                    shards=p["shards"], replicas=p["replicas"], supervise=True, server_args=server_args))
                cluster.restart_delay_s = p["restart_delay_s"]
            except Exception as e:
                raise RuntimeError(f"the local cluster could not start ({type(e).__name__}: {e})") from e

            def cleanup() -> None:
                self.stop.set()
                stop_processes(self.children, 3.0)

            stack.callback(cleanup)
            self.start_load(cluster)
            self.drive(cluster)
            self.stop_and_drain(cluster)
            _log("stopping the cluster")
        return o

    def start_load(self, cluster: Any) -> None:
        """Start the subscriber, then the writers, and wait until all are connected."""
        p, ctx, run_id, n_writers = self.p, self.ctx, self.run_id, self.n_writers
        out_q, ctrl_q, stop, children = self.out_q, self.ctrl_q, self.stop, self.children
        start_at, go, acked_live = self.start_at, self.go, self.acked_live
        startup_failures: list[tuple[Any, str]] = []
        _log(f"starting 1 subscriber and {n_writers} writer processes "
             f"({p['writers_per_shard']} per shard, {p['rate_per_writer']} inserts/s each, {p['record_bytes']} B)")
        sp = ctx.Process(target=_subscriber_main, args=(cluster.zk_hosts, run_id, out_q, ctrl_q, stop),
                         name="failure-subscriber", daemon=True)
        sp.start()
        children.append(sp)
        for w in range(n_writers):
            wp = ctx.Process(target=_writer_main,
                             args=(w, w % p["shards"], cluster.zk_hosts, run_id, p, start_at, go, stop, out_q,
                                   acked_live),
                             name=f"failure-writer-{w}", daemon=True)
            wp.start()
            children.append(wp)
        ready: set = set()
        expected = set(range(n_writers)) | {"sub"}
        deadline = time.monotonic() + p["startup_timeout_s"]
        while ready | {f[0] for f in startup_failures} != expected and time.monotonic() < deadline:
            try:
                kind, who, info = out_q.get(timeout=0.5)
            except queue.Empty:
                if all(not c.is_alive() for c in children):
                    break
                continue
            if kind == "ready":
                ready.add(who)
            elif kind == "failed":
                startup_failures.append((who, info))
        if ready != expected:
            not_ready = sorted(map(str, expected - ready))
            detail = "; ".join(f"{who}: {info}" for who, info in startup_failures) or "no answer in time"
            raise RuntimeError(f"writer/subscriber processes {', '.join(not_ready)} could not connect to the "
                               f"cluster ({detail}); cluster logs in {cluster.logs}")

    def drive(self, cluster: Any) -> None:
        """The load's run, with the kill at ``kill_at_s``."""
        p, o, acked_live = self.p, self.obs, self.acked_live
        o.t0 = time.monotonic() + 0.3
        self.start_at.value = o.t0
        self.go.set()
        _log(f"load running for {p['duration_s']:.1f} s; killing shard {p['kill_shard']} replica "
             f"{p['kill_replica']} at t = {p['kill_at_s']:.1f} s")
        end = o.t0 + p["duration_s"]
        next_report = o.t0 + 1.0
        prev_counts = [0] * p["shards"]
        while True:
            now = time.monotonic()
            if o.kill_t is None and now >= o.t0 + p["kill_at_s"]:
                o.kill_t = time.monotonic()
                try:
                    if p["kill_fh_leader"]:
                        leader = cluster.kill_fh_leader()
                        _log(f"t = {o.kill_t - o.t0:.3f} s: SIGKILL the failure handler's leader (replica {leader})")
                    cluster.kill_replica(p["kill_shard"], p["kill_replica"])
                    _log(f"t = {o.kill_t - o.t0:.3f} s: SIGKILL shard {p['kill_shard']} replica {p['kill_replica']}")
                except Exception as e:  # reported; the run goes on so the timeline still shows something
                    o.kill_error = f"{type(e).__name__}: {e}"
                    _log(f"t = {o.kill_t - o.t0:.3f} s: kill_replica failed: {o.kill_error}")
            if now >= next_report:
                counts = list(acked_live[:])
                rates = [c - pc for c, pc in zip(counts, prev_counts)]
                prev_counts = counts
                _log(f"t = {now - o.t0:.1f} s: acks in the last second by shard {rates}; "
                     f"restarts so far {len(cluster.restarts)}")
                next_report += 1.0
            if now >= end:
                break
            wake = min(end, next_report, o.t0 + p["kill_at_s"] if o.kill_t is None else end)
            time.sleep(max(min(wake - time.monotonic(), 0.05), 0.001))

    def stop_and_drain(self, cluster: Any) -> None:
        """Stop the writers (bounded: an insert waits at most insert_timeout_s), then drain
        the subscriber."""
        p, o, n_writers, collect = self.p, self.obs, self.n_writers, self.collect
        collect(time.monotonic() + p["insert_timeout_s"] + 5.0, set(range(n_writers)))
        lost = sorted(set(range(n_writers)) - set(o.writer_results))
        if lost:
            _log(f"writers {lost} did not report in time; terminating them (their acks are lost)")

        # -- drain the subscriber ----------------------------------------------------------
        acked_keys = [(w, a[1]) for w, r in o.writer_results.items() for a in r["acks"]]
        drain_deadline = time.monotonic() + p["drain_s"]
        _log(f"load done: {len(acked_keys)} acks; draining the subscriber for at most {p['drain_s']:.0f} s")
        self.ctrl_q.put(("drain", acked_keys, drain_deadline))
        collect(drain_deadline + 5.0, {"sub"})
        if o.sub_result is None:
            self.stop.set()
            collect(time.monotonic() + 5.0, {"sub"})
        if o.sub_result is None:
            _log("the subscriber did not report; delivery checks unavailable")
        o.restarts = list(cluster.restarts)
        o.fh_alive = [proc.poll() is None for proc in cluster.fh.values()]


def _run(quick: bool, out: Path, scenario: str) -> list[dict]:
    p = _params(quick, scenario)
    ziplog = _import_ziplog()
    server_args = _server_args(p)
    t_run = time.monotonic()
    o = _LoadRun(p, server_args).run(ziplog)
    _log(f"done in {time.monotonic() - t_run:.1f} s")
    row, doc, restart_t = _analyse(p, scenario, o)
    _report(out, p, server_args, o, row, doc, restart_t)
    return [dict(row, params=p, machine=doc["machine"])]


def _analyse(p: dict, scenario: str, o: _Observed) -> tuple[dict, dict, float | None]:
    """The summary row, the whole document (timeline, writers, kill, restarts), and when
    the killed replica was started again."""
    n_writers = p["shards"] * p["writers_per_shard"]
    width = p["bin_ms"] / 1000.0
    all_acks = [(a[0], a[2]) for r in o.writer_results.values() for a in r["acks"]]
    deliveries = o.sub_result["deliveries"] if o.sub_result else []
    last_t = max([o.t0 + p["duration_s"]] + [d[0] for d in deliveries])
    n_bins = int((last_t - o.t0) // width) + 1
    timeline = {
        "bin_ms": p["bin_ms"],
        "t_s": [round(i * width, 3) for i in range(n_bins)],
        "acks_total": _bins([t for t, _ in all_acks], o.t0, n_bins, width),
        "acks_by_shard": {str(s): _bins([t for t, sh in all_acks if sh == s], o.t0, n_bins, width)
                          for s in range(p["shards"])},
        "deliveries": _bins([d[0] for d in deliveries], o.t0, n_bins, width),
    }

    writers: list[dict] = []
    for w in range(n_writers):
        r = o.writer_results.get(w)
        if r is None:
            writers.append({"writer": w, "shard": w % p["shards"], "reported": False})
            continue
        ts = [a[0] for a in r["acks"]]
        gap, at, open_end = _max_gap(ts, o.t0, r["t_stop"])
        lat = summarize([int(a[4] * 1e9) for a in r["acks"]])
        writers.append({
            "writer": w, "shard": r["shard"], "reported": True, "acked": len(ts),
            "errors": r["errors"], "first_errors": r["first_errors"], "error": r.get("error"),
            "max_gap_ms": _ms(gap), "max_gap_from_s": None if at is None else round(at - o.t0, 3),
            "max_gap_open_at_end": open_end, "latency_p50_us": lat["p50_us"], "latency_p99_us": lat["p99_us"],
            "client_stats": r.get("client_stats"),
        })
    stalls = [wr for wr in writers if wr.get("reported")]
    worst = max(stalls, key=lambda wr: wr["max_gap_ms"] or 0.0, default=None)
    # The killed shard's writers together: the longest gap in their merged ack stream.
    ks_writers = [wr["writer"] for wr in stalls if wr["shard"] == p["kill_shard"]]
    ks_times = [a[0] for w in ks_writers for a in o.writer_results[w]["acks"]]
    ks_end = max((o.writer_results[w]["t_stop"] for w in ks_writers), default=None)
    ks_gap, ks_at, ks_open = _max_gap(ks_times, o.t0, ks_end)
    first_after_kill = min((t for t, sh in all_acks if sh == p["kill_shard"] and o.kill_t is not None and t > o.kill_t),
                           default=None)

    sub_gap = sub_at = None
    sub_open = False
    if o.sub_result is not None:
        dts = [d[0] for d in deliveries]
        g, a, sub_open = _max_gap(dts, o.t0, o.t0 + p["duration_s"] if not dts or max(dts) < o.t0 + p["duration_s"] else None)
        sub_gap, sub_at = g, a

    ours = [r for r in o.restarts if (r[1], r[2]) == (p["kill_shard"], p["kill_replica"])]
    restart_t = next((r[0] for r in ours if o.kill_t is not None and r[0] >= o.kill_t), None)
    restart_delay = None if restart_t is None or o.kill_t is None else restart_t - o.kill_t

    missing, duplicated, delivered_unacked, rid_mismatch = _delivery_checks(o)

    error_totals: dict[str, int] = {}
    for wr in stalls:
        for k, v in wr["errors"].items():
            error_totals[k] = error_totals.get(k, 0) + v

    row = {
        "scenario": scenario,
        "suspect_timeout_ms": SUSPECT_TIMEOUT_MS if p["suspect_timeout_flag_supported"] is not False else None,
        "longest_write_stall_ms": worst["max_gap_ms"] if worst else None,
        "longest_write_stall_writer": worst["writer"] if worst else None,
        "longest_write_stall_shard": worst["shard"] if worst else None,
        "longest_write_stall_open_at_end": worst["max_gap_open_at_end"] if worst else None,
        "killed_shard_ack_gap_ms": _ms(ks_gap) if ks_writers else None,
        "killed_shard_ack_gap_open_at_end": ks_open if ks_writers else None,
        "killed_shard_first_ack_after_kill_ms": _ms(first_after_kill - o.kill_t) if first_after_kill and o.kill_t else None,
        "longest_sub_stall_ms": _ms(sub_gap),
        "longest_sub_stall_from_s": None if sub_at is None else round(sub_at - o.t0, 3),
        "longest_sub_stall_open_at_end": sub_open if o.sub_result is not None else None,
        "restart_delay_ms": _ms(restart_delay),
        "missing": missing,
        "duplicated": duplicated,
        "delivered_unacked": delivered_unacked,
        "rid_mismatch": rid_mismatch,
        "order_violations": o.sub_result["order_violations"] if o.sub_result else None,
        "subscriber_drained": o.sub_result.get("drained") if o.sub_result else None,
        "subscriber_errors": o.sub_result["errors"] if o.sub_result else None,
        "acked": len(all_acks),
        "delivered": len(deliveries),
        "write_errors": sum(error_totals.values()),
        "write_errors_by_type": error_totals,
        "writers_lost": [wr["writer"] for wr in writers if not wr.get("reported")],
    }
    machine = machine_info()
    kill_s = None if o.kill_t is None else round(o.kill_t - o.t0, 4)
    doc = {
        "experiment": "failure",
        "summary": row,
        "timeline": timeline,
        "kill": {"t_s": kill_s, "shard": p["kill_shard"], "replica": p["kill_replica"], "error": o.kill_error},
        "restarts": [{"t_s": round(t - o.t0, 4), "shard": s, "replica": r} for t, s, r in o.restarts],
        "failure_handler_processes_alive": o.fh_alive,
        "writers": writers,
        "params": p,
        "machine": machine,
    }
    return row, doc, restart_t


def _delivery_checks(o: _Observed) -> tuple[int | None, int | None, int | None, int | None]:
    """Acknowledged records the subscriber never delivered, extra deliveries of them,
    deliveries of records no writer saw acknowledged, and deliveries at another record
    id than the acknowledged one (all None without the subscriber's report)."""
    deliveries = o.sub_result["deliveries"] if o.sub_result else []
    missing = duplicated = delivered_unacked = rid_mismatch = None
    if o.sub_result is not None:
        acked_rid = {(w, a[1]): (a[3], a[2]) for w, r in o.writer_results.items() for a in r["acks"]}
        seen: dict[tuple[int, int], int] = {}
        rid_mismatch = 0
        for _, w, seq, gsn, shard in deliveries:
            seen[(w, seq)] = seen.get((w, seq), 0) + 1
            rid = acked_rid.get((w, seq))
            if rid is not None and rid != (gsn, shard):
                rid_mismatch += 1
        missing = sum(1 for k in acked_rid if k not in seen)
        duplicated = sum(seen[k] - 1 for k in acked_rid if seen.get(k, 0) > 1)
        delivered_unacked = sum(1 for k in seen if k not in acked_rid)
    return missing, duplicated, delivered_unacked, rid_mismatch


def _report(out: Path, p: dict, server_args: list[str], o: _Observed, row: dict, doc: dict,
            restart_t: float | None) -> None:
    """Print the table; write failure.json, failure.md and failure.png."""
    n_writers = p["shards"] * p["writers_per_shard"]
    machine, timeline = doc["machine"], doc["timeline"]
    kill_s, error_totals, fh_alive, kill_error = doc["kill"]["t_s"], row["write_errors_by_type"], o.fh_alive, o.kill_error
    table = format_table([row], COLUMNS)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "failure.json").write_text(json.dumps(doc, indent=2) + "\n")
    restart_s = None if restart_t is None else restart_t - o.t0
    plot_note = _plot(out / "failure.png", timeline, kill_s if kill_s is not None else p["kill_at_s"], restart_s, p)
    if plot_note:
        _log(plot_note)

    def fmt(v: Any) -> str:
        return "–" if v is None else str(v)

    md = [
        "# Throughput across a storage replica failure (Figure 4.7)",
        "",
        f"{p['shards']} shards x {p['replicas']} replicas, {n_writers} writer processes "
        f"({p['writers_per_shard']} per shard, Policy.random, each paced to {p['rate_per_writer']} inserts/s of "
        f"{p['record_bytes']}-byte records), one subscriber from the start of the log. At t = {fmt(kill_s)} s "
        + ("the failure handler's leader and then " if p["kill_fh_leader"] else "")
        + f"shard {p['kill_shard']} replica {p['kill_replica']} (its primary) is SIGKILLed; the cluster's supervisor "
        f"restarts it. Load runs {p['duration_s']:.0f} s; bins of {p['bin_ms']} ms. Storage server args: "
        f"`{' '.join(server_args) or '(none: --suspect-timeout-ms not supported by this ziplog.server)'}`.",
        "",
        table,
        f"Longest write stall: writer {fmt(row['longest_write_stall_writer'])} (shard "
        f"{fmt(row['longest_write_stall_shard'])})"
        + (", still stalled when the load ended" if row["longest_write_stall_open_at_end"] else "")
        + f". Killed shard's writers together: longest ack gap {fmt(row['killed_shard_ack_gap_ms'])} ms"
        + (" (still stalled at the end)" if row["killed_shard_ack_gap_open_at_end"] else "")
        + f", first ack after the kill {fmt(row['killed_shard_first_ack_after_kill_ms'])} ms after it. "
        f"Subscriber: longest stall from t = {fmt(row['longest_sub_stall_from_s'])} s"
        + (" (still stalled at the end)" if row["longest_sub_stall_open_at_end"] else "")
        + f"; drained: {fmt(row['subscriber_drained'])}. Acked {row['acked']}, delivered {row['delivered']} "
        f"(delivered but not acked: {fmt(row['delivered_unacked'])}, record id mismatches: "
        f"{fmt(row['rid_mismatch'])}, order violations: {fmt(row['order_violations'])}). "
        f"Write errors by type: {error_totals or 'none'}. Failure handler processes alive at the end: "
        f"{sum(o.fh_alive)}/{len(o.fh_alive)}."
        + (f" The kill failed: {o.kill_error}." if o.kill_error else ""),
        "",
        "`missing`: acknowledged records the subscriber had not delivered when its bounded drain "
        f"({p['drain_s']:.0f} s after the load) ended; `duplicated`: extra deliveries of acknowledged records. "
        "`restart_delay_ms`: from the SIGKILL until the supervisor started the replica again (not until it serves).",
        "",
        "![throughput timeline](failure.png)",
        "",
        f"Machine: {machine['cpu_count']} x {machine['cpu_model']}, Python {machine['python']}, "
        f"pyzmq {machine['pyzmq']} / libzmq {machine['libzmq']}, {machine['platform']}, {machine['date']}",
        "",
    ]
    (out / "failure.md").write_text("\n".join(md))
    _log(f"wrote {out / 'failure.json'}, {out / 'failure.md'}, {out / 'failure.png'}")
