"""A seeded simulation of LogDB's apply path: a scripted log (transactions of several
clients on hot keys, with conflicts, resent commits, dangling writes, hostile commits,
other applications' records and garbage), the production :class:`KvShardDriver` over the
production :class:`SqliteStore`, and a process crash (``os._exit`` in a forked child) at
any chosen SQLite statement. The reference is a plain replay of the same log through a
:class:`CoordinatorCore`: what a KV shard should hold after applying up to any gsn."""

from __future__ import annotations

import os
import random
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ziplog.logdb.core.kvshard import KvShardCore, owner
from ziplog.logdb.core.records import HEADER, NO_RID, Commit, Write, encode
from ziplog.logdb.core.validator import Validator
from ziplog.logdb.kvshard import KvShardDriver
from ziplog.logdb.store import SqliteStore

#: one simulated turn of the clock (a subscription batch)
TURN_NS = 100_000_000
CRASH_EXIT = 77


@dataclass
class SimLog:
    """Turns of the log: each a list of (gsn, shard, data) and the position after it."""
    turns: list[tuple[list[tuple[int, int, bytes]], int]] = field(default_factory=list)

    def records(self) -> list[tuple[int, int, bytes]]:
        return [r for recs, _ in self.turns for r in recs]


def make_log(seed: int, turns: int = 40, keys: int = 6) -> SimLog:
    rng = random.Random(seed)
    ref = Validator()  # to know each key's latest rid while scripting clients
    log = SimLog()
    gsn = 0
    pending: list[tuple[int, dict[bytes, tuple[int, int]], dict[bytes, tuple[int, int]]]] = []
    txn = 0
    for _ in range(turns):
        recs: list[tuple[int, int, bytes]] = []

        def put(data: bytes) -> tuple[int, int]:
            nonlocal gsn
            gsn += rng.randint(1, 20)
            rid = (gsn, rng.randrange(3))
            recs.append((rid[0], rid[1], data))
            ref.on_record(rid[0], rid[1], data)
            return rid

        for _ in range(rng.randint(0, 5)):
            kind = rng.random()
            if kind < 0.55:  # a transaction: reads (some stale), writes, maybe a later commit
                txn += 1
                ks = rng.sample([b"k%d" % i for i in range(keys)], rng.randint(1, 3))
                reads = {k: ref.latest.get(k, NO_RID) for k in ks if rng.random() < 0.7}
                if reads and rng.random() < 0.15:
                    reads[next(iter(reads))] = (max(1, gsn - 5), 0)  # a stale read
                writes = {}
                for k in ks:
                    if rng.random() < 0.8:
                        value = None if rng.random() < 0.1 else b"%d:%s" % (txn, k)
                        writes[k] = put(encode(Write(txn=txn, key=k, value=value)))
                if not writes:
                    continue
                if rng.random() < 0.1:
                    continue  # the client died before its commit: the writes stay invisible
                pending.append((txn, reads, writes))
            elif kind < 0.65:
                put(b"another application's record %d" % rng.randrange(1000))
            elif kind < 0.72:
                put(HEADER + bytes(rng.randrange(256) for _ in range(rng.randint(0, 12))))  # garbage under our header
            elif kind < 0.78:  # hostile: a commit naming rids nobody wrote for it
                txn += 1
                put(encode(Commit(txn=txn, reads={}, writes={b"k0": (rng.randint(1, gsn + 50), 0)})))
            if pending and rng.random() < 0.7:
                t, reads, writes = pending.pop(rng.randrange(len(pending)))
                commit = encode(Commit(txn=t, reads=reads, writes=writes))
                put(commit)
                if rng.random() < 0.15:
                    put(commit)  # resent
        position = gsn + rng.randint(0, 30)
        gsn = position
        ref.advance(position)
        log.turns.append((recs, position))
    return log


def reference(log: SimLog, index: int, shards: int, upto: int) -> tuple[dict[bytes, Any], list[tuple[int, int, int]]]:
    """What KV shard ``index`` must hold once it applied every record up to ``upto``:
    its keys' (value, gsn, shard) and its journal (gsn, txn, keys)."""
    v = Validator()
    kv: dict[bytes, Any] = {}
    journal: list[tuple[int, int, int]] = []
    for gsn, shard, data in log.records():
        if gsn > upto:
            break
        d = v.on_record(gsn, shard, data)
        if d is None or d.duplicate or not d.committed:
            continue
        mine = [w for w in d.writes if owner(w[0], shards) == index]
        if mine:
            journal.append((gsn, d.txn, len(mine)))
            for key, rid, value in mine:
                kv[key] = (value, rid[0], rid[1])
    return kv, journal


class CrashingConnection:
    """A sqlite3 connection whose process dies before its ``crash_at``-th statement."""

    def __init__(self, db: sqlite3.Connection, counter: list[int], crash_at: int | None) -> None:
        self._db = db
        self._counter = counter
        self._crash_at = crash_at

    def _step(self) -> None:
        self._counter[0] += 1
        if self._crash_at is not None and self._counter[0] == self._crash_at:
            os._exit(CRASH_EXIT)

    def execute(self, *a: Any) -> Any:
        self._step()
        return self._db.execute(*a)

    def executemany(self, *a: Any) -> Any:
        self._step()
        return self._db.executemany(*a)

    def executescript(self, *a: Any) -> Any:
        return self._db.executescript(*a)

    @property
    def in_transaction(self) -> bool:
        return self._db.in_transaction

    def close(self) -> None:
        self._db.close()


def run_shard(path: Path, log: SimLog, index: int, shards: int, crash_at: int | None = None) -> int:
    """Run KV shard ``index`` from its store to the end of ``log``; returns the number of
    statements it ran (it dies before statement ``crash_at``, if given)."""
    counter = [0]

    def connect(p: str) -> Any:
        db = sqlite3.connect(p, isolation_level=None)
        db.execute("PRAGMA journal_mode = WAL")
        return CrashingConnection(db, counter, crash_at)

    store = SqliteStore(path, index, shards, connect=connect)
    clock = [0]
    try:
        core = KvShardCore(index, shards, store.load(), 0, snapshot_ns=3 * TURN_NS, idle_store_ns=2 * TURN_NS)
        driver = KvShardDriver(core, store, lambda: clock[0])
        start = core.replay_from
        for recs, position in log.turns:
            clock[0] += TURN_NS
            if position < start:
                continue
            for gsn, shard, data in recs:
                if gsn >= start:
                    driver.on_record(gsn, shard, data)
            driver.on_position(position)
            assert driver.flush()
        clock[0] += 10 * TURN_NS
        driver.flush()
    finally:
        store.close()
    return counter[0]


def crash_child(path: Path, log: SimLog, index: int, shards: int, crash_at: int) -> int:
    """Run the shard in a forked child that dies before statement ``crash_at``; its exit code."""
    pid = os.fork()
    if pid == 0:  # the child: run, and die at the crash point (or finish)
        code = 0
        try:
            run_shard(path, log, index, shards, crash_at)
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)
