"""Epoch planning (sans-I/O): which shards are members of the next epoch and at
what expected rate. Pure integer arithmetic; the leader process (``mms.server``)
feeds it rate reports and the set of ready shards, and writes what it returns to
ZooKeeper before broadcasting."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from ziplog.protocol.gsna import MAX_RATE, EpochConfig


@dataclass
class PlannerSettings:
    #: Rate a shard gets before anything is observed (records/s).
    default_rate: int = 2000
    #: Floor: an idle shard still gets a few slots per epoch so its gsns stay spread.
    min_rate: int = 200
    max_rate: int = 1_000_000
    #: A removed shard stays a member this many epochs at the lowest rate, so that
    #: inserts already on their way complete (clients stop choosing it at once).
    drain_epochs: int = 3


@dataclass
class EpochPlanner:
    settings: PlannerSettings
    last: EpochConfig | None = None
    #: [[first_epoch, members], ...]: epochs from first_epoch on had members
    history: list[list[Any]] = field(default_factory=list)
    rates: dict[int, int] = field(default_factory=dict)
    removed: set[int] = field(default_factory=set)
    #: removed shard -> the first epoch it is no longer a member
    leaving_at: dict[int, int] = field(default_factory=dict)
    #: shards whose rate changed since the last plan (a plan of the same members patches
    #: only their places: see :meth:`plan`)
    dirty: set[int] = field(default_factory=set)
    #: the members of the last full plan, what they were computed from (``generation``,
    #: the shards gone), and each member's place
    _planned: tuple[int, ...] | None = None
    _membership_key: tuple[int, frozenset[int]] | None = None
    _place: dict[int, int] = field(default_factory=dict)
    #: the dirty shards the last plan patched in (no longer dirty once it is committed)
    _patched: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        assert 1 <= self.settings.min_rate <= self.settings.max_rate <= MAX_RATE  # _rates_of clamps in this order
        if self.last is not None:
            for s, r in zip(self.last.shards, self.last.rates):
                self.rates.setdefault(s, r)

    def on_rate(self, shard: int, rate: int) -> None:
        """A shard's report of its smoothed rate (records/s): its primary smooths what it
        observes and reports when the figure moved (``ziplog.cores.replica.rate_report``),
        so the last report is the rate."""
        if self.rates.get(shard) != rate:
            self.rates[shard] = rate
            self.dirty.add(shard)

    def remove(self, shard: int) -> None:
        """Remove ``shard`` for good (it stays readable): it drains for a few epochs at
        the lowest rate, then leaves."""
        if shard not in self.removed:
            self.removed.add(shard)
            epoch = self.last.epoch + 1 if self.last is not None else 0
            self.leaving_at[shard] = epoch + self.settings.drain_epochs

    def drain_ends_at(self, epoch: int) -> bool:
        """A removed shard's drain ends at ``epoch``: the one way membership changes with
        time alone (everything else :meth:`plan` reads changes only with its arguments or
        at :meth:`committed`)."""
        return epoch in self.leaving_at.values()

    def plan(self, ready: Iterable[int], recovering: Iterable[int] = (),
             generation: int | None = None) -> tuple[EpochConfig, list[list[Any]] | None]:
        """The next epoch, and the new membership history if membership changed. Shards
        under failure recovery leave at once and come back when it ends.

        ``generation``: the topology generation ``ready`` and ``recovering`` were read at
        (None: unknown). A plan at the generation of the last one, with the same shards
        gone, has the last plan's members: it costs what changed, not what there is (the
        members as they were, the rates of the shards that reported a change patched in
        place), where a full plan is O(shards log shards) (16,000 shards: tens of
        milliseconds of the leader's loop at every block)."""
        last = self.last
        epoch = last.epoch + 1 if last is not None else 0
        same = last is not None and (last.shards is self._planned or last.shards == self._planned)
        current = self._place if same else set(last.shards) if last is not None else set()
        gone = frozenset(s for s in self.removed if self.leaving_at.get(s, 0) <= epoch or s not in current)
        key = None if generation is None else (generation, gone)
        if same and key is not None and key == self._membership_key:
            assert last is not None
            return self._same_members(epoch, last), None
        members = tuple(sorted((set(current) | set(ready)) - gone - set(recovering)))
        cfg = EpochConfig(epoch, members, self._rates_of(members))
        self._planned, self._membership_key = members, key
        self._place = {s: i for i, s in enumerate(members)}
        self._patched = set(self.dirty)  # every rate is read afresh
        new_history = None
        if not self.history or tuple(self.history[-1][1]) != members:
            new_history = self.history + [[epoch, list(members)]]
        return cfg, new_history

    def _same_members(self, epoch: int, last: EpochConfig) -> EpochConfig:
        """The last plan's members at ``epoch``, with the changed rates patched in."""
        self._patched = set(self.dirty)
        place = self._place
        changed = [(place[s], self._rate_of(s)) for s in self._patched if s in place]
        if not changed:
            return last.at(epoch)
        rates = list(last.rates)
        for i, r in changed:
            rates[i] = r
        # the members passed EpochConfig's checks when first planned, and each rate is
        # clamped into [min_rate, max_rate] within [1, MAX_RATE] (__post_init__ asserts)
        return last.at(epoch).with_rates(tuple(rates))

    def _rate_of(self, shard: int) -> int:
        if shard in self.removed:
            return 1
        st = self.settings
        r = self.rates.get(shard, st.default_rate)
        return st.min_rate if r < st.min_rate else st.max_rate if r > st.max_rate else r

    def _rates_of(self, members: tuple[int, ...]) -> tuple[int, ...]:
        """Each member's smoothed rate clamped to [min_rate, max_rate]; 1 while it drains
        (a full plan only: a block of the same members patches the changed ones)."""
        rate_of = self._rate_of
        return tuple(rate_of(s) for s in members)

    def committed(self, cfg: EpochConfig, history: list[list[Any]] | None) -> None:
        """The plan is in ZooKeeper: make it the base of the next one."""
        self.last = cfg
        self.dirty -= self._patched
        self._patched = set()
        if history is not None:
            self.history = history
