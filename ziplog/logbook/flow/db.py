"""The database a workflow writes to, with the one property BokiFlow needs: a write
conditioned on the row's version (applied iff the row's version is below the write's,
which is the seqnum of the write's step record), so a repeated write applies nothing.

Any database with a conditional write plugs in as a :class:`Database`: PostgreSQL's
``INSERT ... ON CONFLICT DO UPDATE ... WHERE t.version < excluded.version``, DynamoDB's
``ConditionExpression="attribute_not_exists(v) OR v < :v"``, Redis' ``WATCH``/``MULTI``
or a Lua script. :class:`SqliteDatabase` is the embedded default: one file that the
worker processes of a host share (WAL journal; each write is one transaction).

Versions are seqnums, up to 2**64 - 1: SQLite's INTEGER stops at 2**63 - 1, so a
version is kept as 8 big-endian bytes, whose byte order (SQLite compares BLOBs with
``memcmp``) is their numeric order.
"""

from __future__ import annotations

import sqlite3
import threading
from typing import Protocol

__all__ = ["Database", "SqliteDatabase"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS flow_rows (
    tbl TEXT NOT NULL, key TEXT NOT NULL, value BLOB, version BLOB NOT NULL, PRIMARY KEY (tbl, key)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS flow_applied (tbl TEXT NOT NULL, key TEXT NOT NULL, version BLOB NOT NULL);
"""

_WRITE = """
INSERT INTO flow_rows (tbl, key, value, version) VALUES (?, ?, ?, ?)
ON CONFLICT (tbl, key) DO UPDATE SET value = excluded.value, version = excluded.version
WHERE flow_rows.version < excluded.version
"""


class Database(Protocol):
    def write(self, table: str, key: str, value: bytes, version: int) -> bool:
        """Write iff the row's version is below ``version`` (or there is no row); True
        if written."""
        ...

    def read(self, table: str, key: str) -> bytes | None:
        """The row's value, or None."""
        ...

    def close(self) -> None:
        ...


def version_bytes(version: int) -> bytes:
    return version.to_bytes(8, "big")


class SqliteDatabase:
    """A :class:`Database` in the SQLite file at ``path``. ``audit``: every applied write
    is also appended to ``flow_applied`` (table, key, version), so a test or an operator
    can count what was applied (it grows with the writes: off by default)."""

    def __init__(self, path: str, *, audit: bool = False, timeout: float = 30.0) -> None:
        self.path = path
        self.audit = audit
        self._lock = threading.Lock()  # one connection, used from one thread at a time
        self._db = sqlite3.connect(path, timeout=timeout, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a write the workflow went past is on disk
        self._db.executescript(_SCHEMA)

    def write(self, table: str, key: str, value: bytes, version: int) -> bool:
        v = version_bytes(version)
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                applied = db.execute(_WRITE, (table, key, value, v)).rowcount == 1
                if applied and self.audit:
                    db.execute("INSERT INTO flow_applied (tbl, key, version) VALUES (?, ?, ?)", (table, key, v))
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        return applied

    def read(self, table: str, key: str) -> bytes | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM flow_rows WHERE tbl = ? AND key = ?", (table, key)).fetchone()
        return None if row is None else bytes(row[0])

    def applied(self) -> list[tuple[str, str, int]]:
        """Every applied write the audit kept: (table, key, version)."""
        with self._lock:
            rows = self._db.execute("SELECT tbl, key, version FROM flow_applied").fetchall()
        return [(t, k, int.from_bytes(v, "big")) for t, k, v in rows]

    def rows(self, table: str) -> dict[str, bytes]:
        with self._lock:
            got = self._db.execute("SELECT key, value FROM flow_rows WHERE tbl = ?", (table,)).fetchall()
        return {k: bytes(v) for k, v in got}

    def close(self) -> None:
        with self._lock:
            self._db.close()
