"""Experiment ``logbook``: LogBook (Boki's API on ziplog) with its IndiLog-style index tier.

On 2 shards x 2 replicas with 4 KiB records, in one run:

* **append** latency: one session, each append after the previous one;
* **read** latency of the same old records by tag: an engine **cache hit**
  (``read_prev`` of a tag the engine appended, answered by its suffix cache, checked
  with the cache's hit counter, the record from those its subscription delivered), and
  the same with those records set aside (then a ``read_record``); a **tier lookup through the aggregator** (``index="tier"``,
  an engine started after the records were appended, ``read_next`` from seqnum 0, so its
  cache cannot answer); the same with the engine **asking the index nodes** itself
  (``index="nodes"``); the same again with the record **read from the log after the
  lookup** (the engine does not ask the nodes for it: two rounds, as before nodes kept
  records); a plain ziplog ``Client.read_record`` of the record (the floor: a read whose
  record did not come with its lookup ends with one); and the engine's **complete local
  index** (``index="local"``); for the two-round kind also its **parts**, timed apart:
  the index round, and the record read after it (section "read parts"). The one-round
  kinds are checked to read nothing from the log;
* **read-after-append**: an append, then ``read_next`` of its seqnum by a session holding
  the appender's position: a child on the same engine, or a session on another engine;
* the tier with **1 and 2 index nodes** (a fresh cluster each), through the aggregator
  and asking the nodes;
* **feed cost**: what feeding the nodes the records costs, on the 2-node cluster: one
  session appends 4 KiB records, the feeder sending the records with the entries or not
  (started again with ``--record-max-bytes 0``), the two arms alternating over
  ``feed_pairs`` pairs; per arm the append p50 and the feeder's and the index nodes' CPU
  per append (from /proc, over the appends and until the nodes were fed them), and the
  median over the pairs of each pair's ratio;
* **memory**: appends with a new tag each (and a tier lookup every few appends) for a
  fixed period, sampling every second the engine's RSS (it lives in this process), the
  tier processes' RSS and each index node's size.

Every read kind draws from the same records in the same order, round by round, the kinds
taking turns; ratios compare medians (and p99s) of this run.

    python -m bench logbook [--quick] [--out DIR]
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from ziplog.tools.stats import summarize

from ..report import Results, _json_default, histogram, progress

COLUMNS = ["section", "kind", "index_nodes", "count", "p50_us", "p99_us", "mean_us", "vs_read_record",
           "cache_hits", "cache_misses"]
FEED_COLUMNS = ["records fed", "pairs", "append p50_us (median)", "feeder cpu_us per append (median)",
                "index nodes cpu_us per append (median)", "on / off: feeder", "on / off: nodes", "on / off: append p50"]
#: (the ratio columns: the median over the pairs of each pair's ratio)
RATIO_COLUMNS = ["ratio", "p50", "p99", "of"]
NODES_COLUMNS = ["kind", "p50_us N=1", "p50_us N=2", "N=2 / N=1 (p50)", "p99_us N=1", "p99_us N=2"]
MEMORY_COLUMNS = ["process", "first_mib", "last_mib", "max_mib", "slope_kib_per_s", "kib_per_1000_appends",
                  "entries_per_1000_appends"]

#: the read kinds, in the order of the tables
HIT, TIER, NODES, FLOOR, LOCAL = ("cache hit", "tier (aggregator)", "tier (nodes direct)", "read_record",
                                  "local index")
#: asking the nodes for the entry only, then reading its record from the log (two rounds)
TWO_ROUNDS = "tier (nodes direct), then read_record"
#: the cache hit's engine without the records its subscription delivered (a read_record after)
HIT_READ = "cache hit, then read_record"
SAME, OTHER = "same engine (child)", "other engine"
#: the two parts of a tier read (section "read parts")
PART_INDEX, PART_READ = "index round", "record read"
MIB = 1024 * 1024


def params_for(quick: bool) -> dict[str, Any]:
    return {"quick": quick, "record_bytes": 4096, "shards": 2, "replicas": 2, "index_nodes": [1, 2],
            "records": 1000 if quick else 5000, "rounds": 4 if quick else 8,
            "reads_per_round": 250 if quick else 1000,
            "read_after_append": 300 if quick else 2000,
            "feed_pairs": 5 if quick else 9, "feed_appends": 2000 if quick else 5000,
            "memory_seconds": 15.0 if quick else 60.0, "memory_read_every": 50,
            "memory_cache_entries": 2000 if quick else 10000}


# -- helpers ---------------------------------------------------------------------------------------
def _rss(pid: int) -> int | None:
    """Resident set size of process ``pid`` in bytes (None once it is gone)."""
    import psutil
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except (psutil.Error, OSError):
        return None


def _fit(x: list[float], y: list[float]) -> float | None:
    """Slope of the least-squares line through (x, y)."""
    if len(x) < 2 or max(x) == min(x):
        return None
    return float(np.polyfit(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64), 1)[0])


def _row(section: str, kind: str, nodes: int, samples: list[int], **extra: Any) -> dict[str, Any]:
    return {"section": section, "kind": kind, "index_nodes": nodes, **summarize(samples), **extra,
            "histogram": histogram(samples)}


@contextlib.contextmanager
def _tier(p: dict[str, Any], nodes: int, res: Results) -> Iterator[Any]:
    """A fresh local cluster with the index tier of ``nodes`` index nodes."""
    import ziplog
    from ziplog.logbook import local_logbook
    with contextlib.ExitStack() as stack:
        try:
            cluster = stack.enter_context(ziplog.local_cluster(shards=p["shards"], replicas=p["replicas"]))
            tier = stack.enter_context(local_logbook(cluster, index_nodes=nodes))
        except Exception as e:
            res.not_started(f"ziplog + LogBook tier (N={nodes})", str(e))
            raise RuntimeError(f"cannot run the logbook experiment: {e}") from e
        yield tier


# -- appends and reads of old records -----------------------------------------------------------------
def measure_reads(tier: Any, p: dict[str, Any], nodes: int, book: int) -> list[dict[str, Any]]:
    """Append ``records`` tagged records (timed) and read them back the five ways."""
    from ziplog.logbook import LogBook
    from ziplog.logbook.core import records as r
    from ziplog.logbook.core.kept import KeptRecords
    from ziplog.protocol.types import RecordId
    zk = tier.zk_hosts
    payload = os.urandom(p["record_bytes"])
    clock = time.perf_counter_ns
    n = p["records"]
    tags = [f"rec-{i}" for i in range(n)]
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        writer = LogBook(zk, book, index="tier")
        stack.callback(writer.close)
        # the writer's cache learns the book's trim point from one tier answer; after that
        # it answers what it appended itself
        writer.read_next(0)
        appends: list[int] = []
        seqnums: list[int] = []
        for i in range(n):
            t0 = clock()
            seqnums.append(writer.append(payload, tags=[tags[i]]))
            appends.append(clock() - t0)
        rows.append(_row("append", "append (4 KiB, one session)", nodes, appends))
        tier.wait_ready(at_least=seqnums[-1])

        sessions: dict[str, Any] = {HIT: writer}
        for kind, index in ((TIER, "tier"), (NODES, "nodes"), (TWO_ROUNDS, "nodes"), (LOCAL, "local")):
            sessions[kind] = LogBook(zk, book, index=index)
            stack.callback(sessions[kind].close)
        sessions[TWO_ROUNDS]._engine.records_with_lookups = False
        reader = sessions[TIER]
        # warm up: connections to the tier, the local index's catch-up from the log's start
        for kind in (TIER, NODES, TWO_ROUNDS, LOCAL):
            got = sessions[kind].read_next(0, tag=tags[0])
            assert got is not None and got.seqnum == seqnums[0], (kind, got, seqnums[0])
        writer.read_prev(seqnums[0], tag=tags[0])
        local_index = sessions[LOCAL]._engine.index
        rids = []
        for i in range(n):
            hit = local_index.next(book, r.tag_of(tags[i]), 0, local_index.watermark)
            assert hit is not None and hit.gsn == seqnums[i], (i, hit, seqnums[i])
            rids.append(RecordId(hit.gsn, hit.shard))

        def via(kind: str) -> Callable[[int], Any]:
            lb = sessions[kind]
            if kind == HIT:
                return lambda i: lb.read_prev(seqnums[i], tag=tags[i])
            return lambda i: lb.read_next(0, tag=tags[i])

        def without_kept(i: int) -> Any:
            """A cache hit on the writer's engine with its kept records set aside."""
            engine = writer._engine
            kept, engine.kept = engine.kept, KeptRecords(0)
            try:
                return writer.read_prev(seqnums[i], tag=tags[i])
            finally:
                engine.kept = kept

        client = reader._engine.client
        reads: dict[str, Callable[[int], Any]] = {HIT: via(HIT), HIT_READ: without_kept, TIER: via(TIER),
                                                  NODES: via(NODES),
                                                  TWO_ROUNDS: via(TWO_ROUNDS),
                                                  FLOOR: lambda i: client.read_record(rids[i]), LOCAL: via(LOCAL)}
        samples: dict[str, list[int]] = {k: [] for k in reads}
        tiered = (TIER, NODES, TWO_ROUNDS)
        sessions[HIT_READ] = writer
        counters = {k: (sessions[k]._engine.cache.hits, sessions[k]._engine.cache.misses) for k in (HIT, *tiered)}
        parts = {k: _time_parts(sessions[k]._engine) for k in tiered}
        rng = random.Random(nodes)
        kinds = list(reads)
        for rnd in range(p["rounds"]):
            picks = [rng.randrange(n) for _ in range(p["reads_per_round"])]
            gc.collect()
            for kind in kinds[rnd % len(kinds):] + kinds[:rnd % len(kinds)]:
                read, out = reads[kind], samples[kind]
                for i in picks:
                    t0 = clock()
                    got = read(i)
                    out.append(clock() - t0)
                    if kind == FLOOR:
                        assert len(got) > p["record_bytes"], (i, len(got))
                    else:
                        assert got is not None and got.seqnum == seqnums[i], (kind, i, got, seqnums[i])
        done = {k: (sessions[k]._engine.cache.hits - h, sessions[k]._engine.cache.misses - m)
                for k, (h, m) in counters.items()}
        reads_made = p["rounds"] * p["reads_per_round"]
        assert done[HIT] == (2 * reads_made, 0), ("the cache-hit reads were not all hits", done[HIT])
        for kind in tiered:
            assert done[kind] == (0, reads_made), (f"{kind} reads did not all go to the tier", done[kind])
            made = len(parts[kind][1])
            assert made == (reads_made if kind == TWO_ROUNDS else 0), (f"{kind}: {made} records read from the log")
        floor = summarize(samples[FLOOR])
        for kind in kinds:
            s = summarize(samples[kind])
            hits, misses = done.get(kind, (None, None))
            rows.append({"section": "read", "kind": kind, "index_nodes": nodes, **s,
                         "vs_read_record": s["p50_us"] / floor["p50_us"] if floor["p50_us"] else None,
                         "cache_hits": hits, "cache_misses": misses, "histogram": histogram(samples[kind])})
        for kind in (TWO_ROUNDS,):
            lookups, record_reads = parts[kind]
            for part, got in ((PART_INDEX, lookups), (PART_READ, record_reads)):
                got = got[-reads_made:]  # the timed reads' (the warm-up's went before)
                s = summarize(got)
                rows.append({"section": "read parts", "kind": f"{kind}: {part}", "index_nodes": nodes, **s,
                             "vs_read_record": s["p50_us"] / floor["p50_us"] if floor["p50_us"] else None,
                             "histogram": histogram(got)})
    return rows


def _time_parts(engine: Any) -> tuple[list[int], list[int]]:
    """Time each of ``engine``'s lookups (the index round) and record reads apart, from
    here on: what one tier read is made of, beside ``read_record``."""
    from ziplog.logbook.core import session as ls
    lookups: list[int] = []
    record_reads: list[int] = []
    perform, clock = engine.perform, time.perf_counter_ns

    def timed(op: Any) -> Any:
        t0 = clock()
        out = perform(op)
        (lookups if type(op) is ls.Lookup else record_reads).append(clock() - t0)
        return out

    engine.perform = timed
    return lookups, record_reads


# -- what feeding the records costs ---------------------------------------------------------------------
def measure_feed_cost(tier: Any, p: dict[str, Any], book: int) -> list[dict[str, Any]]:
    """The feed-cost arms (see the module's docstring), alternating; one row per arm."""
    from ziplog.logbook import LogBook

    from ..cpu import cpu_seconds
    payload = os.urandom(p["record_bytes"])
    clock = time.perf_counter_ns
    arms = {"yes": (), "no": ("--record-max-bytes", "0")}
    got: dict[str, list[tuple[float, float, float]]] = {arm: [] for arm in arms}
    with LogBook(tier.zk_hosts, book, index="tier") as lb:
        for pair in range(p["feed_pairs"]):
            for arm in (list(arms) if pair % 2 == 0 else list(arms)[::-1]):
                tier.restart_feeder(*arms[arm])
                lb.append(payload, tags=["feed-warm-up"])
                tier.wait_ready(at_least=lb.position)  # the new feeder is up and feeding
                feeder = [tier.feeder.pid]
                nodes = [tier.node_pid(i) for i in tier.nodes]
                f0, n0 = cpu_seconds(feeder), cpu_seconds(nodes)
                times = []
                for k in range(p["feed_appends"]):
                    t0 = clock()
                    lb.append(payload, tags=[f"feed-{k % 100}"])
                    times.append(clock() - t0)
                tier.wait_ready(at_least=lb.position)
                per = 1e6 / p["feed_appends"]
                got[arm].append((float(np.median(times)) / 1000, (cpu_seconds(feeder) - f0) * per,
                                 (cpu_seconds(nodes) - n0) * per))
    med = {arm: [float(np.median([x[i] for x in got[arm]])) for i in range(3)] for arm in arms}
    # each pair's on / off, then their median: the machine's drift over the pairs cancels
    paired = [float(np.median([on[i] / off[i] for on, off in zip(got["yes"], got["no"]) if off[i]]))
              for i in range(3)]
    rows = []
    for arm in arms:
        a = med[arm]
        ratios = paired if arm == "yes" else [1.0, 1.0, 1.0]
        rows.append({"records fed": arm, "pairs": p["feed_pairs"], "append p50_us (median)": a[0],
                     "feeder cpu_us per append (median)": a[1], "index nodes cpu_us per append (median)": a[2],
                     "on / off: feeder": ratios[1], "on / off: nodes": ratios[2], "on / off: append p50": ratios[0],
                     "runs": got[arm]})
    return rows


# -- read-after-append ---------------------------------------------------------------------------------
def measure_read_after_append(tier: Any, p: dict[str, Any], nodes: int, book: int) -> list[dict[str, Any]]:
    """Append, then read_next(that seqnum, tag) by a session at the appender's position:
    a child on the same engine, or a session on a second engine; the two alternate."""
    from ziplog.logbook import LogBook
    payload = os.urandom(p["record_bytes"])
    clock = time.perf_counter_ns
    tag = "raa"
    samples: dict[str, list[int]] = {SAME: [], OTHER: []}
    with contextlib.ExitStack() as stack:
        writer = LogBook(tier.zk_hosts, book, index="tier")
        stack.callback(writer.close)
        other = LogBook(tier.zk_hosts, book, index="tier")
        stack.callback(other.close)
        for lb in (writer, other):  # learn the book's trim point (one tier answer each)
            lb.read_next(0, tag=tag)
        caches: dict[str, Any] = {SAME: writer._engine.cache, OTHER: other._engine.cache}
        before = {k: (c.hits, c.misses) for k, c in caches.items()}
        for j in range(p["read_after_append"]):
            for kind in ((SAME, OTHER) if j % 2 == 0 else (OTHER, SAME)):
                seqnum = writer.append(payload, tags=[tag])
                if kind == SAME:
                    reader = writer.child()
                else:
                    reader = other
                    reader.observe(seqnum)  # the position handed over, as to a child
                t0 = clock()
                got = reader.read_next(seqnum, tag=tag)
                samples[kind].append(clock() - t0)
                assert got is not None and got.seqnum == seqnum, (kind, got, seqnum)
        rows = []
        for kind in (SAME, OTHER):
            c = caches[kind]
            rows.append(_row("read after append", kind, nodes, samples[kind],
                             cache_hits=c.hits - before[kind][0], cache_misses=c.misses - before[kind][1]))
    return rows


# -- memory --------------------------------------------------------------------------------------------
def measure_memory(tier: Any, p: dict[str, Any], nodes: int, book: int, res: Results) -> dict[str, Any]:
    """Appends with a new tag each from one engine (``index="tier"``), a tier lookup of an
    older tag every ``memory_read_every`` appends; a sample of every process's RSS and
    every index node's size each second."""
    import psutil

    from ziplog.logbook import Engine, LogBook
    payload = os.urandom(p["record_bytes"])
    clock = time.perf_counter_ns
    me = psutil.Process()
    node_ids = sorted(tier.nodes)
    procs = {f"index node {i}": tier.nodes[i].pid for i in node_ids}
    procs.update({f"aggregator {i}": a.pid for i, a in sorted(tier.aggregators.items())})
    if tier.feeder is not None:
        procs["feeder"] = tier.feeder.pid
    samples: list[dict[str, Any]] = []
    lookups: list[int] = []
    seqnums: list[int] = []
    rng = random.Random(11)
    with contextlib.ExitStack() as stack:
        engine = Engine(tier.zk_hosts, index="tier", cache_entries=p["memory_cache_entries"])
        stack.callback(engine.close)
        lb = LogBook(tier.zk_hosts, book, _engine=engine)
        stack.callback(lb.close)
        cache = engine.cache
        assert cache is not None
        lb.read_next(0)
        gc.collect()
        t_start = time.monotonic()

        def sample() -> None:
            states = {i: tier.node_state(i) for i in node_ids}
            samples.append({"t_s": round(time.monotonic() - t_start, 3), "appends": len(seqnums),
                            "engine_rss": int(me.memory_info().rss), "cache_size": cache.size,
                            **{f"{name} rss": _rss(pid) for name, pid in procs.items()},
                            **{f"index node {i} size": (st[2] if st else None) for i, st in states.items()}})

        sample()
        next_sample = t_start + 1.0
        end = t_start + p["memory_seconds"]
        while (now := time.monotonic()) < end:
            if now >= next_sample:
                sample()
                next_sample += 1.0
            i = len(seqnums)
            seqnums.append(lb.append(payload, tags=[f"m-{i}"]))
            if i and i % p["memory_read_every"] == 0:
                k = rng.randrange(i)
                t0 = clock()
                got = lb.read_next(0, tag=f"m-{k}")
                lookups.append(clock() - t0)
                assert got is not None and got.seqnum == seqnums[k], (k, got, seqnums[k])
        tier.wait_ready(at_least=seqnums[-1])
        sample()
        hits, misses = cache.hits, cache.misses
    res.log(f"memory: {len(seqnums)} appends in {samples[-1]['t_s']:.0f} s, {len(samples)} samples")
    return {"samples": samples, "appends": len(seqnums), "lookups_ns": lookups, "processes": list(procs),
            "nodes": node_ids, "cache_hits": hits, "cache_misses": misses}


def memory_summary(mem: dict[str, Any]) -> list[dict[str, Any]]:
    """Per process: RSS first/last/max, slope over time and per 1,000 appends; the index
    nodes' size per 1,000 appends."""
    s = mem["samples"]
    out = []
    for name, key in [("engine (this process)", "engine_rss"), *((n, f"{n} rss") for n in mem["processes"])]:
        pts = [(x["t_s"], x["appends"], x[key]) for x in s if x.get(key) is not None]
        if not pts:
            continue
        t, a, v = zip(*pts)
        row: dict[str, Any] = {"process": name, "first_mib": v[0] / MIB, "last_mib": v[-1] / MIB,
                               "max_mib": max(v) / MIB}
        per_s = _fit(list(t), list(v))
        per_append = _fit(list(map(float, a)), list(v))
        row["slope_kib_per_s"] = per_s / 1024 if per_s is not None else None
        row["kib_per_1000_appends"] = per_append * 1000 / 1024 if per_append is not None else None
        if name.startswith("index node"):
            sz = [(x["appends"], x[f"{name} size"]) for x in s if x.get(f"{name} size") is not None]
            fit = _fit([float(q[0]) for q in sz], [float(q[1]) for q in sz]) if sz else None
            row["entries_per_1000_appends"] = fit * 1000 if fit is not None else None
            row["last_size"] = sz[-1][1] if sz else None
        out.append(row)
    nodes = [r for r in out if r["process"].startswith("index node")]
    if nodes:
        total = [(x["appends"], sum(x[f"{r['process']} rss"] or 0 for r in nodes)) for x in s]
        fit = _fit([float(q[0]) for q in total], [float(q[1]) for q in total])
        sizes = [(x["appends"], sum(x.get(f"{r['process']} size") or 0 for r in nodes)) for x in s]
        sfit = _fit([float(q[0]) for q in sizes], [float(q[1]) for q in sizes])
        t_all = [x["t_s"] for x in s]
        tfit = _fit(t_all, [float(q[1]) for q in total])
        out.append({"process": "index nodes (sum)", "first_mib": total[0][1] / MIB, "last_mib": total[-1][1] / MIB,
                    "max_mib": max(q[1] for q in total) / MIB,
                    "slope_kib_per_s": tfit / 1024 if tfit is not None else None,
                    "kib_per_1000_appends": fit * 1000 / 1024 if fit is not None else None,
                    "entries_per_1000_appends": sfit * 1000 if sfit is not None else None,
                    "last_size": sizes[-1][1]})
    return out


# -- the run -------------------------------------------------------------------------------------------
def run(quick: bool, out: Path | None) -> list[dict[str, Any]]:
    p = params_for(quick)
    res = Results("logbook", out, p)
    rows: list[dict[str, Any]] = []
    mem: dict[str, Any] = {}
    feed: list[dict[str, Any]] = []
    main_n = max(p["index_nodes"])
    for nodes in progress("logbook", p["index_nodes"], lambda n: f"a fresh cluster, {n} index node(s)"):
        with _tier(p, nodes, res) as tier:
            res.log(f"N={nodes}: {p['records']} appends, then {p['rounds']} x {p['reads_per_round']} reads per kind")
            rows += measure_reads(tier, p, nodes, book=1)
            if nodes == main_n:
                res.log(f"N={nodes}: {p['read_after_append']} x 2 reads after appends")
                rows += measure_read_after_append(tier, p, nodes, book=2)
                res.log(f"N={nodes}: feed cost, {p['feed_pairs']} x 2 x {p['feed_appends']} appends")
                feed = measure_feed_cost(tier, p, book=4)
                res.log(f"N={nodes}: memory, {p['memory_seconds']:.0f} s of appends with a new tag each")
                mem = measure_memory(tier, p, nodes, book=3, res=res)
    lookups = mem.get("lookups_ns") or []
    if lookups:
        rows.append(_row("memory run", "tier lookup while the index grows", main_n, lookups,
                         cache_hits=mem["cache_hits"], cache_misses=mem["cache_misses"]))
    ratios = ratio_rows(rows, p)
    by_n = nodes_rows(rows, p)
    memory = memory_summary(mem) if mem else []
    _plots(res, rows, mem, main_n)
    res.note("cache hit: read_prev(seqnum, tag) on the engine that appended the records (its suffix cache, "
             "which learned the book's trim point from one tier answer first), the record from those the engine's "
             "subscription delivered; 'cache hit, then read_record': the same with those set aside; "
             "tier and nodes-direct: read_next(0, tag) on an engine started after the appends, so below its "
             "cache's start, the record coming with the lookup's answer from the index node that keeps it (one "
             "round; checked: no record read from the log); 'then read_record': the same lookup without the "
             "record, then a read_record (two rounds). vs_read_record: p50 over read_record's p50 on the same "
             "cluster.")
    res.note("read after append: the time of read_next(seqnum, tag) right after the append returned, by a child "
             "of the appending session (same engine) or by a session on another engine given the appender's "
             "position; both wait until their engine's subscription delivered the record.")
    if mem:
        res.note(f"memory: {mem['appends']} appends with a new tag each in {p['memory_seconds']:.0f} s, one engine "
                 f"(index='tier', cache of {p['memory_cache_entries']} entries), a tier lookup every "
                 f"{p['memory_read_every']} appends; the engine's RSS is this whole process's. Index node size: "
                 "seqnums held over all its (book, tag) rows (an entry with one tag is two). Its tier lookups follow the "
                 "session's own appends, so each first waits for the engine's subscription and the index nodes to "
                 "reach the session's position.")
    res.write(rows, COLUMNS,
              "LogBook on ziplog: appends, reads through the index tier, read-after-append, memory",
              intro=f"{p['shards']} shards x {p['replicas']} replicas, records of {p['record_bytes']} bytes; "
                    f"{p['records']} records read back {p['rounds']} x {p['reads_per_round']} times per kind; "
                    f"index tier of 1 and 2 index nodes (a fresh cluster each) and one aggregator.",
              extra_tables=[("Ratios (this run)", ratios, RATIO_COLUMNS),
                            ("Index nodes: 1 vs 2", by_n, NODES_COLUMNS),
                            (f"Feeding the nodes the records: cost (N={main_n}, alternating arms)", feed,
                             FEED_COLUMNS),
                            ("Memory while appending a new tag per record", memory, MEMORY_COLUMNS)])
    # the JSON: every row, plus the ratios and the memory run (summary and samples)
    full = rows + [{"section": "ratio", **r} for r in ratios] + [{"section": "index nodes", **r} for r in by_n] \
        + [{"section": "memory", **r} for r in memory] + [{"section": "feed cost", **r} for r in feed] \
        + ([{"section": "memory samples", "samples": mem["samples"], "appends": mem["appends"]}] if mem else [])
    (res.dir / "logbook.json").write_text(json.dumps(full, indent=1, default=_json_default) + "\n")
    return rows


def _find(rows: list[dict[str, Any]], section: str, kind: str, nodes: int) -> dict[str, Any] | None:
    return next((r for r in rows if r["section"] == section and r["kind"] == kind and r["index_nodes"] == nodes),
                None)


def ratio_rows(rows: list[dict[str, Any]], p: dict[str, Any]) -> list[dict[str, Any]]:
    n = max(p["index_nodes"])
    lo = min(p["index_nodes"])
    out = []

    def ratio(name: str, a: dict[str, Any] | None, b: dict[str, Any] | None, of: str) -> None:
        if a is None or b is None or not b["p50_us"] or not b["p99_us"]:
            return
        out.append({"ratio": name, "p50": a["p50_us"] / b["p50_us"], "p99": a["p99_us"] / b["p99_us"], "of": of})

    def r(kind: str, nodes: int = n, section: str = "read") -> dict[str, Any] | None:
        return _find(rows, section, kind, nodes)

    ratio("tier lookup / read_record", r(TIER), r(FLOOR), f"N={n}")
    ratio("nodes-direct lookup (the default) / read_record", r(NODES), r(FLOOR), f"N={n}")
    ratio("nodes-direct lookup, record read after it / read_record", r(TWO_ROUNDS), r(FLOOR), f"N={n}")
    ratio("nodes-direct: record with the lookup / read after it", r(NODES), r(TWO_ROUNDS), f"N={n}")
    ratio("nodes-direct / aggregator", r(NODES), r(TIER), f"N={n}")
    ratio("cache hit / read_record", r(HIT), r(FLOOR), f"N={n}")
    ratio("cache hit, then read_record / read_record", r(HIT_READ), r(FLOOR), f"N={n}")
    ratio("local index / read_record", r(LOCAL), r(FLOOR), f"N={n}")
    if lo != n:
        ratio("N=2 / N=1, aggregator" if (lo, n) == (1, 2) else f"N={n} / N={lo}, aggregator", r(TIER),
              r(TIER, lo), "tier lookups")
        ratio("N=2 / N=1, nodes direct" if (lo, n) == (1, 2) else f"N={n} / N={lo}, nodes direct", r(NODES),
              r(NODES, lo), "tier lookups")
        ratio(f"nodes-direct lookup (the default) / read_record, N={lo}", r(NODES, lo), r(FLOOR, lo), f"N={lo}")
    ratio("read after append: other / same engine", r(OTHER, n, "read after append"),
          r(SAME, n, "read after append"), f"N={n}")
    ratio("read after append (same engine) / cache hit", r(SAME, n, "read after append"), r(HIT), f"N={n}")
    return out


def nodes_rows(rows: list[dict[str, Any]], p: dict[str, Any]) -> list[dict[str, Any]]:
    lo, hi = min(p["index_nodes"]), max(p["index_nodes"])
    out = []
    for kind in (TIER, NODES, TWO_ROUNDS, FLOOR, HIT, HIT_READ, LOCAL):
        a, b = _find(rows, "read", kind, lo), _find(rows, "read", kind, hi)
        if a is None or b is None:
            continue
        out.append({"kind": kind, "p50_us N=1": a["p50_us"], "p50_us N=2": b["p50_us"],
                    "N=2 / N=1 (p50)": b["p50_us"] / a["p50_us"] if a["p50_us"] else None,
                    "p99_us N=1": a["p99_us"], "p99_us N=2": b["p99_us"]})
    return out


def _plots(res: Results, rows: list[dict[str, Any]], mem: dict[str, Any], n: int) -> None:
    reads = [dict(r, label=r["kind"]) for r in rows if r["section"] == "read" and r["index_nodes"] == n]
    if reads:
        res.cdf_figure(reads, "label", f"read latency (us), 4 KiB records, N={n} index nodes",
                       "Read latency by kind: cache hit, index tier via the aggregator and direct, read_record, "
                       "local index", suffix="_reads")
    tiers = [dict(r, label=f"{r['kind']}, N={r['index_nodes']}") for r in rows
             if r["section"] == "read" and r["kind"] in (TIER, NODES, TWO_ROUNDS)]
    if tiers:
        res.cdf_figure(tiers, "label", "tier lookup + read (us), 4 KiB records",
                       "Tier lookups through the aggregator and asking the nodes, 1 and 2 index nodes",
                       suffix="_nodes")
    other = [dict(r, label=r["kind"]) for r in rows if r["section"] in ("append", "read after append")]
    if other:
        res.cdf_figure(other, "label", "latency (us), 4 KiB records",
                       "Append, and read_next of the appended record right after it, same and other engine",
                       suffix="_append")
    if not mem:
        return
    s = mem["samples"]
    fig, path = res.figure("_memory")
    fig.set_size_inches(7.5, 7.0)
    ax = fig.add_subplot(2, 1, 1)
    t = [x["t_s"] for x in s]
    ax.plot(t, [x["engine_rss"] / MIB for x in s], marker=".", label="engine (bench process)")
    for name in mem["processes"]:
        ax.plot(t, [(x[f"{name} rss"] or 0) / MIB for x in s], marker=".", label=name)
    ax.set_ylabel("RSS (MiB)")
    ax.set_xlabel("time (s)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax2 = fig.add_subplot(2, 1, 2)
    for i in mem["nodes"]:
        ax2.plot([x["appends"] for x in s], [x.get(f"index node {i} size") or 0 for x in s], marker=".",
                 label=f"index node {i} size")
    ax2.plot([x["appends"] for x in s], [x["cache_size"] for x in s], marker=".", label="engine cache entries")
    ax2.set_xlabel("appends (a new tag each)")
    ax2.set_ylabel("entries held")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=8)
    res.save_figure(fig, path, "Memory while appending a new tag per record: RSS over time (top), index node "
                               "sizes and the engine's cache over appends (bottom)")
