"""LogBook's blocking client: ``ziplog.logbook.LogBook``, Boki's API on ziplog.

    from ziplog.logbook import LogBook
    with LogBook(zk_hosts, book_id=7) as lb:
        s = lb.append(b"hello", tags=[1, "user:42"])
        rec = lb.read_next(0, tag="user:42")      # the first record of the book with that tag
        tail = lb.check_tail()
        child = lb.child()                         # sees at least what lb has seen

A :class:`LogBook` is a session on one book: it carries its position (see
:mod:`ziplog.logbook.core.session`) and shares an :class:`Engine` with its children.
The engine is one ziplog client and a complete index of the log kept by its own
subscription (Boki's engine with a local index), or, when the cluster runs an index
tier (IndiLog: ``ziplog.logbook.local_logbook`` starts one), a bounded cache of the
log's recent suffix that asks the tier what it cannot answer. Lookups wait until the
engine's index reached the session's position.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from ziplog.client.blocking import Client
from ziplog.io import zk, zk_logbook
from ziplog.logbook.core import frames as tf
from ziplog.logbook.core import records as r
from ziplog.logbook.core import session as s
from ziplog.logbook.core.aggregator import Result
from ziplog.logbook.core.cache import CAPACITY as CACHE_ENTRIES
from ziplog.logbook.core.cache import SuffixCache
from ziplog.logbook.core.index import Assignment, Hit, HitRecord, IndexNode
from ziplog.logbook.core.kept import KeptRecords
from ziplog.logbook.tier import TierLink
from ziplog.protocol.errors import ForbiddenError, ZiplogError, ZiplogTimeoutError
from ziplog.protocol.types import RecordId

__all__ = ["LogBook", "LogRecord", "Engine"]

LogRecord = s.LogRecord

#: aux data entries an engine keeps (least recently used dropped first)
AUX_ENTRIES = 100_000
#: bytes of the newest entries' records an engine keeps from its subscription, to answer
#: a read whose hit it keeps without reading the record from the log (0: none)
RECORD_BYTES = 16 << 20
#: A lookup takes in what arrived (one runtime turn that does not wait) when the last
#: such turn is older than this: a session that only reads never moves its position, so
#: nothing else would turn the runtime, and a poller (a consumer at an empty queue) would
#: read its first snapshot for good. At most one poll a millisecond, so a tight loop of
#: reads pays nearly nothing; ``refresh()`` takes in everything at once.
LOOKUP_FRESH_NS = 1_000_000


#: how an engine finds its answers (see :class:`EngineState`)
INDEX_MODES = ("auto", "local", "tier", "nodes")
#: ``"auto"`` asks the index nodes itself (``"nodes"``) when the tier wants at most this
#: many, and an aggregator (``"tier"``) past it: a lookup asks every node, and with a few
#: the hop saved is worth more than the engine's fan-out (``bench logbook``: direct p50
#: 0.63x the aggregator's with two nodes), while many engines each asking many nodes is
#: what the aggregator is for
DIRECT_NODES_MAX = 4


class EngineState:
    """What an engine holds apart from its I/O (shared by the blocking and asyncio
    engines): its index, the aux-data cache, and how a lookup is answered.

    ``index="local"``: a complete index of the log in the engine, fed by its own
    subscription from the start of the log (Boki's engine). ``"tier"``: the index tier
    answers through an aggregator, and the engine keeps only a bounded cache (the log's
    recent suffix from its start on, and the tails the tier told it) that answers when it
    can; ``"nodes"``: the same, the engine asking the index nodes itself. ``"auto"``:
    ``"tier"`` when the cluster has an index tier, else ``"local"``.

    Every mode also keeps the newest entries' records its subscription delivered (at
    most ``record_bytes``, records of at most 32 KiB; the lowest gsns go first): a read
    whose hit it keeps is answered with that record, not read from the log again (they
    are the log's stable records: the same bytes ``read_record`` returns)."""

    def __init__(self, timeout: float, aux_entries: int, record_bytes: int = RECORD_BYTES) -> None:
        self.timeout = timeout
        self.mode = "local"
        #: the newest entries' records, as the subscription delivered them
        self.kept = KeptRecords(record_bytes)
        self.index = IndexNode(0, Assignment([(0, 1)]))
        self.cache: SuffixCache | None = None
        self.aux: OrderedDict[int, bytes] = OrderedDict()
        self.aux_entries = aux_entries
        #: the log's stable-prefix watermark when the engine started: no lookup is
        #: answered below it, so a fresh session sees at least what was there then
        #: (Boki's engines follow the metalog all along; this one catches up on demand)
        self.floor = 0
        #: tier results by lookup key, until the waiting call takes them
        self.results: dict[int, Result] = {}
        self._key = 0
        #: ask the tier for a hit's record with its lookup (one round instead of two
        #: where an index node keeps it)
        self.records_with_lookups = True

    def start_at(self, floor: int, mode: str, cache_entries: int) -> int:
        """Set the engine up at the log's watermark ``floor``; the gsn its subscription
        starts at."""
        self.floor = floor
        self.mode = mode
        if mode == "local":
            return 0
        self.cache = SuffixCache(floor, cache_entries)
        return floor + 1

    @property
    def watermark(self) -> int:
        return self.index.watermark if self.cache is None else self.cache.watermark

    def feed(self, gsn: int, shard: int, data: bytes) -> None:
        rec = r.decode(data)
        if type(rec) is r.Entry and len(data) <= tf.RECORD_IN_ANSWER_MAX:
            self.kept.add(gsn, data)
        if self.cache is not None:
            self.cache.on_decoded(gsn, shard, rec)
            return
        if type(rec) is r.Entry:
            self.index.on_entry(gsn, shard, rec.book, rec.tags)
        elif type(rec) is r.Trim:
            self.index.on_trim(gsn, rec.book, rec.seqnum)

    def on_watermark(self, gsn: int) -> None:
        if self.cache is not None:
            self.cache.on_watermark(gsn)
        else:
            self.index.on_watermark(gsn)

    def answer(self, op: s.Lookup) -> tuple[Any, ...] | None:
        """The lookup at the engine's watermark (the caller caught it up to
        ``op.min_cut``), or None: the tier must answer it."""
        assert self.watermark >= op.min_cut
        cache = self.cache
        if cache is not None:
            if not op.gapless:
                got = cache.answer(op.how, op.book, op.tag, op.seqnum)
                return None if got is None else (got[0], self._with_record(got[1]))
            # A trim point at or below the replay's start took nothing it needs (0: no
            # gap); above it, only the index nodes know what the trim took of the tag.
            point = cache.trim_point(op.book)
            if point is None or point > op.seqnum:
                return None
            got = cache.answer(op.how, op.book, op.tag, op.seqnum)
            return None if got is None else (got[0], self._with_record(got[1]), 0)
        cut = self.index.watermark
        find = self.index.next if op.how == "next" else self.index.prev
        hit = self._with_record(find(op.book, op.tag, op.seqnum, cut))
        return (cut, hit, self.index.trimmed_top(op.book, op.tag, cut)) if op.gapless else (cut, hit)

    def _with_record(self, hit: Hit | None) -> Hit | HitRecord | None:
        """The hit with its record, if the engine keeps it."""
        data = None if hit is None else self.kept.get(hit.gsn)
        if hit is None or data is None:
            return hit
        return HitRecord(hit.gsn, hit.shard, data)

    def caught_up(self, rec: Any, sub_position: int, position: int) -> bool:
        """One step of catching the index up to ``position`` from the engine's
        subscription: ``rec`` (a record to feed: not yet) or None (the subscription is at
        ``sub_position``: done, or the index did not get there in time)."""
        if rec is not None:
            self.feed(rec.rid.gsn, rec.rid.shard, rec.data)
            return False
        self.on_watermark(sub_position)
        if self.watermark >= position:
            return True
        raise ZiplogTimeoutError(f"the index did not reach gsn {position} within {self.timeout}s")

    def ask_tier(self, tier: TierLink, op: s.Lookup) -> int:
        """Send the lookup the engine could not answer to the tier; its result's key."""
        self._key += 1
        tier.lookup(self._key, op.how, op.book, op.tag, op.seqnum, max(op.min_cut, self.floor),
                    record=self.records_with_lookups)
        return self._key

    def on_result(self, res: Result) -> None:
        self.results[res.key] = res  # type: ignore[index]

    def take(self, key: int, op: s.Lookup) -> tuple[Any, ...]:
        """The tier's result for lookup ``key`` (learned by the cache), or its error."""
        res = self.results.pop(key)
        if res.error is not None:
            if res.error == tf.BEHIND:
                raise ZiplogTimeoutError(f"the LogBook index tier: {res.message}")
            if res.error == tf.FORBIDDEN:
                raise ForbiddenError(f"the LogBook index tier: {res.message}")
            raise ZiplogError(f"the LogBook index tier refused a lookup: {res.error} {res.message}")
        assert res.cut >= op.min_cut, ("the tier answered below the asked cut", res.cut, op.min_cut)
        assert self.cache is not None
        self.cache.learn(op.book, op.tag, op.how, op.seqnum, res.cut, res.hit, res.trim_point)
        hit: Hit | HitRecord | None = res.hit
        if res.hit is not None and res.record is not None:
            hit = HitRecord(res.hit.gsn, res.hit.shard, res.record)
        else:
            hit = self._with_record(res.hit)
        return (res.cut, hit, res.trimmed_top) if op.gapless else (res.cut, hit)

    def set_aux(self, seqnum: int, aux: bytes) -> None:
        self.aux[seqnum] = aux
        self.aux.move_to_end(seqnum)
        while len(self.aux) > self.aux_entries:
            self.aux.popitem(last=False)

    def get_aux(self, seqnum: int) -> bytes | None:
        aux = self.aux.get(seqnum)
        if aux is not None:
            self.aux.move_to_end(seqnum)
        return aux

    def with_aux(self, rec: LogRecord | None) -> LogRecord | None:
        if rec is None:
            return None
        aux = self.get_aux(rec.seqnum)
        return rec if aux is None else LogRecord(rec.seqnum, rec.data, rec.tags, rec.names, aux)


def choose_mode(index: str, zk_hosts: str, timeout: float) -> str:
    """The engine's index mode (``"auto"`` looks in ZooKeeper for a tier, and at how many
    index nodes it wants: :data:`DIRECT_NODES_MAX`)."""
    if index not in INDEX_MODES:
        raise ValueError(f"index is one of {INDEX_MODES}, not {index!r}")
    if index != "auto":
        return index
    session = zk.connect(zk_hosts, timeout=timeout)
    try:
        if not zk_logbook.exists(session):
            return "local"
        wanted = zk_logbook.desired_or_none(session)
        return "nodes" if wanted is not None and wanted <= DIRECT_NODES_MAX else "tier"
    finally:
        zk.stop(session)


class Engine(EngineState):
    """One ziplog client, the engine's index (see :class:`EngineState`) fed by its
    subscription, and the aux-data cache; shared by the sessions of one thread."""

    def __init__(self, zk_hosts: str, timeout: float = 30.0, aux_entries: int = AUX_ENTRIES, index: str = "auto",
                 cache_entries: int = CACHE_ENTRIES, key_file: str | None = None,
                 record_bytes: int = RECORD_BYTES) -> None:
        super().__init__(timeout, aux_entries, record_bytes)
        mode = choose_mode(index, zk_hosts, timeout)
        self.client = Client(zk_hosts, timeout=timeout, key_file=key_file)
        self.tier: TierLink | None = None
        try:
            start = self.start_at(self.client.watermark(), mode, cache_entries)
            self.sub = self.client.subscribe(RecordId(start, -1))
            if mode != "local":
                self.tier = TierLink(self.client.runtime, zk_hosts, "nodes" if mode == "nodes" else "aggregator",
                                     int(timeout * 1e9), self.on_result)
        except BaseException:
            self.client.close()
            raise
        self.closed = False
        self._fresh_at = 0  # monotonic ns of the last turn a lookup made

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.tier is not None:
                self.tier.close()
            self.sub.close()
            self.client.close()

    def refresh(self) -> None:
        """Take in what has arrived: one turn of the client's runtime that does not wait.
        A lookup is answered at the engine's watermark once it reached the session's
        position; it turns the runtime itself only while the engine is below that
        position, or when its last turn is older than LOOKUP_FRESH_NS (a session that only
        reads, a poller at an empty queue, would otherwise read one snapshot for good).
        This turn takes in everything now."""
        self.client.runtime.run_once(0)

    def catch_up(self, position: int) -> None:
        """Feed the index everything delivered so far, and at least up to ``position``
        (Boki's rule: an index behind the reader's position does not answer it)."""
        sub = self.sub
        while not self.caught_up(sub.next_until(position, self.timeout), sub.position, position):
            pass

    def perform(self, op: s.Op) -> Any:
        if type(op) is s.Insert:
            rid = self.client.insert_after(op.data, RecordId(*op.after))
            return rid.gsn, rid.shard
        if type(op) is s.ReadRecord:
            return self.client.read_record(RecordId(*op.rid))
        assert type(op) is s.Lookup
        now = time.monotonic_ns()
        if now - self._fresh_at >= LOOKUP_FRESH_NS:
            self._fresh_at = now
            self.client.runtime.run_once(0)
        self.catch_up(max(op.min_cut, self.floor))
        got = self.answer(op)
        if got is not None:
            return got
        assert self.tier is not None
        key = self.ask_tier(self.tier, op)
        self.client.runtime.run_until(lambda: key in self.results)
        return self.take(key, op)


class SessionBase:
    """What both twins' sessions hold: the book, the engine (their own, or their
    parent's), and the position."""

    def __init__(self, book_id: int, engine: Any, own_engine: bool, position: int) -> None:
        if not isinstance(book_id, int) or isinstance(book_id, bool) or not 0 <= book_id < 1 << 64:
            raise ValueError("a book id is an integer in 0..2**64-1")
        self.book_id = book_id
        self._own_engine = own_engine
        self._engine = engine
        self._pos = s.Position(position)

    @property
    def position(self) -> int:
        """Every answer this session got was computed at a cut at or below this gsn, and
        every later one will be at or above it (Boki's metalog position)."""
        return self._pos.gsn

    def observe(self, gsn: int) -> None:
        """Make this session's later answers reflect everything up to ``gsn`` (another
        session's ``position`` handed over, as Boki hands a child on another engine its
        parent's position, or a seqnum learned elsewhere)."""
        self._pos.reached(gsn)

    def _child_args(self) -> dict[str, Any]:
        """A child: the same book and engine, starting at this session's position."""
        return {"_engine": self._engine, "_position": self._pos.gsn}


class LogBook(SessionBase):
    """A session on book ``book_id``. Not thread-safe: one engine per thread."""

    def __init__(self, zk_hosts: str, book_id: int, *, timeout: float = 30.0, index: str = "auto",
                 key_file: str | None = None, _engine: Engine | None = None, _position: int = 0) -> None:
        """``index``: how the engine finds answers (see :class:`EngineState`); ``key_file``:
        the client key of a cluster that speaks CURVE (default ``$ZIPLOG_CLIENT_KEY_FILE``)."""
        super().__init__(book_id, _engine if _engine is not None else Engine(zk_hosts, timeout, index=index,
                                                                            key_file=key_file),
                         _engine is None, _position)
        self._engine: Engine

    def child(self) -> "LogBook":
        """A session on the same book and engine that starts at this one's position."""
        return LogBook("", self.book_id, **self._child_args())

    def refresh(self) -> None:
        """Let this session's next reads see everything the engine has received (a read
        alone takes in what arrived at most once a millisecond: LOOKUP_FRESH_NS)."""
        self._engine.refresh()

    def on_book(self, book_id: int) -> "LogBook":
        """A session on book ``book_id`` with this one's engine, starting at this one's
        position (a library that keeps two books, as BokiFlow keeps its locks apart)."""
        return LogBook("", book_id, _engine=self._engine, _position=self._pos.gsn)

    def close(self) -> None:
        if self._own_engine:
            self._engine.close()

    def __enter__(self) -> "LogBook":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _drive(self, steps: s.Steps) -> Any:
        return s.drive(steps, self._engine.perform)

    # -- Boki's API ---------------------------------------------------------------------------------
    def append(self, data: bytes, tags: "list[int | str] | tuple[int | str, ...]" = ()) -> int:
        """Append ``data`` with ``tags``; its seqnum (above everything this session saw)."""
        result: int = self._drive(s.append(self._pos, self.book_id, data, tags))
        return result

    def read_next(self, min_seqnum: int, tag: int | str | None = None, *, gapless: bool = False) -> LogRecord | None:
        """The first record of the book with ``tag`` (None: any) and seqnum >= ``min_seqnum``.
        ``gapless``: ``TrimmedError`` if a trim took a record of the tag at or above
        ``min_seqnum`` (a replay must not skip what it needed)."""
        return self._with_aux(self._drive(s.read(self._pos, "next", self.book_id, tag, min_seqnum, gapless)))

    def read_prev(self, max_seqnum: int, tag: int | str | None = None) -> LogRecord | None:
        """The last record of the book with ``tag`` (None: any) and seqnum <= ``max_seqnum``."""
        return self._with_aux(self._drive(s.read(self._pos, "prev", self.book_id, tag, max_seqnum)))

    def check_tail(self, tag: int | str | None = None) -> LogRecord | None:
        """The book's last record with ``tag`` (None: any)."""
        return self.read_prev(s.MAX_SEQNUM, tag)

    def trim(self, trim_seqnum: int) -> None:
        """Trim the book: its records with seqnum < ``trim_seqnum`` are gone for every
        read at a cut past the trim."""
        self._drive(s.trim(self._pos, self.book_id, trim_seqnum))

    def set_aux_data(self, seqnum: int, aux: bytes) -> None:
        """Attach ``aux`` to the record at ``seqnum`` in this engine's cache
        (best-effort, as in Boki: a restart forgets it)."""
        self._engine.set_aux(seqnum, bytes(aux))

    def _with_aux(self, rec: LogRecord | None) -> LogRecord | None:
        return self._engine.with_aux(rec)
