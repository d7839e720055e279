"""Experiment: how many shards the membership service serves at a 10 ms epoch interval.

The dissertation (section 4.4.2) reports that with a 10 ms broadcast interval the
membership service supports about 4 000 shards. This runs the real thing against
simulated shards:

* a real 3-node ZooKeeper ensemble (``ZooKeeperEnsemble``) and the real MMS replicas
  (``python -m mms.server``, 3 replicas, ``--interval-ms 10``);
* no storage servers: ``bench.shard_swarm`` registers N shards in ZooKeeper exactly as
  storage servers do, subscribes to every MMS PUB and reports each member shard's rate
  when a primary's rule says so (``ziplog.cores.replica.rate_report``: per change, and a
  heartbeat per shard every hundred epochs), batched, to the leader the broadcasts name,
  like N primaries;
* a probe SUB in this process (an idle subscriber, so its clock is not disturbed by the
  swarm's work) times every EPOCH broadcast.

For each N: epochs per second against the nominal 100/s, the intervals between
consecutive broadcasts (p50, p99, max), the frame size, whether every epoch lists all N
shards, and the CPU of the MMS leader, ZooKeeper and the swarm. Each N runs in its own
ZooKeeper namespace (a chroot: the state a fresh ensemble would have) with freshly
started MMS replicas and swarm, so no N inherits membership history from another.
Every N that does not keep up gets a py-spy profile of the leader (where its time
goes); the first failing N above the largest that keeps up is the limit the notes
discuss, and (full run) it runs again without RATE reports to separate RATE ingestion
from the rest. A failing N during which other work took a quarter of a core is
measured again once (full run): the machine may be shared.

``model_*`` columns replay the leader's per-epoch steps in this process with the real
planner and ``MembershipDriver.on_rate_frame`` (a steady epoch's reports: the
heartbeats that fall on it): the CPU one epoch needs.

    python -m bench mms [--quick] [--out DIR]
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import psutil
import zmq
from kazoo.client import KazooClient

from mms.planner import EpochPlanner, PlannerSettings
from ziplog.protocol.membership import EpochState
from mms.server import MembershipDriver
from ziplog.cores.replica.rate_report import HEARTBEAT_EPOCHS, heartbeat_due
from ziplog.io import zk as discovery
from ziplog.protocol import frames as wire
from ziplog.protocol import layout
from ziplog.protocol.auth import ClusterKey
from ziplog.protocol.epoch_feed import EpochFeed
from ziplog.protocol.gsna import EpochConfig
from ziplog.protocol.topology import TopologyView
from ziplog.shell.process import write_cluster_key
from ziplog.tools import procs
from ziplog.tools.zk_ensemble import ZooKeeperEnsemble

from ..report import Results, progress

NAME = "mms"
INTERVAL_MS = 10.0
NOMINAL_EPOCHS_PER_S = 1000.0 / INTERVAL_MS
#: keeps up = at least this fraction of the nominal epoch rate ...
MIN_RATE_FRACTION = 0.95
#: ... and a p99 interval between broadcasts under this many intervals ...
MAX_P99_INTERVALS = 2.0
#: ... and every epoch listing every registered shard.
KEEPS_UP_RULE = (f"keeps up = epochs/s >= {MIN_RATE_FRACTION:.0%} of the nominal {NOMINAL_EPOCHS_PER_S:.0f}/s, "
                 f"p99 interval between broadcasts < {MAX_P99_INTERVALS:g} x {INTERVAL_MS:g} ms, "
                 "and every epoch lists all N shards")
MMS_REPLICAS = 3
#: other work on the machine above this (% of one core) during a window spoils its timing
DISTURBED_CPU_PCT = 25.0
CHROOT_BASE = "/bench-mms"

COLUMNS = ["shards", "rates", "epochs_per_s", "interval_p50_ms", "interval_p99_ms", "interval_max_ms",
           "block_start_p50_ms", "other_p99_ms", "frame_bytes", "broadcast_B_per_s", "all_shards", "mms_cpu_pct", "zk_cpu_pct",
           "swarm_cpu_pct", "other_cpu_pct", "rate_in_per_s", "model_epoch_ms", "keeps_up"]


def _params(quick: bool) -> dict[str, Any]:
    return {
        "quick": quick,
        "interval_ms": INTERVAL_MS,
        "mms_replicas": MMS_REPLICAS,
        "epochs_per_commit": 10,             # mms.server's default
        "replicas_per_shard": 2,             # f+1, the cluster default: ephemeral nodes per shard
        "records_per_s": 2000,               # what each shard reports in RATE (the planner's default rate)
        "sweep": [100, 1000, 4000] if quick else [100, 500, 1000, 2000, 4000, 8000],
        "extend_to": 4000 if quick else 16000,   # keep doubling past the sweep while it keeps up
        "refine": not quick,                 # one extra N between the last that keeps up and the first that fails
        "warmup_s": 1.0 if quick else 2.0,
        "window_s": 2.5 if quick else 5.0,
        "profile_s": 2 if quick else 5,      # py-spy at every failing N
        "rates_off_variant": not quick,      # rerun the limit N without RATE reports
        "retry_disturbed": not quick,        # measure a failing N again if other work disturbed it
        "zk_force_sync": True,               # as local_cluster
        "keeps_up_rule": KEEPS_UP_RULE,
    }


# -- measuring one N -------------------------------------------------------------------------------

@dataclass
class Broadcast:
    """One EPOCH as the probe received it."""

    t_ns: int  # time.monotonic_ns() at arrival
    epoch: int
    shards: int  # -1: an EPOCH_SAME whose base the probe missed
    size: int
    full: bool  # an EPOCH (members and rates), not an EPOCH_SAME


class EpochProbe:
    """A SUB on every MMS replica's PUB, as a storage server has, timing each broadcast."""

    def __init__(self, pubs: list[str]) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        for pub in pubs:
            self.sub.connect(pub)
        self.last_epoch = -1
        self.feed = EpochFeed()

    def _next(self, deadline: float) -> Broadcast | None:
        """The next broadcast of a new epoch before ``deadline`` (monotonic), or None."""
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.sub.poll(min(left_ms, 100)):
                if time.monotonic() >= deadline:
                    return None
                continue
            frame = self.sub.recv()
            t = time.monotonic_ns()
            msg = wire.decode_epoch(frame)
            got = self.feed.on_message(msg)
            if msg.epoch <= self.last_epoch:
                continue  # an epoch broadcast again (by a new leader)
            self.last_epoch = msg.epoch
            shards = len(got.shards) if isinstance(got, EpochConfig) else -1
            return Broadcast(t, msg.epoch, shards, len(frame), type(msg) is wire.EpochStart)

    def wait_for(self, shards: int, timeout: float) -> bool:
        """Until an epoch lists ``shards`` shards."""
        deadline = time.monotonic() + timeout
        while True:
            b = self._next(deadline)
            if b is None:
                return False
            if b.shards == shards:
                return True

    def record(self, seconds: float) -> list[Broadcast]:
        deadline = time.monotonic() + seconds
        out: list[Broadcast] = []
        while True:
            b = self._next(deadline)
            if b is None:
                return out
            out.append(b)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


class CpuMeter:
    """CPU time of a set of processes (all threads), or of the whole machine when
    ``pids`` is None, between two calls, in % of one core."""

    def __init__(self, pids: list[int] | None) -> None:
        self.procs = None if pids is None else [psutil.Process(p) for p in pids]
        self.t0 = time.monotonic()
        self.cpu0 = self._cpu()

    def _cpu(self) -> float:
        if self.procs is None:
            t = psutil.cpu_times()
            return float(t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0))
        total = 0.0
        for p in self.procs:
            try:
                pt = p.cpu_times()
                total += pt.user + pt.system
            except psutil.Error:
                pass
        return total

    def percent(self) -> float:
        wall = time.monotonic() - self.t0
        return round(100.0 * (self._cpu() - self.cpu0) / wall, 1) if wall > 0 else 0.0


def _read_status(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def _wait(cond: Any, timeout: float, what: str, alive: list[subprocess.Popen[bytes]], logs: Path) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for p in alive:
            if p.poll() is not None:
                raise RuntimeError(f"{str(p.args)[:100]} exited ({p.returncode}) while waiting for "
                                   f"{what}; logs in {logs}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}; logs in {logs}")
        time.sleep(0.05)


@dataclass
class Point:
    """Everything measured for one N (one row, plus what the notes need)."""

    row: dict[str, Any]
    leader_pid: int | None = None
    profile: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


_namespaces = itertools.count()


def disturbed(row: dict[str, Any]) -> bool:
    """Other work on the machine took enough CPU during the window to spoil the timing."""
    return bool(row["other_cpu_pct"] >= DISTURBED_CPU_PCT)


def measure(ens: ZooKeeperEnsemble, root_zk: KazooClient, n: int, params: dict[str, Any], logs: Path,
            send_rates: bool = True, profile_to: Path | None = None,
            profile_if: Callable[[dict[str, Any]], bool] = lambda row: not row["keeps_up"]) -> Point:
    """Start the swarm (N shards registered) and then the MMS replicas in a fresh
    namespace, wait for an epoch with all N, warm up, measure one window, and profile
    the leader to ``profile_to`` if ``profile_if(row)``; stop everything."""
    label = f"n{n}" + ("" if send_rates else "-norates")
    chroot = f"{CHROOT_BASE}/{label}-{next(_namespaces)}"  # a fresh one per attempt
    root_zk.ensure_path(chroot)
    hosts = ens.hosts + chroot
    status = logs / f"{label}-swarm.json"
    status.unlink(missing_ok=True)
    key_file = logs / "cluster.key"  # the swarm and the MMS replicas are one cluster
    if not key_file.exists():
        write_cluster_key(key_file)
    member = ["--cluster-key-file", str(key_file)]
    argv = [sys.executable, "-m", "bench.shard_swarm", "--zk", hosts, "--count", str(n),
            "--replicas", str(params["replicas_per_shard"]), "--records-per-s", str(params["records_per_s"]),
            "--status", str(status), *member] + ([] if send_rates else ["--no-rates"])
    children: list[subprocess.Popen[bytes]] = []
    mms: dict[int, subprocess.Popen[bytes]] = {}
    probe: EpochProbe | None = None
    try:
        swarm = procs.spawn(argv, logs / f"{label}-swarm.log")
        children.append(swarm)
        _wait(lambda: bool(_read_status(status).get("registered")), 60 + n * 0.01, f"{n} shards to register",
              children, logs)
        t_mms = time.monotonic()
        for i in range(params["mms_replicas"]):
            mms[i] = procs.spawn([sys.executable, "-m", "mms.server", "--zk", hosts, "--id", str(i),
                                  "--interval-ms", str(params["interval_ms"]),
                                  "--epochs-per-commit", str(params["epochs_per_commit"]), *member],
                                 logs / f"{label}-mms{i}.log")
            children.append(mms[i])
        replicas_path = chroot + layout.MMS_REPLICAS
        _wait(lambda: root_zk.exists(replicas_path) is not None
              and len(root_zk.get_children(replicas_path)) == params["mms_replicas"],
              60 + n * 0.03, "the MMS replicas to register", children, logs)  # each loads the topology first
        pubs = [layout.dec(root_zk.get(f"{replicas_path}/{c}")[0])["pub"] for c in root_zk.get_children(replicas_path)]
        probe = EpochProbe(pubs)
        # Every replica loads the whole topology (a watch and a read per shard and
        # replica) before it joins the election, so large N take a while to start, and
        # the followers must be done with it before we measure: wait for all contenders.
        election = root_zk.Election(chroot + layout.MMS_ELECTION)
        _wait(lambda: len(election.contenders()) == params["mms_replicas"], 60 + n * 0.03,
              "every MMS replica to load the topology", children, logs)
        if not probe.wait_for(n, 60):
            raise RuntimeError(f"no epoch listed all {n} shards; logs in {logs}")
        startup_s = time.monotonic() - t_mms
        probe.record(params["warmup_s"])
        contenders = election.contenders()
        leader = mms[int(contenders[0])]
        followers = [p.pid for i, p in mms.items() if p is not leader]
        meters = {"mms": CpuMeter([leader.pid]), "followers": CpuMeter(followers),
                  "zk": CpuMeter([p for p in (ens.pid(i) for i in range(ens.size)) if p is not None]),
                  "swarm": CpuMeter([swarm.pid]), "harness": CpuMeter([os.getpid()]), "machine": CpuMeter(None)}
        s0 = _read_status(status)
        seen = probe.record(params["window_s"])
        cpu = {k: m.percent() for k, m in meters.items()}
        s1 = _read_status(status)
        point = Point(_row(n, send_rates, seen, params["window_s"], cpu, s0, s1, _leader_pull(root_zk, chroot, contenders[0]),
                           startup_s, params), leader.pid)
        if profile_to is not None and profile_if(point.row):
            point.profile = profile_leader(leader.pid, params["profile_s"], profile_to)
        return point
    finally:
        if probe is not None:
            probe.close()
        # MMS first: the swarm's exit deletes 2N ephemeral nodes, a watch storm for
        # MMS replicas still running.
        procs.stop_many(list(mms.values()))
        procs.stop_many(children)


def _leader_pull(root_zk: KazooClient, chroot: str, leader_id: str) -> str | None:
    data, _ = root_zk.get(f"{chroot}{layout.MMS_REPLICAS}/{leader_id}")
    pull = (layout.dec(data) or {}).get("pull")
    return str(pull) if pull else None


def _row(n: int, send_rates: bool, seen: list[Broadcast], window_s: float, cpu: dict[str, float],
         s0: dict[str, Any], s1: dict[str, Any], leader_pull: str | None, startup_s: float,
         params: dict[str, Any]) -> dict[str, Any]:
    intervals_ms = np.diff([b.t_ns for b in seen]) / 1e6 if len(seen) > 1 else np.array([])
    p50, p99 = (np.percentile(intervals_ms, [50, 99]) if intervals_ms.size else (math.nan, math.nan))
    # The epoch that starts a block waits for its ZooKeeper commit before it is
    # broadcast. In a fresh namespace whose membership never changes, blocks start at
    # multiples of epochs_per_commit.
    per_block = params["epochs_per_commit"]
    starts = np.array([b.epoch % per_block == 0 for b in seen[1:]], dtype=bool)
    block_ms = intervals_ms[starts] if intervals_ms.size else intervals_ms
    other_ms = intervals_ms[~starts] if intervals_ms.size else intervals_ms
    epochs_per_s = len(seen) / window_s
    missed = (seen[-1].epoch - seen[0].epoch + 1 - len(seen)) if seen else 0
    all_shards = bool(seen) and all(b.shards == n for b in seen)
    dt = float(s1.get("t", 0.0)) - float(s0.get("t", 0.0))
    leader_in = None
    sent1 = s1.get("sent_per_mms", {}).get(leader_pull, 0) if leader_pull else 0
    if leader_pull and dt > 0:
        sent0 = s0.get("sent_per_mms", {}).get(leader_pull, 0)
        leader_in = round((sent1 - sent0) / dt)
    skipped = int(s1.get("epochs_skipped", 0)) - int(s0.get("epochs_skipped", 0))
    model = per_epoch_cost(n, params["replicas_per_shard"], epochs_per_commit=params["epochs_per_commit"])
    keeps_up = (epochs_per_s >= MIN_RATE_FRACTION * NOMINAL_EPOCHS_PER_S
                and bool(p99 < MAX_P99_INTERVALS * INTERVAL_MS) and all_shards)
    full = [b.size for b in seen if b.full]
    frame = int(statistics.median(full)) if full else None
    same = [b.size for b in seen if not b.full]
    sent_per_s = round(sum(b.size for b in seen) / window_s) if seen else None
    return {
        "shards": n,
        "rates": send_rates,
        "epochs_per_s": round(epochs_per_s, 1),
        "interval_p50_ms": round(float(p50), 2),
        "interval_p99_ms": round(float(p99), 2),
        "interval_max_ms": round(float(intervals_ms.max()), 2) if intervals_ms.size else None,
        # intervals ending at an epoch that starts a block (after a ZooKeeper commit), and the rest
        "block_start_p50_ms": round(float(np.percentile(block_ms, 50)), 2) if block_ms.size else None,
        "block_start_p99_ms": round(float(np.percentile(block_ms, 99)), 2) if block_ms.size else None,
        "other_p99_ms": round(float(np.percentile(other_ms, 99)), 2) if other_ms.size else None,
        "frame_bytes": frame,
        # the block's later epochs, each "same as" its first: bytes, and the share of epochs
        "same_frame_bytes": int(statistics.median(same)) if same else None,
        "same_fraction": round(len(same) / len(seen), 2) if seen else None,
        "broadcast_B_per_s": sent_per_s,
        "all_shards": all_shards,
        "epochs_missed_by_probe": missed,
        "mms_cpu_pct": cpu["mms"],
        "mms_followers_cpu_pct": cpu["followers"],
        "zk_cpu_pct": cpu["zk"],
        "swarm_cpu_pct": cpu["swarm"],
        # everything else the machine ran meanwhile: other people's work disturbs the timing
        "other_cpu_pct": round(max(0.0, cpu["machine"] - cpu["mms"] - cpu["followers"] - cpu["zk"] - cpu["swarm"]
                                   - cpu["harness"]), 1),
        # RATE frames/s the leader's PULL accepted, and the reports/s steady shards send
        # (their heartbeats: each shard one per HEARTBEAT_EPOCHS epochs)
        "rate_in_per_s": leader_in if send_rates else 0,
        # RATE frames the swarm sent the leader from its start to the window's end: at
        # least the first reports (the load moved from nothing), however slow the epochs
        "rate_to_leader_total": int(sent1) if send_rates else 0,
        "rate_nominal_per_s": round(n * epochs_per_s / HEARTBEAT_EPOCHS) if send_rates else 0,
        "swarm_epochs_skipped": skipped,
        # bytes/s the PUB would send with one subscriber per storage replica, as deployed
        "fanout_MB_s": round(sent_per_s * n * params["replicas_per_shard"] / 1e6, 1) if sent_per_s else None,
        **model,
        "register_s": s1.get("register_s"),
        "startup_s": round(startup_s, 1),
        "keeps_up": keeps_up,
    }


# -- the leader's per-epoch work, replayed in-process ----------------------------------------------

def per_epoch_cost(n: int, replicas: int, repeat: int = 5, epochs_per_commit: int = 10) -> dict[str, float]:
    """Milliseconds of the leader's steps for one epoch with ``n`` member shards (best
    of ``repeat``): a block's plan at an unchanged topology (``EpochPlanner.plan`` as
    ``EpochSequencer`` plans at a block commit, the rates that changed patched in: here
    a steady epoch's reports), shared by the block's ``epochs_per_commit`` epochs;
    encoding the EPOCH frame; a steady epoch's rate reports (the heartbeats that fall on
    it) through the real ``MembershipDriver.on_rate_frame``. Apart: ``model_full_plan_ms``,
    the ready list and a full plan, which a topology change costs once. Not included:
    the ZooKeeper commit (one per block) and the kazoo and libzmq threads."""
    from ziplog.io.zmq_runtime import ZmqRuntime

    topo = TopologyView()
    topo.replica_counts = {s: replicas for s in range(n)}
    topo.replicas = {s: {r: f"tcp://127.0.0.1:{r}" for r in range(replicas)} for s in range(n)}
    planner = EpochPlanner(PlannerSettings())
    cfg, history = planner.plan(range(n))
    planner.committed(cfg, history)
    key = ClusterKey(b"the in-process model's secret")
    # steady shards report only their heartbeats, spread by shard id: n / HEARTBEAT_EPOCHS
    # an epoch, in frames of up to MAX_RATE_REPORTS as a storage process batches them
    due = [s for s in range(n) if heartbeat_due(s, cfg.epoch)]
    frames = [wire.seal(key, wire.encode(wire.Rate(reports=[wire.RateEntry(shard=s, epoch=cfg.epoch, rate=2000,
                                                                           busy=True)
                                                            for s in due[i:i + wire.MAX_RATE_REPORTS]])))
              for i in range(0, len(due), wire.MAX_RATE_REPORTS)]
    rt = ZmqRuntime()
    try:
        coord = _ModelCoordination(topo, history or [])
        driver = MembershipDriver(rt, rt, coord, coord, 0, key)
        driver.lead_begin()  # leads, as far as rate reports go
        best = {"full_plan": math.inf, "plan": math.inf, "encode": math.inf, "rates": math.inf}
        generation = 0
        for i in range(repeat):
            generation += 1  # a topology change: the ready list and a full plan
            t0 = time.perf_counter()
            ready = [s for s in topo.replica_counts if topo.shard_complete(s) and s not in topo.removed]
            cfg2, hist2 = planner.plan(ready, topo.recovering, generation)
            t1 = time.perf_counter()
            planner.committed(cfg2, hist2)
            for s in due:  # the reports of a steady epoch move these shards' rates
                planner.on_rate(s, 2000 + i + 1)
            t2 = time.perf_counter()
            cfg3, hist3 = planner.plan(ready, topo.recovering, generation)  # the next block's
            t3 = time.perf_counter()
            planner.committed(cfg3, hist3)
            wire.EpochEncoder(0).encode(cfg3.epoch, cfg3.shards, cfg3.rates)
            t4 = time.perf_counter()
            for f in frames:
                driver.on_rate_frame(f)
            t5 = time.perf_counter()
            for k, dt in (("full_plan", t1 - t0), ("plan", t3 - t2), ("encode", t4 - t3), ("rates", t5 - t4)):
                best[k] = min(best[k], dt)
        driver.close()
    finally:
        rt.close()
    ms = {k: v * 1000 for k, v in best.items()}
    # a block's plan and its frame's encoding (EpochEncoder restates the frame for the
    # other epochs of the block by its epoch number alone) are shared by its epochs
    epoch_ms = (ms["plan"] + ms["encode"]) / epochs_per_commit + ms["rates"]
    return {"model_full_plan_ms": round(ms["full_plan"], 2), "model_plan_ms": round(ms["plan"], 3),
            "model_encode_ms": round(ms["encode"], 3), "model_rates_ms": round(ms["rates"], 3),
            "model_epoch_ms": round(epoch_ms, 3)}


#: the cluster sizes the plan past this machine is modelled at
MODEL_SIZES = (16_000, 32_000, 64_000)


def scale_model(params: dict[str, Any], sizes: tuple[int, ...] = MODEL_SIZES) -> list[dict[str, Any]]:
    """What N shards cost the membership service, from its own code run in-process (no
    swarm and no sockets: what two cores cannot host as processes): the leader's CPU per
    epoch (:func:`per_epoch_cost`), the EPOCH frame and the bytes per second each
    subscriber receives, and ZooKeeper's write load (one block commit per
    ``epochs_per_commit`` epochs, its node holding every member and rate)."""
    per_block = params["epochs_per_commit"]
    epochs_per_s = NOMINAL_EPOCHS_PER_S
    out = []
    for n in sizes:
        cost = per_epoch_cost(n, params["replicas_per_shard"], repeat=3, epochs_per_commit=per_block)
        shards, rates = tuple(range(n)), tuple([params["records_per_s"]] * n)
        frame = len(wire.EpochEncoder(0).encode(10**6, shards, rates))
        same = len(wire.EpochEncoder(0).encode_same(10**6 + 1, 10**6))
        # a block's first epoch in full, the rest "same as" it
        per_block_bytes = frame + (per_block - 1) * same
        block = len(layout.enc({"epoch": 10**6, "last": 10**6 + per_block - 1, "shards": list(shards),
                                "rates": list(rates)}))
        out.append({
            "shards": n, **cost,
            "leader_cpu_pct": round(100 * cost["model_epoch_ms"] * epochs_per_s / 1000, 1),
            "epoch_frame_bytes": frame,
            "epoch_same_bytes": same,
            "per_subscriber_MB_s": round(per_block_bytes * epochs_per_s / per_block / 1e6, 2),
            "subscribers": n * params["replicas_per_shard"],
            "zk_commits_per_s": epochs_per_s / per_block,
            "zk_block_bytes": block,
            "zk_MB_s": round(block * epochs_per_s / per_block / 1e6, 2),
            "rate_reports_per_s": round(n * epochs_per_s / HEARTBEAT_EPOCHS),
        })
    return out


def _model_note(res: Results, model: list[dict[str, Any]]) -> None:
    lines = ["The plan past this machine (the leader's own code in-process, steady shards; `scale_model`):", "",
             "| shards | leader CPU per epoch | leader CPU | full plan (topology change) | EPOCH frame (a block's "
             "first epoch; the rest EPOCH_SAME) | per subscriber | subscribers | ZooKeeper | rate reports |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in model:
        lines.append(f"| {m['shards']:,} | {m['model_epoch_ms']} ms | {m['leader_cpu_pct']} % | "
                     f"{m['model_full_plan_ms']} ms | {m['epoch_frame_bytes'] / 1000:.0f} KB; {m['epoch_same_bytes']} B | "
                     f"{m['per_subscriber_MB_s']} MB/s | {m['subscribers']:,} | {m['zk_commits_per_s']:g} commits/s "
                     f"of {m['zk_block_bytes'] / 1000:.0f} KB ({m['zk_MB_s']} MB/s) | {m['rate_reports_per_s']:,}/s |")
    res.note("\n".join(lines))


class _ModelCoordination:
    """The membership service's coordination and election ports for the in-process
    model: a fixed topology, nothing committed, commits that are never answered."""

    def __init__(self, topology: TopologyView, history: list[list[Any]]) -> None:
        self.topology = topology
        self.history = history

    def register_mms(self, replica_id: int, addrs: dict[str, str]) -> None:
        pass

    def read_epoch_state(self) -> EpochState:
        return EpochState(None, 0, self.history, 0)

    def commit_block(self, commit: Any, on_done: Any) -> None:
        pass

    def run_election(self, path: str, identifier: str, on_elected: Any, on_lost: Any) -> None:
        pass

    def resign(self) -> None:
        pass

    def heartbeat(self) -> None:
        pass

    def fence(self) -> str | None:
        return None


# -- profile -----------------------------------------------------------------------------------------

#: what a stack of the leader's main thread is doing, by the functions on it (first match)
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("RATE ingestion (on_rate_frame, on_rate)", ("on_rate_frame", "on_rate", "decode_rate")),
    ("planning (ready list, EpochPlanner.plan)", ("plan", "<listcomp>", "shard_complete", "<genexpr>", "remove")),
    ("ZooKeeper block commit", ("commit_block", "commit_async", "transaction", "set_data")),
    ("waiting for the next epoch (poll, sleep)", ("poll", "sleep")),
]


def profile_leader(pid: int, seconds: int, path: Path) -> dict[str, Any] | None:
    """py-spy record (with idle samples) of the MMS leader, summarised for its main
    thread: the share of samples per category, and the top frames by own samples."""
    spy = Path(sys.executable).with_name("py-spy")
    cmd = [str(spy), "record", "--pid", str(pid), "--duration", str(seconds), "--format", "speedscope",
           "--idle", "-o", str(path)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=seconds + 30)
        data = json.loads(path.read_text())
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        return {"error": f"py-spy failed: {e}"}
    frames = data["shared"]["frames"]
    # py-spy names frames by qualified name ("ZmqRuntime.run_forever"): match on the last part
    names = [str(f["name"]).rsplit(".", 1)[-1] for f in frames]
    lead_profiles = [p for p in data["profiles"] if any(names[i] == "run_forever" for s in p["samples"] for i in s)]
    if not lead_profiles:
        return {"error": "no thread running the event loop (run_forever) in the profile"}
    prof = max(lead_profiles, key=lambda p: len(p["samples"]))
    samples: list[list[int]] = prof["samples"]
    total = len(samples)
    shares: dict[str, int] = {}
    own: dict[int, int] = {}
    for stack in samples:
        on_stack = {names[i] for i in stack}
        cat = next((c for c, fns in CATEGORIES if on_stack & set(fns)), "broadcast and the rest of the loop")
        shares[cat] = shares.get(cat, 0) + 1
        if stack:
            own[stack[-1]] = own.get(stack[-1], 0) + 1
    top = sorted(own.items(), key=lambda kv: -kv[1])[:10]
    return {
        "samples": total,
        "seconds": seconds,
        "file": path.name,
        "categories": {c: round(100.0 * k / total, 1) for c, k in sorted(shares.items(), key=lambda kv: -kv[1])},
        "top_frames": [{"pct": round(100.0 * k / total, 1), "function": frames[i]["name"],
                        "where": f"{_short(frames[i]['file'])}:{frames[i]['line']}"} for i, k in top],
    }


def _short(file: str) -> str:
    for marker in ("/site-packages/", "/work/main/"):
        if marker in file:
            return file.split(marker, 1)[1]
    return Path(file).name


def _profile_text(prof: dict[str, Any], n: int) -> str:
    if "error" in prof:
        return f"Profile of the MMS leader at {n} shards: {prof['error']}."
    cats = ", ".join(f"{c} {p}%" for c, p in prof["categories"].items())
    top = "; ".join(f"{f['pct']}% {f['function']} ({f['where']})" for f in prof["top_frames"])
    return (f"Profile of the MMS leader at {n} shards (py-spy, {prof['seconds']} s, idle samples included, "
            f"main thread, {prof['samples']} samples; `{prof['file']}` opens in speedscope.app): {cats}. "
            f"Top frames by own samples: {top}.")


# -- the sweep ------------------------------------------------------------------------------------------

def limit_point(points: list[Point]) -> Point | None:
    """The N where the MMS stops keeping up: the smallest failing N (with RATE) above the
    largest that keeps up (noise can make a smaller N fail too), else the smallest failing."""
    with_rates = [p for p in points if p.row["rates"]]
    ok = [p.row["shards"] for p in with_rates if p.row["keeps_up"]]
    bad = sorted((p for p in with_rates if not p.row["keeps_up"]), key=lambda p: p.row["shards"])
    above = [p for p in bad if not ok or p.row["shards"] > max(ok)]
    return above[0] if above else (bad[0] if bad else None)


def run(quick: bool, out: Path | None, shards: list[int] | None = None) -> list[dict[str, Any]]:
    """The sweep (``shards``: measure only these N, with no extension, refinement or
    variant; e.g. one N too large for the sweep's time, alone)."""
    params = _params(quick)
    if shards:
        params |= {"sweep": sorted(shards), "extend_to": 0, "refine": False, "rates_off_variant": False}
    res = Results(NAME, out, params)
    logs = res.dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    points: list[Point] = []
    rates_off: Point | None = None
    with tempfile.TemporaryDirectory(prefix="ziplog-bench-mms-") as tmp:
        ens = ZooKeeperEnsemble(Path(tmp) / "zookeeper", size=3, force_sync=params["zk_force_sync"])
        root_zk: KazooClient | None = None
        try:
            res.log("starting a 3-node ZooKeeper ensemble")
            ens.start()
            root_zk = discovery.connect(ens.hosts)

            def one(n: int, send_rates: bool = True) -> Point:
                # every failing N (with RATE) is profiled; the notes use the limit's
                profile_to = res.dir / f"mms_profile_n{n}.speedscope.json" if send_rates else None
                attempts = 2 if params["retry_disturbed"] else 1
                for attempt in range(1, attempts + 1):
                    last = attempt == attempts
                    p = measure(ens, root_zk, n, params, logs, send_rates, profile_to,
                                profile_if=lambda r: not r["keeps_up"] and (last or not disturbed(r)))
                    p.row["attempts"] = attempt
                    if p.row["keeps_up"] or not disturbed(p.row) or last:
                        break
                    res.log(f"N={n}: other work took {p.row['other_cpu_pct']}% of a core meanwhile; measuring again")
                r = p.row
                r["profile"] = profile_to.name if p.profile is not None and profile_to is not None else None
                res.log(f"N={n}{'' if send_rates else ' (no RATE)'}: {r['epochs_per_s']} epochs/s, p99 "
                        f"{r['interval_p99_ms']} ms, leader CPU {r['mms_cpu_pct']}%, swarm CPU "
                        f"{r['swarm_cpu_pct']}%, other work {r['other_cpu_pct']}%, keeps up: {r['keeps_up']}")
                return p

            sweep = list(params["sweep"])
            for n in progress(NAME, sweep, label=lambda n: f"N={n} shards"):
                points.append(one(n))
            n = sweep[-1]
            while points[-1].row["keeps_up"] and n * 2 <= params["extend_to"]:
                n *= 2
                res.log(f"still keeps up: trying N={n}")
                try:
                    points.append(one(n))
                except Exception as e:  # e.g. ZooKeeper refusing a listing past its 1 MB reply limit
                    res.note(f"N={n} could not be measured ({type(e).__name__}: {e}); the sweep stops at "
                             f"N={points[-1].row['shards']}.")
                    res.log(f"N={n} failed ({type(e).__name__}); stopping the extension")
                    break
            limit = limit_point(points)
            ok = [p.row["shards"] for p in points if p.row["keeps_up"]]
            if params["refine"] and limit is not None and ok and limit.row["shards"] > max(ok) * 1.3:
                mid = int(round(math.sqrt(limit.row["shards"] * max(ok)) / 100.0) * 100)
                res.log(f"refining between {max(ok)} and {limit.row['shards']}: N={mid}")
                points.append(one(mid))
                limit = limit_point(points)
            if params["rates_off_variant"] and limit is not None:
                n = limit.row["shards"]
                res.log(f"N={n} again without RATE reports")
                rates_off = one(n, send_rates=False)
                points.append(rates_off)
        finally:
            if root_zk is not None:
                discovery.stop(root_zk)
            ens.stop()
    rows = sorted((p.row for p in points), key=lambda r: (r["shards"], not r["rates"]))
    _notes(res, rows, limit_point(points), rates_off)
    res.log("modelling the leader at " + ", ".join(f"{n:,}" for n in MODEL_SIZES) + " shards")
    model = scale_model(params)
    (res.dir / "mms_model.json").write_text(json.dumps(model, indent=1))
    _model_note(res, model)
    _plot(res, rows)
    res.write(rows, COLUMNS, "Membership service: shards served at a 10 ms epoch interval", _intro(params))
    return rows


def _intro(params: dict[str, Any]) -> str:
    return (
        "Real ZooKeeper (3 nodes) and real MMS replicas (`python -m mms.server`, 3 replicas, `--interval-ms "
        f"{params['interval_ms']:g}`); `bench.shard_swarm` registers N shards ({params['replicas_per_shard']} "
        "replicas each) in ZooKeeper as storage servers do and plays their primaries: it subscribes to every "
        "MMS PUB and reports each member shard's rate as a primary does (per change, and a heartbeat per shard "
        "every 100 epochs spread by shard id), batched, to the leader's PULL. A probe SUB in "
        f"the harness times each EPOCH broadcast over {params['window_s']:g} s after {params['warmup_s']:g} s "
        f"of warm-up. {KEEPS_UP_RULE}. CPU columns are % of one core over the window: `mms_cpu_pct` the "
        "leader alone, `zk_cpu_pct` the 3 JVMs, `other_cpu_pct` everything else the machine ran (work that is "
        "not this run, which disturbs the timing). "
        "`block_start_p50_ms`: the intervals that end at an epoch starting a "
        f"block of {params['epochs_per_commit']} (broadcast only after its ZooKeeper commit); `other_p99_ms`: the "
        "other intervals. `rate_in_per_s`: RATE frames/s the leader's PULL accepted. `model_epoch_ms`: "
        "the leader's per-epoch CPU (a block's plan at an unchanged topology and its EPOCH encoding, shared by "
        "the block's epochs; a steady epoch's reports through `on_rate_frame`) replayed in-process; above 10 ms "
        "one core cannot hold the interval. `rates=False`: "
        "the swarm sends no RATE.")


def _notes(res: Results, rows: list[dict[str, Any]], limit: Point | None, rates_off: Point | None) -> None:
    with_rates = [r for r in rows if r["rates"]]
    ok = [r["shards"] for r in with_rates if r["keeps_up"]]
    best = max(ok) if ok else None
    below = [r["shards"] for r in with_rates if not r["keeps_up"] and best is not None and r["shards"] < best]
    if best is None:
        res.note(f"No N kept up. {KEEPS_UP_RULE}.")
    elif limit is None:
        res.note(f"Every N measured kept up; the largest is {best} shards (the dissertation: about 4 000). "
                 f"{KEEPS_UP_RULE}.")
    else:
        res.note(f"Largest N that keeps up: **{best} shards** (the dissertation: about 4 000); the next N measured, "
                 f"{limit.row['shards']}, does not"
                 + (f" (smaller N that failed too, most likely disturbed: {below})" if below else "")
                 + f". {KEEPS_UP_RULE}.")
    if limit is not None:
        r = limit.row
        parts = [f"At {r['shards']} shards the leader ran {r['epochs_per_s']} epochs/s (p99 interval "
                 f"{r['interval_p99_ms']} ms) at {r['mms_cpu_pct']}% CPU of one core, ZooKeeper at "
                 f"{r['zk_cpu_pct']}%, the swarm at {r['swarm_cpu_pct']}%; the leader's PULL took "
                 f"{r['rate_in_per_s']} RATE frames/s (steady shards send {r['rate_nominal_per_s']} reports/s at "
                 "that epoch rate). Its "
                 f"per-epoch work replayed in-process takes {r['model_epoch_ms']} ms (a block's plan "
                 f"{r['model_plan_ms']} and encoding {r['model_encode_ms']}, shared by its epochs; RATE "
                 f"ingestion {r['model_rates_ms']}; a full plan after a topology change {r['model_full_plan_ms']}) "
                 f"against a {INTERVAL_MS:g} ms interval."]
        if rates_off is not None:
            o = rates_off.row
            parts.append(f"Without RATE reports the same N runs {o['epochs_per_s']} epochs/s, p99 "
                         f"{o['interval_p99_ms']} ms, leader CPU {o['mms_cpu_pct']}% (keeps up: {o['keeps_up']}).")
        parts.append(_cause(limit))
        res.note(" ".join(parts))
        if limit.profile is not None:
            res.note(_profile_text(limit.profile, r["shards"]))
    busy = [f"{r['shards']}" + ("" if r["rates"] else " without RATE") for r in rows if disturbed(r)]
    if busy:
        res.note(f"Other work used {DISTURBED_CPU_PCT:g}% of a core or more during the window at N = {', '.join(busy)} "
                 "(`other_cpu_pct`): those timings are disturbed; rerun on a quiet machine.")
    if any(r["swarm_cpu_pct"] >= 80 for r in with_rates):
        res.note("The swarm shares the machine's cores with the MMS and ZooKeeper; where its CPU is high it also "
                 "takes CPU the MMS leader would otherwise have (on a 2-core machine this lowers the limit).")
    big = [r for r in with_rates if r.get("fanout_MB_s")]
    if big:
        r = max(big, key=lambda r: r["shards"])
        res.note(f"Not measured: the PUB's fan-out. Here one SUB per swarm receives each epoch; deployed, every "
                 f"storage replica subscribes, so at {r['shards']} shards the {r['broadcast_B_per_s']} B/s of "
                 f"broadcasts (a {r['frame_bytes']}-byte EPOCH per block, {r['same_frame_bytes']}-byte EPOCH_SAMEs "
                 f"between) go to {r['shards'] * res.params['replicas_per_shard']} subscribers: "
                 f"{r['fanout_MB_s']} MB/s from the leader (`fanout_MB_s` in the JSON).")


def _cause(point: Point) -> str:
    """A few sentences on what held the leader back at a failing N."""
    r, prof = point.row, point.profile
    cats: dict[str, float] = prof.get("categories", {}) if prof else {}
    if disturbed(r):
        return (f"Other work took {r['other_cpu_pct']}% of a core meanwhile, so this failure may be the machine's "
                "rather than the MMS's.")
    waiting = next((pct for c, pct in cats.items() if c.startswith("waiting")), None)
    busy_pct = 100.0 - waiting if waiting is not None else None
    out = []
    if r["mms_cpu_pct"] >= 75 or (busy_pct is not None and busy_pct >= 75):
        work = [(c, pct) for c, pct in cats.items() if not c.startswith("waiting")][:2]
        out.append(f"The leader is (nearly) CPU-bound: {r['mms_cpu_pct']}% of a core"
                   + (f", its main thread busy {busy_pct:.0f}% of the time" if busy_pct is not None else "")
                   + (f"; {' and '.join(f'{pct}% of it goes to {c}' for c, pct in work)}" if work else "") + ".")
    zk = next((pct for c, pct in cats.items() if c.startswith("ZooKeeper")), 0.0)
    if zk >= 20:
        out.append(f"It waits for ZooKeeper block commits {zk}% of the time.")
    rate_ok = r["epochs_per_s"] >= MIN_RATE_FRACTION * NOMINAL_EPOCHS_PER_S
    if rate_ok and r.get("block_start_p50_ms") is not None and r.get("other_p99_ms") is not None:
        out.append(f"The epoch rate holds but the tail does not: an interval ending at a block's first epoch "
                   f"(planning, then the ZooKeeper commit, then the broadcast) has a median of "
                   f"{r['block_start_p50_ms']} ms; the other intervals' p99 is {r['other_p99_ms']} ms.")
    return " ".join(out) if out else "The leader is neither CPU-bound nor waiting on ZooKeeper: see the profile."


def _plot(res: Results, rows: list[dict[str, Any]]) -> None:
    data = [r for r in rows if r["rates"]]
    if not data:
        return
    fig, path = res.figure()
    ax = fig.add_subplot(1, 1, 1)
    xs = [r["shards"] for r in data]
    ax.plot(xs, [r["epochs_per_s"] for r in data], "o-", color="tab:blue", label="epochs/s")
    ax.axhline(NOMINAL_EPOCHS_PER_S, color="tab:blue", ls=":", lw=1, label=f"nominal {NOMINAL_EPOCHS_PER_S:.0f}/s")
    ax.axhline(MIN_RATE_FRACTION * NOMINAL_EPOCHS_PER_S, color="tab:blue", ls="--", lw=0.8,
               label=f"{MIN_RATE_FRACTION:.0%} of nominal")
    ax.set_xscale("log")
    ax.set_xlabel("shards (N)")
    ax.set_ylabel("epochs broadcast per second", color="tab:blue")
    ax.set_ylim(0, NOMINAL_EPOCHS_PER_S * 1.15)
    ax2 = ax.twinx()
    ax2.plot(xs, [r["interval_p99_ms"] for r in data], "s-", color="tab:red", label="p99 interval (ms)")
    ax2.axhline(MAX_P99_INTERVALS * INTERVAL_MS, color="tab:red", ls="--", lw=0.8,
                label=f"{MAX_P99_INTERVALS:g} x interval")
    ax2.set_yscale("log")
    from matplotlib.ticker import FuncFormatter
    plain = FuncFormatter(lambda v, _pos: f"{v:g}")
    ax2.yaxis.set_major_formatter(plain)
    ax2.yaxis.set_minor_formatter(plain)
    ax2.set_ylabel("p99 interval between broadcasts (ms)", color="tab:red")
    ax.axvline(4000, color="grey", ls="-.", lw=0.8)
    ax.text(4000, 5, " 4 000 (dissertation)", color="grey", fontsize=8)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="lower left")
    ax.set_title(f"MMS at a {INTERVAL_MS:g} ms interval: epoch rate and p99 interval vs shards")
    res.save_figure(fig, path, "Epochs broadcast per second (left) and p99 interval between broadcasts (right) "
                               "against the number of shards")
