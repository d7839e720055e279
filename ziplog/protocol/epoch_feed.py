"""A subscriber's side of the epoch announcements (pure): EPOCH frames in, epoch
configurations out.

The membership service commits a block of epochs with one configuration before it
broadcasts any of them. Its first broadcast of a block is a full EPOCH (members and
rates, the *base*); the block's later epochs go out as EPOCH_SAME, "epoch ``e`` has the
configuration of epoch ``base``", a few bytes whatever the number of shards. An epoch's
configuration is fixed once its block is committed (a block starting at an epoch is
committed once, and nobody plans an epoch again), so an EPOCH_SAME resolves against the
base frame it names, exactly.

A subscriber that missed the base (it connected late, a frame was lost, or a new leader
took over between a base and its followers) asks for the committed block
(:class:`BlockWanted`) and resolves the epoch from it when the block covers both the
base and the epoch; otherwise the epoch counts as missed, which every subscriber already
handles (a primary reads the membership history for the epochs it never saw and
assigns nothing in them). A base that could not be had is not asked for again, so a
stream of EPOCH_SAME frames naming it costs one read, not one per frame."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from ziplog.protocol.frames import EpochSame
from ziplog.protocol.gsna import EpochConfig

#: bases kept (a new leader's base and a late frame of the old one's may interleave)
MAX_BASES = 4
#: bases that could not be had, remembered so that their frames are not asked about again
MAX_UNAVAILABLE = 16


@dataclass(frozen=True, slots=True)
class BlockWanted:
    """Epoch ``epoch`` has the configuration of epoch ``base``, which this subscriber does
    not have: the committed block may say (:meth:`EpochFeed.on_block`)."""

    epoch: int
    base: int


class EpochFeed:
    def __init__(self) -> None:
        self._bases: OrderedDict[int, EpochConfig] = OrderedDict()
        self._unavailable: deque[int] = deque(maxlen=MAX_UNAVAILABLE)
        #: EPOCH_SAME frames resolved from a base frame, from a block read, and not at all
        self.resolved = 0
        self.fetched = 0
        self.unresolved = 0

    def on_message(self, msg: Any) -> EpochConfig | BlockWanted | None:
        """A decoded broadcast (``frames.decode_epoch``: an EPOCH or an EPOCH_SAME); a
        ValueError for a configuration that breaks the rules (``EpochConfig``)."""
        if type(msg) is EpochSame:
            return self.on_same(msg.epoch, msg.base)
        return self.on_full(EpochConfig(msg.epoch, tuple(msg.shards), tuple(msg.rates)))

    def on_full(self, cfg: EpochConfig) -> EpochConfig:
        """A full EPOCH: the configuration, and a base for the frames that name its epoch."""
        self._remember(cfg)
        return cfg

    def on_same(self, epoch: int, base: int) -> EpochConfig | BlockWanted | None:
        """An EPOCH_SAME: the configuration, or the block to read for it, or None (its base
        could not be had before: the epoch counts as missed)."""
        if not 0 <= base < epoch:
            raise ValueError(f"epoch {epoch} names base {base}, which is not an earlier epoch")
        cfg = self._bases.get(base)
        if cfg is not None:
            self.resolved += 1
            return cfg.at(epoch)
        if base in self._unavailable:
            self.unresolved += 1
            return None
        return BlockWanted(epoch, base)

    def on_block(self, wanted: BlockWanted, block: Any) -> EpochConfig | None:
        """The committed block as ZooKeeper holds it (``{epoch, last, shards, rates}``; None
        or anything else: not to be had): the configuration of ``wanted.epoch`` when the
        block covers it and its base, else None (the epoch counts as missed)."""
        cfg = _block_config(block)
        if cfg is None or not cfg.epoch <= wanted.base < wanted.epoch <= _block_last(block):
            self._unavailable.append(wanted.base)
            self.unresolved += 1
            return None
        self.fetched += 1
        self._remember(cfg.at(wanted.base))
        return cfg.at(wanted.epoch)

    def _remember(self, cfg: EpochConfig) -> None:
        bases = self._bases
        bases[cfg.epoch] = cfg
        bases.move_to_end(cfg.epoch)
        while len(bases) > MAX_BASES:
            bases.popitem(last=False)


def _block_config(block: Any) -> EpochConfig | None:
    if not isinstance(block, dict) or type(block.get("epoch")) is not int:
        return None
    shards, rates = block.get("shards"), block.get("rates")
    if not isinstance(shards, list) or not isinstance(rates, list) \
            or not all(type(x) is int for x in shards) or not all(type(x) is int for x in rates):
        return None
    try:
        return EpochConfig(block["epoch"], tuple(shards), tuple(rates))
    except ValueError:
        return None


def _block_last(block: dict[str, Any]) -> int:
    last = block.get("last", block["epoch"])
    return last if type(last) is int else -1
