"""``python -m ziplog.tools.logdb_demo`` (``make run`` runs it after the log's demo): a bank on
LogDB under faults.

Starts a local cluster (ZooKeeper x3, the membership service, 2 shards x 2 replicas),
two coordinator replicas and three KV shards; opens 20 accounts; runs transfers from
three processes for a few seconds while it SIGKILLs the coordinator leader and a KV
shard (started again later); prints committed and aborted transactions per second and
the transfer latency, then checks that the total balance is what the accounts opened
with and that every KV shard holds what the log says. Exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import sys
import time

from ziplog.logdb.bank import run_bank


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ziplog.tools.logdb_demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--accounts", type=int, default=20)
    args = ap.parse_args(argv)

    import ziplog
    from ziplog.logdb import LogDB
    from ziplog.tools.logdb_local import local_logdb

    print("starting a local cluster and a LogDB (2 coordinators, 3 KV shards)...", flush=True)
    with ziplog.local_cluster(shards=2, replicas=2) as cluster, local_logdb(cluster, coordinators=2, kv_shards=3) as ldb:
        faults = [
            (args.seconds * 0.3, "SIGKILL the coordinator leader (started again)",
             lambda: ldb.kill_coordinator_leader()),
            (args.seconds * 0.5, "SIGKILL KV shard 1", lambda: ldb.kill_kv_shard(1)),
            (args.seconds * 0.75, "start KV shard 1 again", lambda: ldb.restart_kv_shard(1)),
        ]
        print(f"bank: {args.accounts} accounts, transfers from {args.processes} processes for {args.seconds:g} s",
              flush=True)
        report = run_bank(ldb.zk_hosts, accounts=args.accounts, processes=args.processes, seconds=args.seconds,
                          faults=faults)
        for line in report.lines():
            print(line)
        ok = report.total == report.expected_total
        # every KV shard catches up and holds the same balances as the transactions read
        with LogDB(ldb.zk_hosts) as db:
            want = {k: db.get(k) for k in (b"account-%04d" % i for i in range(args.accounts))}
            position = db.position
        deadline = time.monotonic() + 30
        for i in range(ldb.kv_shards):
            while True:
                store = ldb.kv_store(i)
                try:
                    applied, items = store.applied(), store.items()
                finally:
                    store.close()
                if applied >= position or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            mine = {k: v[0] for k, v in items.items() if k in want}
            agree = all(want[k] == v for k, v in mine.items())
            print(f"KV shard {i}: applied up to gsn {applied}, {len(mine)} accounts, "
                  f"{'agrees with' if agree and applied >= position else 'DIFFERS from'} the log")
            ok = ok and agree and applied >= position
    print("LogDB demo: all checks passed" if ok else "LogDB demo: A CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
