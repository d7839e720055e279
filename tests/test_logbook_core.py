"""LogBook's cores without I/O: the record format (strict; anything else is not
LogBook's), and the index: nodes fed by epoch assignment, lagging one another, answer
every read_next / read_prev / check_tail at the cut they are asked at exactly as a full
replay of the log up to that cut does (Hypothesis, against that oracle)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ziplog.logbook.core import records as r
from ziplog.logbook.core.index import ALL, Assignment, Hit, IndexNode, choose_cut, first, last
from ziplog.protocol.gsna import epoch_base

MAX_SEQNUM = (1 << 64) - 1


# -- the record format -------------------------------------------------------------------------------
def test_records_round_trip_and_string_tags_keep_their_name() -> None:
    e = r.entry(7, b"hello", [3, "user:42", 3])
    assert e.tags == (3, r.tag_of("user:42")) and e.names == {r.tag_of("user:42"): "user:42"}
    assert r.decode(r.encode(e)) == e
    t = r.Trim(book=7, seqnum=12345)
    assert r.decode(r.encode(t)) == t
    # the hash is fixed: the same in every process (not Python's salted hash)
    assert r.tag_of("user:42") == int.from_bytes(__import__("hashlib").blake2b(b"user:42", digest_size=8).digest(), "big")


@pytest.mark.parametrize("bad", [-1, 1 << 64, True, 1.5, None])
def test_a_tag_is_a_string_or_a_64_bit_integer(bad: Any) -> None:
    with pytest.raises(ValueError):
        r.tag_of(bad)


def test_what_is_not_logbooks_decodes_to_none() -> None:
    assert r.decode(b"another application's record") is None
    assert r.decode(r.HEADER) is None
    assert r.decode(r.MAGIC + bytes([r.FORMAT + 1]) + msgspec.msgpack.encode([1, 7, [], {}, b"x"])) is None
    assert r.decode(r.HEADER + msgspec.msgpack.encode([1, -7, [], {}, b"x"])) is None  # a negative book
    assert r.decode(r.HEADER + msgspec.msgpack.encode([1, 7, list(range(r.MAX_TAGS + 1)), {}, b"x"])) is None
    assert r.decode(r.HEADER + msgspec.msgpack.encode([2, 7, 5, "extra"])) is None
    assert r.decode(r.HEADER + msgspec.msgpack.encode([3, 7, 5])) is None  # an unknown kind


_msgpack = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats(allow_nan=False) | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.integers(0, 9) | st.text(max_size=3), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(_msgpack, st.binary(max_size=40))
def test_the_decoder_is_total(value: Any, raw: bytes) -> None:
    for data in (r.HEADER + msgspec.msgpack.encode(value), r.HEADER + raw, raw):
        rec = r.decode(data)
        assert rec is None or isinstance(rec, (r.Entry, r.Trim))


# -- the index against a full replay -----------------------------------------------------------------
class Oracle:
    """The log as a full genesis replay sees it: every record, in gsn order."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, int, int, tuple[int, ...]]] = []  # gsn, shard, book, tags
        self.trims: list[tuple[int, int, int]] = []  # gsn, book, seqnum

    def _visible(self, book: int, tag: int | None, cut: int) -> list[Hit]:
        point = max((s for g, b, s in self.trims if b == book and g <= cut), default=0)
        return [Hit(g, sh) for g, sh, b, tags in self.entries
                if b == book and g <= cut and g >= point and (tag is ALL or tag in tags)]

    def next(self, book: int, tag: int | None, min_seqnum: int, cut: int) -> Hit | None:
        return next((h for h in self._visible(book, tag, cut) if h.gsn >= min_seqnum), None)

    def prev(self, book: int, tag: int | None, max_seqnum: int, cut: int) -> Hit | None:
        hits = [h for h in self._visible(book, tag, cut) if h.gsn <= max_seqnum]
        return hits[-1] if hits else None


_op = st.one_of(
    st.tuples(st.just("entry"), st.integers(0, 1), st.lists(st.integers(0, 2), max_size=3), st.integers(0, 2)),
    st.tuples(st.just("trim"), st.integers(0, 1), st.integers(0, 40)),
    st.tuples(st.just("gap"), st.sampled_from([1, 2, 5, "epoch"])),
    st.tuples(st.just("watermark"), st.sets(st.integers(0, 3)) | st.just({0, 1, 2, 3})),
    st.tuples(st.just("read"), st.sampled_from(["next", "prev", "tail"]), st.integers(0, 1),
              st.none() | st.integers(0, 2), st.integers(0, 40), st.integers(0, 100)),
)


def _near_the_end(seqnums: list[int], pick: int) -> int:
    """One of the last few seqnums given out (where trims and reads disagree most when a
    node lags), or a small number before any."""
    return seqnums[-1 - pick % min(len(seqnums), 4)] if seqnums else pick


@settings(max_examples=500, deadline=None)
@given(st.integers(1, 3), st.none() | st.tuples(st.integers(1, 6), st.integers(1, 4)), st.lists(_op, max_size=80))
def test_nodes_answer_at_a_cut_exactly_as_a_replay_up_to_it(first_n: int, later: tuple[int, int] | None,
                                                            ops: list[Any]) -> None:
    history = [(0, first_n)] + ([(later[0], max(first_n, later[1]))] if later else [])
    assignment = Assignment(history)
    nodes = [IndexNode(i, assignment) for i in range(assignment.nodes)]
    oracle = Oracle()
    gsn, epoch, k = 0, 0, 0
    seqnums: list[int] = []  # the gsns given out, to trim and read near them
    position = 0  # a session's position: the cuts it was served at never go below it
    reads = 0

    def next_gsn(step: int) -> int:
        nonlocal gsn, k
        k += step
        gsn = epoch_base(epoch) + k
        return gsn

    for op in ops:
        kind = op[0]
        if kind == "gap":
            if op[1] == "epoch":
                epoch, k = epoch + 1, 0
            else:
                next_gsn(op[1])
        elif kind == "entry":
            _, book, tags, shard = op
            g = next_gsn(1)
            nodes[assignment.node_of(g)].on_entry(g, shard, book, tags)
            oracle.entries.append((g, shard, book, tuple(tags)))
            seqnums.append(g)
        elif kind == "trim":
            _, book, pick = op
            g = next_gsn(1)
            point = _near_the_end(seqnums, pick)
            for n in nodes:
                n.on_trim(g, book, point)
            oracle.trims.append((g, book, point))
        elif kind == "watermark":
            for i in op[1]:
                if i < len(nodes):
                    nodes[i].on_watermark(gsn)
        else:
            _, how, book, tag, pick, pos = op
            cut = choose_cut([n.watermark for n in nodes], [n.floor for n in nodes], position)
            if cut is None:
                assert min(n.watermark for n in nodes) < max(position, *(n.floor for n in nodes))
                continue
            assert cut >= position
            seqnum = _near_the_end(seqnums, pick) + (pick % 3 - 1)
            if how == "next":
                got = first(n.next(book, tag, seqnum, cut) for n in nodes)
                want = oracle.next(book, tag, seqnum, cut)
            else:
                bound = MAX_SEQNUM if how == "tail" else seqnum
                got = last(n.prev(book, tag, bound, cut) for n in nodes)
                want = oracle.prev(book, tag, bound, cut)
            assert got == want, (how, book, tag, seqnum, cut)
            position = cut if pos % 2 else position  # the session moves to the cut it was served at
            reads += 1


def test_a_trim_above_the_cut_changes_no_answer_at_it() -> None:
    node = IndexNode(0, Assignment([(0, 1)]))
    for g in (1, 2, 3):
        node.on_entry(g, 0, 7, [1])
    node.on_watermark(3)
    node.on_trim(4, 7, 3)  # book 7 below seqnum 3 is gone from gsn 4 on
    assert node.next(7, 1, 0, 3) == Hit(1, 0) and node.prev(7, ALL, 2, 3) == Hit(2, 0)  # at cut 3: not yet
    assert node.trim_point(7, 3) == 0 and node.trim_point(7, 4) == 3 and node.trim_point(8, 4) == 0
    size = node.size
    node.on_watermark(4)
    assert node.next(7, 1, 0, 4) == Hit(3, 0) and node.prev(7, ALL, 2, 4) is None  # at cut 4: trimmed
    # passing the trim dropped its rows (memory), and no cut below it is answered now
    assert node.floor == 4 and node.size == size - 4
    with pytest.raises(AssertionError, match="does not answer"):
        node.next(7, 1, 0, 3)


def test_a_node_remembers_the_highest_seqnum_a_trim_took_of_each_tag(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a replay needs to know it lost records (``read_next(..., gapless=True)``):
    the same before the watermark passes the trim (entries still held) and after (the
    entries dropped, the number kept); a tag the trim took nothing of says 0; beyond
    the bound, the oldest tags fold into their book's number (a replay may then be told
    of a loss that is not its own: refused, never silently wrong)."""
    import ziplog.logbook.core.index as ix

    node = IndexNode(0, Assignment([(0, 1)]))
    for g, tag in ((1, 1), (2, 2), (3, 1), (4, 5)):
        node.on_entry(g, 0, 7, [tag])
    node.on_watermark(4)
    node.on_trim(5, 7, 4)  # book 7 below seqnum 4 is gone from gsn 5 on
    assert node.trimmed_top(7, 1, 4) == 0  # at cut 4 the trim is not in force
    at_5 = [node.trimmed_top(7, t, 5) for t in (1, 2, 5, ALL)]
    node.on_watermark(5)  # the entries below 4 are dropped now
    assert [node.trimmed_top(7, t, 5) for t in (1, 2, 5, ALL)] == at_5 == [3, 2, 0, 3]
    assert node.trimmed_top(8, 1, 5) == 0

    monkeypatch.setattr(ix, "MAX_TRIMMED_ROWS", 2)
    small = IndexNode(0, Assignment([(0, 1)]))
    for g, tag in ((1, 1), (2, 2), (3, 3), (4, 4)):
        small.on_entry(g, 0, 7, [tag])
    small.on_watermark(4)
    small.on_trim(5, 7, 4)
    small.on_watermark(5)  # four rows trimmed (the book's and tags 1-3): the oldest fold into book 7's
    tops = {t: small.trimmed_top(7, t, 5) for t in (ALL, 1, 2, 3, 4)}
    assert all(tops[t] >= true for t, true in ((ALL, 3), (1, 1), (2, 2), (3, 3), (4, 0)))  # never below the truth
    assert len(small._trimmed) <= 2


def test_a_node_refuses_a_cut_it_has_not_reached_and_a_feed_that_goes_back() -> None:
    node = IndexNode(0, Assignment([(0, 1)]))
    node.on_entry(5, 0, 1, [9])
    with pytest.raises(AssertionError, match="does not answer"):
        node.next(1, 9, 0, 5)
    node.on_watermark(5)
    assert node.next(1, 9, 0, 5) == Hit(5, 0) and node.prev(1, ALL, MAX_SEQNUM, 5) == Hit(5, 0)
    with pytest.raises(AssertionError, match="went back"):
        node.on_entry(4, 0, 1, [])


def test_the_assignment_spreads_epochs_and_grows_from_an_epoch_on() -> None:
    a = Assignment([(0, 2), (10, 3)])
    assert [a.node_of(epoch_base(e) + 1) for e in range(12)] == [0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 1, 2]
    with pytest.raises(AssertionError):
        IndexNode(0, a).on_entry(epoch_base(1) + 1, 0, 0, [])  # epoch 1 is node 1's


def test_a_cut_never_goes_below_the_sessions_position() -> None:
    assert choose_cut([10, 7, 12], [0, 0, 0], 7) == 7
    assert choose_cut([10, 7, 12], [0, 0, 0], 8) is None  # one node is behind the session: the read waits
    assert choose_cut([10, 7, 12], [0, 0, 9], 0) is None  # one node answers no cut below 9: wait for the others
    assert first([None, Hit(9, 1), Hit(4, 0)]) == Hit(4, 0) and last([Hit(9, 1), None, Hit(4, 0)]) == Hit(9, 1)
    assert first([None, None]) is None


# -- BokiStore's replay (ziplog/logbook/core/objects.py) ----------------------------------------------
def _replay_over(updates: dict[int, Any], steps: Any) -> Any:
    """Drive a replay's steps over ``updates`` (seqnum -> update), answering each Scan."""
    from ziplog.logbook.core import objects as o
    from ziplog.logbook.core.session import drive

    def scan(op: o.Scan) -> list[tuple[int, Any]]:
        return [(s, u) for s, u in sorted(updates.items()) if op.lo <= s <= op.hi and _touches(u, op.tag)]
    return drive(steps, scan)


def _touches(u: Any, tag: int) -> bool:
    from ziplog.logbook.core import objects as o
    if type(u) is o.Write:
        return o.object_tag(u.obj) == tag
    return type(u) is o.TxnCommit and any(o.object_tag(ob) == tag for ob, _, _ in u.writes)


def test_a_long_chain_of_undecided_commits_is_decided_without_deep_recursion() -> None:
    """Commit i's window holds commit i-1 only: the first takes effect, each next one
    conflicts with its predecessor iff that one took effect (so they alternate). Deciding
    the last of thousands must not recurse through all of them."""
    from ziplog.logbook.core import objects as o
    n = 2000  # past the interpreter's recursion limit (1000) twice over
    updates: dict[int, Any] = {2 * i: o.TxnCommit(txn=i, start=2 * i - 3 if i > 1 else 0, writes=[("x", "v", i)])
                               for i in range(1, n + 1)}
    replay = o.Replay()
    assert _replay_over(updates, replay.committed(2 * n, updates[2 * n])) == (n % 2 == 1)
    assert [replay.outcomes[2 * i] for i in range(1, 7)] == [True, False, True, False, True, False]
    # a view replays the same decisions: x holds the last commit that took effect
    assert _replay_over(updates, replay.view("x", 2 * n)) == {"v": n if n % 2 == 1 else n - 1}
    # a plain write in a window always conflicts
    updates[2 * n + 1] = o.Write(obj="x", field="v", value=-1)
    late = o.TxnCommit(txn=n + 1, start=2 * n, writes=[("x", "v", 0)])
    assert _replay_over(updates, replay.committed(2 * n + 2, late)) is False
