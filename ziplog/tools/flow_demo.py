"""BokiFlow demo: travel reservations that run exactly once while their workers are killed.

``python -m ziplog.tools.flow_demo`` starts a local cluster and three worker processes,
then clients book trips concurrently: a trip searches for a hotel and a flight, then
reserves both in one transaction, or neither. Meanwhile workers are SIGKILLed and started
again, and some trips are requested twice under the same workflow id. At the end it
checks, from the database and the log, that every trip ended, that a duplicate request
got the first one's answer, that no room or seat was sold twice or lost, and that every
booking holds a hotel and a flight; it prints each check and exits 1 if one fails.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any

from ziplog.logbook.flow.travel import FLIGHTS, HOTELS

def check(name: str, ok: bool, detail: str, failures: list[str]) -> None:
    print(f"  [{'ok' if ok else 'FAILED'}] {name}: {detail}")
    if not ok:
        failures.append(name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ziplog.tools.flow_demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trips", type=int, default=32, help="trips to book (more than there are rooms: some fail)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--kills", type=int, default=4, help="workers SIGKILLed during the run")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    import ziplog
    from ziplog.logbook import LogBook
    from ziplog.logbook.flow import FlowClient, SqliteDatabase, WorkerPool

    rng = random.Random(args.seed)
    t0 = time.monotonic()
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ziplog-flow-") as tmp, ziplog.local_cluster(shards=2, replicas=2) as cluster:
        db_path = os.path.join(tmp, "travel.sqlite")
        SqliteDatabase(db_path, audit=True).close()
        book = 7
        pool = WorkerPool(cluster.zk_hosts, book, "ziplog.logbook.flow.travel:functions", db_path, args.workers,
                          retry_after=1.0, audit=True)
        pool.start()
        lb = LogBook(cluster.zk_hosts, book)
        try:
            print(f"flow demo: {args.workers} workers, {args.clients} clients, {args.trips} trips, "
                  f"{args.kills} worker kills")
            FlowClient(lb).call("setup", None, "setup")
            requests = [(f"trip-{i}", {"prefer": rng.randrange(len(HOTELS))}) for i in range(args.trips)]
            duplicates = {wf for wf, _ in rng.sample(requests, max(1, args.trips // 5))}
            calls = requests + [r for r in requests if r[0] in duplicates]
            rng.shuffle(calls)
            answers: dict[str, list[Any]] = {}
            lock = threading.Lock()

            def client(mine: list[tuple[str, dict[str, Any]]]) -> None:
                with LogBook(cluster.zk_hosts, book) as session:  # an engine per thread
                    fc_ = FlowClient(session, retry_after=1.0)
                    for wf, req in mine:
                        got = fc_.call("book_trip", req, wf, timeout=60)
                        with lock:
                            answers.setdefault(wf, []).append(got)

            threads = [threading.Thread(target=client, args=(calls[i::args.clients],)) for i in range(args.clients)]
            for t in threads:
                t.start()
            killed = []
            for _ in range(args.kills):
                time.sleep(rng.uniform(0.3, 0.8))
                pid = pool.kill(rng.randrange(args.workers))
                if pid is not None:
                    killed.append(pid)
            for t in threads:
                t.join()
            pool.wait_restarts(len(killed), 30)  # the last one killed may have ended the run unreplaced
            elapsed = time.monotonic() - t0
            db = SqliteDatabase(db_path, audit=True)
            try:
                _report(db, requests, duplicates, answers, killed, pool.restarts, failures)
            finally:
                db.close()
            print(f"flow demo: {len(requests)} trips in {elapsed:.1f} s; "
                  f"{'all checks hold' if not failures else 'FAILED: ' + ', '.join(failures)}")
        finally:
            lb.close()
            pool.close()
    return 1 if failures else 0


def _report(db: Any, requests: list[tuple[str, dict[str, Any]]], duplicates: set[str],
            answers: dict[str, list[Any]], killed: list[int], restarts: int, failures: list[str]) -> None:
    from ziplog.logbook.core import flow as fc

    hotels = {k: fc.unpack(v) for k, v in db.rows("hotels").items()}
    flights = {k: fc.unpack(v) for k, v in db.rows("flights").items()}
    bookings = {k: fc.unpack(v) for k, v in db.rows("bookings").items()}
    booked = {wf: a[0] for wf, a in answers.items() if a[0]["booked"]}
    check("every trip ended", len(answers) == len(requests), f"{len(answers)} of {len(requests)} answered", failures)
    same = all(len(a) == 2 and a[0] == a[1] for wf, a in answers.items() if wf in duplicates)
    check("a duplicate request got the first one's answer", same,
          f"{len(duplicates)} trips requested twice", failures)
    check("workers were killed and started again", len(killed) > 0 and restarts >= len(killed),
          f"{len(killed)} SIGKILLs, {restarts} restarts", failures)
    check("every booking is one the caller was told of, and the other way round",
          set(bookings) == set(booked) and all(bookings[wf] == [b["hotel"], b["flight"]] for wf, b in booked.items()),
          f"{len(bookings)} bookings, {len(booked)} trips told booked", failures)
    sold_h = Counter(b[0] for b in bookings.values())
    sold_f = Counter(b[1] for b in bookings.values())
    check("no room sold twice or lost", all(hotels[h] + sold_h[h] == n for h, n in HOTELS.items()),
          ", ".join(f"{h}: {hotels[h]} left + {sold_h[h]} sold" for h in sorted(HOTELS)), failures)
    check("no seat sold twice or lost", all(flights[f] + sold_f[f] == n for f, n in FLIGHTS.items()),
          ", ".join(f"{f}: {flights[f]} left + {sold_f[f]} sold" for f in sorted(FLIGHTS)), failures)
    applied = Counter((t, k) for t, k, _ in db.applied() if t == "bookings")
    check("each booking written once", all(n == 1 for n in applied.values()) and len(applied) == len(bookings),
          f"{sum(applied.values())} booking writes applied for {len(bookings)} bookings", failures)


if __name__ == "__main__":
    sys.exit(main())
