"""The LogBook index (IndiLog's index tier, sans-I/O): which index node holds which
records, one node's (book, tag) -> seqnums, and answers at one cut of the log.

* **Placement** (:class:`Assignment`): the records of epoch ``e`` are indexed on node
  ``e % n``, ``n`` the node count in force at ``e`` (a versioned history of
  ``(first_epoch, n)``: nodes are added from an epoch on, never in the middle of one).
  Every record is indexed on exactly one node; a hot tag spreads over all of them.
* **Memory**: once a node's watermark passes a trim record, the book's entries below
  the trim point are dropped and the node answers no cut below that record (its
  ``floor``: a reader is answered at a later cut instead, which Boki allows: any cut at
  or above the session's position will do). Without trims a node grows with the log.
* **A node** (:class:`IndexNode`) is fed, in gsn order, the entries of its epochs and
  every book's trim records, and the watermark ``W``: every record with a gsn at or
  below ``W`` that it must know has been fed. It answers a lookup at a cut ``C <= W``
  from exactly the records with gsns at or below ``C``: a record fed later (gsn above
  ``C``) or a trim record above ``C`` changes no answer at ``C``.
* **The cut** (:func:`choose_cut`): an answer assembled from nodes is computed at one
  cut, the smallest of their watermarks, and never below the asking session's
  position. Taking each node's best answer at its own watermark instead could return a
  later record while an earlier one is not indexed yet (Boki's "first record wins"
  would pick the wrong one).
* **Aggregation** (:func:`first`, :func:`last`): ``read_next`` takes the smallest hit
  of all nodes at the cut, ``read_prev``/``check_tail`` the largest.

Seqnums are gsns. A hit is ``(gsn, shard)``: where to read the record.
"""

from __future__ import annotations

import bisect
from typing import Iterable, NamedTuple

from ziplog.protocol.gsna import epoch_of

#: the book-wide row (``tag=None``: every entry of the book)
ALL = None
#: (book, tag) rows whose highest trimmed seqnum a node remembers one by one; beyond
#: it the oldest are folded into their book's (a replay of those tags may then be told
#: of a trim that took none of its records: refused, never silently wrong)
MAX_TRIMMED_ROWS = 1 << 20
#: the applied head of the pending trims is cut off once it is this long and half the list
COMPACT_AFTER = 1024


class Hit(NamedTuple):
    gsn: int
    shard: int


class HitRecord(NamedTuple):
    """A hit that came with its record's bytes (an index node keeps its newest
    entries' records): the reader need not read it from the log."""
    gsn: int
    shard: int
    record: bytes


class Assignment:
    """Which node indexes each epoch: ``history`` is ``[(first_epoch, nodes), ...]``,
    first epochs increasing (the versioned assignment in ZooKeeper)."""

    def __init__(self, history: Iterable[tuple[int, int]]) -> None:
        self.history = sorted((int(f), int(n)) for f, n in history)
        assert self.history and self.history[0][0] == 0, "the assignment starts at epoch 0"
        assert all(n >= 1 for _, n in self.history), "at least one index node"
        assert len({f for f, _ in self.history}) == len(self.history), "one node count per first epoch"
        self._firsts = [f for f, _ in self.history]

    def nodes_at(self, epoch: int) -> int:
        return self.history[bisect.bisect_right(self._firsts, epoch) - 1][1]

    def node_of(self, gsn: int) -> int:
        """The node that indexes the record at ``gsn``."""
        e = epoch_of(gsn)
        return e % self.nodes_at(e)

    @property
    def nodes(self) -> int:
        """How many nodes there are now (the latest count)."""
        return self.history[-1][1]


class _Row:
    """One (book, tag)'s seqnums, increasing, and the shard of each."""

    __slots__ = ("gsns", "shards")

    def __init__(self) -> None:
        self.gsns: list[int] = []
        self.shards: list[int] = []


class IndexNode:
    def __init__(self, node: int, assignment: Assignment) -> None:
        self.node = node
        self.assignment = assignment
        #: every record this node must know with a gsn at or below it has been fed
        self.watermark = 0
        #: no cut below this is answered (entries under a trim it passed are dropped)
        self.floor = 0
        #: the highest gsn fed (entries and trims), to check the feed is in order
        self._fed = 0
        self._rows: dict[tuple[int, int | None], _Row] = {}
        #: book -> the tags (and ALL) it has rows for, to drop a book's rows on a trim
        self._book_tags: dict[int, set[int | None]] = {}
        #: book -> (gsns of its trim records, the trim point in force from each on)
        self._trims: dict[int, tuple[list[int], list[int]]] = {}
        #: (gsn, book) of trims fed and not yet passed by the watermark, gsn order
        self._unapplied: list[tuple[int, int]] = []
        self._applied = 0
        #: (book, tag) -> the highest seqnum of its entries a trim dropped (at most
        #: MAX_TRIMMED_ROWS; older ones folded into ``_trimmed_books``)
        self._trimmed: dict[tuple[int, int | None], int] = {}
        self._trimmed_books: dict[int, int] = {}

    # -- the feed ---------------------------------------------------------------------------------
    def on_entry(self, gsn: int, shard: int, book: int, tags: Iterable[int]) -> None:
        """An entry record of one of this node's epochs."""
        assert self.assignment.node_of(gsn) == self.node, ("fed an entry of another node's epoch", gsn)
        self._advance(gsn)
        for tag in (ALL, *dict.fromkeys(tags)):  # a tag twice (not written by entry()) counts once
            row = self._rows.get((book, tag))
            if row is None:
                row = self._rows[(book, tag)] = _Row()
                self._book_tags.setdefault(book, set()).add(tag)
            row.gsns.append(gsn)
            row.shards.append(shard)

    def on_trim(self, gsn: int, book: int, seqnum: int) -> None:
        """A trim record (every node is fed every one): from ``gsn`` on, the book's
        entries below ``seqnum`` are gone (a trim never moves the point back)."""
        self._advance(gsn)
        gsns, points = self._trims.setdefault(book, ([], []))
        gsns.append(gsn)
        points.append(max(seqnum, points[-1] if points else 0))
        self._unapplied.append((gsn, book))

    def on_watermark(self, gsn: int) -> None:
        """Everything this node must know up to ``gsn`` has been fed."""
        if gsn > self.watermark:
            self.watermark = gsn
            self._fed = max(self._fed, gsn)
            self._compact()

    def _compact(self) -> None:
        """Drop what the trims the watermark passed hide from every cut at or above them,
        and answer no cut below them any more."""
        todo = self._unapplied
        while self._applied < len(todo) and todo[self._applied][0] <= self.watermark:
            gsn, book = todo[self._applied]
            self._applied += 1
            point = self.trim_point(book, gsn)
            for tag in list(self._book_tags.get(book, ())):
                row = self._rows[(book, tag)]
                i = bisect.bisect_left(row.gsns, point)
                if i:
                    self._note_trimmed(book, tag, row.gsns[i - 1])
                    del row.gsns[:i]
                    del row.shards[:i]
                if not row.gsns:
                    del self._rows[(book, tag)]
                    self._book_tags[book].discard(tag)
            if not self._book_tags.get(book, True):
                del self._book_tags[book]
            self.floor = max(self.floor, gsn)
            # the book's trims below the floor collapse into the one in force there
            gsns, points = self._trims[book]
            j = bisect.bisect_right(gsns, self.floor) - 1
            if j > 0:
                del gsns[:j]
                del points[:j]
        if self._applied > COMPACT_AFTER and self._applied * 2 > len(todo):
            del todo[:self._applied]
            self._applied = 0

    def _note_trimmed(self, book: int, tag: int | None, top: int) -> None:
        trimmed = self._trimmed
        key = (book, tag)
        if key in trimmed:
            trimmed[key] = max(trimmed[key], top)
            return
        trimmed[key] = top
        if len(trimmed) > MAX_TRIMMED_ROWS:
            oldest = next(iter(trimmed))
            old_top = trimmed.pop(oldest)
            old_book = oldest[0]
            self._trimmed_books[old_book] = max(self._trimmed_books.get(old_book, 0), old_top)

    def _advance(self, gsn: int) -> None:
        assert gsn > self._fed, ("the feed went back", gsn, self._fed)
        self._fed = gsn

    # -- lookups ----------------------------------------------------------------------------------
    def trim_point(self, book: int, cut: int) -> int:
        """The book's trim point for a reader at ``cut``: entries below it are gone."""
        trims = self._trims.get(book)
        if trims is None:
            return 0
        i = bisect.bisect_right(trims[0], cut)
        return trims[1][i - 1] if i else 0

    def trimmed_top(self, book: int, tag: int | None, cut: int) -> int:
        """The highest seqnum of an entry of ``(book, tag)`` that a trim in force at
        ``cut`` took from this node (0: none). A replay reading the tag from a seqnum at
        or below it would skip records it needed (``read_next(..., gapless=True)``)."""
        top = max(self._trimmed.get((book, tag), 0), self._trimmed_books.get(book, 0))
        point = self.trim_point(book, cut)
        row = self._rows.get((book, tag))
        if point and row is not None:  # entries under a trim the watermark has not passed yet
            i = bisect.bisect_left(row.gsns, point)
            if i:
                top = max(top, row.gsns[i - 1])
        return top

    def next(self, book: int, tag: int | None, min_seqnum: int, cut: int) -> Hit | None:
        """The first entry of ``book`` with ``tag`` (None: any) and a seqnum at or above
        ``min_seqnum``, among this node's entries at or below ``cut``."""
        assert self.floor <= cut <= self.watermark, ("asked at a cut this node does not answer at", cut, self.floor,
                                                     self.watermark)
        row = self._rows.get((book, tag))
        if row is None:
            return None
        lo = max(min_seqnum, self.trim_point(book, cut))
        i = bisect.bisect_left(row.gsns, lo)
        if i < len(row.gsns) and row.gsns[i] <= cut:
            return Hit(row.gsns[i], row.shards[i])
        return None

    def prev(self, book: int, tag: int | None, max_seqnum: int, cut: int) -> Hit | None:
        """The last entry of ``book`` with ``tag`` (None: any) and a seqnum at or below
        ``max_seqnum``, among this node's entries at or below ``cut``."""
        assert self.floor <= cut <= self.watermark, ("asked at a cut this node does not answer at", cut, self.floor,
                                                     self.watermark)
        row = self._rows.get((book, tag))
        if row is None:
            return None
        i = bisect.bisect_right(row.gsns, min(max_seqnum, cut)) - 1
        if i >= 0 and row.gsns[i] >= self.trim_point(book, cut):
            return Hit(row.gsns[i], row.shards[i])
        return None

    @property
    def size(self) -> int:
        """Seqnums held (every row counted) and trim records kept: what this node's
        memory grows with."""
        return sum(len(r.gsns) for r in self._rows.values()) + sum(len(g) for g, _ in self._trims.values())


def choose_cut(watermarks: Iterable[int], floors: Iterable[int], position: int) -> int | None:
    """The cut an answer assembled from nodes with these watermarks and floors is
    computed at: the smallest watermark, if it is at or above the session's ``position``
    and every node's floor (None: some node is behind; the read waits for it rather than
    go back)."""
    cut = min(watermarks)
    return cut if cut >= max(position, *floors) else None


def first(hits: Iterable[Hit | None]) -> Hit | None:
    """``read_next`` across nodes: the smallest hit."""
    return min((h for h in hits if h is not None), default=None)


def last(hits: Iterable[Hit | None]) -> Hit | None:
    """``read_prev`` and ``check_tail`` across nodes: the largest hit."""
    return max((h for h in hits if h is not None), default=None)
