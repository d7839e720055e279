"""A bank on LogDB: accounts, and transfers between them from several processes. What
the demo (``python -m ziplog.tools.logdb_demo``) and ``ziplog logdb bank`` run.

Every transfer is one transaction (read two balances, write both); a transfer that
aborts on a conflict runs again (``db.run``). At the end a read-only transaction reads
every balance at once: the total must be what the accounts opened with.
"""

from __future__ import annotations

import multiprocessing
import queue
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ziplog.logdb.client import LogDB, Txn
from ziplog.logdb.core.records import TransactionAborted

OPENING_BALANCE = 1_000


def account(i: int) -> bytes:
    return b"account-%04d" % i


def open_accounts(db: LogDB, accounts: int) -> None:
    def opening(t: Txn) -> None:
        for i in range(accounts):
            t.put(account(i), b"%d" % OPENING_BALANCE)
    db.run(opening)


def balances(db: LogDB, accounts: int) -> dict[bytes, int]:
    """Every balance, read by one (read-only, validated) transaction."""
    def read(t: Txn) -> dict[bytes, int]:
        return {account(i): int(t.get(account(i)) or b"0") for i in range(accounts)}
    return db.run(read, retries=100)


def _worker(zk_hosts: str, name: str, accounts: int, seconds: float, seed: int, out: Any) -> None:
    """One process's transfers: puts (second, committed, aborted, [latency ns]) per second."""
    rng = random.Random(seed)
    with LogDB(zk_hosts, name=name) as db:
        start = time.monotonic()
        second, committed, aborted = 0, 0, 0
        lat: list[int] = []
        while (now := time.monotonic()) - start < seconds:
            if int(now - start) != second:
                out.put((second, committed, aborted, lat))
                second, committed, aborted, lat = int(now - start), 0, 0, []
            a, b = rng.sample(range(accounts), 2)
            amount = rng.randint(1, 100)
            t0 = time.perf_counter_ns()
            while True:
                try:
                    with db.transaction() as t:
                        va, vb = int(t.get(account(a)) or b"0"), int(t.get(account(b)) or b"0")
                        t.put(account(a), b"%d" % (va - amount))
                        t.put(account(b), b"%d" % (vb + amount))
                    break
                except TransactionAborted:
                    aborted += 1
            committed += 1
            lat.append(time.perf_counter_ns() - t0)
        out.put((second, committed, aborted, lat))
    out.put(None)


@dataclass
class BankReport:
    accounts: int
    #: second -> (committed, aborted)
    per_second: dict[int, list[int]] = field(default_factory=dict)
    latencies_ns: list[int] = field(default_factory=list)
    total: int = 0
    events: list[tuple[float, str]] = field(default_factory=list)

    @property
    def expected_total(self) -> int:
        return OPENING_BALANCE * self.accounts

    def percentile_ms(self, q: float) -> float:
        lat = sorted(self.latencies_ns)
        return lat[min(len(lat) - 1, int(q * len(lat)))] / 1e6 if lat else 0.0

    def lines(self) -> list[str]:
        out = ["second  committed/s  aborted/s"]
        for s in sorted(self.per_second):
            c, a = self.per_second[s]
            out.append(f"{s:6d}  {c:11d}  {a:9d}")
        for at, what in self.events:
            out.append(f"  at {at:4.1f} s: {what}")
        n = len(self.latencies_ns)
        out.append(f"{n} transfers committed; transfer latency (with retries) p50 {self.percentile_ms(0.5):.2f} ms, "
                   f"p99 {self.percentile_ms(0.99):.2f} ms")
        ok = "OK" if self.total == self.expected_total else "WRONG"
        out.append(f"total balance {self.total} (expected {self.expected_total}): {ok}")
        return out


def run_bank(zk_hosts: str, *, name: str = "default", accounts: int = 20, processes: int = 3, seconds: float = 8.0,
             faults: list[tuple[float, str, Callable[[], Any]]] | None = None) -> BankReport:
    """Open the accounts, run ``processes`` transfer processes for ``seconds`` (calling
    each fault ``(at seconds, label, fn)`` on the way), then check the total."""
    report = BankReport(accounts)
    with LogDB(zk_hosts, name=name) as db:
        open_accounts(db, accounts)
    ctx = multiprocessing.get_context("spawn")  # no fork under kazoo's and ZeroMQ's threads
    out = ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(zk_hosts, name, accounts, seconds, seed, out), daemon=True)
               for seed in range(processes)]
    for w in workers:
        w.start()
    pending = sorted(faults or [], key=lambda x: x[0])
    start = time.monotonic()
    running = processes
    try:
        while running:
            if pending and time.monotonic() - start >= pending[0][0]:
                _, label, fn = pending.pop(0)
                fn()
                report.events.append((time.monotonic() - start, label))
            try:
                item = out.get(timeout=0.05)
            except queue.Empty:
                if not any(w.is_alive() for w in workers) and out.empty():
                    raise RuntimeError("a bank worker process died") from None
                continue
            if item is None:
                running -= 1
                continue
            second, committed, aborted, lat = item
            row = report.per_second.setdefault(second, [0, 0])
            row[0] += committed
            row[1] += aborted
            report.latencies_ns.extend(lat)
    finally:
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.kill()
    with LogDB(zk_hosts, name=name) as db:
        report.total = sum(balances(db, accounts).values())
    return report
