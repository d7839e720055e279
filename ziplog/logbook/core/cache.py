"""An engine's bounded local index when the index tier holds the whole one (sans-I/O):
the **recent suffix** of the log, and the **popular tags'** tails the tier told it.

The cache is fed the log from ``start`` on (the engine's own subscription) and keeps at
most ``capacity`` entries and trims, dropping the oldest (``start`` moves up with them):
it knows every LogBook record in ``(start, watermark]``. It answers a lookup at the cut
``watermark`` only when that suffix decides it:

* the book's trim point at the cut must be known: learned from a tier answer at a cut
  ``c >= start`` (trims in ``(c, watermark]`` are in the suffix);
* ``read_next(s)``: when everything at or above ``max(s, trim point)`` is in the suffix;
* ``read_prev(s)``: when the suffix holds a hit, or the trim point is above ``s``, or a
  tail the tier gave for the (book, tag) at a cut ``c >= start`` with ``s >= c`` covers
  the rest (nothing in ``(c, s]`` came since, or the suffix would hold it).

Otherwise the engine asks the tier and tells the cache what it learned. Every answer is
at one cut, the cache's watermark, at or above the session's position.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from typing import Any

from ziplog.logbook.core import records as r
from ziplog.logbook.core.index import ALL, Hit

#: entries and trims the suffix holds at most
CAPACITY = 100_000
#: (book, tag) tails and books' trim points remembered at most (least recently used go)
REMEMBERED = 10_000


class _Row:
    """A (book, tag)'s seqnums in the suffix; ``head`` skips the evicted ones."""

    __slots__ = ("gsns", "shards", "head")

    def __init__(self) -> None:
        self.gsns: list[int] = []
        self.shards: list[int] = []
        self.head = 0

    def __len__(self) -> int:
        return len(self.gsns) - self.head

    def pop_front(self) -> None:
        self.head += 1
        if self.head > 64 and self.head * 2 > len(self.gsns):
            del self.gsns[:self.head]
            del self.shards[:self.head]
            self.head = 0


class SuffixCache:
    def __init__(self, start: int, capacity: int = CAPACITY, remembered: int = REMEMBERED) -> None:
        #: the cache knows every LogBook record with a gsn in (start, watermark]
        self.start = start
        self.watermark = start
        self.capacity = capacity
        self.remembered = remembered
        #: (gsn, book, tags or None for a trim), oldest first: what to evict
        self._order: deque[tuple[int, int, tuple[int, ...] | None]] = deque()
        self._rows: dict[tuple[int, int | None], _Row] = {}
        #: book -> [(gsn, seqnum)] of its trims in the suffix
        self._trims: dict[int, deque[tuple[int, int]]] = {}
        #: book -> (cut, trim point there) from the tier
        self._points: OrderedDict[int, tuple[int, int]] = OrderedDict()
        #: (book, tag) -> (cut, the last entry at that cut) from the tier
        self._tails: OrderedDict[tuple[int, int | None], tuple[int, Hit | None]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @property
    def size(self) -> int:
        return len(self._order)

    # -- the feed ---------------------------------------------------------------------------------
    def on_record(self, gsn: int, shard: int, data: bytes) -> None:
        self.on_decoded(gsn, shard, r.decode(data))

    def on_decoded(self, gsn: int, shard: int, rec: r.Record | None) -> None:
        """:meth:`on_record` of a record already decoded (None: not LogBook's)."""
        assert gsn > self.watermark, ("the cache's feed went back", gsn, self.watermark)
        if type(rec) is r.Entry:
            tags = tuple(dict.fromkeys(rec.tags))  # a tag twice (not written by entry()) counts once
            for tag in (ALL, *tags):
                row = self._rows.get((rec.book, tag))
                if row is None:
                    row = self._rows[(rec.book, tag)] = _Row()
                row.gsns.append(gsn)
                row.shards.append(shard)
            self._order.append((gsn, rec.book, tags))
        elif type(rec) is r.Trim:
            self._trims.setdefault(rec.book, deque()).append((gsn, rec.seqnum))
            self._order.append((gsn, rec.book, None))
        else:
            return
        self.watermark = gsn
        while len(self._order) > self.capacity:
            self._evict()

    def on_watermark(self, gsn: int) -> None:
        self.watermark = max(self.watermark, gsn)

    def _evict(self) -> None:
        gsn, book, tags = self._order.popleft()
        if tags is None:
            trims = self._trims[book]
            trims.popleft()
            if not trims:
                del self._trims[book]
        else:
            for tag in (ALL, *tags):
                row = self._rows[(book, tag)]
                assert row.gsns[row.head] == gsn
                row.pop_front()
                if not row:
                    del self._rows[(book, tag)]
        self.start = gsn

    # -- what the tier said -----------------------------------------------------------------------
    def learn(self, book: int, tag: int | None, how: str, seqnum: int, cut: int, hit: Hit | None,
              trim_point: int) -> None:
        """A tier answer at ``cut``: the book's trim point there, and for a read_prev at or
        above the cut, the (book, tag)'s tail there."""
        _remember(self._points, book, (cut, trim_point), self.remembered)
        if how == "prev" and seqnum >= cut:
            _remember(self._tails, (book, tag), (cut, hit), self.remembered)

    # -- answers ----------------------------------------------------------------------------------
    def trim_point(self, book: int) -> int | None:
        """The book's trim point at the watermark, if the cache can tell."""
        known = self._points.get(book)
        if known is None or known[0] < self.start or known[0] > self.watermark:
            return None
        cut, point = known
        for gsn, seqnum in self._trims.get(book, ()):
            if gsn > cut:
                point = max(point, seqnum)
        return point

    def answer(self, how: str, book: int, tag: int | None, seqnum: int) -> tuple[int, Hit | None] | None:
        """``(cut, hit)`` at the watermark, or None: ask the tier."""
        got = self._answer(how, book, tag, seqnum)
        if got is None:
            self.misses += 1
            return None
        self.hits += 1
        return self.watermark, got[0]

    def _answer(self, how: str, book: int, tag: int | None, seqnum: int) -> tuple[Hit | None] | None:
        point = self.trim_point(book)
        if point is None:
            return None
        row = self._rows.get((book, tag))
        if how == "next":
            lo = max(seqnum, point)
            if lo <= self.start:
                return None  # entries at or below start may match: the suffix does not know them
            if row is None:
                return (None,)
            i = bisect.bisect_left(row.gsns, lo, row.head)
            return (Hit(row.gsns[i], row.shards[i]) if i < len(row.gsns) else None,)
        hi = min(seqnum, self.watermark)
        if row is not None:
            i = bisect.bisect_right(row.gsns, hi, row.head) - 1
            if i >= row.head:
                return (Hit(row.gsns[i], row.shards[i]) if row.gsns[i] >= point else None,)
        if point > hi:
            return (None,)
        tail = self._tails.get((book, tag))
        if tail is not None and self.start <= tail[0] <= hi:
            self._tails.move_to_end((book, tag))
            h = tail[1]
            return (h if h is not None and h.gsn >= point else None,)
        return None


def _remember(memo: "OrderedDict[Any, Any]", key: Any, value: Any, bound: int) -> None:
    memo[key] = value
    memo.move_to_end(key)
    while len(memo) > bound:
        memo.popitem(last=False)
