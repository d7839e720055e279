"""Client-side protocol logic shared by ``Client`` and ``AsyncClient`` (sans-I/O).

Each class takes decoded reply frames and says when an operation is settled;
the clients only move frames between these and their sockets.
"""

from __future__ import annotations

import itertools
import os
import random
from typing import Any

from . import wire
from .errors import ZiplogError, from_reply
from .types import Policy


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

    def _init_identity(self, timeout: float, policy: Policy | None, client_id: int | None) -> None:
        self.timeout = timeout
        self._policy = policy or Policy.random()
        self.client_id = client_id if client_id is not None else int.from_bytes(os.urandom(8), "big") >> 1
        self._seq = itertools.count(1)
        self._req = itertools.count(1)
        self._rng = random.Random()
        self._stable: dict[int, int] = {}


class Redirect(Exception):
    """The shard takes no inserts now (not a member of its epoch, or its primary is
    blocked awaiting failure recovery): try another shard."""


class InsertWait:
    """Waits out one InsertAfter on a shard with ``n`` replicas (replica 0 the primary).

    The primary's ack is the decision. The insert is done when every backup's
    *latest* ack equals it; it took the fast path when every backup's *first* ack
    already did.
    """

    __slots__ = ("req_id", "n", "decided", "latest", "first", "stable")

    def __init__(self, req_id: int, replicas: int) -> None:
        self.req_id = req_id
        self.n = replicas
        self.decided: int | None = None
        self.latest: list[int | None] = [None] * replicas
        self.first: list[int | None] = [None] * replicas
        self.stable = 0

    def feed(self, replica: int, msg: list[Any]) -> bool:
        """One reply from ``replica``; True once the insert is settled. Raises the
        server's error (``Redirect`` for a shard that takes no inserts)."""
        if len(msg) < 3 or msg[2] != self.req_id:
            return False  # a late answer to an earlier request
        op = msg[1]
        if op == wire.ERROR:
            if msg[3] in (wire.E_NOT_MEMBER, wire.E_NOT_READY) and replica == 0:
                raise Redirect()  # the shard takes no inserts now: another shard will
            raise from_reply(msg[3], msg[4])
        if op != wire.ACK:
            return False
        gsn = msg[3]
        if msg[5] > self.stable:
            self.stable = msg[5]
        if replica == 0:
            assert self.decided in (None, gsn), ("the primary changed its decision", self.decided, gsn)
            self.decided = gsn
        if self.first[replica] is None:
            self.first[replica] = gsn
        self.latest[replica] = gsn
        return self.done

    def settled(self, replica: int) -> bool:
        """Nothing more is needed from ``replica`` (for the primary: its decision; for a
        backup: an ack equal to it)."""
        if replica == 0:
            return self.decided is not None
        return self.decided is not None and self.latest[replica] == self.decided

    @property
    def done(self) -> bool:
        d = self.decided
        return d is not None and all(g == d for g in self.latest)

    @property
    def fast(self) -> bool:
        return all(g == self.decided for g in self.first)


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
