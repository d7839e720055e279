"""The membership history (pure): ``[[first_epoch, members], ...]`` as the membership
service commits it to ZooKeeper, and the per-epoch ranges read from it."""

from __future__ import annotations

from typing import Any, NamedTuple


class EpochState(NamedTuple):
    """What ZooKeeper holds when a membership service leader starts: the committed epoch
    block (None: nothing yet) and the membership history, each with its node's version."""

    block: dict[str, Any] | None
    block_version: int
    history: list[list[Any]]
    history_version: int


def members_in_history(history: list[list[Any]], epoch: int) -> tuple[int, ...]:
    """Members of ``epoch`` according to a membership history (empty before the first)."""
    members: tuple[int, ...] = ()
    for first, m in history:
        if first <= epoch:
            members = tuple(m)
        else:
            break
    return members


def history_ranges(history: list[list[Any]], first: int, last: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """Epochs first..last as (first, last, members) ranges."""
    out: list[tuple[int, int, tuple[int, ...]]] = []
    if last < first:
        return out
    points = sorted({first} | {f for f, _ in history if first < f <= last})
    for i, p in enumerate(points):
        end = points[i + 1] - 1 if i + 1 < len(points) else last
        out.append((p, end, members_in_history(history, p)))
    return out
