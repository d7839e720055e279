"""When a primary tells the membership service its rate (sans-I/O, exact integers).

The membership service plans each epoch's slots from every member shard's rate. It takes
rates up only when it commits a block (every ``epochs_per_commit`` epochs, 100 ms by
default), so a report every epoch from every primary (what the leader used to read:
shards x 100 reports a second, whatever the shards do) bought nothing past the first of
each block. A primary now reports **per change**:

* it smooths the rate it observed itself, a window of at least :data:`OBSERVE_NS` at a
  time (the weight of the newest window 1/2, the membership planner's old rule, moved
  here whole), and the report carries the smoothed rate, which the planner takes as it
  is. A window is whole epochs: one 10 ms epoch's count of a busy shard is a noisy
  figure, and on a loaded machine a replica can take two epoch broadcasts in one turn,
  the second closing after microseconds with no record; smoothed per epoch, either
  moved the rate past the bound about every epoch (four shards under load on two cores:
  nearly 100 reports a second per shard, for a figure the planner takes up once a block);
* it reports when that rate moved more than 1/:data:`MOVE_DIVISOR` away from what it
  reported last (and more than :data:`MOVE_FLOOR` records/s: a shard around the
  planner's floor does not chatter), and when it turns **busy** (records in an epoch
  after an idle spell) or **idle** (:data:`IDLE_EPOCHS` epochs without a record);
* a **heartbeat** every :data:`HEARTBEAT_EPOCHS` epochs, at the epochs of its shard's
  phase (:func:`heartbeat_due`: shard ids spread the heartbeats evenly over the epochs,
  so a thousand steady shards cost the leader ten reports an epoch, not a thousand
  every hundredth epoch);
* a new leader of the membership service (the epoch broadcasts name it) is owed a
  report, sent at the first epoch of the shard's phase within :data:`LEADER_SPREAD`
  epochs (:func:`owed_due`: a leader change does not bring every shard's report in one
  epoch). The new leader meanwhile plans with the committed block's rates and counts
  every shard busy (``mms.sequencer.LEADER_GRACE_EPOCHS`` > LEADER_SPREAD).

What a stale rate costs: between reports the planner's figure is within 1/8 of the
shard's own smoothed one (or within 64 records/s), for at most a heartbeat (1 s at
10 ms epochs; the planner takes rates up every block anyway). A rate 1/8 low gives the
shard 1/8 fewer slots in an epoch; an insert that finds its epoch's slots used takes a
slot passed to it on demand or waits for the next epoch (one interval, the cost the
smoothing's own lag already has); a rate 1/8 high gives it slots it passes on notice.
Neither touches an invariant: slots are assigned from the committed schedule alone,
whatever rate it was planned from.
"""

from __future__ import annotations

from dataclasses import dataclass

from ziplog.protocol import frames as f
from ziplog.protocol.gsna import NS_PER_S

#: a report when the smoothed rate moved more than 1/MOVE_DIVISOR from the last one
MOVE_DIVISOR = 8
#: the smoothed rate takes in whole epochs at least this long at a time (two epochs at
#: the planner's 10 ms; a turn to busy or idle takes in what it has at once)
OBSERVE_NS = 20_000_000
#: ... and by more than this many records/s
MOVE_FLOOR = 64
#: epochs without a record before a shard reports itself idle (the membership
#: service lengthens an idle cluster's epochs from then on)
IDLE_EPOCHS = 3
#: a primary that serves reports at least this often (epochs), at its phase
HEARTBEAT_EPOCHS = 100
#: a report owed to a new leader leaves within this many epochs, at the shard's phase
LEADER_SPREAD = 8


def heartbeat_due(shard: int, epoch: int) -> bool:
    """``epoch`` is one of ``shard``'s heartbeat epochs."""
    return (epoch - shard) % HEARTBEAT_EPOCHS == 0


def owed_due(shard: int, epoch: int) -> bool:
    """A report owed to a new leader may leave at ``epoch``."""
    return (epoch - shard) % LEADER_SPREAD == 0


@dataclass(frozen=True, slots=True)
class RateReport:
    """What a primary tells the membership service: its smoothed rate (records/s) as of
    ``epoch``, and whether it took records lately."""
    epoch: int
    rate: int
    busy: bool

    def frame(self, shard: int) -> f.Rate:
        """The report as a RATE frame of one (a storage driver merges a turn's)."""
        return f.Rate(reports=[f.RateEntry(shard=shard, epoch=self.epoch, rate=self.rate, busy=self.busy)])


class RateReporter:
    """One shard's reporting rule. :meth:`on_epoch_closed` after each epoch its primary
    served; a report to send, or None."""

    def __init__(self, shard: int) -> None:
        self.shard = shard
        #: the smoothed rate (None: no epoch observed yet)
        self.rate: int | None = None
        #: what was last reported (None: nothing yet)
        self.reported: RateReport | None = None
        #: a new leader has not had a report yet
        self.owed = False
        #: consecutive epochs without a record
        self.empty_epochs = 0
        #: epochs closed since the last report (a heartbeat epoch missed while the shard
        #: was not a member is made good at twice the heartbeat)
        self.silent_epochs = 0
        #: the membership leader the broadcasts name (-1: none known)
        self.leader = -1
        #: records and time of the epochs closed since the smoothed rate last took some in
        self.window_count = 0
        self.window_ns = 0

    @property
    def busy(self) -> bool:
        return self.empty_epochs < IDLE_EPOCHS

    def on_leader(self, leader: int) -> None:
        """An epoch broadcast named the membership service's leader: a new one is owed a
        report (it knows only the committed block's rates)."""
        if leader != self.leader:
            self.leader = leader
            self.owed = True

    def observe(self, count: int, duration_ns: int) -> bool:
        """Take an epoch's ``count`` records over ``duration_ns`` into the window, and the
        window into the smoothed rate once it is :data:`OBSERVE_NS` long (or the shard
        turned busy or idle, or it is the first); True when that changed what was
        reported (moved past the bound, or turned busy or idle), or nothing was reported
        yet."""
        assert count >= 0, count
        was_busy = self.busy
        self.empty_epochs = 0 if count else self.empty_epochs + 1
        self.window_count += count
        self.window_ns += max(duration_ns, 1)  # an epoch closed in the turn it began
        if self.rate is None or self.window_ns >= OBSERVE_NS or self.busy != was_busy:
            observed = self.window_count * NS_PER_S // self.window_ns
            self.rate = observed if self.rate is None else (self.rate + observed) // 2
            self.window_count = self.window_ns = 0
        last = self.reported
        if last is None or last.busy != self.busy:
            return True
        assert self.rate is not None
        moved = abs(self.rate - last.rate)
        return moved * MOVE_DIVISOR > last.rate and moved > MOVE_FLOOR

    def on_epoch_closed(self, epoch: int, count: int, duration_ns: int) -> RateReport | None:
        """Epoch ``epoch`` closed after ``duration_ns`` with ``count`` records taken."""
        changed = self.observe(count, duration_ns)
        self.silent_epochs += 1
        if not (changed or heartbeat_due(self.shard, epoch) or self.silent_epochs >= 2 * HEARTBEAT_EPOCHS
                or (self.owed and owed_due(self.shard, epoch))):
            return None
        return self.report(epoch)

    def report(self, epoch: int) -> RateReport:
        """The report as of ``epoch`` (what :meth:`on_epoch_closed` sends when one is due)."""
        assert self.rate is not None, "no epoch observed yet"
        report = self.reported = RateReport(epoch, self.rate, self.busy)
        self.silent_epochs = 0
        self.owed = False
        return report
