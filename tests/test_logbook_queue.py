"""BokiQueue (Boki journal 5.3): the replay core against a list-based model, with
producers, consumers and failures interleaved step by step over an in-memory book; then
real processes: 4 producers and 4 consumers, each on its own engine, on one queue:
every element popped exactly once, each producer's elements in its push order."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ziplog
from ziplog.logbook import LogBook
from ziplog.logbook.core import queue as q
from ziplog.logbook.core.session import drive
from ziplog.logbook.queue import BokiQueue
from ziplog.protocol.errors import ZiplogTimeoutError

NAME = "jobs"
TAG = q.queue_tag(NAME)


# -- an in-memory book: the queue core's operations served at the tail, with no delay ----------------
class FakeBook:
    """Tagged records with increasing, non-consecutive seqnums; every read is at the tail
    (a LogBook read at a cut at or above the reader's position, with nothing in flight)."""

    def __init__(self) -> None:
        self.records: list[tuple[int, str, bytes]] = []
        self.last = 0
        #: appends whose reply was lost and that go in later (a retried insert's late copy)
        self.stray: list[tuple[bytes, str]] = []

    def land_strays(self) -> None:
        for data, tag in self.stray:
            self.append(data, tag)
        self.stray.clear()

    def append(self, data: bytes, tag: str) -> int:
        self.last += 1 + (len(self.records) * 7) % 5  # seqnums are gsns: increasing, not consecutive
        self.records.append((self.last, tag, data))
        return self.last

    def perform(self, op: q.Op) -> Any:
        if type(op) is q.Append:
            return self.append(op.data, op.tag)
        tagged = [(s, d) for s, t, d in self.records if t == op.tag]
        if type(op) is q.ReadTail:
            return tagged[-1][0] if tagged else None
        assert type(op) is q.ReadNext
        return next(((s, d) for s, d in tagged if s >= op.seqnum), None)

    def history(self, tag: str = TAG, upto: int | None = None) -> list[tuple[int, bytes]]:
        """The records tagged ``tag`` (the first ``upto`` records of the book only)."""
        return [(s, d) for s, t, d in self.records[:upto] if t == tag]


def push(book: FakeBook, data: bytes, name: str = NAME) -> int:
    return book.append(q.encode(q.Push(queue=name, data=data)), q.queue_tag(name))


Taken = dict[int, tuple[int, bytes | None]]  # pop seqnum -> (its consumer, the data it took or None)


def model(history: list[tuple[int, bytes]], name: str = NAME) -> tuple[Taken, list[bytes]]:
    """The list-based oracle: each pop record of ``name`` takes the head of a plain list
    of pushed data; (pop seqnum -> (consumer, data taken or None), data left)."""
    pushed: list[bytes] = []
    taken: Taken = {}
    for seqnum, data in history:
        rec = q.decode(data)
        if isinstance(rec, q.Push) and rec.queue == name:
            pushed.append(rec.data)
        elif isinstance(rec, q.Pop) and rec.queue == name:
            taken[seqnum] = (rec.consumer, pushed.pop(0) if pushed else None)
    return taken, pushed


# -- the core, by hand -------------------------------------------------------------------------------
def test_pops_take_the_oldest_untaken_push_before_them_in_log_order() -> None:
    book = FakeBook()
    a = q.Consumer(NAME, 1)
    b = q.Consumer(NAME, 2)
    assert drive(a.pop(), book.perform) is None and book.records == []  # empty: nothing appended
    push(book, b"x")
    push(book, b"y")
    assert drive(b.pop(), book.perform) == b"x"
    assert drive(a.pop(), book.perform) == b"y"
    push(book, b"z")
    assert drive(b.pop(), book.perform) == b"z"
    assert drive(a.pop(), book.perform) is None
    takes = [(t.consumer, None if t.element is None else t.element[1]) for t in q.takes(NAME, book.history())]
    assert takes == [(2, b"x"), (1, b"y"), (2, b"z")]


def test_a_pop_record_that_finds_the_queue_empty_takes_nothing() -> None:
    """Two consumers both see one element at their tail reads and both append a pop: the
    first pop record takes it, the second takes nothing (the element is popped once)."""
    book = FakeBook()
    push(book, b"only")
    a, b = q.Consumer(NAME, 1).pop(), q.Consumer(NAME, 2).pop()
    op_a, op_b = next(a), next(b)
    while type(op_a) is not q.Append:  # a: tail read and replay, up to its append
        op_a = a.send(book.perform(op_a))
    while type(op_b) is not q.Append:
        op_b = b.send(book.perform(op_b))
    results = [finish(b, op_b, book.perform), finish(a, op_a, book.perform)]  # b's record goes in first
    assert results == [b"only", None]


def finish(steps: q.Steps, op: q.Op, perform: Callable[[q.Op], Any]) -> Any:
    """Drive ``steps`` from the operation ``op`` it is waiting on to its end."""
    try:
        while True:
            op = steps.send(perform(op))
    except StopIteration as stop:
        return stop.value


def test_records_that_are_not_the_queues_are_skipped() -> None:
    book = FakeBook()
    push(book, b"1")
    book.append(b"garbage", TAG)  # not the queue's format: under the queue's tag all the same
    book.append(q.encode(q.Push(queue="other", data=b"theirs")), TAG)  # a tag collision
    book.append(q.HEADER[:-1] + b"\x02" + q.encode(q.Pop(queue=NAME, consumer=3))[len(q.HEADER):], TAG)  # format 2
    push(book, b"2", name="other")  # another queue: another tag
    c = q.Consumer(NAME, 1)
    assert [drive(c.pop(), book.perform) for _ in range(3)] == [b"1", None, None]
    assert [t.consumer for t in q.takes(NAME, book.history())] == [1]


def test_a_pop_replays_only_the_records_since_the_previous_one() -> None:
    book = FakeBook()
    for i in range(10):
        push(book, bytes([i]))
    c = q.Consumer(NAME, 1)
    reads: list[int] = []

    def counting(op: q.Op) -> Any:
        if type(op) is q.ReadNext:
            reads.append(op.seqnum)
        return book.perform(op)

    assert drive(c.pop(), counting) == b"\x00"
    assert len(reads) == 11  # the 10 pushes, then its own pop record
    assert [s for s, _ in c.live] == [s for s, _ in book.history()[1:10]]  # only the live elements are kept
    reads.clear()
    push(book, b"new")
    assert drive(c.pop(), counting) == b"\x01"
    assert len(reads) == 2  # the new push and its own pop record


def test_a_failed_pop_leaves_its_element_to_the_next_pop() -> None:
    book = FakeBook()
    for data in (b"a", b"b", b"c"):
        push(book, data)
    c = q.Consumer(NAME, 1)
    steps = c.pop()
    op = next(steps)
    while type(op) is not q.Append:
        op = steps.send(book.perform(op))
    book.perform(op)  # the pop record goes in, but its consumer does not learn its seqnum
    with pytest.raises(ZiplogTimeoutError):
        steps.throw(ZiplogTimeoutError("the append's reply was lost"))
    steps = c.pop()
    op = next(steps)  # the tail read meets the orphan: returned without a new record
    assert finish(steps, op, book.perform) == b"a" and len(book.history()) == 4
    assert drive(c.pop(), book.perform) == b"b"
    assert [t.element[1] for t in q.takes(NAME, book.history()) if t.element] == [b"a", b"b"]


def test_an_orphan_that_lands_late_is_returned_before_the_newer_take() -> None:
    """A failed pop's record goes in only after the next pop read the tail (a late copy
    of a retried insert): the next pop's replay meets it before its own record, and
    returns its element first, so the consumer's elements keep their log order."""
    book = FakeBook()
    for data in (b"a", b"b", b"c"):
        push(book, data)
    c = q.Consumer(NAME, 1)
    steps = c.pop()
    op = next(steps)
    while type(op) is not q.Append:
        op = steps.send(book.perform(op))
    with pytest.raises(ZiplogTimeoutError):
        steps.throw(ZiplogTimeoutError("the append's reply was lost"))
    steps = c.pop()
    op = next(steps)
    while type(op) is not q.Append:
        op = steps.send(book.perform(op))
    assert isinstance(op, q.Append)
    book.append(op.data, op.tag)  # the failed pop's record (the same bytes: same queue, same consumer)
    assert finish(steps, op, book.perform) == b"a"
    assert drive(c.pop(), book.perform) == b"b" and len(book.history()) == 5  # held: no new record


def test_records_no_replay_would_accept_are_refused() -> None:
    for name in ("", "x" * (q.MAX_NAME + 1)):
        with pytest.raises(ValueError):
            q.encode(q.Push(queue=name, data=b""))
        with pytest.raises(ValueError):
            q.Consumer(name, 1)
    with pytest.raises(TypeError):
        q.encode(q.Push(queue=NAME, data="text"))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        q.encode(q.Pop(queue=NAME, consumer=1 << 63))
    assert q.decode(q.encode(q.Push(queue=NAME, data=b""))) == q.Push(queue=NAME, data=b"")
    assert q.decode(b"ZLBS\x01" + q.encode(q.Pop(queue=NAME, consumer=5))[5:]) is None  # BokiStore's header


# -- the core, interleaved: a property against the list model ------------------------------------------
PRODUCERS = 2
CONSUMERS = 3
NOISE = PRODUCERS + CONSUMERS  # the actor that appends records that are not the queue's


@dataclass
class Actor:
    """A consumer in the interleaving: its core, its pop in flight and the operation
    that pop waits on, and what its pops returned."""
    core: q.Consumer
    steps: q.Steps | None = None
    op: q.Op | None = None
    tail_len: int = 0
    appended: int | None = None
    returned: list[bytes] = field(default_factory=list)
    failures: int = 0


def step(actor: Actor, book: FakeBook, fail: int, checks: list[tuple[Actor, int | None, int]]) -> None:
    """Advance ``actor`` by one operation (start a pop if none is in flight); with
    ``fail``, the operation fails: a read is not served, an append goes in unanswered
    (1: now, 2: later, when the noise actor next moves)."""
    if actor.steps is None:
        actor.steps, actor.appended = actor.core.pop(), None
        advance(actor, lambda s: next(s), checks)
        return
    op = actor.op
    assert op is not None and actor.steps is not None
    if fail and type(op) in (q.Append, q.ReadNext):
        if type(op) is q.Append and fail == 1:
            book.perform(op)
        elif type(op) is q.Append:
            book.stray.append((op.data, op.tag))
        with pytest.raises(ZiplogTimeoutError):
            actor.steps.throw(ZiplogTimeoutError("injected"))
        actor.steps, actor.failures = None, actor.failures + 1
        return
    if type(op) is q.ReadTail:
        actor.tail_len = len(book.records)
    result = book.perform(op)
    if type(op) is q.Append:
        actor.appended = result
    advance(actor, lambda s: s.send(result), checks)


def advance(actor: Actor, move: Callable[[q.Steps], q.Op], checks: list[tuple[Actor, int | None, int]]) -> None:
    assert actor.steps is not None
    try:
        actor.op = move(actor.steps)
    except StopIteration as stop:
        if stop.value is None:
            checks.append((actor, actor.appended, actor.tail_len))
        else:
            actor.returned.append(stop.value)
        actor.steps = actor.op = None


NOISE_RECORDS = [b"", b"ZLBQ", b"garbage", q.encode(q.Push(queue="other", data=b"n")),
                 q.encode(q.Pop(queue="other", consumer=0))]


@settings(max_examples=1000, deadline=None)
@given(st.lists(st.tuples(st.integers(0, NOISE), st.integers(0, 14)), max_size=150))
def test_interleaved_producers_consumers_and_failures_match_the_list_model(script: list[tuple[int, int]]) -> None:
    book = FakeBook()
    actors = [Actor(q.Consumer(NAME, c)) for c in range(CONSUMERS)]
    pushed: list[bytes] = []
    checks: list[tuple[Actor, int | None, int]] = []  # pops that returned None
    for who, roll in script:
        if who < PRODUCERS:
            data = b"%d:%d" % (who, sum(p.startswith(b"%d:" % who) for p in pushed))
            pushed.append(data)
            push(book, data)
        elif who == NOISE:
            book.append(NOISE_RECORDS[roll % len(NOISE_RECORDS)], TAG)
            book.land_strays()
        else:
            step(actors[who - PRODUCERS], book, roll if roll <= 2 else 0, checks)
    for actor in actors:  # the pops in flight run to their end, without failures
        while actor.steps is not None:
            step(actor, book, 0, checks)
        assert len(actor.core.orphans) <= actor.failures
    taken, left = model(book.history())
    held = {id(a): [d for _, d in a.core.orphans] for a in actors}
    for actor in actors:
        mine = [d for c, d in taken.values() if c == actor.core.consumer and d is not None]
        # each consumer got what its records took, in log order, but for the elements of
        # its failed pops: held for its next pop, or taken by a record it has not replayed
        # yet (later in the log than every record it has)
        got = actor.returned + held[id(actor)]
        assert mine[:len(got)] == got
    book.land_strays()
    for actor in actors:  # every consumer pops until it finds the queue empty: nothing is lost
        while True:
            step(actor, book, 0, checks)
            while actor.steps is not None:
                step(actor, book, 0, checks)
            if checks and checks[-1][0] is actor and checks[-1][1] is None:
                break

    taken, left = model(book.history())
    # the core's replay is the model's
    assert {t.pop: (t.consumer, None if t.element is None else t.element[1])
            for t in q.takes(NAME, book.history())} == taken
    assert left == []
    for actor in actors:
        mine = [d for c, d in taken.values() if c == actor.core.consumer and d is not None]
        # each consumer got exactly what its records took, in log order
        assert actor.returned == mine and not actor.core.orphans
    for actor, appended, tail_len in checks:
        if appended is None:  # it read the tail, found the queue empty and appended nothing
            assert model(book.history(upto=tail_len))[1] == []
        else:
            assert taken[appended] == (actor.core.consumer, None)
    # every element taken exactly once, in push order overall (so per producer too)
    assert [d for _, d in taken.values() if d is not None] + left == pushed


# -- real processes ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=2, replicas=2) as c:
        yield c


def queue_history(lb: LogBook, tag: str) -> list[tuple[int, bytes]]:
    """Every record tagged ``tag`` in ``lb``'s book, in seqnum order."""
    out: list[tuple[int, bytes]] = []
    s = 0
    while (rec := lb.read_next(s, tag=tag)) is not None:
        out.append((rec.seqnum, rec.data))
        s = rec.seqnum + 1
    return out


def test_one_queue_seen_from_two_engines(cluster: ziplog.LocalCluster) -> None:
    with LogBook(cluster.zk_hosts, 300) as lb, LogBook(cluster.zk_hosts, 300) as elsewhere:
        a = BokiQueue(lb, NAME)
        assert a.pop() is None
        seqnums = [a.push(b"1"), a.push(b"2"), a.push(b"")]
        assert seqnums == sorted(seqnums)
        BokiQueue(lb, "elsewhere").push(b"not jobs")
        # a session on another engine handed this one's position (as Boki hands a child its
        # parent's) pops at once what was pushed: its reads are at cuts at or above it
        b = BokiQueue(LogBook("", 300, _engine=elsewhere._engine, _position=lb.position), NAME)
        assert b.pop() == b"1"
        assert a.pop() == b"2" and b.pop() == b"" and a.pop() is None and b.pop() is None
        with pytest.raises(TypeError):
            a.push("text")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            BokiQueue(lb, "")


ITEMS = 60  # per producer
ACTORS = 4  # producers, and consumers
WAIT = 60.0  # the longest a consumer waits for a push or the end (a hang fails, never a slow run)


class Progress:
    """Pushes done and elements popped, shared by the threads: a consumer that found the
    queue empty waits for a push it has not seen popped, not for a clock."""

    def __init__(self, total: int) -> None:
        self.cond = threading.Condition()
        self.total = total
        self.pushed = 0
        self.popped = 0
        self.failed = False

    def add(self, pushed: int = 0, popped: int = 0) -> None:
        with self.cond:
            self.pushed += pushed
            self.popped += popped
            self.cond.notify_all()

    def fail(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()

    def more_to_pop(self) -> bool:
        """Wait until an element may be there to pop (True) or all are popped (False)."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.failed or self.popped == self.total or self.pushed > self.popped,
                                      WAIT):
                raise AssertionError(f"no push nor pop for {WAIT:g} s: {self.pushed} pushed, {self.popped} popped")
            if self.failed:
                raise AssertionError("another thread failed")
            return self.popped < self.total


def test_producers_and_consumers_pop_every_element_once_fifo_per_producer(cluster: ziplog.LocalCluster) -> None:
    book = 301
    progress = Progress(ACTORS * ITEMS)
    popped: list[list[bytes]] = [[] for _ in range(ACTORS)]
    consumer_ids = [0] * ACTORS
    errors: list[BaseException] = []

    def producer(p: int) -> None:
        try:
            with LogBook(cluster.zk_hosts, book) as lb:
                queue = BokiQueue(lb, NAME)
                for i in range(ITEMS):
                    queue.push(b"%d:%04d" % (p, i))
                    progress.add(pushed=1)
        except BaseException as exc:  # reported below: a thread's failure must fail the test
            errors.append(exc)
            progress.fail()

    def consumer(c: int) -> None:
        try:
            with LogBook(cluster.zk_hosts, book) as lb:
                queue = BokiQueue(lb, NAME)
                consumer_ids[c] = queue.consumer
                while progress.more_to_pop():
                    data = queue.pop()
                    if data is not None:
                        popped[c].append(data)
                        progress.add(popped=1)
        except BaseException as exc:
            errors.append(exc)
            progress.fail()

    threads = [threading.Thread(target=producer, args=(i,)) for i in range(ACTORS)]
    threads += [threading.Thread(target=consumer, args=(i,)) for i in range(ACTORS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors

    pushed = {b"%d:%04d" % (p, i) for p in range(ACTORS) for i in range(ITEMS)}
    everything = [d for got in popped for d in got]
    assert len(everything) == len(pushed) and set(everything) == pushed  # each exactly once, nothing else
    with LogBook(cluster.zk_hosts, book) as lb:
        takes = list(q.takes(NAME, queue_history(lb, TAG)))
    # a fresh engine's replay of the log agrees with what every consumer was handed
    for c in range(ACTORS):
        assert popped[c] == [t.element[1] for t in takes if t.consumer == consumer_ids[c] and t.element is not None]
    in_log_order = [t.element[1] for t in takes if t.element is not None]
    for p in range(ACTORS):  # FIFO per producer: its elements popped in its push order
        mine = [d for d in in_log_order if d.startswith(b"%d:" % p)]
        assert mine == sorted(mine) and len(mine) == ITEMS
    empty = sum(t.element is None for t in takes)
    print(f"{len(everything)} elements through {len(takes)} pop records ({empty} found the queue empty); "
          f"per consumer {[len(got) for got in popped]}")


def test_a_consumer_that_only_polls_an_empty_queue_sees_a_later_push(cluster: ziplog.LocalCluster) -> None:
    """A consumer whose pops find the queue empty appends nothing, so its session's
    position never moves: its engine must still take in what arrives, or it would read
    the snapshot of its first pop for good and never see another engine's push."""
    with LogBook(cluster.zk_hosts, 302) as consumer_lb, LogBook(cluster.zk_hosts, 302) as producer_lb:
        consumer = BokiQueue(consumer_lb, NAME)
        assert consumer.pop() is None
        pushed = BokiQueue(producer_lb, NAME).push(b"later")
        deadline = time.monotonic() + WAIT
        while (got := consumer.pop()) is None:
            assert time.monotonic() < deadline, f"the push at {pushed} was never seen by a polling consumer"
            time.sleep(0.005)
        assert got == b"later"
