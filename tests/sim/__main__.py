"""Run simulation seeds: ``python -m tests.sim --seeds 1000 [--first 0]``."""

from __future__ import annotations

import argparse
import sys
import time

from .shard import run


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.sim")
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--trace", action="store_true", help="print the trace of a failing seed")
    args = ap.parse_args()
    t0 = time.monotonic()
    fast = slow = 0
    for seed in range(args.first, args.first + args.seeds):
        try:
            out = run(seed)
        except AssertionError as exc:
            print(f"seed {seed} FAILED: {exc}\nreplay: python -m tests.sim --first {seed} --seeds 1 --trace", file=sys.stderr)
            return 1
        fast += out.fast
        slow += out.slow
    dt = time.monotonic() - t0
    print(f"{args.seeds} seeds passed in {dt:.1f}s; inserts fast path {fast}, slow path {slow}")
    return 0


sys.exit(main())
