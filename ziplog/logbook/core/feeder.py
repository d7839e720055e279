"""The feeder's core (sans-I/O): the log, read by one subscription, routed to the index
nodes (IndiLog's index tier): each entry to the node its epoch is assigned to, every
trim to every node, each batch closed by the subscription's position (everything at or
below it was delivered) as the nodes' watermark.

* **Restartable**: the feeder keeps nothing. It starts reading at the lowest watermark
  of the nodes (it asks each its status first); a node that restarted empty refuses the
  next Feed (``Fed(accepted=False)`` with its watermark) and the feeder **rewinds**: it
  reads again from there (``rewind_to``), and the nodes that are ahead skip what they
  have. ``gen`` counts rewinds, so the refusals of Feeds sent before one are not taken
  for new gaps.
* **Flow**: at most ``window`` Feeds unanswered per node; while a registered node's
  window is full, or an assignment change is being written, the feeder reads no more
  (``paused``). A Feed unanswered for ``ack_ns`` (a node that restarted at the same
  address lost it) resets the node's window and asks again from the position, which
  finds a gap if there is one.
* **Nodes added**: a larger desired count becomes a new step of the assignment history,
  written to ZooKeeper (:class:`WriteAssignment`) before another record is routed. It
  starts at the epoch after the highest gsn anything was routed up to: the feeder's
  highest position and every watermark a node reported (a rewound feeder's position is
  not enough: records past it were routed already, and a node ahead skips them when they
  come again, so they must stay where the old assignment put them). It waits until every
  node of the assignment has said where it is.
* **Records**: an entry's record of at most ``record_max`` bytes goes with it
  (``Feed.records``), for the node to answer lookups with, unless the node said it keeps
  none (``NodeState.keeps`` 0); a Feed carries at most FEED_RECORD_BYTES of them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator

from ziplog.cores.effects import Messages
from ziplog.logbook.core import frames as f
from ziplog.logbook.core import records as r
from ziplog.logbook.core.index import Assignment
from ziplog.protocol.gsna import epoch_of

#: Feeds in flight per node at most
WINDOW = 8
#: a Feed unanswered this long is taken as lost
ACK_NS = 2_000_000_000


@dataclass
class WriteAssignment:
    """Coordination write: the assignment ``history``, if ZooKeeper's version of it is
    still ``version``; answered with :meth:`FeederCore.on_assignment_written`."""
    history: list[tuple[int, int]]
    version: int


class _Link:
    __slots__ = ("addr", "inflight", "watermark", "asked_at", "keeps")

    def __init__(self, addr: str, now: int) -> None:
        self.addr = addr
        #: when the node was last asked its state (asked again until it answers)
        self.asked_at = now
        #: when each unanswered Feed was sent, oldest first
        self.inflight: deque[int] = deque()
        #: the node's watermark as it last said (-1: not heard from)
        self.watermark = -1
        #: whether the node keeps records (it said so in its state): none are sent it if not
        self.keeps = True


class FeederCore:
    def __init__(self, history: list[tuple[int, int]], version: int, window: int = WINDOW, ack_ns: int = ACK_NS,
                 record_max: int = f.RECORD_IN_ANSWER_MAX) -> None:
        assert 0 <= record_max <= f.RECORD_IN_ANSWER_MAX
        #: entries' records up to this size go with them (0: none)
        self.record_max = record_max
        self.history = history
        self.version = version
        self.assignment = Assignment(history)
        self.window = window
        self.ack_ns = ack_ns
        self.links: dict[int, _Link] = {}
        #: everything at or below it was read and routed (None: not started)
        self.position: int | None = None
        self.gen = 0
        #: where the driver must read from again (exclusive), once
        self.rewind_to: int | None = None
        self._writing: WriteAssignment | None = None
        self._desired = self.assignment.nodes
        self.rewinds = 0
        #: the highest gsn anything was routed up to, as far as this feeder knows
        self.high = 0

    # -- nodes and the assignment -------------------------------------------------------------
    def on_nodes(self, addrs: dict[int, str], now: int) -> Messages:
        """The nodes registered now (node -> address). A new address is asked for its
        state (its answer tells where it is)."""
        out: Messages = []
        for node in list(self.links):
            if node not in addrs:
                del self.links[node]
        for node, addr in addrs.items():
            link = self.links.get(node)
            if link is None or link.addr != addr:
                self.links[node] = _Link(addr, now)
                out.append(((addr,), f.Status(req=node)))
        return out

    def on_state(self, state: f.NodeState, now: int) -> Messages:
        link = self.links.get(state.node)
        if link is None or state.node >= self.assignment.nodes:
            return []
        link.watermark = state.watermark
        link.keeps = state.keeps > 0
        self.high = max(self.high, state.watermark)
        if self.position is None:
            return []
        if state.watermark < self.position:
            self._rewind(state.watermark)
            return []
        return [self._probe(link, now)]

    def start(self) -> int | None:
        """The position to read from (exclusive) once every node of the assignment said
        where it is: the lowest of their watermarks (None: not yet)."""
        if self.position is not None:
            return self.position
        marks = [self.links[n].watermark if n in self.links else -1 for n in range(self.assignment.nodes)]
        if min(marks) < 0:
            return None
        self.position = min(marks)
        return self.position

    def on_desired(self, nodes: int) -> None:
        """The operator wants ``nodes`` index nodes (nodes are only ever added)."""
        self._desired = max(self._desired, nodes)

    def growth(self) -> WriteAssignment | None:
        """The assignment to write now for the nodes wanted, once (None: nothing to
        write, or not yet: a write is under way, or some node has not said where it is)."""
        if self._writing is not None or self.position is None or self._desired <= self.assignment.nodes:
            return None
        if any(n not in self.links or self.links[n].watermark < 0 for n in range(self.assignment.nodes)):
            return None
        # past everything routed, and past the last step (the history only grows)
        first = max(epoch_of(max(self.high, self.position)) + 1, self.history[-1][0] + 1)
        history = [*self.history, (first, self._desired)]
        self._writing = WriteAssignment(history, self.version)
        return self._writing

    def on_assignment_written(self, history: list[tuple[int, int]], version: int) -> None:
        """ZooKeeper holds ``history`` at ``version`` (written by this feeder, or read
        after another one's write won)."""
        self._writing = None
        if len(history) >= len(self.history):
            self.history, self.version = history, version
            self.assignment = Assignment(history)

    # -- the log ----------------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        if self._writing is not None or self.position is None:
            return True
        return any(len(link.inflight) >= self.window for link in self.links.values())

    def on_batch(self, records: Iterable[tuple[int, int, bytes]], position: int, now: int) -> Messages:
        """Records ``(gsn, shard, data)`` read, in gsn order, and the subscription's
        position after them: a Feed per node. After a rewind they are dropped (the driver
        reads them again from the rewind's point)."""
        assert self.position is not None, "not started"
        if self.rewind_to is not None:
            return []
        n = self.assignment.nodes
        entries: list[list[f.FedEntry]] = [[] for _ in range(n)]
        sent: list[dict[int, bytes]] = [{} for _ in range(n)]
        trims: list[f.FedTrim] = []
        for gsn, shard, data in records:
            rec = r.decode(data)
            if type(rec) is r.Entry:
                node = self.assignment.node_of(gsn)
                entries[node].append((gsn, shard, rec.book, rec.tags))
                if len(data) <= self.record_max:
                    sent[node][gsn] = data
            elif type(rec) is r.Trim:
                trims.append((gsn, rec.book, rec.seqnum))
        out: Messages = []
        start = self.position
        position = max(position, start)
        for node, link in self.links.items():
            if node < n:
                out.extend(self._feeds(link, start, position, entries[node], trims, sent[node] if link.keeps else {},
                                       now))
        self.position = position
        self.high = max(self.high, position)
        return out

    def _feeds(self, link: _Link, start: int, end: int, entries: list[f.FedEntry], trims: list[f.FedTrim],
               records: dict[int, bytes], now: int) -> Messages:
        """Feeds covering ``(start, end]`` with at most MAX_FEED_ITEMS items and
        FEED_RECORD_BYTES of records each."""
        items: list[tuple[int, int, object]] = sorted([(e[0], 0, e) for e in entries] + [(t[0], 1, t) for t in trims])
        out: Messages = []
        for chunk, more in _chunks(items, records):
            last = chunk[-1][0] if more else end
            feed = f.Feed(gen=self.gen, from_gsn=start, watermark=last, history=list(self.history),
                          entries=[it for _, k, it in chunk if k == 0],  # type: ignore[misc]
                          trims=[it for _, k, it in chunk if k == 1],  # type: ignore[misc]
                          records=[(g, records[g]) for g, k, _ in chunk if k == 0 and g in records])
            out.append(((link.addr,), feed))
            link.inflight.append(now)
            start = last
        return out

    def _probe(self, link: _Link, now: int) -> tuple[tuple[str], f.Feed]:
        """An empty Feed from the position: taken if the node has it all, else refused
        with its watermark (a gap to rewind to)."""
        assert self.position is not None
        link.inflight.append(now)
        return ((link.addr,), f.Feed(gen=self.gen, from_gsn=self.position, watermark=self.position,
                                     history=list(self.history), entries=[], trims=[]))

    def on_fed(self, fed: f.Fed, now: int) -> None:
        link = self.links.get(fed.node)
        if link is None:
            return
        if link.inflight:
            link.inflight.popleft()
        link.watermark = fed.watermark
        self.high = max(self.high, fed.watermark)
        if not fed.accepted and fed.gen == self.gen:
            self._rewind(fed.watermark)

    def _rewind(self, to: int) -> None:
        assert self.position is not None
        if to >= self.position:
            return
        self.gen += 1
        self.rewinds += 1
        self.position = to
        self.rewind_to = to if self.rewind_to is None else min(self.rewind_to, to)

    def rewound(self) -> int:
        """The driver reads again from the returned gsn (exclusive)."""
        assert self.rewind_to is not None
        to, self.rewind_to = self.rewind_to, None
        return to

    def tick(self, now: int) -> Messages:
        """Feeds unanswered for ``ack_ns`` are taken as lost: the node is asked again; so
        is a node that did not say its state."""
        out: Messages = []
        for node, link in self.links.items():
            if link.watermark < 0 and now - link.asked_at >= self.ack_ns:
                link.asked_at = now
                out.append(((link.addr,), f.Status(req=node)))
        if self.position is None:
            return out
        for node, link in self.links.items():
            if node < self.assignment.nodes and link.inflight and now - link.inflight[0] >= self.ack_ns:
                link.inflight.clear()
                out.append(self._probe(link, now))
        return out


def _chunks(items: list[tuple[int, int, object]], records: dict[int, bytes]) -> Iterator[tuple[list[tuple[int, int, object]], bool]]:
    """``items`` cut into Feeds' worth (MAX_FEED_ITEMS items, FEED_RECORD_BYTES of
    ``records`` at most), each with whether more follow; at least one, maybe empty."""
    chunk: list[tuple[int, int, object]] = []
    size = 0
    for item in items:
        n = len(records.get(item[0], b"")) if item[1] == 0 else 0
        if chunk and (len(chunk) == f.MAX_FEED_ITEMS or size + n > f.FEED_RECORD_BYTES):
            yield chunk, True
            chunk, size = [], 0
        chunk.append(item)
        size += n
    yield chunk, False
