"""What LogDB's end-to-end tests check against: the log replayed from the genesis (the
committed transactions in gsn order) and the KV shards' stores once caught up."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ziplog import RID_GENESIS, Client
from ziplog.logdb.core.kvshard import owner
from ziplog.logdb.core.validator import Decision, Validator


@dataclass
class Replay:
    #: committed decisions (no duplicates), in gsn order
    committed: list[Decision]
    #: every decision, duplicates included
    decisions: list[Decision]
    #: key -> (value, write gsn, write shard) after every commit
    state: dict[bytes, tuple[bytes | None, int, int]]
    position: int


def replay_log(zk_hosts: str, upto: int, timeout: float = 60.0) -> Replay:
    """Replay the log from the genesis through a fresh validator up to gsn ``upto``."""
    v = Validator()
    decisions: list[Decision] = []
    with Client(zk_hosts) as c, c.subscribe(RID_GENESIS) as sub:
        deadline = time.monotonic() + timeout
        while sub.position < upto:
            assert time.monotonic() < deadline, f"the log did not reach gsn {upto}"
            rec = sub.next(timeout=0.2)
            if rec is not None:
                d = v.on_record(rec.rid.gsn, rec.rid.shard, rec.data)
                if d is not None:
                    decisions.append(d)
        position = sub.position
        while (rec := sub.next(timeout=0)) is not None:  # what the last batch brought
            d = v.on_record(rec.rid.gsn, rec.rid.shard, rec.data)
            if d is not None:
                decisions.append(d)
    committed = [d for d in decisions if d.committed and not d.duplicate]
    state: dict[bytes, tuple[bytes | None, int, int]] = {}
    for d in committed:
        for key, rid, value in d.writes:
            state[key] = (value, rid[0], rid[1])
    return Replay(committed, decisions, state, position)


def wait_applied(ldb: Any, gsn: int, timeout: float = 60.0) -> None:
    """Until every KV shard has applied every record up to ``gsn``."""
    deadline = time.monotonic() + timeout
    for i in range(ldb.kv_shards):
        while True:
            store = ldb.kv_store(i)
            try:
                applied = store.applied()
            finally:
                store.close()
            if applied >= gsn:
                break
            assert time.monotonic() < deadline, f"KV shard {i} applied only up to {applied}, not {gsn}"
            time.sleep(0.05)


def check_shards_against(ldb: Any, replay: Replay) -> None:
    """Every KV shard holds exactly the replay's values of its keys, and its journal is
    the replay's committed transactions touching its keys, in gsn order, each once."""
    n = ldb.kv_shards
    for i in range(n):
        store = ldb.kv_store(i)
        try:
            items, journal = store.items(), store.journal()
        finally:
            store.close()
        want_state = {k: v for k, v in replay.state.items() if owner(k, n) == i}
        assert items == want_state, f"KV shard {i} holds other values than the replay"
        want = [(d.gsn, d.txn, sum(1 for w in d.writes if owner(w[0], n) == i)) for d in replay.committed
                if any(owner(w[0], n) == i for w in d.writes)]
        assert journal == want, f"KV shard {i} applied another sequence than the log's committed transactions"
