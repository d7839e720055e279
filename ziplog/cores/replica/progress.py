"""Progress on demand (NOTICE): a primary that decided a record tells the other member
shards the highest gsn it decided, so that their primaries pass their slots below it now
instead of when their schedule's clock says so, and their backups guess past it as their
primaries will. A primary that hears such a NOTICE passes its own slots up to the gsn
named (the sequencer makes them no-ops: :meth:`PrimarySequencer._pass`).

This part decides whom to tell and what to pass; it changes no slot itself.
"""

from __future__ import annotations

from ziplog.cores.effects import Outbox, ShardReplicas
from ziplog.cores.replica.settings import ReplicaSettings
from ziplog.protocol import frames as f
from ziplog.protocol.gsna import EpochConfig, SlotCursor, epoch_base, epoch_end, epoch_of

#: a time long before any clock reading: the first NOTICE is never held back
LONG_AGO_NS = -(1 << 62)


class Progress:
    def __init__(self, settings: ReplicaSettings, out: Outbox, stats: dict[str, int]) -> None:
        self.s = settings
        self.shard = settings.shard
        self.out = out
        #: the core's counters (STATUS): ``late_notices``, NOTICEs of an epoch this primary
        #: had closed already (the record named was released here by the close, not by the
        #: notice), and ``announcements_closed``, announcements held back by the notice
        #: interval whose epoch closed first (the close passed them everywhere)
        self.stats = stats
        #: the highest gsn this primary decided a record at and has not announced yet
        self.to_announce = 0
        self.last_notice_ns = LONG_AGO_NS
        #: another shard -> the highest gsn of this epoch it needs no NOTICE up to: it
        #: announced it (it has passed it), or we told it, or it owns no slot between
        #: that and what it knew before
        self.told: dict[int, int] = {}
        #: notices of epochs not begun here yet: epoch -> the highest gsn named (at most
        #: max_epochs_ahead epochs are kept)
        self.early_notices: dict[int, int] = {}

    def decided(self, gsn: int) -> None:
        """This primary decided a record at ``gsn``: news for the other shards."""
        if gsn > self.to_announce:
            self.to_announce = gsn

    def epoch_began(self, epoch: int) -> int | None:
        """An epoch began here: the gsn to pass at once, if a NOTICE of it came early."""
        self.told = {}  # what another shard passed in an earlier epoch says nothing of this one
        early = self.early_notices
        if not early:
            return None
        self.early_notices = {e: g for e, g in early.items() if e > epoch}
        return early.get(epoch)

    def on_notice(self, msg: f.Notice, config: EpochConfig | None, last_epoch: int) -> int | None:
        """Another shard decided a record at ``msg.gsn``: the gsn to pass now, or None. A
        notice of a later epoch waits for it, one of an earlier epoch is dropped, one of
        a shard that is no member or naming a gsn outside its epoch changes nothing: a
        member can burn at most the rest of one epoch of our slots."""
        if msg.shard == self.shard or not (epoch_base(msg.epoch) <= msg.gsn <= epoch_end(msg.epoch)):
            return None
        current = config.epoch if config is not None else last_epoch
        if msg.epoch > current:
            if msg.epoch <= current + self.s.max_epochs_ahead:
                if msg.gsn > self.early_notices.get(msg.epoch, 0):
                    self.early_notices[msg.epoch] = msg.gsn
            return None
        if config is None or msg.epoch < config.epoch or msg.shard not in config.shards:
            if msg.epoch < current:
                self.stats["late_notices"] = self.stats.get("late_notices", 0) + 1
            return None
        if msg.gsn > self.told.get(msg.shard, 0):
            self.told[msg.shard] = msg.gsn  # keys: member shards only
        return msg.gsn

    def flush(self, now: int, config: EpochConfig | None, cursor: SlotCursor | None) -> None:
        """End of a turn that decided records: announce them, at most once per
        notice_interval."""
        if self.to_announce:
            if not self.s.notices:
                self.to_announce = 0
            elif now - self.last_notice_ns >= self.s.notice_interval_ns:
                self.last_notice_ns = now
                self._announce(now, config, cursor)

    def _announce(self, now: int, config: EpochConfig | None, cursor: SlotCursor | None) -> None:
        """Tell the other member shards the highest gsn decided (one NOTICE to each of
        their replicas). A shard is not told when it announced a gsn at or above it
        itself, or when it owns no slot between what it was told before and this gsn: it
        would pass nothing, and its backup would guess nothing differently (an idle shard
        at the planner's lowest rate owns a few slots per epoch, so most of a busy shard's
        NOTICEs would wake its replicas for nothing)."""
        g, self.to_announce = self.to_announce, 0
        if config is None or cursor is None or epoch_of(g) != config.epoch:
            # decided in an epoch that is closed now: its close passed it everywhere
            self.stats["announcements_closed"] = self.stats.get("announcements_closed", 0) + 1
            return
        sched = cursor.schedule
        before = config.base - 1
        msg = None
        for s in config.shards:
            if s == self.shard:
                continue
            told = self.told.get(s, before)
            if told >= g:
                continue
            self.told[s] = g
            if sched.first_slot_after(s, told) == sched.first_slot_after(s, g):
                continue  # no slot of its in (told, g]: nothing to pass
            msg = msg or f.Notice(shard=self.shard, epoch=config.epoch, gsn=g,
                                  stamp=f.wall_stamp(now, self.s.wall_offset_ns))
            self.out.send(ShardReplicas(s, sched.rate(s)), msg)  # its rate: it may pass by the clock

    def next_deadline(self, best: int | None) -> int | None:
        """The earlier of ``best`` and when an announcement is due."""
        if self.to_announce:
            t = self.last_notice_ns + self.s.notice_interval_ns
            if best is None or t < best:
                best = t
        return best
