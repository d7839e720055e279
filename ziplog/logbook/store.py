"""BokiStore (Boki journal 5.2) on a LogBook: durable JSON objects named by strings,
with snapshot-isolated transactions whose commits are speculative records in the book
(the protocol: :mod:`ziplog.logbook.core.objects`).

    store = BokiStore(LogBook(zk_hosts, book_id=1))
    store.set("alice", "balance", 100)
    t = store.begin()
    t.set("alice", "balance", t.get("alice")["balance"] - 10)
    t.set("bob", "balance", t.get("bob").get("balance", 0) + 10)
    ok = t.commit()              # False: a write to alice or bob took effect in between

A store remembers commit outcomes and object views (Boki keeps views in aux data): a
read replays only the updates since the view it last built. Its reads are gapless: if a
trim of the book took an update a view needs, the read raises ``TrimmedError`` rather
than build the object without it; a view the trim took nothing from goes on.
"""

from __future__ import annotations

import random
from typing import Any

from ziplog.logbook.client import LogBook
from ziplog.logbook.core import objects as o
from ziplog.logbook.core.session import drive
from ziplog.protocol.errors import ZiplogError


class BokiStore:
    """Objects in ``lb``'s book. Not thread-safe (nor is the LogBook)."""

    def __init__(self, lb: LogBook, rng: random.Random | None = None) -> None:
        self.lb = lb
        self.replay = o.Replay()
        self.rng = rng if rng is not None else random.Random()

    def _run(self, steps: o.Steps) -> Any:
        return drive(steps, self._scan)

    def _scan(self, op: o.Scan) -> list[tuple[int, o.Update]]:
        """The store's updates tagged ``op.tag`` in ``[op.lo, op.hi]``, read through the
        LogBook (every one at a cut at or above ``op.hi``: none can appear later)."""
        out: list[tuple[int, o.Update]] = []
        s = op.lo
        while s <= op.hi:
            # gapless: an update a trim took would otherwise be skipped without a word
            rec = self.lb.read_next(s, tag=op.tag, gapless=True)
            if rec is None or rec.seqnum > op.hi:
                break
            update = o.decode(rec.data)
            if update is not None:
                out.append((rec.seqnum, update))
            s = rec.seqnum + 1
        return out

    def _now(self) -> int:
        """A position at or above every update taken effect so far: the book's tail as
        this session sees it now."""
        self.lb.check_tail()
        return self.lb.position

    # -- the API ----------------------------------------------------------------------------------
    def get(self, obj: str) -> dict[str, Any]:
        """The object's fields now."""
        fields: dict[str, Any] = self._run(self.replay.view(obj, self._now()))
        return fields

    def set(self, obj: str, field: str, value: Any) -> int:
        """Set one field (a write always takes effect); its seqnum."""
        return self.lb.append(o.encode(o.Write(obj=obj, field=field, value=value)), tags=[o.object_tag(obj)])

    def begin(self, read_only: bool = False) -> "Transaction":
        return Transaction(self, read_only)


class Transaction:
    """Reads see the snapshot at its start; writes are buffered until :meth:`commit`."""

    def __init__(self, store: BokiStore, read_only: bool) -> None:
        self.store = store
        self.read_only = read_only
        self.txn = store.rng.getrandbits(63)
        self.writes: list[tuple[str, str, Any]] = []
        self.done = False
        if read_only:
            self.snapshot = store._now()  # appends nothing: reads at the position now
        else:
            self.snapshot = store.lb.append(o.encode(o.TxnStart(txn=self.txn)))

    def get(self, obj: str) -> dict[str, Any]:
        """The object's fields in the snapshot, with this transaction's own writes."""
        fields: dict[str, Any] = self.store._run(self.store.replay.view(obj, self.snapshot))
        for ob, f, v in self.writes:
            if ob == obj:
                fields[f] = v
        return fields

    def set(self, obj: str, field: str, value: Any) -> None:
        if self.read_only:
            raise ZiplogError("a read-only transaction writes nothing")
        self.writes.append((obj, field, value))

    def commit(self) -> bool:
        """True if it took effect: no successful write to an object it writes lies
        between its start and its commit record."""
        if self.done:
            raise ZiplogError("the transaction is over")
        self.done = True
        if self.read_only or not self.writes:
            return True
        commit = o.TxnCommit(txn=self.txn, start=self.snapshot, writes=self.writes)
        objs = list(dict.fromkeys(ob for ob, _, _ in self.writes))
        seqnum = self.store.lb.append(o.encode(commit), tags=[o.object_tag(ob) for ob in objs])
        ok: bool = self.store._run(self.store.replay.committed(seqnum, commit))
        return ok
