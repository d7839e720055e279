"""The stable-prefix watermark (pure): the largest gsn W such that every gsn up to W is
decided and stable on every member shard of its epoch, so no record can ever appear at
or below W later. The same rule as a subscriber's merge (``SubscriberMerge.deliverable``),
computed from each shard's stable watermark and the committed membership history.

Safety needs the history to be at least as new as the stables: read the stables first,
then the history (a shard's stable never covers an epoch whose membership is not yet
committed, since the membership service commits before it broadcasts).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ziplog.protocol.gsna import epoch_end, epoch_of


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
