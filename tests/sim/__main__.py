"""Run simulation seeds.

One shard (``tests/sim/shard.py``)::

    python -m tests.sim --seeds 1000 [--first 0] [--trace]

The whole system (``tests/sim/system.py``: shards, MMS, failure handler, clients,
subscribers, crashes)::

    python -m tests.sim --system --seeds 10000 [--first 0] [--jobs J]
    python -m tests.sim --system --seed S --trace      # replay one seed with its trace
    python -m tests.sim --system --seeds 2000 --digests before.txt   # one line per seed: a
        # digest of its counts and simulated time, to hold a refactoring's outcome equal

LogDB on the whole system (``tests/sim/logdb_system.py``: coordinators, KV shards and
bank clients on top, with their own kills; serializability and exactly-once checked)::

    python -m tests.sim --logdb --seeds 2000 [--jobs J]
    python -m tests.sim --logdb --seed S --trace

BokiFlow on the whole system (``tests/sim/flow_system.py``: workers running bank
transactions, trips and lock holders on LogBook sessions, with workers killed mid-workflow
and duplicate runs; exactly-once writes, one outcome per workflow and one lock holder
checked)::

    python -m tests.sim --flow --seeds 1000 [--jobs J]
    python -m tests.sim --flow --seed S --trace

The LogBook index tier (``tests/sim/logbook.py``: feeder, index nodes, aggregator on a
scripted log, with kills and a node added; every answer checked against a replay)::

    python -m tests.sim --logbook --seeds 1000 [--first 0]

Seeds that fail only because of a known protocol bug (``tests.sim.system.KNOWN_BUGS``) are
reported apart (and do not fail the run) only with ``--lenient``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import multiprocessing
import os
import sys
import time
from typing import Any


def _shard_main(args: argparse.Namespace) -> int:
    from .shard import run

    t0 = time.monotonic()
    fast = slow = 0
    first = args.seed if args.seed is not None else args.first
    count = 1 if args.seed is not None else args.seeds
    for seed in range(first, first + count):
        try:
            out = run(seed)
        except AssertionError as exc:
            print(f"seed {seed} FAILED: {exc}\nreplay: python -m tests.sim --first {seed} --seeds 1 --trace", file=sys.stderr)
            return 1
        fast += out.fast
        slow += out.slow
    dt = time.monotonic() - t0
    print(f"{count} seeds passed in {dt:.1f}s; inserts fast path {fast}, slow path {slow}")
    return 0


#: the simulation ``--system`` runs: ``system``, ``logdb_system`` with ``--logdb`` or
#: ``flow_system`` with ``--flow`` (set before the workers fork)
_SIM = "system"


def _run(seed: int, trace: bool = False) -> Any:
    return importlib.import_module(f"{__package__}.{_SIM}").run(seed, trace=trace)


def _system_one(seed: int) -> tuple[int, dict[str, int] | None, float, str | None, str | None]:
    """Worker: (seed, counts or None, simulated ms, failure message or None, known bug or None)."""
    from .system import KnownBug

    try:
        out = _run(seed)
    except KnownBug as exc:
        return seed, None, 0.0, str(exc), exc.bug
    except AssertionError as exc:
        return seed, None, 0.0, str(exc), None
    return seed, out.counts(), out.sim_ms, None, None


def _system_trace(seed: int) -> int:
    try:
        out = _run(seed, trace=True)
    except AssertionError as exc:
        sim: Any = getattr(exc, "sim", None)
        if sim is not None:
            print("\n".join(sim.outcome.trace))
        print(f"\nFAILED {exc}", file=sys.stderr)
        return 1
    print("\n".join(out.trace))
    print(f"\nseed {seed} passed: {out.counts()}; simulated {out.sim_ms:.1f} ms")
    return 0


def _system_main(args: argparse.Namespace) -> int:
    if args.seed is not None and args.trace:
        return _system_trace(args.seed)
    first = args.seed if args.seed is not None else args.first
    count = 1 if args.seed is not None else args.seeds
    seeds = range(first, first + count)
    jobs = max(1, args.jobs or os.cpu_count() or 1)
    t0 = time.monotonic()
    totals: dict[str, int] = {}
    failed: list[tuple[int, str]] = []
    known: dict[str, list[int]] = {}
    sim_ms = 0.0
    done = 0
    digests: dict[int, str] = {}
    if jobs == 1 or count == 1:
        results: Any = map(_system_one, seeds)
        pool = None
    else:
        pool = multiprocessing.get_context("fork").Pool(jobs)
        results = pool.imap_unordered(_system_one, seeds, chunksize=max(1, min(50, count // (jobs * 8) or 1)))
    try:
        for seed, counts, ms, err, bug in results:
            done += 1
            if bug is not None and args.lenient:
                known.setdefault(bug, []).append(seed)
                if args.verbose:
                    print(f"KNOWN BUG {err}", file=sys.stderr, flush=True)
                continue
            if err is not None:
                failed.append((seed, err))
                print(f"FAILED {err}", file=sys.stderr, flush=True)
                continue
            assert counts is not None
            sim_ms += ms
            digests[seed] = hashlib.sha256(json.dumps([counts, ms], sort_keys=True).encode()).hexdigest()[:16]
            for k, v in counts.items():
                totals[k] = totals.get(k, 0) + v
            if args.progress and done % args.progress == 0:
                dt = time.monotonic() - t0
                print(f"  {done}/{count} seeds, {done / dt:.1f} seeds/s, {len(failed)} failed", flush=True)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    dt = time.monotonic() - t0
    if args.digests:
        with open(args.digests, "w") as out:
            out.writelines(f"{seed} {digests.get(seed, 'failed')}\n" for seed in seeds)
    nknown = sum(len(v) for v in known.values())
    ok = count - len(failed) - nknown
    print(f"{count} seeds ({first}..{first + count - 1}), {jobs} job(s): {ok} passed, {len(failed)} failed, "
          f"{nknown} hit a known bug, in {dt:.1f}s ({count / dt:.1f} seeds/s; {sim_ms / 1000:.1f} s simulated)")
    if known:
        from .system import KNOWN_BUGS

        for bug, ss in sorted(known.items()):
            print(f"known bug {bug} ({KNOWN_BUGS.get(bug, '?')}): {len(ss)} seeds, e.g. {' '.join(map(str, sorted(ss)[:10]))}")
    if totals:
        print("totals: " + ", ".join(f"{k} {v}" for k, v in totals.items()))
    if failed:
        print("failed seeds: " + " ".join(str(s) for s, _ in sorted(failed)))
        flag = {"logdb_system": "--logdb", "flow_system": "--flow"}.get(_SIM, "--system")
        print(f"replay one: python -m tests.sim {flag} --seed {min(s for s, _ in failed)} --trace")
        return 1
    return 0


def _logbook_main(args: argparse.Namespace) -> int:
    from tests.sim import logbook

    seeds = [args.seed] if args.seed is not None else range(args.first, args.first + args.seeds)
    t0, bad = time.monotonic(), 0
    for seed in seeds:
        stats = logbook.run_seed(seed)
        if stats.failures:
            bad += 1
            print(f"seed {seed}: {stats.failures[:3]}")
    print(f"{len(seeds)} seeds, {bad} failed, {time.monotonic() - t0:.0f} s")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.sim")
    ap.add_argument("--system", action="store_true", help="simulate the whole system (default: one shard)")
    ap.add_argument("--logdb", action="store_true", help="simulate LogDB on the whole system")
    ap.add_argument("--flow", action="store_true", help="simulate BokiFlow on the whole system")
    ap.add_argument("--logbook", action="store_true", help="simulate the LogBook index tier")
    ap.add_argument("--seeds", type=int, default=100, help="how many seeds")
    ap.add_argument("--first", type=int, default=0, help="first seed")
    ap.add_argument("--seed", type=int, default=None, help="run this one seed")
    ap.add_argument("--trace", action="store_true", help="print the trace (--system: of --seed; one shard: unused)")
    ap.add_argument("--jobs", type=int, default=0, help="--system: worker processes (default: one per core)")
    ap.add_argument("--progress", type=int, default=0, help="--system: report every N seeds")
    ap.add_argument("--lenient", action="store_true",
                    help="--system: report seeds hitting a formerly known bug apart instead of failing them")
    ap.add_argument("--verbose", action="store_true", help="--system: print every known-bug seed too")
    ap.add_argument("--digests", metavar="FILE",
                    help="--system: write each seed's digest (its counts and simulated time) to FILE")
    args = ap.parse_args()
    if args.logbook:
        return _logbook_main(args)
    if args.logdb or args.flow:
        global _SIM
        _SIM = "logdb_system" if args.logdb else "flow_system"
        return _system_main(args)
    return _system_main(args) if args.system else _shard_main(args)


sys.exit(main())
