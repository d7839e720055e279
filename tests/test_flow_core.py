"""BokiFlow's protocols (ziplog/logbook/core/flow.py, flow_lock.py) driven against a model
of a book that grants exactly what LogBook guarantees and no more: a read is served at
some cut at or above the session's position (any such cut: a stale one too), an append
lands anywhere above the session's position and above every cut served so far (not in
real-time order). Locks: never two holders, over random schedules of concurrent takers
and random cuts. Steps: a workflow run again after a crash at any operation, or run
twice interleaved, applies each write once and ends with the first run's outcome."""

from __future__ import annotations

import random
from typing import Any, Generator

from hypothesis import given, settings
from hypothesis import strategies as st

from ziplog.cores.app_session import drive
from ziplog.logbook.core import flow as fc
from ziplog.logbook.core import flow_records as fr
from ziplog.logbook.core.book_ops import Append, ReadNext
from ziplog.logbook.core.flow_lock import LockChain
from ziplog.logbook.core.records import tag_of


class ModelBook:
    """Records by seqnum; sessions' positions; the highest cut served."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.records: dict[int, tuple[int, bytes]] = {}  # seqnum -> (tag, data)
        self.served = 0

    def append(self, pos: list[int], data: bytes, tags: list[str]) -> int:
        floor = max(pos[0], self.served)
        while True:
            seqnum = floor + self.rng.randint(1, 50)
            if seqnum not in self.records:
                break
        self.records[seqnum] = (tag_of(tags[0]), data)  # one tag: what these steps read by
        pos[0] = max(pos[0], seqnum)
        return seqnum

    def read_next(self, pos: list[int], tag: str, seqnum: int) -> tuple[int, bytes] | None:
        top = max([pos[0], *self.records])
        cut = self.rng.randint(pos[0], top)  # any cut at or above the position: stale too
        self.served = max(self.served, cut)
        pos[0] = max(pos[0], cut)
        key = tag_of(tag)
        hits = [s for s, (t, _) in self.records.items() if seqnum <= s <= cut and t == key]
        if not hits:
            return None
        first = min(hits)
        return first, self.records[first][1]

    def perform(self, pos: list[int], op: Any) -> Any:
        if type(op) is fc.OnLocks:
            op = op.op
        if type(op) is Append:
            return self.append(pos, op.data, [op.tag, *op.also])
        assert type(op) is ReadNext, op
        return self.read_next(pos, op.tag, op.seqnum)


def _taker(chain: LockChain, holder: str, rounds: int, beliefs: dict[str, bool]) -> Generator[Any, Any, None]:
    """``rounds`` times: try to take the lock; if taken, hold it a while, then give it back."""
    for _ in range(rounds):
        taken = yield from chain.try_acquire(holder)
        if taken:
            beliefs[holder] = True
            yield "hold"
            yield "hold"
            beliefs[holder] = False
            assert (yield from chain.release(holder))


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), takers=st.integers(2, 4), rounds=st.integers(1, 4))
def test_a_lock_never_has_two_holders(seed: int, takers: int, rounds: int) -> None:
    rng = random.Random(seed)
    book = ModelBook(rng)
    beliefs: dict[str, bool] = {}
    runs: list[tuple[Generator[Any, Any, None], list[int], list[Any]]] = []  # (steps, position, last result)
    for i in range(takers):
        holder = fr.holder_of(f"w{i}", 1)
        beliefs[holder] = False
        runs.append((_taker(LockChain("L"), holder, rounds, beliefs), [0], [None]))
    taken_ever = 0
    while runs:
        run = rng.choice(runs)
        gen, pos, value = run
        try:
            op = gen.send(value[0])
        except StopIteration:
            runs.remove(run)
            continue
        value[0] = None if op == "hold" else book.perform(pos, op)
        holding = [h for h, b in beliefs.items() if b]
        assert len(holding) <= 1, holding
        taken_ever += bool(holding)
    # the whole chain, replayed at the last cut: acquires and releases alternate
    final = LockChain("L")
    joined = [(s, fr.decode(d)) for s, (_, d) in sorted(book.records.items()) if final.apply(s, d)]
    assert all(rec.acquire == (i % 2 == 0) for i, (_, rec) in enumerate(joined))  # type: ignore[union-attr]
    assert taken_ever > 0 and final.holder is None


class ModelDb:
    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], tuple[bytes, int]] = {}
        self.applied: list[tuple[str, str, int]] = []

    def perform(self, op: Any) -> Any:
        if type(op) is fc.DbWrite:
            row = self.rows.get((op.table, op.key))
            if row is None or row[1] < op.version:
                self.rows[(op.table, op.key)] = (op.value, op.version)
                self.applied.append((op.table, op.key, op.version))
                return True
            return False
        assert type(op) is fc.DbRead
        row = self.rows.get((op.table, op.key))
        return None if row is None else row[0]


class Crash(Exception):
    pass


def _workflow(wf: str, chain: LockChain, nonce: int) -> Generator[Any, Any, Any]:
    """A workflow as a run performs it: read, write, lock, unlock, a transaction's decision."""
    value = yield from fc.read(wf, 1, "t", "k")
    count = (0 if value is None else fc.unpack(value)) + 1
    yield from fc.write(wf, 2, "t", "k", fc.pack(count))
    _, made = yield from fc.logged(wf, 3, "remember", fc.pack(nonce))  # a value this run made up
    taken = yield from fc.lock(wf, 4, chain)
    if taken:
        yield from fc.unlock(wf, 5, chain, fr.holder_of(wf, 4))
    _, committed, _ = yield from fc.decide(wf, 6, True, [["t", "other", fc.pack(count)]])
    return (yield from fc.finish(wf, fc.pack_outcome(True, [count, fc.unpack(made), taken, committed])))


def _perform(book: ModelBook, db: ModelDb, pos: list[int]) -> Any:
    def perform(op: Any) -> Any:
        if type(op) in (fc.DbWrite, fc.DbRead):
            return db.perform(op)
        return book.perform(pos, op)
    return perform


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), crash_at=st.integers(0, 40))
def test_a_run_again_after_a_crash_at_any_operation_applies_each_write_once(seed: int, crash_at: int) -> None:
    book, db = ModelBook(random.Random(seed)), ModelDb()
    ops = [0]
    inner = _perform(book, db, [0])

    def crashing(op: Any) -> Any:
        ops[0] += 1
        if ops[0] == crash_at:
            inner(op)  # its effect happened, and the run dies before it goes on
            raise Crash()
        return inner(op)

    first = None
    try:
        first = drive(_workflow("w", LockChain("L"), 1), crashing)
    except Crash:
        pass
    pos = [0]
    again = drive(_workflow("w", LockChain("L"), 2), _perform(book, db, pos))
    if first is not None:
        assert again == first  # the first outcome is every caller's
    count, made, taken, committed = fc.unpack_outcome(again)
    assert count == 1 and taken and committed
    logged = drive(fc.first_step("w", 3, "remember"), _perform(book, db, pos))  # at a cut past the run's records
    assert logged is not None
    assert made == fc.unpack(logged[1].value)  # made up once, by whichever run logged it first
    assert sorted(db.applied) == sorted({a for a in db.applied})  # no write applied twice
    assert [(t, k) for t, k, _ in db.applied] == [("t", "k"), ("t", "other")]
    assert fc.unpack(db.rows[("t", "k")][0]) == 1


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_two_runs_at_once_have_one_effect_and_one_outcome(seed: int) -> None:
    rng = random.Random(seed)
    book, db = ModelBook(rng), ModelDb()
    runs = [[_workflow("w", LockChain("L"), n), _perform(book, db, [0]), None] for n in (1, 2)]
    outcomes = []
    while runs:
        run = rng.choice(runs)
        try:
            op = run[0].send(run[2])  # type: ignore[union-attr]
        except StopIteration as stop:
            outcomes.append(stop.value)
            runs.remove(run)
            continue
        run[2] = run[1](op)  # type: ignore[operator]
    assert outcomes[0] == outcomes[1]
    count, _, taken, committed = fc.unpack_outcome(outcomes[0])
    assert count == 1 and taken and committed
    assert [(t, k) for t, k, _ in db.applied] == [("t", "k"), ("t", "other")]


def _stale_holder_book() -> ModelBook:
    """Workflow ``wA``'s lock step 1 recorded that it did not take lock ``L`` (at 5); a run
    of that step that came second found ``L`` free, and its acquire joined (at 10), and it
    died before it gave it back."""
    book = ModelBook(random.Random(1))
    book.records[5] = (tag_of(fr.step_tag("wA", 1)),
                       fr.encode(fr.Step(workflow="wA", step=1, part=0, op="lock", value=fc.pack(False))))
    book.records[10] = (tag_of(fr.lock_tag("L")),
                        fr.encode(fr.LockOp(lock="L", prev=0, holder=fr.holder_of("wA", 1), acquire=True)))
    return book


def test_a_lock_left_by_a_step_that_recorded_it_failed_is_given_back_by_the_next_taker() -> None:
    """The lock's holder is a step whose first record says it failed: no run of it holds
    the lock or will give it back, so ``wB``'s lock step gives it back for it and takes it."""
    book, db = _stale_holder_book(), ModelDb()
    pos = [10]  # past both records
    assert drive(fc.lock("wB", 1, LockChain("L")), _perform(book, db, pos)) is True
    final = LockChain("L")
    for seqnum, (_, data) in sorted(book.records.items()):
        final.apply(seqnum, data)
    assert final.holder == fr.holder_of("wB", 1)


def test_a_lock_whose_holder_step_has_no_record_yet_is_left_to_it() -> None:
    """What the test above relies on (else it would pass vacuously): a holder whose lock
    step has no record yet may be taking the lock; it is not given back."""
    book, db = _stale_holder_book(), ModelDb()
    del book.records[5]
    assert drive(fc.lock("wB", 1, LockChain("L")), _perform(book, db, [10])) is False


@settings(max_examples=300, deadline=None)
@given(junk=st.binary(max_size=64), body=st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8)
                                                         | st.binary(max_size=8),
                                                         lambda c: st.lists(c, max_size=6), max_leaves=12))
def test_flow_records_decode_totally(junk: bytes, body: Any) -> None:
    """Any bytes, and any msgpack value behind the header, decode to a record or None."""
    for data in (junk, fr.HEADER + junk, fr.HEADER + fc.pack(body)):
        rec = fr.decode(data)
        assert rec is None or type(rec) in (fr.Intent, fr.Step, fr.Done, fr.LockOp)


@settings(max_examples=200, deadline=None)
@given(events=st.lists(st.tuples(st.sampled_from(["intent", "end", "tick"]), st.integers(0, 5)), max_size=60))
def test_the_sweep_never_trims_past_a_live_or_kept_workflow(events: list[tuple[str, int]]) -> None:
    """Intents read in seqnum order, workflows seen ended, time passing: every trim point
    is at or below each intent not yet seen ended and each ended one kept, and never goes back."""
    from ziplog.logbook.core.flow_sweep import SweepState

    state = SweepState(retry_after_ns=0, collect_after_ns=10, limit=4)
    now, seqnum = 0, 0
    intents: dict[str, int] = {}
    ended_at: dict[str, int] = {}
    for kind, n in events:
        now += 1
        if kind == "intent":
            seqnum += 1 + n
            wf = f"w{seqnum}"
            state.on_intent(seqnum, fr.encode(fr.Intent(workflow=wf, function="f", input=b"")), now)
            intents[wf] = seqnum
        elif kind == "end" and state.pending:
            wf = list(state.pending)[n % len(state.pending)]
            state.ended_at(wf, now)
            ended_at[wf] = now
        point = state.trim_point(now)
        if point is not None:
            forgotten = [s for w, s in intents.items() if w not in state.pending and w not in ended_at]
            kept = [s for w, s in intents.items()
                    if w in state.pending or w in forgotten or now - ended_at.get(w, now) < 10]
            assert all(point <= s for s in kept), (point, kept)
            state.trimmed(point)
