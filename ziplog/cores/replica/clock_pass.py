"""Passing a shard's slots by the clock, with no message: the floor each insert's stamp
puts under its slot, and, in a shard scheduled busy, the expiry of slots while no insert
comes.

An insert stamped t (the client's send time) takes no slot expected before t (slot k is
expected (k+1)/rate after the epoch's stamp, the membership leader's send time): the
slots skipped become no-ops, as for an InsertAfter jump, so the shard's frontier follows
the clock while its records come, with no NOTICE, no no-op range of its own and no
replication round for one (a NOTICE that comes later passes nothing). Both replicas
compute the floor from the insert's stamp and the epoch's, so the backup's guess is
still the primary's slot. A shard the epoch schedules at ``clock_pass_rate`` records/s
or more takes its inserts often enough that they pass its slots about as soon as a
NOTICE would: other shards send it none (``NoticeFanout.add``), and slots expected more
than ``clock_idle_ns`` ago while no insert came (it went quiet before the planner
lowered its rate) pass at most once per ``clock_idle_ns`` (:meth:`ClockPass.expire`).
The expiry by a fixed timeout of every shard's slots (off by default, how slots passed
before NOTICEs) is here too. Passing its own unused slots is what a primary may always
do alone: nothing here decides anything another replica or shard relies on.
"""

from __future__ import annotations

from ziplog.cores.replica.settings import ReplicaSettings
from ziplog.protocol import frames as f
from ziplog.protocol.gsna import SlotCursor


class ClockPass:
    """One epoch's clock under a member shard's slots (``busy``: scheduled at
    ``clock_pass_rate`` or more, so its slots also expire)."""

    def __init__(self, cursor: SlotCursor, stamp: int, taken: int, slack: int, idle: int, wall_offset: int,
                 stats: dict[str, int], busy: bool) -> None:
        self.cursor = cursor
        self.busy = busy
        #: the core's counters (STATUS): ``passed_by_clock``, inserts placed (or guessed)
        #: past slots the clock passed, and the primary's ``expired_by_clock``
        self.stats = stats
        self.wall_offset = wall_offset
        #: the epoch's stamp (wall-clock ns): slot k is expected (k+1)/rate after it
        self.stamp = stamp
        #: when this replica took the epoch (its monotonic clock)
        self.taken = taken
        self.slack = slack
        self.idle = idle
        #: the earliest the next expiry may run (monotonic)
        self.next_check = taken + idle

    @staticmethod
    def of(settings: ReplicaSettings, cursor: SlotCursor | None, stamp: int, now: int,
           stats: dict[str, int]) -> ClockPass | None:
        """The clock of an epoch that began at ``now`` (stamped ``stamp``, 0: now), or None
        when this shard is no member of it or passes no slot by the clock (rate 0)."""
        threshold = settings.clock_pass_rate
        if cursor is None or threshold <= 0:
            return None
        return ClockPass(cursor, stamp or f.wall_stamp(now, settings.wall_offset_ns), now,
                         settings.clock_slack_ns, settings.clock_idle_ns, settings.wall_offset_ns, stats,
                         cursor.schedule.rate(cursor.shard) >= threshold)

    def place(self, slot: int, stamp: int, now: int) -> int:
        """The slot for an insert stamped ``stamp`` that would take ``slot``: past every
        slot the clock passed by then (:meth:`floor`)."""
        floor = self.floor(stamp, now)
        if floor <= slot:
            return slot
        self.stats["passed_by_clock"] = self.stats.get("passed_by_clock", 0) + 1
        return floor

    def floor(self, stamp: int, now: int) -> int:
        """The first slot an insert stamped ``stamp`` may take: none expected before it
        (0 when not stamped). A stamp ahead of this replica's wall clock by more than
        ``slack`` (a client's clock ahead) counts as that clock plus ``slack``, so it burns
        no more of the epoch; the floor never passes the epoch's last slot."""
        if not stamp:
            return 0
        latest = f.wall_stamp(now, self.wall_offset) + self.slack
        c = self.cursor
        due = c.schedule.slots_due(c.shard, (stamp if stamp < latest else latest) - self.stamp)
        return due if due < c.count else c.count - 1

    def expire(self, now: int, next_slot: int) -> int:
        """The next slot once the slots expected more than ``idle`` ago are passed
        (``next_slot`` when none is), at most once per ``idle``."""
        if not self.busy or now < self.next_check:
            return next_slot
        self.next_check = now + self.idle
        c = self.cursor
        due = min(c.schedule.slots_due(c.shard, now - self.taken - self.idle), c.count)
        if due <= next_slot:
            return next_slot
        self.stats["expired_by_clock"] = self.stats.get("expired_by_clock", 0) + 1
        return due

    def deadline(self, next_slot: int) -> int | None:
        """When :meth:`expire` may next pass a slot: ``next_slot`` expected ``idle`` ago."""
        c = self.cursor
        if not self.busy or next_slot >= c.count:
            return None
        t = self.taken + c.schedule.expected_ns(c.shard, next_slot) + self.idle
        return t if t > self.next_check else self.next_check


def timeout_expiry(cursor: SlotCursor, elapsed: int, timeout: int, next_slot: int) -> int:
    """``--noop-timeout-us`` (off by default): the next slot once slots whose expected
    arrival passed ``timeout`` ago (``elapsed`` into the epoch) are no-ops. It catches up
    to the schedule *now*, not just to the timeout: a writer slower than its rate then
    triggers this once per timeout's worth of lag rather than once per record, and each
    expiry is a chance for a backup to guess a record's slot before it hears of the
    no-ops (a slow-path insert)."""
    sched = cursor.schedule
    if sched.slots_due(cursor.shard, elapsed - timeout) <= next_slot:
        return next_slot
    return min(sched.slots_due(cursor.shard, elapsed), cursor.count)


def timeout_deadline(cursor: SlotCursor, epoch_start: int, next_slot: int, timeout: int) -> int | None:
    """When :func:`timeout_expiry` next passes a slot (None: no slot left)."""
    if next_slot >= cursor.count:
        return None
    return epoch_start + cursor.schedule.expected_ns(cursor.shard, next_slot) + timeout
