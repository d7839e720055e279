"""Subscriber merge: delivers a gsn only when every member of its epoch has passed it."""

from __future__ import annotations

import pytest

from ziplog.cores.merge import MergeError, SubscriberMerge
from ziplog.protocol.gsna import epoch_base, epoch_end

B0, B1 = epoch_base(0), epoch_base(1)


def drain(m: SubscriberMerge) -> list[int]:
    out = []
    while (item := m.pop()) is not None:
        out.append(item[0])
    return out


def test_waits_for_every_member() -> None:
    m = SubscriberMerge(1)
    m.on_batch(0, [[B0 + 1, b"a"], [B0 + 3, b"c"]], [[0, 0, [0, 1]]], B0 + 3)
    assert drain(m) == []  # shard 1 has said nothing yet
    m.on_batch(1, [[B0 + 2, b"b"]], [], B0 + 2)
    assert drain(m) == [B0 + 1, B0 + 2]  # B0+3 waits: shard 1 may still own something below it
    m.on_batch(1, [], [], B0 + 10)
    assert drain(m) == [B0 + 3]


def test_crosses_epochs_and_membership_changes() -> None:
    m = SubscriberMerge(1)
    m.on_batch(0, [[B0 + 1, b"a"]], [[0, 0, [0]], [1, 1, [0, 1]]], epoch_end(0))
    assert drain(m) == [B0 + 1]
    m.on_batch(0, [[B1 + 5, b"x"]], [], B1 + 5)
    assert drain(m) == []  # shard 1 joined in epoch 1
    assert m.known_shards() >= {0, 1}
    m.on_batch(1, [[B1 + 2, b"y"]], [[1, 1, [0, 1]]], B1 + 7)
    assert drain(m) == [B1 + 2, B1 + 5]


def test_empty_epochs_are_skipped() -> None:
    m = SubscriberMerge(1)
    m.on_batch(0, [[B1 + 1, b"a"]], [[0, 0, []], [1, 1, [0]]], B1 + 1)
    assert drain(m) == [B1 + 1]


def test_contradictions_are_loud() -> None:
    m = SubscriberMerge(1)
    m.on_batch(0, [], [[0, 0, [0, 1]]], 0)
    with pytest.raises(MergeError):
        m.on_batch(1, [], [[0, 0, [1]]], 0)
    m = SubscriberMerge(1)
    m.on_batch(0, [[B0 + 4, b"a"]], [[0, 0, [0]]], B0 + 4)
    with pytest.raises(MergeError):
        m.on_batch(0, [[B0 + 4, b"again"]], [], B0 + 5)
    m = SubscriberMerge(1)
    m.on_batch(0, [], [[0, 0, [0]]], 0)
    with pytest.raises(MergeError):  # a record from a shard that is no member of its epoch
        m.on_batch(1, [[B0 + 1, b"z"]], [], epoch_end(0))
        m.on_batch(0, [], [], epoch_end(0))


def test_start_position_skips_earlier_records() -> None:
    m = SubscriberMerge(B0 + 3)
    m.on_batch(0, [[B0 + 3, b"c"], [B0 + 4, b"d"]], [[0, 0, [0]]], B0 + 4)
    assert drain(m) == [B0 + 3, B0 + 4]
