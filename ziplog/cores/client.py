"""Client-side protocol logic shared by ``Client`` and ``AsyncClient`` (sans-I/O).

Each class takes decoded reply frames and says when an operation is settled;
the clients only move frames between these and their sockets.
"""

from __future__ import annotations

import itertools
import os
import random
from typing import Any

from ziplog.protocol import frames as wire
from ziplog.protocol.errors import ZiplogError, from_reply
from ziplog.protocol.types import Policy


#: How long new records avoid a shard that answered FROZEN or refused (ZooKeeper says
#: the same a little later, through the shard's recovering flag).
AVOID_S = 1.0
#: Resend an unanswered insert (same client id and sequence number) after this long...
RETRY_AFTER_S = 0.25
#: ... or this long when the shard is refusing or frozen for recovery: the answer that
#: settles the record comes only in reply to a resend.
RETRY_TROUBLED_S = 0.05


class ClientCommon:
    """What both clients keep per instance, and the calls that need no I/O. The client id
    and per-insert sequence numbers make a resent insert recognisable, so a retry never
    stores a record twice."""

    topology: Any

    def set_policy(self, policy: Policy) -> None:
        """Choose which shard inserts go to: Policy.random() (default), Policy.fixed(s),
        Policy.by_key()."""
        if not isinstance(policy, Policy):
            raise TypeError("policy must be a ziplog.Policy")
        self._policy = policy

    def live_shards(self) -> list[int]:
        """Shards in the current membership with every replica up."""
        return list(self.topology.live_shards())

    def _learn_stable(self, shard: int, stable: int) -> None:
        """Replies carry the replica's stable watermark; reads at or below it need one replica."""
        if stable > self._stable.get(shard, 0):
            self._stable[shard] = stable

    def _avoid(self, shard: int, now: float) -> None:
        """Send new records elsewhere for a while: the shard is recovering or refusing."""
        self._avoided[shard] = now + AVOID_S

    def _choose_shard(self, key: bytes | None, data: bytes, excluded: set[int], now: float) -> int | None:
        live = [s for s in self.topology.live_shards() if s not in excluded]
        # Avoiding a slow shard only helps a policy that may pick another one: a fixed
        # policy keeps its shard while it is live (refusals still exclude it).
        if self._avoided and self._policy.kind != "fixed":
            healthy = [s for s in live if self._avoided.get(s, 0.0) <= now]
            if healthy:
                live = healthy
        return self._policy.choose(live, key, data, self._rng)

    def _pinned_shard_may_return(self, excluded: set[int]) -> bool:
        """A fixed policy's shard exists but is not live, and did not refuse this record:
        it may come back (recovery, a restart), so the insert waits for it instead of
        failing at once. A shard ZooKeeper never heard of fails at once."""
        return (self._policy.kind == "fixed" and self._policy.shard not in excluded
                and self._policy.shard in self.topology.replica_counts)

    def _init_identity(self, timeout: float, policy: Policy | None, client_id: int | None) -> None:
        self.timeout = timeout
        self._policy = policy or Policy.random()
        self.client_id = client_id if client_id is not None else int.from_bytes(os.urandom(8), "big") >> 1
        self._seq = itertools.count(1)
        self._req = itertools.count(1)
        self._rng = random.Random()
        self._stable: dict[int, int] = {}
        self._avoided: dict[int, float] = {}  # shard -> until when new records avoid it


class Redirect(Exception):
    """The shard will not hold this record and holds no copy of it: the primary refused it
    (not a member, or blocked awaiting recovery) and every backup said it has no copy, or
    the recovering shard's authority said it will not hold it. Another shard may take it
    under the same client id and sequence number, and it still appears once."""


#: A backup's latest answer when it holds no copy of the record (E_NO_GUESS).
NO_COPY = -1


class InsertWait:
    """Waits out one InsertAfter on a shard with ``n`` replicas (replica 0 the primary).

    The primary's ack is the decision. The insert is done when every backup's
    *latest* ack equals it; it took the fast path when every backup's *first* ack
    already did. During failure recovery a single *final* ack (from the replica whose
    state the failure handler keeps) settles it: that gsn is what recovery rolls forward.

    A record may only move to another shard once this shard provably holds no copy of
    it (``Redirect``): otherwise recovery could roll a backup's guess forward while the
    record is also stored elsewhere.
    """

    __slots__ = ("req_id", "n", "decided", "latest", "first", "stable", "refused", "frozen", "final")

    def __init__(self, req_id: int, replicas: int) -> None:
        self.req_id = req_id
        self.n = replicas
        self.decided: int | None = None
        self.latest: list[int | None] = [None] * replicas
        self.first: list[int | None] = [None] * replicas
        self.stable = 0
        self.refused = False  # the primary refused for good
        self.frozen = False  # a replica said the shard is frozen for recovery
        self.final = False

    def feed(self, replica: int, msg: list[Any]) -> bool:
        """One reply from ``replica``; True once the insert is settled. Raises the
        server's error, or ``Redirect`` once the shard provably holds no copy."""
        if len(msg) < 3 or msg[2] != self.req_id:
            return False  # a late answer to an earlier request
        op = msg[1]
        if op == wire.ERROR:
            code = msg[3]
            if code == wire.E_NO_GUESS and replica > 0:
                self.latest[replica] = NO_COPY
                if self.first[replica] is None:
                    self.first[replica] = NO_COPY
            elif code == wire.E_NOT_HELD:
                raise Redirect()
            elif code == wire.E_FROZEN:
                self.frozen = True
            elif code in (wire.E_NOT_MEMBER, wire.E_NOT_READY) and replica == 0:
                self.refused = True
            else:
                raise from_reply(code, msg[4])
            if self.refused and all(self.latest[i] == NO_COPY for i in range(1, self.n)):
                raise Redirect()
            return False
        if op != wire.ACK:
            return False
        gsn = msg[3]
        if msg[5] > self.stable:
            self.stable = msg[5]
        if len(msg) > 7 and msg[7]:
            self.decided = gsn
            self.final = True
            return True
        if replica == 0:
            if self.decided is not None and self.decided != gsn:
                # Only after a failure recovery that did not keep the record (it was never
                # acknowledged): the recovered primary placed the resend anew.
                self.latest = [None] * self.n
                self.first = [None] * self.n
            self.decided = gsn
        if self.first[replica] is None:
            self.first[replica] = gsn
        self.latest[replica] = gsn
        return self.done

    def settled(self, replica: int) -> bool:
        """Nothing more is expected from ``replica`` for now (for the primary: its
        decision or refusal; for a backup: an ack equal to the decision, or no copy)."""
        if self.final:
            return True
        if replica == 0:
            return self.decided is not None or self.refused or self.frozen
        return (self.decided is not None and self.latest[replica] == self.decided) or self.latest[replica] == NO_COPY

    @property
    def done(self) -> bool:
        d = self.decided
        return self.final or (d is not None and all(g == d for g in self.latest))

    @property
    def fast(self) -> bool:
        return not self.final and all(g == self.decided for g in self.first)

    @property
    def troubled(self) -> bool:
        """The shard is refusing or recovering: ask again soon, and send new records elsewhere."""
        return self.frozen or self.refused


class ReadWait:
    """Waits out a ReadRecord sent to ``n`` replicas: one stable answer settles it, as
    does agreement of all."""

    __slots__ = ("req_id", "gsn", "n", "answers", "data", "stable")

    def __init__(self, req_id: int, gsn: int, replicas: int) -> None:
        self.req_id = req_id
        self.gsn = gsn
        self.n = replicas
        self.answers: dict[int, bytes] = {}
        self.data: bytes | None = None
        self.stable = 0  # highest stable watermark a replica reported

    def feed(self, replica: int, msg: list[Any]) -> bool:
        if len(msg) < 3 or msg[2] != self.req_id:
            return False
        if msg[1] == wire.ERROR:
            raise from_reply(msg[3], msg[4])
        if msg[1] != wire.READ_OK:
            return False
        if msg[5] > self.stable:
            self.stable = msg[5]
        if msg[5] >= self.gsn:  # stable: every replica holds exactly this
            self.data = msg[4]
            return True
        self.answers[replica] = msg[4]
        if len(self.answers) == self.n:
            values = list(self.answers.values())
            if any(v != values[0] for v in values):
                raise ZiplogError("replicas disagree on a decided record")
            self.data = values[0]
            return True
        return False


class EachReplica:
    """Waits for one answer from each of ``n`` replicas (trim, status); an ERROR raises.
    Answers to an earlier attempt (another ``req_id``) are ignored."""

    __slots__ = ("req_id", "n", "replies")

    def __init__(self, req_id: int, replicas: int) -> None:
        self.req_id = req_id
        self.n = replicas
        self.replies: dict[int, list[Any]] = {}

    def feed(self, replica: int, msg: list[Any]) -> bool:
        if msg[2] != self.req_id:
            return False
        if msg[1] == wire.ERROR:
            raise from_reply(msg[3], msg[4])
        self.replies[replica] = msg
        return len(self.replies) == self.n
