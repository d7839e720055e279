"""An index node's core (sans-I/O): the feeder's Feeds in, lookups answered at a cut,
lookups that ask for a cut the node has not reached parked until it does.

The node's index (:class:`~ziplog.logbook.core.index.IndexNode`) holds the entries of
the epochs the assignment gives it and every trim. A Feed is taken only if the node
already knows everything up to its ``from_gsn`` (so what it knows is always a prefix of
the log: nothing is ever missing below its watermark); what it already has is skipped,
so a Feed sent again after a rewind, or by a second feeder, changes nothing. A restarted
node starts empty at watermark 0, answers ``Fed(accepted=False)`` to the next Feed, and
the feeder goes back to feed it from the start: the same records in the same order give
the same answers.

A node also keeps the bytes of its newest entries that the feeder sent with them
(:class:`~ziplog.logbook.core.kept.KeptRecords`) and answers a lookup that asks for it
with its hit's record, if it still keeps it.
"""

from __future__ import annotations

import heapq
from typing import Iterator, cast

from ziplog.cores.effects import Messages
from ziplog.logbook.core import frames as f
from ziplog.logbook.core.index import Assignment, IndexNode
from ziplog.logbook.core.kept import KEEP_BYTES, KeptRecords
from ziplog.protocol.gsna import epoch_of

#: a parked lookup is answered BEHIND after this long (its asker asks again)
PARK_NS = 5_000_000_000
#: lookups parked at once at most (more are answered BUSY)
MAX_PARKED = 4096


class NodeCore:
    def __init__(self, node: int, park_ns: int = PARK_NS, max_parked: int = MAX_PARKED,
                 keep_bytes: int = KEEP_BYTES) -> None:
        self.node = node
        self.index = IndexNode(node, Assignment([(0, node + 1)]))
        #: the records of the newest entries, to answer lookups with
        self.kept = KeptRecords(keep_bytes)
        #: the assignment history the feeds so far routed by (empty: none came yet)
        self.history: list[tuple[int, int]] = []
        self.park_ns = park_ns
        self.max_parked = max_parked
        #: (cut, seq, deadline, route, lookup), smallest cut first
        self._parked: list[tuple[int, int, int, bytes, f.Lookup]] = []
        self._seq = 0
        #: times this node forgot its index for an assignment step below its watermark
        self.resets = 0

    @property
    def watermark(self) -> int:
        return self.index.watermark

    # -- the feed ---------------------------------------------------------------------------------
    def on_feed(self, route: bytes, feed: f.Feed, now: int) -> Messages:
        """A Feed sealed by a cluster member (the driver checked the seal)."""
        problem = f.check_feed(feed) or self._check_history(feed) or self._check_owner(feed)
        if problem is not None:
            return [(route, f.Failed(req=0, code=f.BAD_FEED, message=problem))]
        if len(feed.history) < len(self.history):
            # from a feeder that did not know a step this node was fed under: routed by an
            # assignment no longer in force (a dead feeder's late frame)
            return [(route, f.Failed(req=0, code=f.BAD_FEED, message=(
                f"fed by an older assignment {feed.history}, this node has {self.history}")))]
        if self._routed_otherwise(feed):
            # nodes were added from an epoch this node indexed under the old assignment:
            # what it holds from there on is routed the old way. It forgets it all and is
            # fed again (the feeder goes back when it refuses the feed below); answers
            # wait meanwhile, as after a restart.
            self.index = IndexNode(self.node, Assignment(feed.history))
            self.kept.clear()
            self.history = []
            self.resets += 1
        index = self.index
        if feed.from_gsn > index.watermark:
            # a gap: something between our watermark and the feed's start never came
            return [(route, f.Fed(gen=feed.gen, node=self.node, watermark=index.watermark, accepted=False))]
        if len(feed.history) > len(self.history):
            self.history = [(int(a), int(b)) for a, b in feed.history]
            index.assignment = Assignment(self.history)
        records = dict(feed.records)
        for kind, item in _merged(feed, index.watermark):
            if kind == 0:
                e = cast(tuple[int, int, int, tuple[int, ...]], item)
                index.on_entry(e[0], e[1], e[2], e[3])
                data = records.get(e[0])
                if data is not None:
                    self.kept.add(e[0], data)
            else:
                t = cast(tuple[int, int, int], item)
                index.on_trim(t[0], t[1], t[2])
        index.on_watermark(feed.watermark)
        out: Messages = [(route, f.Fed(gen=feed.gen, node=self.node, watermark=index.watermark, accepted=True))]
        out.extend(self._release(now))
        return out

    def _routed_otherwise(self, feed: f.Feed) -> bool:
        """Whether the feed's assignment adds a step from an epoch at or below what this
        node has indexed (the feeder never does, but a feeder's view can lag a dead
        one's late frames)."""
        if not self.history or len(feed.history) <= len(self.history):
            return False
        return feed.history[len(self.history)][0] <= epoch_of(self.index.watermark)

    def _check_history(self, feed: f.Feed) -> str | None:
        """The history only grows: a feed's must extend the one this node has."""
        mine, theirs = self.history, [(int(a), int(b)) for a, b in feed.history]
        short, long = (mine, theirs) if len(mine) <= len(theirs) else (theirs, mine)
        if long[:len(short)] != short:
            return f"the assignment history {theirs} contradicts {mine}"
        if self.node >= theirs[-1][1]:
            return f"node {self.node} is not in the assignment {theirs}"
        return None

    def _check_owner(self, feed: f.Feed) -> str | None:
        assignment = Assignment(feed.history)
        for gsn, *_ in feed.entries:
            if assignment.node_of(gsn) != self.node:
                return f"the entry at gsn {gsn} belongs to node {assignment.node_of(gsn)}"
        return None

    # -- lookups ----------------------------------------------------------------------------------
    def on_lookup(self, route: bytes, q: f.Lookup, now: int) -> Messages:
        index = self.index
        if q.exact and q.cut < index.floor:
            return [(route, f.Failed(req=q.req, code=f.TOO_OLD, floor=index.floor,
                                     message=f"node {self.node} answers no cut below {index.floor}"))]
        if q.cut <= index.watermark:
            return [(route, self._answer(q))]
        if any(r == route and p.req == q.req for _, _, _, r, p in self._parked):
            return []  # a resend of a lookup parked here: it is answered once
        if len(self._parked) >= self.max_parked:
            return [(route, f.Failed(req=q.req, code=f.BUSY, message=f"{self.max_parked} lookups wait here"))]
        self._seq += 1
        heapq.heappush(self._parked, (q.cut, self._seq, now + self.park_ns, route, q))
        return []

    def _answer(self, q: f.Lookup) -> f.Found:
        index = self.index
        cut = q.cut if q.exact else index.watermark
        find = index.next if q.how == f.NEXT else index.prev
        hit = find(q.book, q.tag, q.seqnum, cut)
        return f.Found(req=q.req, cut=cut, found=hit is not None, gsn=hit.gsn if hit else 0,
                       shard=hit.shard if hit else 0, trim_point=index.trim_point(q.book, cut),
                       watermark=index.watermark,
                       nodes=index.assignment.nodes_at(epoch_of(cut)) if self.history else 0,
                       trimmed_top=index.trimmed_top(q.book, q.tag, cut),
                       record=self.kept.get(hit.gsn) if q.record and hit is not None else None)

    def _release(self, now: int) -> Messages:
        out: Messages = []
        parked = self._parked
        while parked and parked[0][0] <= self.index.watermark:
            _, _, _, route, q = heapq.heappop(parked)
            out.extend(self.on_lookup(route, q, now))
        return out

    def tick(self, now: int) -> Messages:
        """Answer BEHIND what waited longer than ``park_ns``."""
        if not self._parked or all(deadline > now for _, _, deadline, _, _ in self._parked):
            return []
        out: Messages = []
        keep = []
        for item in self._parked:
            cut, _, deadline, route, q = item
            if deadline <= now:
                out.append((route, f.Failed(req=q.req, code=f.BEHIND, message=(
                    f"node {self.node} is at gsn {self.index.watermark}, not yet at {cut}"))))
            else:
                keep.append(item)
        heapq.heapify(keep)
        self._parked = keep
        return out

    def status(self, req: int) -> f.NodeState:
        index = self.index
        return f.NodeState(req=req, node=self.node, watermark=index.watermark, floor=index.floor, size=index.size,
                           nodes=self.history[-1][1] if self.history else 0, kept=len(self.kept),
                           keeps=self.kept.max_bytes)


def _merged(feed: f.Feed, above: int) -> Iterator[tuple[int, object]]:
    """The feed's entries (0) and trims (1) with gsns above ``above``, in gsn order."""
    entries = [(e[0], 0, e) for e in feed.entries if e[0] > above]
    trims = [(t[0], 1, t) for t in feed.trims if t[0] > above]
    for _, kind, item in heapq.merge(entries, trims):
        yield kind, item
