"""Subscriber merge (sans-I/O): turns per-shard subscription batches into one stream
in gsn order with no gaps.

Each shard streams its records in gsn order plus a *progress* watermark ``p``:
every slot of that shard with gsn <= p is stable and its records up to p have
been sent. Each shard also sends which shards were members of each epoch. A
gsn ``g`` of epoch ``e`` may be delivered only when every member of ``e`` has
progress >= g; then nothing below g can still appear, and because progress
only ever covers stable positions, nothing delivered can later vanish.

No-ops are never delivered: they are simply the gsns no shard sent a record for.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from typing import Any, Iterable, Sequence

from ziplog.protocol.gsna import epoch_end, epoch_of


class MergeError(AssertionError):
    """The shards' streams contradict each other: an invariant is broken."""


class SubscriberMerge:
    def __init__(self, start_gsn: int) -> None:
        assert start_gsn >= 1
        self.start = start_gsn
        self.delivered = start_gsn - 1  # every gsn <= delivered has been decided on
        self.last_delivered_gsn = 0
        self.progress: dict[int, int] = {}
        self.queues: dict[int, deque[tuple[int, bytes]]] = {}
        #: [first_epoch, last_epoch, members] ranges, contiguous, merged from all shards
        self.membership: list[list[Any]] = []
        self._ready: deque[tuple[int, int, bytes]] = deque()
        #: shard -> bytes of its records received and not yet popped (waiting for other
        #: shards' progress, or for the reader): credit its server cannot use
        self.held_bytes: dict[int, int] = {}

    # -- membership -------------------------------------------------------------------------
    def _members_range(self, epoch: int) -> list[Any] | None:
        i = bisect.bisect_right(self.membership, epoch, key=lambda r: r[0]) - 1
        if i < 0 or epoch > self.membership[i][1]:
            return None
        return self.membership[i]

    def _add_epochs(self, first: int, last: int, members: Iterable[int]) -> None:
        members = tuple(members)
        e = first
        while e <= last:  # check the overlap with what we know, range by range
            known = self._members_range(e)
            if known is None:
                break
            if tuple(known[2]) != members:
                raise MergeError(f"shards disagree on the members of epoch {e}: {known[2]} vs {members}")
            e = known[1] + 1
        if e > last:
            return
        # Shards send contiguous history, so what is new must extend what we know.
        if self.membership and e != self.membership[-1][1] + 1:
            raise MergeError(f"membership for epochs {e}..{last} does not extend the known range "
                             f"(which ends at epoch {self.membership[-1][1]})")
        if self.membership and tuple(self.membership[-1][2]) == members:
            self.membership[-1][1] = last
        else:
            self.membership.append([e, last, members])

    def members(self, epoch: int) -> tuple[int, ...] | None:
        r = self._members_range(epoch)
        return None if r is None else tuple(r[2])

    def known_shards(self) -> set[int]:
        out: set[int] = set()
        for r in self.membership:
            if r[1] >= epoch_of(self.delivered + 1):
                out.update(r[2])
        return out

    # -- input ------------------------------------------------------------------------------
    def on_batch(self, shard: int, records: Sequence[Sequence[Any]], epochs: Sequence[Sequence[Any]], progress: int) -> None:
        for first, last, members in epochs:
            self._add_epochs(first, last, members)
        q = self.queues.setdefault(shard, deque())
        # Everything up to the shard's progress (and its last record) has been sent:
        # a record at or below it would be a duplicate or out of order.
        prev = max(q[-1][0] if q else 0, self.progress.get(shard, 0), self.start - 1)
        held = 0
        for gsn, data in records:
            if gsn <= prev:
                raise MergeError(f"shard {shard} sent gsn {gsn} after {prev}: not increasing")
            q.append((gsn, data))
            held += len(data)
            prev = gsn
        self.held_bytes[shard] = self.held_bytes.get(shard, 0) + held
        if progress > self.progress.get(shard, 0):
            self.progress[shard] = progress
        self._advance()

    def resume_point(self, shard: int) -> int:
        """Where to subscribe again on ``shard`` so that nothing it already sent comes twice."""
        q = self.queues.get(shard)
        last = q[-1][0] if q else 0
        return max(last, self.progress.get(shard, 0), self.start - 1) + 1

    # -- output -----------------------------------------------------------------------------
    def deliverable(self) -> int:
        """Largest gsn below which every position is decided by every member."""
        g = self.delivered
        while True:
            r = self._members_range(epoch_of(g + 1))
            if r is None:
                return g
            members = r[2]
            if members:
                p = min(self.progress.get(s, 0) for s in members)
            else:
                p = epoch_end(r[1])
            if p >= epoch_end(r[1]):
                g = epoch_end(r[1])
                continue
            return max(g, p)

    def _advance(self) -> None:
        limit = self.deliverable()
        if limit <= self.delivered:
            return
        heads = []
        for shard, q in self.queues.items():
            if q and q[0][0] <= limit:
                out = []
                while q and q[0][0] <= limit:
                    out.append(q.popleft())
                heads.append([(g, shard, d) for g, d in out])
        if len(heads) == 1:
            merged: Iterable[tuple[int, int, bytes]] = heads[0]
        else:
            merged = heapq.merge(*heads)
        last = self.last_delivered_gsn
        for g, shard, d in merged:
            if g <= last:
                raise MergeError(f"gsn {g} delivered after {last}: two shards own one gsn or order broke")
            members = self.members(epoch_of(g))
            if members is not None and shard not in members:
                raise MergeError(f"shard {shard} sent gsn {g} in epoch {epoch_of(g)} where it is not a member")
            last = g
            self._ready.append((g, shard, d))
        self.last_delivered_gsn = last
        self.delivered = limit

    def first_ready_gsn(self) -> int | None:
        return self._ready[0][0] if self._ready else None

    @property
    def position(self) -> int:
        """Every gsn up to here has been handed out by :meth:`pop` (or holds no record):
        nothing can appear at or below it later."""
        return self._ready[0][0] - 1 if self._ready else self.delivered

    def pop(self) -> tuple[int, int, bytes] | None:
        if not self._ready:
            return None
        g, shard, d = self._ready.popleft()
        self.held_bytes[shard] -= len(d)
        return g, shard, d

    @property
    def buffered_bytes(self) -> int:
        """Bytes of records received and not yet popped, every shard's."""
        return sum(self.held_bytes.values())

    def __len__(self) -> int:
        return len(self._ready)
