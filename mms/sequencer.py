"""The membership service leader's epochs (sans-I/O): which epoch comes next, the
committed block it belongs to, when a new plan is needed, and the block commits to ask
ZooKeeper for. No clock and no ZooKeeper: the driver (``mms.server``) performs the
commits and times the broadcasts.

Blocks of ``epochs_per_commit`` epochs (one transaction, same members and rates) are
committed before any of their epochs is broadcast. A block in ZooKeeper may have been
partly broadcast by a previous leader, so a new leader honours it whole and broadcasts
none of it: its first broadcast is the first epoch after it, in a block it commits
first (shards that missed epochs of the inherited block fill them from the membership
history). A new leader thus writes before it broadcasts anything, and that write
bumps the block's version, so a deposed leader still running (stalled, say) cannot
commit after it. Its own blocks a leader may cut short at any epoch it has not
broadcast yet, which is how a membership change takes effect at the next epoch.

A block's first broadcast carries its configuration (EPOCH); the block's later epochs
go out as EPOCH_SAME naming that one (:meth:`EpochSequencer.same_as`), so a broadcast
costs per block, not per epoch and shard (``ziplog.protocol.epoch_feed``).

Planning (the ready list over every shard, then ``EpochPlanner.plan``) costs O(shards),
so it runs only when its result can differ from the block's config:

* a block is due: rates are taken up at block commits only;
* the topology changed (shards registered or gone, replicas up or down, a shard marked
  ``removed`` or ``recovering`` or no longer recovering): its generation differs from
  the one the last plan read;
* a removed shard's drain ends (``EpochPlanner.drain_ends_at``): membership changes
  with no event;
* the last plan changed membership but could not commit it (the epoch was the first of
  the current block), so it must be tried again.

Between plans the planner's inputs that matter for membership are unchanged, and a plan
of an unchanged input is the committed membership again (members = previous members |
ready - gone - recovering is idempotent), so skipping it loses nothing.

:meth:`EpochSequencer.prepare` may hand back a :class:`CommitBlock` (a coordination
request of its ``Ready``) for the driver to commit; nothing of that block is used (not
even for the next plan) until
:meth:`EpochSequencer.on_commit_result` says ZooKeeper took it, and
:meth:`EpochSequencer.config` refuses an epoch whose block is not committed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from mms.planner import EpochPlanner, PlannerSettings
from ziplog.cores.effects import CommitBlock, Ready
from ziplog.protocol.gsna import EpochConfig
from ziplog.protocol.membership import EpochState
from ziplog.protocol.topology import TopologyView


#: epochs a new leader counts every shard busy: each primary reports to a leader it has
#: not reported to at its next epoch close, so by then every live shard has said
#: whether it is busy (a lost report is made good by the primary's heartbeat)
LEADER_GRACE_EPOCHS = 10


class Block(NamedTuple):
    """Epochs ``first..last``, committed to ZooKeeper with one config."""

    first: int
    last: int
    config: EpochConfig


class EpochSequencer:
    def __init__(self, state: EpochState, topology: TopologyView, settings: PlannerSettings,
                 epochs_per_commit: int) -> None:
        assert epochs_per_commit >= 1
        self.topology = topology
        self.epochs_per_commit = epochs_per_commit
        #: versions our transactions expect: a commit by anyone else refuses ours
        self.block_version = state.block_version
        self.history_version = state.history_version
        self.planner = EpochPlanner(settings, None, state.history or [])
        #: the committed block ``next_epoch`` belongs to (None: nothing committed yet)
        self.block: Block | None = None
        self.next_epoch = 0
        #: the topology generation the last plan read (None: no plan yet)
        self.planned_generation: int | None = None
        #: the last plan changed membership and that change is not committed yet
        self.change_pending = False
        #: shards with every replica registered and not removed, as of planned_generation
        self._ready: list[int] = []
        #: the block whose commit was handed out and not yet answered
        self._committing: tuple[Block, list[list[Any]] | None] | None = None
        #: shards whose last report says busy (records lately), each a registered shard
        self.busy: set[int] = set()
        #: the first epoch of the current quiet spell: no shard busy since (None: busy)
        self.quiet_from: int | None = None
        #: until this epoch every shard counts as busy (see LEADER_GRACE_EPOCHS)
        self.grace_until = 0
        #: the topology generation the last interval was chosen under
        self._interval_generation: int | None = None
        #: the last epoch this leader broadcast in full (None: none yet); the later epochs
        #: of its block go out as "same as" it
        self.base: int | None = None
        cur = state.block
        if cur:
            # Honour the inherited block whole (a previous leader may have broadcast any
            # of it) without broadcasting any of it: the next broadcast is the epoch after
            # it, in a block this leader commits first.
            last = int(cur.get("last", cur["epoch"]))
            inherited = EpochConfig(last, tuple(cur["shards"]), tuple(cur["rates"]))
            self.planner.committed(inherited, None)
            self.next_epoch = last + 1
            self.block = Block(last, last, inherited)
        self.grace_until = self.next_epoch + LEADER_GRACE_EPOCHS

    # -- what to do -----------------------------------------------------------------------
    @property
    def committing(self) -> bool:
        return self._committing is not None

    def block_due(self) -> bool:
        return self.block is None or self.next_epoch > self.block.last

    def topology_moved(self) -> bool:
        return self.topology.generation != self.planned_generation

    def needs_plan(self) -> bool:
        return (self.block_due() or self.topology_moved() or self.change_pending
                or self.planner.drain_ends_at(self.next_epoch))

    def on_rate(self, shard: int, rate: int, busy: bool) -> bool:
        """A primary's rate report (its smoothed rate, and whether it took records
        lately); False (and ignored) for a shard not registered: the planner keeps a rate
        per shard and the busy set a shard each, so only real shards may add one."""
        if shard not in self.topology.replica_counts:
            return False
        self.planner.on_rate(shard, rate)
        if busy:
            self.busy.add(shard)
        else:
            self.busy.discard(shard)
        return True

    def interval_ns(self, base_ns: int, idle_max_ns: int) -> int:
        """How long the epoch just broadcast lasts: ``base_ns`` while a shard is busy (or
        the topology moves, or a new leader's grace lasts), and, once every shard reported
        itself idle (its primary took no record for ``rate_report.IDLE_EPOCHS`` epochs),
        twice as long each epoch up to ``idle_max_ns``: an idle cluster passes time
        rarely (slots on demand make records independent of the epoch's length). A
        primary reports busy when it closes the first epoch with records, so the base
        interval is back one or two epochs later."""
        generation = self.topology.generation
        moved, self._interval_generation = generation != self._interval_generation, generation
        if moved:
            self.busy &= self.topology.replica_counts.keys()  # a shard gone reports no more
        if moved or self.busy or self.next_epoch < self.grace_until or idle_max_ns <= base_ns:
            self.quiet_from = None
            return base_ns
        if self.quiet_from is None:
            self.quiet_from = self.next_epoch - 1
        idle = self.next_epoch - self.quiet_from
        return min(base_ns << min(idle, 20), idle_max_ns)

    # -- the steps of an epoch ------------------------------------------------------------
    def prepare(self) -> Ready:
        """Get ``next_epoch`` ready: plan if something can have changed, and hand back
        (as a coordination effect) the commit of a new block from ``next_epoch`` if one
        is due or membership changed. May be called again for the same epoch (nothing
        broadcast in between): the topology may have changed meanwhile. Not while a
        commit is unanswered."""
        assert self._committing is None, "the previous commit is not answered yet"
        if not self.needs_plan():
            return Ready()
        cfg, history = self._plan()
        changed = history is not None
        block = self.block
        if block is None or self.next_epoch > block.last or (changed and self.next_epoch > block.first):
            self.change_pending = False
            return Ready(coordinate=[self._commit(cfg, changed)])
        # A change found at the first epoch of a block (one inherited, or one we just
        # committed for this epoch) cannot cut it: it waits for the next epoch.
        self.change_pending = changed
        return Ready()

    def on_commit_result(self, ok: bool) -> bool:
        """ZooKeeper's answer to the commit :meth:`prepare` handed out. False: it refused
        (another leader committed), so this one must step down."""
        assert self._committing is not None, "no commit in flight"
        block, history = self._committing
        self._committing = None
        if not ok:
            return False
        self.block_version += 1
        if history is not None:
            self.history_version += 1
        self.planner.committed(block.config, history)
        self.block = block
        return True

    def ready(self) -> bool:
        """``next_epoch`` is in a committed block and no commit is unanswered."""
        block = self.block
        return self._committing is None and block is not None and block.first <= self.next_epoch <= block.last

    def config(self) -> EpochConfig:
        """The configuration of ``next_epoch``: the committed block's."""
        assert self.ready(), "an epoch is broadcast only once its block is committed"
        assert self.block is not None
        return self.block.config.at(self.next_epoch)

    def same_as(self) -> int | None:
        """The epoch whose configuration ``next_epoch``'s broadcast may name instead of
        carrying its own: an earlier epoch of the same block that this leader broadcast in
        full (None: broadcast it in full). A block's epochs share one configuration."""
        assert self.block is not None
        base = self.base
        return base if base is not None and self.block.first <= base < self.next_epoch else None

    def advance(self) -> None:
        """``next_epoch`` was broadcast (in full unless :meth:`same_as` named a base): it is
        the base of the next plan."""
        assert self.ready()
        assert self.block is not None
        if self.same_as() is None:
            self.base = self.next_epoch
        self.planner.last = self.block.config.at(self.next_epoch)
        self.next_epoch += 1

    # -- internals ------------------------------------------------------------------------
    def _plan(self) -> tuple[EpochConfig, list[list[Any]] | None]:
        topo = self.topology
        # Read the generation first: a change racing with the reads below shows as a
        # different generation at the next epoch, and is planned then.
        generation = topo.generation
        removed, recovering = topo.removed, topo.recovering
        for s in removed:
            self.planner.remove(s)
        if generation != self.planned_generation:
            # The ready list is the topology's alone: a plan at a block commit with no
            # change since the last plan reuses it (it is the costlier half of a plan).
            self._ready = [s for s in topo.replica_counts if s not in removed and topo.shard_complete(s)]
        self.planned_generation = generation
        # the planner leaves recovering shards out, and at an unchanged generation keeps
        # the last plan's members (patching only the rates that changed)
        return self.planner.plan(self._ready, recovering, generation)

    def _commit(self, planned: EpochConfig, changed: bool) -> CommitBlock:
        """The commit of the block that starts at ``next_epoch``, the first epoch nobody
        broadcast, with the planned config (versions as last answered: one commit at a
        time)."""
        first = self.next_epoch
        assert planned.epoch == first, (planned.epoch, first)
        last = first + self.epochs_per_commit - 1
        history = self.planner.history + [[first, list(planned.shards)]] if changed else None
        self._committing = (Block(first, last, planned), history)
        return CommitBlock({"epoch": first, "last": last, "shards": list(planned.shards), "rates": list(planned.rates)},
                           self.block_version, history, self.history_version)
