"""A KV shard's store on SQLite (the standard library's ``sqlite3``): the data, the
applied position, the validator snapshot and a journal of applied transactions, all
written by one SQLite transaction per :class:`ApplyBatch`, so a crash at any point
leaves either all of a batch or none of it.

Tables:

* ``kv(key, value, gsn, shard)``: each owned key's latest committed value (NULL: deleted)
  and the rid of the write that put it there;
* ``meta``: one row: the shard's index and the shard count it was created with, and
  ``applied``: every committed write up to this gsn is in ``kv``;
* ``snapshot``: one row: the validator snapshot and its position (at or below applied);
* ``journal(gsn, txn, keys, applied_at)``: one row per applied transaction, with the
  wall-clock time (ns) it was stored (``txn`` is UNIQUE: a transaction applied twice is
  an error SQLite refuses, not a silent double write);
  rows older than the snapshot beyond ``JOURNAL_KEEP`` are dropped.

WAL mode with ``synchronous=NORMAL``: each batch is atomic, and a power loss can lose the
last batches *with* their position (the shard replays them from the log). A batch that
carries a snapshot is written with ``synchronous=FULL``: its position is published as
the point the log may be trimmed to, so it must survive a power loss.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any, Callable

from ziplog.logdb.core.kvshard import ApplyBatch, Stored

#: journal rows kept below the snapshot (the audit trail of what was applied)
JOURNAL_KEEP = 100_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (key BLOB PRIMARY KEY, value BLOB, gsn INTEGER NOT NULL, shard INTEGER NOT NULL)
    WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (id INTEGER PRIMARY KEY CHECK (id = 0), shard_index INTEGER NOT NULL,
    shards INTEGER NOT NULL, applied INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS snapshot (id INTEGER PRIMARY KEY CHECK (id = 0), position INTEGER NOT NULL,
    data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS journal (gsn INTEGER PRIMARY KEY, txn BLOB NOT NULL UNIQUE, keys INTEGER NOT NULL,
    applied_at INTEGER NOT NULL);
"""


class StoreMismatch(RuntimeError):
    """The store was created for another shard index or shard count."""


class SqliteStore:
    def __init__(self, path: Path | str, index: int, shards: int,
                 connect: Callable[[str], Any] | None = None) -> None:
        self.path = str(path)
        # ``connect`` lets a test put a crashing connection under the same code
        self.db = (connect or _connect)(self.path)
        self.db.executescript(_SCHEMA)
        row = self.db.execute("SELECT shard_index, shards FROM meta WHERE id = 0").fetchone()
        if row is None:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute("INSERT INTO meta (id, shard_index, shards, applied) VALUES (0, ?, ?, 0)", (index, shards))
            self.db.execute("COMMIT")
        elif tuple(row) != (index, shards):
            raise StoreMismatch(f"{self.path} holds KV shard {row[0]} of {row[1]}, not {index} of {shards}")

    def load(self) -> Stored:
        (applied,) = self.db.execute("SELECT applied FROM meta WHERE id = 0").fetchone()
        row = self.db.execute("SELECT position, data FROM snapshot WHERE id = 0").fetchone()
        return Stored(int(applied), None if row is None else bytes(row[1]))

    def apply(self, batch: ApplyBatch) -> None:
        """Store ``batch`` in one SQLite transaction (all or nothing)."""
        db = self.db
        if batch.snapshot is not None:
            db.execute("PRAGMA synchronous = FULL")
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                at = time.time_ns()
                for a in batch.applied:
                    db.execute("INSERT INTO journal (gsn, txn, keys, applied_at) VALUES (?, ?, ?, ?)",
                               (a.gsn, a.txn.to_bytes(8, "big"), len(a.writes), at))
                    db.executemany(
                        "INSERT INTO kv (key, value, gsn, shard) VALUES (?, ?, ?, ?) ON CONFLICT (key) DO UPDATE"
                        " SET value = excluded.value, gsn = excluded.gsn, shard = excluded.shard",
                        [(key, value, rid[0], rid[1]) for key, rid, value in a.writes])
                cur = db.execute("UPDATE meta SET applied = ? WHERE id = 0 AND applied <= ?", (batch.position, batch.position))
                assert cur.rowcount == 1, "the applied position would go back"
                if batch.snapshot is not None:
                    db.execute("INSERT INTO snapshot (id, position, data) VALUES (0, ?, ?) ON CONFLICT (id) DO UPDATE"
                               " SET position = excluded.position, data = excluded.data",
                               (batch.position, batch.snapshot))
                    db.execute("DELETE FROM journal WHERE gsn IN (SELECT gsn FROM journal WHERE gsn <= ?"
                               " ORDER BY gsn DESC LIMIT -1 OFFSET ?)", (batch.position, JOURNAL_KEEP))
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
        finally:
            if batch.snapshot is not None:
                db.execute("PRAGMA synchronous = NORMAL")

    def get(self, key: bytes) -> tuple[bytes | None, int, int] | None:
        """(value, gsn, shard) of ``key``'s applied write, or None."""
        row = self.db.execute("SELECT value, gsn, shard FROM kv WHERE key = ?", (key,)).fetchone()
        return None if row is None else (None if row[0] is None else bytes(row[0]), int(row[1]), int(row[2]))

    def applied(self) -> int:
        return int(self.db.execute("SELECT applied FROM meta WHERE id = 0").fetchone()[0])

    def items(self) -> dict[bytes, tuple[bytes | None, int, int]]:
        """Every key's (value, gsn, shard): for checks and tools."""
        return {bytes(k): (None if v is None else bytes(v), int(g), int(s))
                for k, v, g, s in self.db.execute("SELECT key, value, gsn, shard FROM kv")}

    def journal(self) -> list[tuple[int, int, int]]:
        """(gsn, txn, keys) of every transaction still in the journal, in gsn order."""
        return [(int(g), int.from_bytes(t, "big"), int(n))
                for g, t, n in self.db.execute("SELECT gsn, txn, keys FROM journal ORDER BY gsn")]

    def applied_times(self) -> dict[int, int]:
        """gsn -> when (wall clock, ns) each journaled transaction was stored."""
        return {int(g): int(t) for g, t in self.db.execute("SELECT gsn, applied_at FROM journal")}

    def close(self) -> None:
        self.db.close()


def _connect(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("PRAGMA synchronous = NORMAL")
    return db
