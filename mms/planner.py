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

    def __post_init__(self) -> None:
        assert self.settings.min_rate <= self.settings.max_rate <= MAX_RATE  # _rates_of clamps in this order
        if self.last is not None:
            for s, r in zip(self.last.shards, self.last.rates):
                self.rates.setdefault(s, r)

    def on_rate(self, shard: int, rate: int) -> None:
        """A shard's report of its smoothed rate (records/s): its primary smooths what it
        observes and reports when the figure moved (``ziplog.cores.replica.rate_report``),
        so the last report is the rate."""
        self.rates[shard] = rate

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

    def plan(self, ready: Iterable[int], recovering: Iterable[int] = ()) -> tuple[EpochConfig, list[list[Any]] | None]:
        """The next epoch, and the new membership history if membership changed. Shards
        under failure recovery leave at once and come back when it ends."""
        current = set(self.last.shards) if self.last is not None else set()
        epoch = self.last.epoch + 1 if self.last is not None else 0
        gone = {s for s in self.removed if self.leaving_at.get(s, 0) <= epoch or s not in current}
        members = tuple(sorted((current | set(ready)) - gone - set(recovering)))
        cfg = EpochConfig(epoch, members, self._rates_of(members))
        new_history = None
        if not self.history or tuple(self.history[-1][1]) != members:
            new_history = self.history + [[epoch, list(members)]]
        return cfg, new_history

    def _rates_of(self, members: tuple[int, ...]) -> tuple[int, ...]:
        """Each member's smoothed rate clamped to [min_rate, max_rate]; 1 while it drains.
        (A plain loop: it runs over every member at each block commit.)"""
        st, removed, known = self.settings, self.removed, self.rates
        lo, hi, default = st.min_rate, st.max_rate, st.default_rate
        rates = []
        for s in members:
            if s in removed:
                rates.append(1)
            else:
                r = known.get(s, default)
                rates.append(lo if r < lo else hi if r > hi else r)
        return tuple(rates)

    def committed(self, cfg: EpochConfig, history: list[list[Any]] | None) -> None:
        """The plan is in ZooKeeper: make it the base of the next one."""
        self.last = cfg
        if history is not None:
            self.history = history
