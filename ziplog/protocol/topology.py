"""A view of the topology held in ZooKeeper (pure): shards, their replicas' addresses,
the latest membership, the control plane's addresses. ``ziplog.io.zk.Topology`` keeps
one current with kazoo watches; the simulation keeps one from its model of ZooKeeper.
Both answer the same queries with this code.

Writers replace whole fields (never mutate them in place) and then call
:meth:`TopologyView.changed`, so a reader on another thread never sees a half-built view,
and ``generation`` tells it that something moved since it last looked.
"""

from __future__ import annotations

from typing import Any, Callable


class TopologyView:
    def __init__(self) -> None:
        self.replicas: dict[int, dict[int, str]] = {}  # shard -> replica -> addr
        #: shard -> replica -> the ZooKeeper session that registered it: another one at the
        #: same address is another incarnation (a server restarted on its fixed --port)
        self.replica_owners: dict[int, dict[int, int]] = {}
        #: shard -> replica -> the pid its registration names: replicas at one host with
        #: one pid are served by one process (``ziplog.server --serve``)
        self.replica_pids: dict[int, dict[int, int]] = {}
        #: shard -> replica -> what its build reads beyond the builds before it
        #: (``frames.READS``; 0: a registration that does not say)
        self.replica_reads: dict[int, dict[int, int]] = {}
        #: shard -> replica -> the incarnation its registration names (a nonce drawn by
        #: each start of a server; 0: a registration of a build before incarnations): what a
        #: backup's HELLO, FORWARD checks and ACKs name (``frames.Hello.to_inc``)
        self.replica_incs: dict[int, dict[int, int]] = {}
        #: shard -> replica -> the rate from which it passes its slots by the clock and
        #: needs no NOTICE (``ReplicaSettings.clock_pass_rate``; 0: never, or not said)
        self.replica_clock: dict[int, dict[int, int]] = {}
        #: (generation, answer) of :meth:`every_replica_reads`, asked at every epoch
        self._reads_at: tuple[int, int] = (-1, 0)
        self.replica_counts: dict[int, int] = {}
        self.removed: frozenset[int] = frozenset()
        self.recovering: frozenset[int] = frozenset()
        #: failure handler replicas: name -> {"pull": addr}
        self.fh: dict[str, dict[str, str]] = {}
        #: the committed membership history [[first_epoch, members], ...]
        self.history: list[list[Any]] = []
        #: membership service replicas: id -> {"pub": addr, "pull": addr}
        self.mms: dict[str, dict[str, str]] = {}
        self._generation = 0
        self._live: list[int] | None = None
        #: replica_addrs answers, until the next change (they are on every insert's path)
        self._addrs: dict[int, tuple[str, ...] | None] = {}
        self._listeners: list[Callable[[], None]] = []

    # -- writers --------------------------------------------------------------------------------
    def on_change(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` after every change (on the writer's thread)."""
        self._listeners.append(fn)

    def changed(self) -> None:
        self._generation += 1
        self._live = None
        self._addrs = {}
        for fn in list(self._listeners):
            fn()

    # -- queries --------------------------------------------------------------------------------
    def every_replica_reads(self) -> int:
        """The least that every registered storage replica reads (``frames.READS``; 0
        while one does not say): a sender of what only newer builds read waits for it.
        Computed once per change."""
        generation = self._generation
        if self._reads_at[0] != generation:
            least = min((self.replica_reads.get(s, {}).get(r, 0) for s, reps in self.replicas.items() for r in reps),
                        default=0)
            self._reads_at = (generation, least)
        return self._reads_at[1]

    def passes_by_clock(self, shard: int, rate: int) -> bool:
        """Every replica of ``shard`` passes its slots by the clock at ``rate`` records/s
        (its registration says from which rate it does): a NOTICE would pass nothing
        its own inserts do not. A replica that does not say (a build before) needs them."""
        reps = self.replicas.get(shard)
        if not reps:
            return False
        clock = self.replica_clock.get(shard, {})
        for r in reps:
            threshold = clock.get(r, 0)
            if threshold <= 0 or threshold > rate:
                return False
        return True

    @property
    def generation(self) -> int:
        """Counts changes to this view: read it before reading the view, and a later
        change shows as a different value (a writer updates the view first, then this)."""
        return self._generation

    def live_shards(self) -> list[int]:
        """Shards in the latest membership, not removed or recovering, whose replicas are
        all registered (cached until the next change: this is on every insert's path)."""
        live = self._live
        if live is None:
            gen = self._generation
            members = self.history[-1][1] if self.history else []
            out = self.removed | self.recovering
            live = [s for s in members if s not in out and self.shard_complete(s)]
            if gen == self._generation:  # no change raced with us: safe to keep
                self._live = live
        return live

    def shard_complete(self, shard: int) -> bool:
        n = self.replica_counts.get(shard, 0)
        addrs = self.replicas.get(shard, {})
        return n > 0 and all(i in addrs for i in range(n))

    def replica_addrs(self, shard: int) -> tuple[str, ...] | None:
        """Every replica's address, replica 0 (the primary) first; None unless all are up."""
        cache = self._addrs
        try:
            return cache[shard]
        except KeyError:
            pass
        gen = self._generation
        n = self.replica_counts.get(shard, 0)
        addrs = self.replicas.get(shard, {})
        found = None if n == 0 or any(i not in addrs for i in range(n)) else tuple(addrs[i] for i in range(n))
        if gen == self._generation:  # no change raced with us: safe to keep
            cache[shard] = found
        return found

    def registered_addrs(self, shard: int) -> tuple[str, ...]:
        """The addresses of the replicas of ``shard`` registered now, by replica number
        (some may be missing: one restarting)."""
        addrs = self.replicas.get(shard, {})
        return tuple(addrs[i] for i in sorted(addrs))

    def shards(self) -> list[int]:
        """Every shard ever registered (removed ones included: they stay readable)."""
        return sorted(self.replica_counts)

    def mms_pubs(self) -> list[str]:
        return [a for info in self.mms.values() if (a := info.get("pub"))]

    def mms_pulls(self) -> list[str]:
        return [a for info in self.mms.values() if (a := info.get("pull"))]

    def mms_pull_of(self, replica_id: int) -> str | None:
        """The PULL address membership service replica ``replica_id`` registered."""
        return self.mms.get(str(replica_id), {}).get("pull")

    def fh_pulls(self) -> list[str]:
        return [a for info in self.fh.values() if (a := info.get("pull"))]
