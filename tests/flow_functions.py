"""Functions the BokiFlow tests' worker processes run (``tests.flow_functions:functions``):
a bank whose transfers are transactions, and a counter behind a lock."""

from __future__ import annotations

from typing import Any

from ziplog.logbook.flow import Env, Functions

ACCOUNTS = [f"acct-{i}" for i in range(6)]
START = 100

functions = Functions()


@functions.register
def open_accounts(env: Env, _: Any) -> None:
    for a in ACCOUNTS:
        env.write("accounts", a, START)


@functions.register
def transfer(env: Env, req: dict[str, Any]) -> bool:
    """Move ``amount`` from one account to another, in a transaction tried again while
    another transfer holds a lock."""
    for _ in range(50):
        with env.transaction() as t:
            a, b = t.read("accounts", req["from"]), t.read("accounts", req["to"])
            if a < req["amount"]:
                return False
            t.write("accounts", req["from"], a - req["amount"])
            t.write("accounts", req["to"], b + req["amount"])
        if t.committed:
            return True
    return False


#: what ``count_under_lock`` answers when the lock stayed taken too long
BUSY = -1


@functions.register
def count_under_lock(env: Env, _: Any) -> int:
    """Add 1 to a counter read and written outside any transaction, under a lock: two
    holders at once would lose an increment. If the lock stays taken for 20 s, BUSY (no
    increment), and the caller calls again under a new workflow id: a holder killed
    mid-run keeps the lock until its run again (its give-up is remembered, so a run
    again of the same workflow gives up too)."""
    if not env.lock("counter", timeout=20):
        return BUSY
    n = env.read("counters", "c", 0) + 1
    env.write("counters", "c", n)
    env.unlock("counter")
    return n
