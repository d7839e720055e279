"""The stable-prefix watermark (pure): the largest gsn W such that every gsn up to W is
decided and stable on every member shard of its epoch, so no record can ever appear at
or below W later. The same rule as a subscriber's merge (``SubscriberMerge.deliverable``),
computed from each shard's stable watermark and the committed membership history.

Safety needs the history to be at least as new as the stables: read the stables first,
then the history (a shard's stable never covers an epoch whose membership is not yet
committed, since the membership service commits before it broadcasts).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from ziplog.cores.client.state import ClientState
from ziplog.protocol import frames as wire
from ziplog.protocol.gsna import epoch_end, epoch_of

#: a gsn above every real one: COUNT from here answers with the replica's stable watermark
PAST_EVERY_GSN = (1 << 63) - 1
#: a RANGE answer carries about this much data
RANGE_BYTES = 1 << 20


def stable_watermark(history: Sequence[Sequence[Any]], stables: Mapping[int, int], floor: int = 0) -> int:
    """``history``: [[first_epoch, members], ...] in epoch order; ``stables``: each
    shard's stable watermark (a shard missing counts as 0). ``floor``: a watermark known
    already (the answer is never below it)."""
    if not history:
        return floor
    g = floor
    while True:
        e = epoch_of(g + 1)
        i = None
        for k in range(len(history) - 1, -1, -1):
            if history[k][0] <= e:
                i = k
                break
        if i is None:
            return g  # before the first epoch: nothing is decided yet
        members = history[i][1]
        last = history[i + 1][0] - 1 if i + 1 < len(history) else None
        if not members:
            if last is None:
                return g
            g = epoch_end(last)
            continue
        p = min(stables.get(s, 0) for s in members)
        if last is not None and p >= epoch_end(last):
            g = epoch_end(last)
            continue
        return max(g, p)


def shards_in(history: Sequence[Sequence[Any]]) -> list[int]:
    """Every shard a member of some epoch of ``history``."""
    return sorted({s for _, members in history for s in members})


class WatermarkQuery:
    """What a client does to learn the watermark: ask every shard of the history for its
    stable watermark (:meth:`to_ask`, :meth:`got`), then read the history again
    (:meth:`on_history`); a shard that history names and was not asked is asked in
    another round. Each shard counts with the best answer the client ever had from it,
    and the result is never below a watermark the client returned before: every one of
    them stays true, and a reader (a Spark offset, a LogBook position) must never see
    the watermark move back."""

    def __init__(self, history: Sequence[Sequence[Any]], client: ClientState) -> None:
        self.history = history
        self.client = client
        self.stables: dict[int, int] = {}

    def to_ask(self) -> list[int]:
        return [s for s in shards_in(self.history) if s not in self.stables]

    @staticmethod
    def request(req: int) -> wire.Count:
        return wire.Count(req_id=req, lo=PAST_EVERY_GSN, hi=PAST_EVERY_GSN, nth=0)

    def got(self, shard: int, answer: wire.CountOk | None) -> None:
        """``answer``: the shard's COUNT_OK, or None when it could not be asked (it counts
        as 0: the watermark waits for it)."""
        self.stables[shard] = self.client.learn_servable(shard, answer.upto if answer is not None else 0)

    def on_history(self, history: Sequence[Sequence[Any]]) -> int | None:
        """The history read after the answers: the watermark, or None for another round."""
        self.history = history
        if self.to_ask():
            return None
        w = stable_watermark(history, self.stables, self.client.watermark)
        self.client.watermark = w
        return w


class RangePager:
    """A read of one shard's records in ``[lo, hi]``, a RANGE at a time: the next request,
    and what an answer means (the records it carries are the caller's to hand out)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.next = lo
        self.hi = hi

    @property
    def done(self) -> bool:
        return self.next > self.hi

    def request(self) -> Callable[[int], wire.Range]:
        lo, hi = self.next, self.hi
        return lambda req: wire.Range(req_id=req, lo=lo, hi=hi, max_bytes=RANGE_BYTES)

    def on_answer(self, answer: wire.RangeOk) -> bool:
        """Take an answer; False when it moved nothing (the replica asked is behind)."""
        if answer.upto < self.next:
            return False
        self.next = answer.upto + 1
        return True
