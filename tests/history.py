"""A recorded history of a run against a real cluster, and the checker the fault tests end
with, in the manner of Jepsen's: what clients were told, what subscribers were shown and
what reads returned, checked against what a shared log promises, whatever happened to the
processes in between.

Records are told apart by their bytes: every insert a test makes carries data no other
insert carries. An insert's outcome is ``ok`` (acknowledged: its gsn and shard),
``failed`` (the client was told no shard holds it: ``NoShardAvailableError``,
``DiskFullError``, ``LogFullError``) or ``unknown`` (anything else: a timeout, a closed client, a process
gone mid-call). The promises checked (:func:`check`):

1. every acknowledged record is delivered to every subscriber exactly once, at the gsn
   and shard it was acknowledged with (delivered and acknowledged records that did not
   reach the end of a subscriber's run are judged against what it saw);
2. nothing is delivered that no one inserted, and nothing twice;
3. a record whose outcome is unknown is delivered at most once; a failed one never;
4. InsertAfter: an acknowledged record's gsn is above its dependency's;
5. every subscriber's sequence is strictly increasing in gsn, and all of them are
   prefixes of one sequence;
6. a read of a gsn returns what subscribers were shown there (and a record no subscriber
   was shown is not read at a gsn a subscriber passed).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from ziplog.protocol.errors import DiskFullError, LogFullError, NoShardAvailableError
from ziplog.protocol.types import RecordId

OK, FAILED, UNKNOWN, PENDING = "ok", "failed", "unknown", "pending"
#: errors that tell a client that no shard holds its record
DEFINITE_FAILURES = (NoShardAvailableError, DiskFullError, LogFullError)


@dataclass
class Insert:
    data: bytes
    after: int  # the gsn of the record it must follow (0: none)
    outcome: str = PENDING
    rid: RecordId | None = None
    error: str = ""


@dataclass
class Read:
    rid: RecordId
    data: bytes | None  # None: not found (or trimmed)


@dataclass
class History:
    """What clients were told and subscribers shown; every method may be called from any
    thread."""

    inserts: list[Insert] = field(default_factory=list)
    deliveries: dict[str, list[tuple[RecordId, bytes]]] = field(default_factory=dict)
    reads: list[Read] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def invoke(self, data: bytes, after: int) -> Insert:
        op = Insert(data, after)
        with self._lock:
            self.inserts.append(op)
        return op

    def ok(self, op: Insert, rid: RecordId) -> None:
        op.rid, op.outcome = rid, OK

    def fail(self, op: Insert, error: BaseException) -> None:
        op.outcome = FAILED if isinstance(error, DEFINITE_FAILURES) else UNKNOWN
        op.error = repr(error)

    def delivered(self, subscriber: str, rid: RecordId, data: bytes) -> None:
        with self._lock:
            self.deliveries.setdefault(subscriber, []).append((rid, data))

    def read(self, rid: RecordId, data: bytes | None) -> None:
        with self._lock:
            self.reads.append(Read(rid, data))

    def acknowledged(self) -> list[Insert]:
        with self._lock:
            return [op for op in self.inserts if op.outcome == OK]


class HistoryViolation(AssertionError):
    pass


def check(history: History, ours: Callable[[bytes], bool] = lambda data: True, complete: bool = True) -> list[str]:
    """Every broken promise of the module's list, as a sentence each (empty: none).

    ``ours``: which delivered records this history's clients could have inserted (a
    run's records carry its tag; records of other runs in the same log are only
    ordered). ``complete``: every subscriber ran until after the last acknowledgement
    (each must then have delivered every acknowledged record; otherwise only those up
    to where it got)."""
    with history._lock:
        inserts = list(history.inserts)
        deliveries = {k: list(v) for k, v in history.deliveries.items()}
        reads = list(history.reads)
    problems: list[str] = []
    by_data: dict[bytes, Insert] = {}
    for op in inserts:
        if op.data in by_data:
            problems.append(f"two inserts carry the same data {op.data!r}: the history cannot tell them apart")
        by_data[op.data] = op

    # 5. one order, strictly increasing
    longest: list[tuple[RecordId, bytes]] = []
    for name, seq in deliveries.items():
        gsns = [rid.gsn for rid, _ in seq]
        bad = next((i for i in range(1, len(gsns)) if gsns[i] <= gsns[i - 1]), None)
        if bad is not None:
            problems.append(f"subscriber {name}: gsn {gsns[bad]} after {gsns[bad - 1]} (not strictly increasing)")
        if len(seq) > len(longest):
            longest = seq
    for name, seq in deliveries.items():
        if seq != longest[:len(seq)]:
            i = next(i for i, (a, b) in enumerate(zip(seq, longest)) if a != b)
            problems.append(f"subscriber {name} is no prefix of the longest sequence: at position {i} it saw "
                            f"{seq[i][0]} {seq[i][1][:40]!r}, another saw {longest[i][0]} {longest[i][1][:40]!r}")
    at_gsn = {rid.gsn: (rid, data) for rid, data in longest}

    # 2, 3. nothing invented, nothing twice, failed never, unknown at most once
    for name, seq in deliveries.items():
        seen: dict[bytes, RecordId] = {}
        for rid, data in seq:
            if not ours(data):
                continue
            inserted = by_data.get(data)
            if inserted is None:
                problems.append(f"subscriber {name}: {rid} holds {data[:40]!r}, which no one inserted")
                continue
            if data in seen:
                problems.append(f"subscriber {name}: {data[:40]!r} delivered twice, at {seen[data]} and {rid}")
            seen[data] = rid
            if inserted.outcome == FAILED:
                problems.append(f"subscriber {name}: {data[:40]!r} delivered at {rid}, but its client was told no "
                                f"shard holds it ({inserted.error})")

    # 1, 4. acknowledged: at their rid, once, after their dependency
    top = longest[-1][0].gsn if longest else 0
    where_in: dict[str, dict[bytes, list[RecordId]]] = {}
    for name, seq in deliveries.items():
        index: dict[bytes, list[RecordId]] = {}
        for rid, data in seq:
            index.setdefault(data, []).append(rid)
        where_in[name] = index
    for op in inserts:
        if op.outcome != OK:
            continue
        assert op.rid is not None
        if op.rid.gsn <= op.after:
            problems.append(f"{op.data[:40]!r} acknowledged at {op.rid}, not above its dependency's gsn {op.after}")
        for name, seq in deliveries.items():
            reached = seq[-1][0].gsn if seq else 0
            if not complete and op.rid.gsn > reached:
                continue
            where = where_in[name].get(op.data, [])
            if where != [op.rid]:
                problems.append(f"subscriber {name}: acknowledged {op.data[:40]!r} at {op.rid} was delivered at "
                                f"{where or 'no gsn'}")
        held = at_gsn.get(op.rid.gsn)
        if held is not None and held[1] != op.data and op.rid.gsn <= top:
            problems.append(f"gsn {op.rid.gsn} holds {held[1][:40]!r}, but {op.data[:40]!r} was acknowledged there")

    # 6. reads agree with deliveries
    passed = min((seq[-1][0].gsn if seq else 0) for seq in deliveries.values()) if deliveries else 0
    for r in reads:
        shown = at_gsn.get(r.rid.gsn)
        if r.data is None:
            continue  # not found, or trimmed since: says nothing against the log
        if shown is None:
            if r.rid.gsn <= passed:
                problems.append(f"read {r.rid} returned {r.data[:40]!r}; every subscriber passed gsn {r.rid.gsn} "
                                f"and was shown nothing there")
            continue
        if shown[0] != r.rid or shown[1] != r.data:
            problems.append(f"read {r.rid} returned {r.data[:40]!r}; subscribers were shown {shown[1][:40]!r} at {shown[0]}")
    return problems


def assert_holds(history: History, ours: Callable[[bytes], bool] = lambda data: True, complete: bool = True) -> None:
    problems = check(history, ours, complete)
    if problems:
        raise HistoryViolation(f"{len(problems)} broken promises; first ones:\n  " + "\n  ".join(problems[:10]))
