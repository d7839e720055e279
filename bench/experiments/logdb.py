"""Experiment ``logdb``: LogDB on ziplog against the same LogDB code on the Scalog-style
log (dissertation 4.4.6, Figures 4.8 and 4.9).

The paper's transaction: pick one of 10 keys at random, read its value v, write v + 1,
commit. Closed-loop clients (1 to 32, asyncio tasks over two worker processes), each
starting its next transaction as soon as the last one is decided; an abort is counted
and not retried. For each system and client count: committed transactions per second
(Fig. 4.8), the abort rate at that throughput (Fig. 4.9), the latency of committed
transactions, and the **apply delay**: from the moment the client learned its commit to
the moment the KV shard stored it (LogPlayer's measure; both clocks are this machine's
wall clock).

Both systems run LogDB's coordinator (2 replicas) and KV shards (3) as processes, on
2 shards x 2 replicas of their log; the Scalog-style log (:mod:`bench.systems.scalog_log`)
appends with appendToShard and reads with readRecord, as the paper did.

    python -m bench logdb [--quick] [--out DIR]
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import multiprocessing as mp
import random
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from ziplog.tools.stats import summarize

from ..report import Results, progress

COLUMNS = ["system", "clients", "committed_per_s", "aborted_per_s", "abort_rate", "p50_ms", "p99_ms",
           "apply_p50_ms", "apply_p99_ms"]
KEYS = [b"counter-%d" % i for i in range(10)]


def params_for(quick: bool, shards: int = 2) -> dict[str, Any]:
    return {"quick": quick, "clients": [1, 4, 16] if quick else [1, 2, 4, 8, 16, 32],
            "seconds": 3.0 if quick else 8.0, "warmup_s": 0.5, "shards": shards, "replicas": 2,
            "coordinators": 2, "kv_shards": 3, "keys": len(KEYS), "mms_args": []}


# -- the workload (in worker processes) --------------------------------------------------------------
def _worker(zk_hosts: str, name: str, scalog: list[list[str]] | None, tasks: int, seconds: float, warmup: float,
            seed: int) -> dict[str, Any]:
    from ziplog.client.aio import run
    return run(_work(zk_hosts, name, scalog, tasks, seconds, warmup, seed))


async def _work(zk_hosts: str, name: str, scalog: list[list[str]] | None, tasks: int, seconds: float,
                warmup: float, seed: int) -> dict[str, Any]:
    from ziplog.logdb import AsyncLogDB, TransactionAborted
    log: Any = None
    if scalog is not None:
        from bench.systems.scalog_log import AsyncScalogLog
        log = AsyncScalogLog(scalog, seed=seed)
    db = AsyncLogDB(zk_hosts, name=name, log=log)
    await db._start()
    committed: list[tuple[int, int, int]] = []  # (latency ns, commit gsn, decided at wall ns)
    aborted = [0]
    loop = asyncio.get_running_loop()
    start = loop.time() + warmup
    end = start + seconds

    async def client(c: int) -> None:
        rng = random.Random(seed * 1000 + c)
        while (now := loop.time()) < end:
            key = rng.choice(KEYS)
            t0 = time.perf_counter_ns()
            try:
                async with db.transaction() as t:
                    t.put(key, b"%d" % (int(await t.get(key) or b"0") + 1))
                decided = time.time_ns()
                if now >= start:
                    committed.append((time.perf_counter_ns() - t0, t.serialized_at or 0, decided))
            except TransactionAborted:
                if now >= start:
                    aborted[0] += 1

    try:
        await asyncio.gather(*(client(c) for c in range(tasks)))
    finally:
        await db.close()
        if log is not None:
            await log.close()
    return {"committed": committed, "aborted": aborted[0]}


def run_point(zk_hosts: str, name: str, scalog: list[list[str]] | None, clients: int, p: dict[str, Any],
              pool: concurrent.futures.ProcessPoolExecutor) -> dict[str, Any]:
    procs = min(2, clients)
    split = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    futs = [pool.submit(_worker, zk_hosts, name, scalog, n, p["seconds"], p["warmup_s"], i + 1)
            for i, n in enumerate(split)]
    results = [f.result(timeout=300) for f in futs]
    committed = [c for r in results for c in r["committed"]]
    aborted = sum(r["aborted"] for r in results)
    return {"committed": committed, "aborted": aborted}


# -- the systems ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def ziplog_logdb(p: dict[str, Any]) -> Iterator[tuple[str, str, None, Any]]:
    import ziplog
    from ziplog.tools.logdb_local import local_logdb
    with ziplog.local_cluster(shards=p["shards"], replicas=p["replicas"], mms_args=p["mms_args"]) as cluster, \
            local_logdb(cluster, coordinators=p["coordinators"], kv_shards=p["kv_shards"],
                        coordinator_args=["--no-gc"]) as ldb:
        yield ldb.zk_hosts, ldb.name, None, ldb


class _ScalogLogDB:
    """LogDB's processes on the Scalog-style log, found through a ZooKeeper of their own."""

    def __init__(self, data_dir: Path, zk_hosts: str, key_file: Path, addrs: list[list[str]], p: dict[str, Any]) -> None:
        self.data_dir = data_dir / "logdb" / "scalog"
        self.logs = data_dir / "logs"
        self.name = "scalog"
        self.zk_hosts = zk_hosts
        self.kv_shards = p["kv_shards"]
        common = ["--scalog", json.dumps(addrs), "--zk", zk_hosts, "--name", self.name, "--data-dir",
                  str(self.data_dir), "--cluster-key-file", str(key_file)]
        from ziplog.tools import procs
        self.procs = [procs.spawn([sys.executable, "-m", "bench.systems.scalog_logdb", "coordinator", *common,
                                   "--id", str(i), "--kv-shards", str(self.kv_shards), "--no-gc"],
                                  self.logs / f"scalog-coordinator{i}.log") for i in range(p["coordinators"])]
        self.procs += [procs.spawn([sys.executable, "-m", "bench.systems.scalog_logdb", "kvshard", *common,
                                    "--index", str(i), "--shards", str(self.kv_shards)],
                                   self.logs / f"scalog-kv{i}.log") for i in range(self.kv_shards)]

    def kv_store(self, i: int) -> Any:
        from ziplog.logdb.store import SqliteStore
        return SqliteStore(self.data_dir / f"kv-{i}-of-{self.kv_shards}.sqlite3", i, self.kv_shards)

    def wait_ready(self, timeout: float = 60.0) -> None:
        from ziplog.io import zk
        from ziplog.io.zk_logdb import Directory
        c = zk.connect(self.zk_hosts)
        try:
            d = Directory(c, self.name, timeout)
            if not (d.wait("coordinator", timeout) and d.wait("kv", timeout)):
                raise RuntimeError("LogDB on the Scalog-style log did not start")
        finally:
            zk.stop(c)

    def stop(self) -> None:
        from ziplog.tools import procs
        procs.stop_many(self.procs)


@contextlib.contextmanager
def scalog_logdb(p: dict[str, Any], tmp: Path) -> Iterator[tuple[str, str, list[list[str]], Any]]:
    from bench.systems.scalog import ScalogSystem
    from ziplog.shell.process import write_cluster_key
    from ziplog.tools.zk_ensemble import ZooKeeperEnsemble
    system = ScalogSystem(shards=p["shards"], replicas=p["replicas"])
    system.start()
    try:
        with ZooKeeperEnsemble(tmp / "zk", size=1, force_sync=False) as ens:
            key_file = tmp / "cluster.key"
            write_cluster_key(key_file)
            ldb = _ScalogLogDB(tmp, ens.hosts, key_file, system.addrs, p)
            try:
                ldb.wait_ready()
                yield ens.hosts, ldb.name, system.addrs, ldb
            finally:
                ldb.stop()
    finally:
        system.stop()


def apply_delays(ldb: Any, committed: list[tuple[int, int, int]], timeout: float = 30.0) -> list[int]:
    """Decision-to-applied delays (ns) of the committed transactions, from the KV shards'
    journals (waiting until every shard stored them)."""
    want = {gsn: at for _, gsn, at in committed}
    if not want:
        return []
    last = max(want)
    applied: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    for i in range(ldb.kv_shards):
        while True:
            store = ldb.kv_store(i)
            try:
                done = store.applied() >= last
                if done or time.monotonic() > deadline:
                    applied.update(store.applied_times())
                    break
            finally:
                store.close()
            time.sleep(0.05)
    return [applied[g] - at for g, at in want.items() if g in applied]


def run(quick: bool, out: Path | None) -> list[dict[str, Any]]:
    import tempfile
    p = params_for(quick)
    res = Results("logdb", out, p)
    rows: list[dict[str, Any]] = []
    pool = concurrent.futures.ProcessPoolExecutor(2, mp_context=mp.get_context("spawn"))
    try:
        for system in ("ziplog", "Scalog-style"):
            with tempfile.TemporaryDirectory(prefix="bench-logdb-") as tmp:
                ctx = ziplog_logdb(p) if system == "ziplog" else scalog_logdb(p, Path(tmp))
                with ctx as (zk_hosts, name, scalog, ldb):
                    for clients in progress("logdb", p["clients"], lambda c: f"{system}, {c} clients"):
                        got = run_point(zk_hosts, name, scalog, clients, p, pool)
                        lat = [c[0] for c in got["committed"]]
                        n, a = len(lat), got["aborted"]
                        delays = apply_delays(ldb, got["committed"])
                        s = summarize(lat) if lat else {"p50_us": 0.0, "p99_us": 0.0}
                        d = summarize(delays) if delays else {"p50_us": 0.0, "p99_us": 0.0}
                        rows.append({"system": system, "clients": clients,
                                     "committed_per_s": round(n / p["seconds"], 1),
                                     "aborted_per_s": round(a / p["seconds"], 1),
                                     "abort_rate": round(a / (n + a), 3) if n + a else 0.0,
                                     "p50_ms": round(s["p50_us"] / 1000, 2), "p99_ms": round(s["p99_us"] / 1000, 2),
                                     "apply_p50_ms": round(d["p50_us"] / 1000, 3),
                                     "apply_p99_ms": round(d["p99_us"] / 1000, 3),
                                     "applied_measured": len(delays)})
    finally:
        pool.shutdown()
    _plots(res, rows)
    res.note("apply delay: the KV shard's store time minus the time the client learned the commit (negative "
             "when the shard stored it first; both replay the log at once)")
    res.write(rows, COLUMNS, "LogDB: committed transactions and aborts, ziplog vs Scalog-style (Fig. 4.8, 4.9)",
              intro=f"read key k of {len(KEYS)}, write k + 1; closed-loop clients; {p['seconds']} s per point; "
                    f"{p['shards']} shards x {p['replicas']} replicas; 2 coordinators, 3 KV shards.")
    return rows


def _plots(res: Results, rows: list[dict[str, Any]]) -> None:
    fig, path = res.figure("_committed")
    ax = fig.add_subplot(1, 1, 1)
    for system in ("ziplog", "Scalog-style"):
        r = [x for x in rows if x["system"] == system]
        ax.plot([x["clients"] for x in r], [x["committed_per_s"] for x in r], marker="o", label=system)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("closed-loop clients")
    ax.set_ylabel("committed transactions / s")
    ax.grid(True, alpha=0.3)
    ax.legend()
    res.save_figure(fig, path, "Committed transactions per second by client count (Fig. 4.8)")
    fig, path = res.figure("_aborts")
    ax = fig.add_subplot(1, 1, 1)
    for system in ("ziplog", "Scalog-style"):
        r = [x for x in rows if x["system"] == system]
        ax.plot([x["committed_per_s"] for x in r], [x["abort_rate"] for x in r], marker="o", label=system)
    ax.set_xlabel("committed transactions / s")
    ax.set_ylabel("abort rate")
    ax.grid(True, alpha=0.3)
    ax.legend()
    res.save_figure(fig, path, "Abort rate against throughput (Fig. 4.9)")
