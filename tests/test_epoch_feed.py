"""A subscriber's epoch feed (``ziplog.protocol.epoch_feed``): EPOCH_SAME frames resolve
to exactly the configuration their epoch was committed with, whatever frames are lost,
late or reordered and whatever block ZooKeeper holds when a missing base is read; a base
that cannot be had is asked for once."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ziplog.protocol.epoch_feed import MAX_UNAVAILABLE, BlockWanted, EpochFeed
from ziplog.protocol.gsna import EpochConfig


def _block(first: int, last: int, cfg: EpochConfig) -> dict:
    return {"epoch": first, "last": last, "shards": list(cfg.shards), "rates": list(cfg.rates)}


@st.composite
def announcements(draw: st.DrawFn) -> tuple[list[tuple[int, int, EpochConfig]], list[tuple[int, int | None]], int]:
    """Committed blocks (first, last, config) and the frames a leader sent for them: per
    block a full frame at the first epoch it broadcast and EPOCH_SAME frames naming it
    after; a new leader's block starts at its predecessor's last epoch's successor, and a
    block may be cut short (a membership change)."""
    blocks: list[tuple[int, int, EpochConfig]] = []
    frames: list[tuple[int, int | None]] = []  # (epoch, base or None: full)
    epoch = draw(st.integers(0, 50))
    for _ in range(draw(st.integers(1, 6))):
        shards = tuple(sorted(draw(st.sets(st.integers(0, 9), min_size=1, max_size=4))))
        cfg = EpochConfig(epoch, shards, tuple(draw(st.integers(1, 5000)) for _ in shards))
        length = draw(st.integers(1, 10))
        blocks.append((epoch, epoch + length - 1, cfg))
        sent = draw(st.integers(1, length))  # cut short after `sent` broadcasts
        for e in range(epoch, epoch + sent):
            frames.append((e, None if e == epoch else epoch))
        epoch += sent
    return blocks, frames, draw(st.integers(0, 2**32))


@settings(max_examples=300, deadline=None)
@given(announcements(), st.data())
def test_resolved_configs_are_the_committed_ones(case, data) -> None:
    blocks, frames, _ = case
    truth = {e: cfg.at(e) for first, last, cfg in blocks for e in range(first, last + 1)}

    def block_of(epoch: int) -> dict:
        for first, last, cfg in blocks:
            if first <= epoch <= last:
                return _block(first, last, cfg)
        raise AssertionError(epoch)

    # lose some frames, deliver the rest with bounded lateness
    lost = data.draw(st.lists(st.booleans(), min_size=len(frames), max_size=len(frames)))
    kept = [f for f, gone in zip(frames, lost) if not gone]
    order = sorted(range(len(kept)), key=lambda i: i + data.draw(st.integers(0, 3)))
    feed = EpochFeed()
    newest = -1
    for i in order:
        epoch, base = kept[i]
        newest = max(newest, epoch)
        got: EpochConfig | BlockWanted | None
        if base is None:
            got = feed.on_full(truth[epoch])
        else:
            got = feed.on_same(epoch, base)
            if isinstance(got, BlockWanted):
                assert got == BlockWanted(epoch, base)
                # ZooKeeper holds the block of the newest epoch sent so far, or a later one
                later = data.draw(st.integers(0, 1))
                newest_block = max(i for i, b in enumerate(blocks) if b[0] <= newest)
                pick = blocks[min(newest_block + later, len(blocks) - 1)]
                got = feed.on_block(got, _block(pick[0], pick[1], pick[2]))
        if got is not None:
            assert got == truth[epoch], (epoch, got, truth[epoch])
            assert got.epoch == epoch


def test_a_missing_base_is_read_once_and_a_stale_block_resolves_nothing() -> None:
    feed = EpochFeed()
    cfg = EpochConfig(20, (0, 1), (100, 200))
    wanted = feed.on_same(23, 20)
    assert wanted == BlockWanted(23, 20)
    # ZooKeeper already holds the next block: the epoch counts as missed
    assert feed.on_block(wanted, _block(30, 39, cfg.at(30))) is None
    assert feed.on_same(24, 20) is None and feed.on_same(25, 20) is None  # not asked again
    assert feed.unresolved == 3
    # a block that covers base and epoch resolves it, and the base serves the next ones
    wanted = feed.on_same(32, 30)
    assert isinstance(wanted, BlockWanted)
    assert feed.on_block(wanted, _block(30, 39, cfg.at(30))) == cfg.at(32)
    assert feed.on_same(33, 30) == cfg.at(33) and feed.fetched == 1 and feed.resolved == 1
    # an epoch past the block's last is not the block's
    wanted = feed.on_same(45, 40)
    assert isinstance(wanted, BlockWanted) and feed.on_block(wanted, _block(40, 44, cfg.at(40))) is None


def test_bad_blocks_and_bases_are_refused() -> None:
    feed = EpochFeed()
    block: object
    for block in (None, [], {"epoch": "1"}, {"epoch": 1, "shards": ["a"], "rates": [1]},
                  {"epoch": 1, "shards": [1, 0], "rates": [1, 1]}, {"epoch": 1, "shards": [0], "rates": [0]},
                  {"epoch": 1, "last": 9, "shards": [0]}, {"epoch": 1.0, "last": 9, "shards": [0], "rates": [1]}):
        wanted = BlockWanted(5, 1)
        assert feed.on_block(wanted, block) is None, block
    for epoch, base in ((5, 5), (5, 6), (5, -1)):
        try:
            feed.on_same(epoch, base)
        except ValueError:
            continue
        raise AssertionError((epoch, base))


def test_the_memories_are_bounded() -> None:
    feed = EpochFeed()
    for base in range(1000):
        wanted = feed.on_same(base + 1, base)
        assert isinstance(wanted, BlockWanted)
        feed.on_block(wanted, None)
        feed.on_full(EpochConfig(base, (0,), (1,)))
    assert len(feed._unavailable) == MAX_UNAVAILABLE and len(feed._bases) <= 4
