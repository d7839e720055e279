"""``python -m bench <experiment> [--quick] [--out DIR]``; ``python -m bench all`` runs
every experiment, each into its own folder under ``--out``.

Each experiment is a module of :mod:`bench.experiments` with
``run(quick: bool, out: Path | None) -> list[dict]``; add new ones to :data:`EXPERIMENTS`."""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import sys
import time
from pathlib import Path

#: subcommand -> (module, what it measures)
EXPERIMENTS: dict[str, tuple[str, str]] = {
    "latency": ("bench.experiments.latency", "append latency: ziplog, floor and rivals; open-loop sweep (Fig. 4.4, 4.5)"),
    "throughput": ("bench.experiments.throughput", "pipelined throughput per shard, as shards are added; rivals"),
    "mms": ("bench.experiments.mms", "shards the membership service sustains at 10 ms epochs"),
    "sequential": ("bench.experiments.sequential", "insert-to-delivery latency at a subscriber (Fig. 4.6), rate step"),
    "read": ("bench.experiments.read", "ReadRecord latency, stable and recent records"),
    "failure": ("bench.experiments.failure", "throughput across a replica failure (Fig. 4.7)"),
    "rolling": ("bench.experiments.rolling", "a rolling restart of every process under load: stall per process kind"),
    "spark": ("bench.experiments.spark", "Spark replay: batch records/s vs subscribe, streaming insert-to-sink latency"),
    "logdb": ("bench.experiments.logdb", "LogDB transactions and aborts, ziplog vs Scalog-style (Fig. 4.8, 4.9)"),
    "logbook": ("bench.experiments.logbook", "LogBook: appends, reads via the index tier vs read_record, "
                                              "read-after-append, 1 vs 2 index nodes, memory"),
    "flow": ("bench.experiments.flow", "BokiFlow: write, read, invoke, lock and a workflow vs an unsafe baseline "
                                        "that logs nothing; time waiting for the log"),
    "curve": ("bench.experiments.curve", "what CURVE costs: one-client latency and one-shard throughput, "
                                          "CURVE vs NULL, paired rounds"),
    "idle": ("bench.experiments.idle", "CPU an idle cluster uses, shipped settings vs the clock-driven ones of before"),
    "shardcost": ("bench.experiments.shardcost", "what shards add to one another: an N-shard cluster vs N one-shard "
                                                  "clusters (the control) vs one shard, same load per shard; rounds"),
    "reference": ("bench.experiments.reference", "forward by reference on vs off: servers' CPU per 4 KiB append, "
                                                  "FORWARD bytes, catch-ups; paired rounds"),
    "epochstamp": ("bench.experiments.epochstamp", "where a turn takes an epoch: the leader's stamp vs each "
                                                    "replica's arrival; fast path, wrong guesses, CPU; rounds"),
    "noticefanout": ("bench.experiments.noticefanout", "a process per CPU: a NOTICE once per process vs once per "
                                                        "replica; NOTICE frames, messages, CPU per append; rounds"),
    "clockpass": ("bench.experiments.clockpass", "slots passed by the clock vs on NOTICEs alone; fast path, NOTICE "
                                                  "frames, messages, CPU per append; rounds"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description="ziplog benchmarks")
    sub = ap.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    for name, (_, what) in [*EXPERIMENTS.items(), ("all", (None, "every experiment above, one folder each"))]:
        p = sub.add_parser(name, help=what, description=what)
        p.add_argument("--quick", action="store_true", help="a short run (about two minutes for latency)")
        p.add_argument("--out", type=Path, default=None,
                       help=f"output directory (default results/{name}-<timestamp>/)")
        if name == "mms":
            p.add_argument("--shards", default=None,
                           help="comma-separated N to measure alone instead of the sweep (e.g. 16000)")
        if name == "latency":
            p.add_argument("--systems", default=None,
                           help="comma-separated subset of ziplog,floor,floor-zmtp,floor-tcp,nopaxos,scalog,zookeeper,nats,nats-r3,redis,redis-replica")
    args = ap.parse_args(argv)
    names = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    base = args.out
    if args.experiment == "all" and base is None:
        base = Path("results") / f"all-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    failed = []
    for name in names:
        mod = importlib.import_module(EXPERIMENTS[name][0])
        out = base / name if args.experiment == "all" else args.out
        kw = {}
        if getattr(args, "systems", None) and "systems" in inspect.signature(mod.run).parameters:
            kw["systems"] = args.systems.split(",")
        if getattr(args, "shards", None) and "shards" in inspect.signature(mod.run).parameters:
            kw["shards"] = [int(n) for n in args.shards.split(",")]
        t0 = time.monotonic()
        try:
            mod.run(quick=args.quick, out=out, **kw)
        except RuntimeError as e:
            print(f"bench {name}: {e}", file=sys.stderr)
            failed.append(name)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        print(f"bench {name}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    if failed:
        print(f"bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
