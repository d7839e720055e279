"""What a client keeps across its calls (sans-I/O): its identity, the sequence numbers
that make a resent insert recognisable (so a retry never stores a record twice), the
stable watermarks it learned, the shards it avoids for a while, and its counters."""

from __future__ import annotations

import random

from ziplog.protocol.frames import wall_stamp
from ziplog.protocol.types import Policy

NS_PER_S = 1_000_000_000
#: How long new records avoid a shard an insert had to be resent to or moved away from
#: (a shard that recovers says the same a little later, through its recovering flag).
AVOID_NS = 1_000_000_000
#: the avoided shards are swept of expired entries once there are more than this
AVOIDED_PRUNE_AT = 64
#: Resend an unanswered insert (same client id and sequence number) after this long...
RETRY_AFTER_NS = 250_000_000
#: ... or this long when the shard is refusing or frozen for recovery: the answer that
#: settles the record comes only in reply to a resend.
RETRY_TROUBLED_NS = 50_000_000
#: A stable read asks one replica; after this long without an answer it asks all.
STABLE_READ_WAIT_NS = 500_000_000
#: Shards whose stable watermark a client remembers (one entry per shard it used).
MAX_SHARDS_REMEMBERED = 1_000_000


class ClientState:
    def __init__(self, client_id: int, policy: Policy | None, rng: random.Random, timeout_ns: int,
                 retry_after_ns: int = RETRY_AFTER_NS, retry_troubled_ns: int = RETRY_TROUBLED_NS,
                 wall_offset_ns: int = 0) -> None:
        self.client_id = client_id
        #: wall clock minus the monotonic clock the calls are given (``now``), read once by
        #: the driver: an insert's stamp is its send time on the wall clock, which clients
        #: on other hosts share (to within their clock sync), where monotonic clocks are
        #: unrelated across hosts
        self.wall_offset_ns = wall_offset_ns
        self.policy = policy or Policy.random()
        self.rng = rng
        self.timeout_ns = timeout_ns
        self.retry_after_ns = retry_after_ns
        self.retry_troubled_ns = retry_troubled_ns
        self._seq = 0
        self._req = 0
        self.stable: dict[int, int] = {}  # shard -> highest stable watermark a reply reported
        #: shard -> the highest point a COUNT said it serves (stable, or fixed by a recovery),
        #: and the highest watermark this client returned: replicas of one shard answer
        #: differently (one restarted from its disk reports less than its peer did), so a
        #: watermark is computed from the best answer ever had and never goes back
        self.servable: dict[int, int] = {}
        self.watermark = 0
        self.avoided: dict[int, int] = {}  # shard -> until when new records avoid it
        self.stats: dict[str, int] = {"fast_path": 0, "slow_path": 0, "retries": 0, "redirects": 0}

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def stamp(self, now: int) -> int:
        """An insert's stamp (``frames.Insert.stamp``) when sent at ``now``."""
        return wall_stamp(now, self.wall_offset_ns)

    def next_req(self) -> int:
        self._req += 1
        return self._req

    def learn_stable(self, shard: int, stable: int) -> None:
        """Replies carry the replica's stable watermark; reads at or below it need one replica."""
        if stable > self.stable.get(shard, 0) and (shard in self.stable or len(self.stable) < MAX_SHARDS_REMEMBERED):
            self.stable[shard] = stable

    def learn_servable(self, shard: int, upto: int) -> int:
        """A COUNT's ``upto`` for ``shard``; the highest one known."""
        best = self.servable.get(shard, 0)
        if upto > best and (shard in self.servable or len(self.servable) < MAX_SHARDS_REMEMBERED):
            self.servable[shard] = best = upto
        return best

    def avoid(self, shard: int, now: int) -> None:
        """Send new records elsewhere for a while: the shard is recovering or refusing."""
        self.avoided[shard] = now + AVOID_NS
        if len(self.avoided) > AVOIDED_PRUNE_AT:
            self.avoided = {s: t for s, t in self.avoided.items() if t > now}

    def choose_shard(self, live: list[int], key: bytes | None, data: bytes, excluded: set[int], now: int) -> int | None:
        if excluded:
            live = [s for s in live if s not in excluded]
        # Avoiding a slow shard only helps a policy that may pick another one: a fixed
        # policy keeps its shard while it is live (refusals still exclude it).
        if self.avoided and self.policy.kind != "fixed":
            healthy = [s for s in live if self.avoided.get(s, 0) <= now]
            if healthy:
                live = healthy
        return self.policy.choose(live, key, data, self.rng)

    def pinned_shard_may_return(self, excluded: set[int], known_shards: dict[int, int]) -> bool:
        """A fixed policy's shard exists but is not live, and did not refuse this record:
        it may come back (recovery, a restart), so the insert waits for it instead of
        failing at once. A shard ZooKeeper never heard of fails at once."""
        return (self.policy.kind == "fixed" and self.policy.shard not in excluded
                and self.policy.shard in known_shards)
