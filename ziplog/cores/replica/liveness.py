"""Failure suspicion (dissertation 4.2.5). Replicas of a shard hear from each other at
least every heartbeat (an idle primary's empty FORWARD, an idle backup's PREFIX); a peer
heard before and silent for the suspicion timeout, or the replica's own lost state (a
blocked primary), makes it ask the failure handler for recovery, again every timeout
until the handler acts (it freezes the replica)."""

from __future__ import annotations

from ziplog.cores.effects import Outbox, Peer
from ziplog.protocol.frames import Suspect


class Liveness:
    def __init__(self, shard: int, replica: int, timeout_ns: int, out: Outbox) -> None:
        self.shard = shard
        self.replica = replica
        self.timeout_ns = timeout_ns  # 0: never suspect
        self.out = out
        #: peer replica -> when we last heard it (armed once heard in this incarnation)
        self.heard: dict[int, int] = {}
        self.suspect_sent_ns: int | None = None
        self.suspicions = 0

    def hear(self, replica: int, now: int) -> None:
        self.heard[replica] = now

    def restart_clock(self, replica: int, now: int) -> None:
        """``replica``'s registration changed (it left ZooKeeper, as a process stopping
        gracefully does, or a new incarnation came): its silence counts from now, so a
        restart that takes longer than the timeout is not taken for a failure; a peer
        that stays gone is suspected one timeout later. A peer never heard stays unarmed."""
        if replica in self.heard:
            self.heard[replica] = max(self.heard[replica], now)

    def reset(self, now: int, peers: list[int]) -> None:
        """A recovery ended: suspicion starts afresh, armed for every peer (each took part
        in the recovery, so each is expected to speak from now on). A peer we still cannot
        hear (the link between us is down while both reach the failure handler) is
        suspected again after a timeout, and again, until the link or the membership
        changes: a recovery that ended does not make a broken link look healthy."""
        self.heard = {r: now for r in peers}
        self.suspect_sent_ns = None

    def check(self, now: int, blocked: str | None) -> None:
        if self.timeout_ns <= 0:
            return
        limit = now - self.timeout_ns
        if blocked is None and all(t >= limit for t in self.heard.values()):
            return
        silent = sorted(r for r, t in self.heard.items() if t < limit)
        if not silent and blocked is None:
            return
        if self.suspect_sent_ns is not None and now - self.suspect_sent_ns < self.timeout_ns:
            return
        self.suspect_sent_ns = now
        self.suspicions += 1
        reason = blocked or f"no word from replicas {silent}"
        self.out.send(Peer.HANDLER, Suspect(shard=self.shard, replica=self.replica, reason=reason))

    def next_deadline(self) -> int | None:
        if self.timeout_ns <= 0 or not self.heard:
            return None
        t = min(self.heard.values()) + self.timeout_ns
        if self.suspect_sent_ns is not None:
            t = max(t, self.suspect_sent_ns + self.timeout_ns)
        return t
