"""A storage replica's NOTICEs to the replicas of other shards, by process: one copy to
each process that serves some of the replicas a NOTICE is for (``ziplog.server --serve``
serves several), sent ``hosted``; a process hands a hosted NOTICE that reached one of its
replicas to every other replica it serves of a shard other than the sender's. A NOTICE
then costs a message per process told, not per replica (docs/PROTOCOL.md, NOTICE)."""

from __future__ import annotations

from typing import Protocol

import msgspec

from ziplog.cores.effects import ShardReplicas
from ziplog.cores.replica import ReplicaCore, ReplicaSettings
from ziplog.protocol import frames as f
from ziplog.protocol.auth import ClusterKey
from ziplog.server.frame_counts import FrameCounts
from ziplog.server.links import ReplicaLinks


class HostedReplica(Protocol):
    """What a hosted NOTICE needs of another replica its process serves (a
    ``StorageDriver``): its shard, whether it still serves, and its core."""

    settings: ReplicaSettings
    closed: bool
    core: ReplicaCore


class NoticeFanout:
    def __init__(self, links: ReplicaLinks, key: ClusterKey, frames: FrameCounts, stats: dict[str, int]) -> None:
        self.links = links
        #: the driver's counters (STATUS): ``notices_handed_on``, and ``notices_by_clock``,
        #: the shards not told because they pass their slots by the clock
        self.stats = stats
        self.key = key
        self.frames = frames
        #: the drivers of the other replicas this process serves: a hosted NOTICE is for
        #: them too (set by the process once every driver exists)
        self.siblings: list[HostedReplica] = []
        #: the NOTICE a batch of messages addresses to several shards (one message per
        #: shard, the same frame), and those shards: sent once all are known
        self._pending: f.Notice | None = None
        self._shards: list[int] = []

    def add(self, dest: ShardReplicas, msg: f.Notice) -> None:
        """The core's NOTICE to every replica of ``dest.shard`` (:meth:`flush` sends it),
        unless they pass their slots by the clock at the rate the epoch schedules that
        shard at (their registrations say from which rate: ``clock_pass.py``); a replica
        of a build before, or one that passes by NOTICEs alone, is told."""
        if self.links.coord.topology.passes_by_clock(dest.shard, dest.rate):
            self.stats["notices_by_clock"] += 1
            return
        if msg is not self._pending:
            self.flush()
            self._pending = msg
        self._shards.append(dest.shard)

    def flush(self) -> None:
        """Send the pending NOTICE: a copy to each process that serves replicas of its
        shards (:meth:`ReplicaLinks.notice_endpoints`)."""
        msg, shards = self._pending, self._shards
        if msg is None:
            return
        self._pending, self._shards = None, []
        peers, hosted = self.links.notice_endpoints(shards)
        if hosted:
            msg = msgspec.structs.replace(msg, hosted=True)
        frame = f.seal(self.key, f.encode_compact(msg))  # not hosted: the frame of the builds before
        for ep in peers:
            ep.send(frame)
        self.frames.sent(f.Notice, len(peers))

    def hand_on(self, msg: f.Notice, now: int) -> None:
        """A hosted NOTICE reached this replica: every replica of another shard than the
        sender's that this process serves holds it too, and takes it at this turn's end
        with its own inserts (every driver's ``answer_turn`` runs after every turn)."""
        for sib in self.siblings:
            if sib.settings.shard != msg.shard and not sib.closed:
                sib.core.driver_stats["notices_handed_on"] += 1
                sib.core.on_request(b"", msg, now)
