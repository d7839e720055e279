"""The history checker (``tests/history.py``) catches what it must: a planted loss, a
planted duplicate, a planted fork, and each of its other promises broken once; a clean
history passes."""

from __future__ import annotations

import pytest

from tests.history import History, HistoryViolation, assert_holds, check
from ziplog.protocol.errors import NoShardAvailableError, ZiplogTimeoutError
from ziplog.protocol.types import RecordId


def clean() -> History:
    """Three acknowledged records, one of unknown outcome that made it, one failed; two
    subscribers that saw the same log; reads that agree."""
    h = History()
    a = h.invoke(b"a", 0)
    h.ok(a, RecordId(10, 0))
    b = h.invoke(b"b", 10)
    h.ok(b, RecordId(12, 1))
    c = h.invoke(b"c", 0)
    h.fail(c, ZiplogTimeoutError("unanswered"))
    d = h.invoke(b"d", 12)
    h.ok(d, RecordId(20, 0))
    e = h.invoke(b"e", 0)
    h.fail(e, NoShardAvailableError("none"))
    for sub in ("s0", "s1"):
        for rid, data in ((RecordId(10, 0), b"a"), (RecordId(12, 1), b"b"), (RecordId(15, 1), b"c"),
                          (RecordId(20, 0), b"d")):
            h.delivered(sub, rid, data)
    h.read(RecordId(12, 1), b"b")
    h.read(RecordId(13, 0), None)
    return h


def test_a_clean_history_passes() -> None:
    assert check(clean()) == []
    assert_holds(clean())


def test_a_planted_loss_is_caught() -> None:
    h = clean()
    h.deliveries["s1"] = [x for x in h.deliveries["s1"] if x[1] != b"b"]
    with pytest.raises(HistoryViolation, match="acknowledged b'b'"):
        assert_holds(h)


def test_a_planted_duplicate_is_caught() -> None:
    h = clean()
    h.deliveries["s0"].append((RecordId(25, 1), b"a"))
    h.deliveries["s1"].append((RecordId(25, 1), b"a"))
    problems = check(h)
    assert any("delivered twice" in p for p in problems), problems


def test_a_planted_fork_is_caught() -> None:
    """The subscribers disagree at one gsn: one of them reads another shard's replica."""
    h = clean()
    h.deliveries["s1"][2] = (RecordId(15, 1), b"x")
    problems = check(h)
    assert any("no prefix" in p for p in problems), problems


def test_every_other_promise_is_checked() -> None:
    h = clean()
    f = h.invoke(b"f", 0)
    h.fail(f, NoShardAvailableError("none"))
    h.delivered("s0", RecordId(30, 0), b"f")  # failed, yet delivered
    assert any("told no shard holds it" in p for p in check(h, complete=False))
    h = clean()
    h.delivered("s0", RecordId(30, 0), b"nobody")
    assert any("no one inserted" in p for p in check(h, complete=False))
    h = clean()
    h.inserts[1].after = 50  # InsertAfter broken
    assert any("not above its dependency" in p for p in check(h))
    h = clean()
    h.read(RecordId(12, 1), b"not b")
    assert any("read" in p for p in check(h))
    h = clean()
    h.read(RecordId(11, 0), b"ghost")  # read where every subscriber saw nothing
    assert any("shown nothing there" in p for p in check(h))
    h = clean()
    h.deliveries["s0"][1], h.deliveries["s0"][2] = h.deliveries["s0"][2], h.deliveries["s0"][1]
    assert any("not strictly increasing" in p for p in check(h))
    h = clean()
    h.deliveries["s0"].append((RecordId(21, 1), b"c"))  # unknown outcome, twice
    assert any("delivered twice" in p for p in check(h, complete=False))


def test_records_of_other_runs_are_only_ordered() -> None:
    h = clean()
    for sub in ("s0", "s1"):
        h.delivered(sub, RecordId(40, 0), b"earlier run")
    assert any("no one inserted" in p for p in check(h))
    assert check(h, ours=lambda data: data != b"earlier run") == []
