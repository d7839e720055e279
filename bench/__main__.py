"""``python -m bench <experiment> [--quick] [--out DIR]``.

Each experiment is a module with ``run(quick: bool, out: Path | None) -> list[dict]``;
add new ones to :data:`EXPERIMENTS`."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

#: subcommand -> module exposing ``run(quick, out)``
EXPERIMENTS: dict[str, str] = {
    "latency": "bench.latency",
    "failure": "bench.failure",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description="ziplog benchmarks")
    sub = ap.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    for name, modname in EXPERIMENTS.items():
        p = sub.add_parser(name, help=f"run {modname}")
        p.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
        p.add_argument("--out", type=Path, default=None,
                       help=f"output directory (default results/{name}-<timestamp>/)")
    args = ap.parse_args(argv)
    mod = importlib.import_module(EXPERIMENTS[args.experiment])
    try:
        mod.run(quick=args.quick, out=args.out)
    except RuntimeError as e:
        print(f"bench {args.experiment}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
