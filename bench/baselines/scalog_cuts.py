"""Scalog's ordering arithmetic (dissertation 3.3.1), with no I/O: local cuts -> global
cut, and a sequence of global cuts -> the global sequence number (gsn) of every record.

Shapes. A deployment has ``m`` shards; shard ``s`` has ``n_s`` storage servers, each
the primary of one *log segment*. The segment of server ``i`` of shard ``s`` is named
``(s, i)``; its records are numbered ``0, 1, 2, ...`` in the order ``i`` received them.

* A **local cut** of server ``i`` of shard ``s`` is a vector of length ``n_s``: entry
  ``j`` counts the records of segment ``(s, j)`` that ``i`` holds (its own for ``j == i``,
  replicated ones otherwise). Replication is FIFO, so a count is always a prefix.
* A **global cut** ``c`` maps each segment to how many of its records are durable:
  ``c[s][j] = min over servers i of shard s of local_i[j]`` (every replica holds them).
* Cuts are totally ordered by the ordering layer: ``c_0 = 0, c_1, c_2, ...`` with each
  ``c_k >= c_{k-1}`` element-wise. The records of cut ``k`` are those in
  ``c_k - c_{k-1}``; they get the gsns ``total(c_{k-1}) ... total(c_k) - 1`` in
  lexicographic order: lower shard first, within a shard lower server first, within a
  segment by record number.

gsns are 0-based here: the gsn of a record is the number of records ordered before it.
Everything is exact integer arithmetic; a violated invariant raises ``CutError``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

#: cut[shard][server] = number of records of that segment covered by the cut
Cut = tuple[tuple[int, ...], ...]
#: shape[shard] = number of storage servers (segments) in that shard
Shape = tuple[int, ...]


class CutError(AssertionError):
    """A cut broke an invariant (wrong shape, went backwards, skipped in the sequence)."""


def zero_cut(shape: Sequence[int]) -> Cut:
    """The cut before any record: every segment at 0."""
    if not shape or any(n < 1 for n in shape):
        raise CutError(f"every shard needs at least one server, got shape {tuple(shape)}")
    return tuple((0,) * n for n in shape)


def shape_of(cut: Cut) -> Shape:
    return tuple(len(row) for row in cut)


def total(cut: Cut) -> int:
    """Records ordered up to and including ``cut`` (the paper's sum of a cut's elements)."""
    return sum(sum(row) for row in cut)


def flatten(cut: Cut) -> list[int]:
    """The wire form: segments in (shard, server) order."""
    return [x for row in cut for x in row]


def unflatten(shape: Sequence[int], flat: Sequence[int]) -> Cut:
    if len(flat) != sum(shape):
        raise CutError(f"a flat cut of shape {tuple(shape)} has {sum(shape)} entries, got {len(flat)}")
    out: list[tuple[int, ...]] = []
    at = 0
    for n in shape:
        out.append(tuple(int(x) for x in flat[at:at + n]))
        at += n
    return tuple(out)


def combine(local_cuts: Sequence[Sequence[Sequence[int]]]) -> Cut:
    """The global cut from every server's local cut.

    ``local_cuts[s][i]`` is server ``i`` of shard ``s``'s vector over its shard's
    segments; the result's ``[s][j]`` is the element-wise minimum over ``i`` (records of
    segment ``(s, j)`` held by every replica, hence durable)."""
    out: list[tuple[int, ...]] = []
    for s, reports in enumerate(local_cuts):
        n = len(reports)
        if n == 0:
            raise CutError(f"shard {s} has no servers")
        for i, vec in enumerate(reports):
            if len(vec) != n:
                raise CutError(f"server {i} of shard {s} reported {len(vec)} segments, shard has {n}")
            if any(x < 0 for x in vec):
                raise CutError(f"server {i} of shard {s} reported a negative count: {list(vec)}")
        out.append(tuple(min(reports[i][j] for i in range(n)) for j in range(n)))
    return tuple(out)


def check_advance(prev: Cut, new: Cut) -> bool:
    """Raise unless ``new`` is a legal successor of ``prev`` (same shape, no segment
    going back); return whether it covers any new record."""
    if shape_of(prev) != shape_of(new):
        raise CutError(f"cut shape changed from {shape_of(prev)} to {shape_of(new)}")
    grew = False
    for s, (a_row, b_row) in enumerate(zip(prev, new)):
        for i, (a, b) in enumerate(zip(a_row, b_row)):
            if b < a:
                raise CutError(f"segment ({s}, {i}) went back from {a} to {b}")
            if b > a:
                grew = True
    return grew


@dataclass(frozen=True)
class Span:
    """Records ``first_index .. first_index + count - 1`` of segment ``(shard, server)``
    get gsns ``first_gsn .. first_gsn + count - 1``."""

    shard: int
    server: int
    first_index: int
    first_gsn: int
    count: int


def interleave(prev: Cut, new: Cut) -> Iterator[Span]:
    """The deterministic rule between two consecutive cuts: the newly covered records of
    every segment, in gsn order (lower shard, then lower server, first). Empty
    segments are skipped."""
    check_advance(prev, new)
    gsn = total(prev)
    for s, (a_row, b_row) in enumerate(zip(prev, new)):
        for i, (a, b) in enumerate(zip(a_row, b_row)):
            if b > a:
                yield Span(s, i, a, gsn, b - a)
                gsn += b - a


def span_of(prev: Cut, new: Cut, shard: int, server: int, prev_total: int | None = None) -> Span:
    """Just segment ``(shard, server)``'s part of :func:`interleave` (``count`` may be
    0), in O(segments) without materialising the other spans. ``prev_total`` saves
    recomputing ``total(prev)`` when the caller tracks it."""
    base = total(prev) if prev_total is None else prev_total
    before = 0  # records of lower segments newly covered by ``new``
    for s in range(shard):
        before += sum(new[s]) - sum(prev[s])
    a_row, b_row = prev[shard], new[shard]
    for i in range(server):
        before += b_row[i] - a_row[i]
    a, b = a_row[server], b_row[server]
    if b < a:
        raise CutError(f"segment ({shard}, {server}) went back from {a} to {b}")
    return Span(shard, server, a, base + before, b - a)


class SegmentOrder:
    """What one storage server needs: follow the cut sequence and say which of its own
    segment's records each new cut orders, and at which gsns.

    Cuts must arrive in sequence (``number`` 1, 2, 3, ...); the rule depends on the
    previous cut, so a skipped cut would silently shift every later gsn."""

    def __init__(self, shape: Sequence[int], shard: int, server: int) -> None:
        if not (0 <= shard < len(shape) and 0 <= server < shape[shard]):
            raise CutError(f"segment ({shard}, {server}) is not in shape {tuple(shape)}")
        self.shape: Shape = tuple(shape)
        self.shard = shard
        self.server = server
        self.cut: Cut = zero_cut(shape)
        self.cut_total = 0
        self.number = 0  # sequence number of ``self.cut``; the zero cut is 0

    def on_cut(self, number: int, new: Cut) -> Span:
        if number != self.number + 1:
            raise CutError(f"cut {number} arrived after cut {self.number}: cuts must not be skipped or repeated")
        check_advance(self.cut, new)
        span = span_of(self.cut, new, self.shard, self.server, self.cut_total)
        self.cut, self.number = new, number
        self.cut_total = total(new)
        return span


class CutLog:
    """The whole cut sequence, for answering ``gsn_of`` and ``record_at`` about any
    record (tests; a reader that wants a record's position)."""

    def __init__(self, shape: Sequence[int]) -> None:
        self.shape: Shape = tuple(shape)
        self.cuts: list[Cut] = [zero_cut(shape)]
        self.totals: list[int] = [0]
        #: per segment, its count in each cut: bisect finds the cut that covered a record
        self._counts: dict[tuple[int, int], list[int]] = {
            (s, i): [0] for s, n in enumerate(self.shape) for i in range(n)}

    def append(self, new: Cut) -> None:
        """Add the next cut; a cut covering nothing new is ignored (it orders nothing)."""
        if not check_advance(self.cuts[-1], new):
            return
        self.cuts.append(new)
        self.totals.append(total(new))
        for (s, i), counts in self._counts.items():
            counts.append(new[s][i])

    @property
    def ordered(self) -> int:
        """How many records the latest cut orders (gsns ``0 .. ordered - 1``)."""
        return self.totals[-1]

    def gsn_of(self, shard: int, server: int, index: int) -> int:
        """The gsn of record ``index`` (0-based) of segment ``(shard, server)``."""
        counts = self._counts[(shard, server)]
        if not 0 <= index < counts[-1]:
            raise KeyError(f"record {index} of segment ({shard}, {server}) is not ordered yet ({counts[-1]} are)")
        k = bisect_right(counts, index)  # first cut whose count exceeds index
        span = span_of(self.cuts[k - 1], self.cuts[k], shard, server, self.totals[k - 1])
        return span.first_gsn + (index - span.first_index)

    def record_at(self, gsn: int) -> tuple[int, int, int]:
        """The inverse of :meth:`gsn_of`: ``(shard, server, index)`` of the record at ``gsn``."""
        if not 0 <= gsn < self.ordered:
            raise KeyError(f"gsn {gsn} is not ordered yet ({self.ordered} are)")
        k = bisect_right(self.totals, gsn)  # cut k covers gsn
        for span in interleave(self.cuts[k - 1], self.cuts[k]):
            if gsn < span.first_gsn + span.count:
                return span.shard, span.server, span.first_index + (gsn - span.first_gsn)
        raise CutError(f"cut {k} does not cover gsn {gsn}")  # unreachable if totals are right
