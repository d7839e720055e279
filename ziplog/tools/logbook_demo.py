"""``python -m ziplog.tools.logbook_demo`` (``make run`` runs it after LogDB's demo): BokiStore
counters on LogBook with the index tier, under faults.

Starts a local cluster (ZooKeeper x3, the membership service, 2 shards x 2 replicas)
and the LogBook index tier (a feeder, 2 index nodes, an aggregator); runs transactions
that add 1 to 2, 3 or 5 of 16 counters from several processes for a few seconds while
it SIGKILLs index node 1 (started again later: it is fed the log again from the start)
and the feeder; then checks that every counter equals the number of committed
increments the processes report, and that the index nodes hold what a fresh engine with
a complete local index answers. Exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import sys
import time
from typing import Any

COUNTERS = 16
BOOK = 1


def _worker(zk_hosts: str, seconds: float, seed: int, out: Any) -> None:
    from ziplog.logbook import LogBook
    from ziplog.logbook.store import BokiStore

    rng = random.Random(seed)
    committed = [0] * COUNTERS
    attempts = 0
    try:
        with LogBook(zk_hosts, BOOK) as lb:
            store = BokiStore(lb, rng)
            stop_at = time.monotonic() + seconds
            while time.monotonic() < stop_at:
                picked = rng.sample(range(COUNTERS), rng.choice([2, 3, 5]))
                t = store.begin()
                for c in picked:
                    t.set(f"counter-{c}", "n", t.get(f"counter-{c}").get("n", 0) + 1)
                attempts += 1
                if t.commit():
                    for c in picked:
                        committed[c] += 1
        out.put(("ok", committed, attempts))
    except BaseException as exc:  # the parent reports it and fails the demo
        out.put(("error", repr(exc), attempts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ziplog.tools.logbook_demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--processes", type=int, default=4)
    args = ap.parse_args(argv)

    import ziplog
    from ziplog.logbook import LogBook
    from ziplog.logbook.store import BokiStore
    from ziplog.tools.logbook_local import local_logbook

    print("starting a local cluster and the LogBook index tier (feeder, 2 index nodes, aggregator)...", flush=True)
    with ziplog.local_cluster(shards=2, replicas=2) as cluster, local_logbook(cluster, index_nodes=2) as tier:
        faults = [
            (args.seconds * 0.25, "SIGKILL index node 1", lambda: tier.kill_index_node(1)),
            (args.seconds * 0.4, "start index node 1 again (fed from the start)", lambda: tier.restart_index_node(1)),
            (args.seconds * 0.6, "SIGKILL the feeder and start it again", lambda: tier.restart_feeder()),
        ]
        print(f"BokiStore: {COUNTERS} counters, transactions from {args.processes} processes for {args.seconds:g} s",
              flush=True)
        ctx = multiprocessing.get_context("spawn")  # no fork under kazoo's and ZeroMQ's threads
        out = ctx.Queue()
        workers = [ctx.Process(target=_worker, args=(tier.zk_hosts, args.seconds, seed, out), daemon=True)
                   for seed in range(args.processes)]
        for w in workers:
            w.start()
        started = time.monotonic()
        # faults from this thread: a process it starts dies with the thread that started it
        for at, what, act in faults:
            time.sleep(max(0.0, started + at - time.monotonic()))
            print(f"  t={at:4.1f}s  {what}", flush=True)
            act()
        reports = [out.get(timeout=args.seconds + 120) for _ in workers]
        for w in workers:
            w.join(timeout=30)
        ok = all(r[0] == "ok" for r in reports)
        for r in reports:
            if r[0] != "ok":
                print(f"  a process failed: {r[1]}")
        want = [sum(r[1][c] for r in reports if r[0] == "ok") for c in range(COUNTERS)]
        attempts = sum(r[2] for r in reports)
        print(f"  {attempts} transactions, {sum(want)} committed increments")
        with LogBook(tier.zk_hosts, BOOK) as lb:
            store = BokiStore(lb)
            got = [store.get(f"counter-{c}").get("n", 0) for c in range(COUNTERS)]
            tail = lb.check_tail()
            position = lb.position
        good = got == want
        print(f"  counters {'equal' if good else 'DIFFER from'} the committed increments: {got}")
        ok = ok and good
        # the tier (restarted node, restarted feeder) answers as a complete local index does
        with LogBook(tier.zk_hosts, BOOK, index="local") as local:
            local_tail = local.check_tail()
            same = (local_tail is not None and tail is not None and local_tail.seqnum == tail.seqnum
                    and local.position >= position)
        print(f"  the tier's tail of the book {'matches' if same else 'DIFFERS from'} a complete local index")
        ok = ok and same
    print("LogBook demo: all checks passed" if ok else "LogBook demo: A CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
