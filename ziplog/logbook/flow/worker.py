"""A BokiFlow worker process: ``python -m ziplog.logbook.flow.worker --zk HOSTS --book N
--functions MODULE:ATTR --db FILE``. It pops workflow ids from the queue and runs each to
its end; SIGTERM or SIGINT ends it after the workflow it runs (SIGKILL at any point loses
nothing: the workflow is run again by another worker, and takes what this one recorded).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from ziplog.logbook.client import LogBook
from ziplog.logbook.flow.db import SqliteDatabase
from ziplog.logbook.flow.env import FlowBook
from ziplog.logbook.flow.runtime import QUEUE, Worker, load_functions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ziplog.logbook.flow.worker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--zk", required=True, help="ZooKeeper hosts of the cluster")
    ap.add_argument("--book", type=int, required=True, help="the workflows' book (its locks: the next one)")
    ap.add_argument("--functions", required=True, help="MODULE:ATTR of a Functions registry")
    ap.add_argument("--db", required=True, help="the SQLite file the functions write to")
    ap.add_argument("--queue", default=QUEUE, help="the queue to take workflow ids from")
    ap.add_argument("--audit", action="store_true", help="keep the database's audit of applied writes")
    ap.add_argument("--key-file", default=None, help="a client key file (a cluster that speaks CURVE)")
    args = ap.parse_args(argv)
    functions = load_functions(args.functions)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    db = SqliteDatabase(args.db, audit=args.audit)
    lb = LogBook(args.zk, args.book, key_file=args.key_file)
    try:
        Worker(FlowBook(lb, db), functions, args.queue).serve(stop)
    finally:
        lb.close()
        db.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
