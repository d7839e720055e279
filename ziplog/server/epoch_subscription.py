"""A storage replica's EPOCH subscription: broadcast frames in, epoch configurations
(with the leader they name) out, through :class:`ziplog.protocol.epoch_feed.EpochFeed`.
An EPOCH_SAME whose base this replica never saw is resolved from the committed block
in ZooKeeper (one read per missing base); one that cannot be resolved is dropped, and
the epoch counts as missed (the primary reads the membership history for it)."""

from __future__ import annotations

from typing import Any, Callable

from ziplog.io.ports import CoordinationUnavailable, StorageCoordination
from ziplog.protocol import frames as f
from ziplog.protocol.epoch_feed import BlockWanted, EpochFeed
from ziplog.protocol.gsna import EpochConfig


class EpochSubscription:
    def __init__(self, coord: StorageCoordination, trouble_log: Callable[[str, Any], None]) -> None:
        self.coord = coord
        self.trouble_log = trouble_log
        self.feed = EpochFeed()

    def take(self, frame: bytes) -> tuple[EpochConfig, int | None, int] | None:
        """The configuration a broadcast frame announces, the leader it names and its
        stamp (0: none), or None (a bad frame, logged; or an epoch whose configuration
        cannot be had)."""
        try:
            msg = f.decode_epoch(frame)
            got = self.feed.on_message(msg)
        except (f.ProtocolError, ValueError) as exc:
            self.trouble_log("bad epoch broadcast dropped", exc)
            return None
        if isinstance(got, BlockWanted):
            try:
                block = self.coord.epoch_block()
            except CoordinationUnavailable as exc:
                self.trouble_log("cannot read the epoch block now", exc)
                return None  # the epoch counts as missed; a later frame asks again
            got = self.feed.on_block(got, block)
        if got is None:
            return None
        assert isinstance(got, EpochConfig)
        return got, msg.leader, msg.stamp
