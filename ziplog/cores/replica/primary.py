"""The primary's part (replica 0): it alone decides. Dissertation 4.2.3-4.2.4.

Each INSERT gets the primary's next slot of the current epoch's schedule (or the first
slot after the rid): that is the decision, acknowledged at once (``decided=true``), and
forwarded to the backups in order with the primary's frontier, batched per turn. Slots
whose expected arrival passed ``noop_timeout`` ago become no-ops. The backups' PREFIX
reports make positions stable: ``stable`` = min(every replica's frontier).

The sequencer owns the lifecycle, the epochs and the slots; three parts do the rest, each
with its own state: :class:`~.admission.Admission` (refusals and parked inserts),
:class:`~.forwarding.Forwarding` (FORWARDs, catch-ups, stability from the PREFIXes) and
:class:`~.progress.Progress` (NOTICE announce and pass).

Lifecycle (:class:`PrimaryState`): a (re)started primary may have lost decisions its
backups hold, so it is STARTING and decides nothing, not even an epoch's start, until
every backup's HELLO shows it is not ahead; then it is SERVING. A backup ahead of it
makes it BLOCKED for good: it refuses everything (NOT_READY) and asks for failure
recovery, whose RESUME is the only way back to SERVING.
"""

from __future__ import annotations

import enum

from ziplog.cores.effects import Outbox, Peer, ReadHistory
from ziplog.cores.replica.admission import Admission, ErrorReply
from ziplog.cores.replica.clock_pass import ClockPass, timeout_deadline, timeout_expiry
from ziplog.cores.replica.forwarding import Forwarding
from ziplog.cores.replica.log import DecidedLog
from ziplog.cores.replica.memory import Memory
from ziplog.cores.replica.parking import Parked, Parking
from ziplog.cores.replica.progress import Progress
from ziplog.cores.replica.rate_report import RateReporter
from ziplog.cores.replica.settings import ReplicaSettings
from ziplog.protocol import frames as f
from ziplog.protocol.events import EpochEvent, FrontierEvent, Members, RecordEvent, record_size
from ziplog.protocol.gsna import EpochConfig, EpochSchedule, SlotCursor, epoch_end


class PrimaryState(enum.Enum):
    #: (re)started: waits for every backup's HELLO before deciding anything
    STARTING = "starting"
    #: deciding
    SERVING = "serving"
    #: a backup is ahead: this primary lost state; it refuses everything until recovered
    BLOCKED = "blocked"


_TRANSITIONS = {
    PrimaryState.STARTING: {PrimaryState.SERVING, PrimaryState.BLOCKED},
    PrimaryState.SERVING: {PrimaryState.BLOCKED},
    PrimaryState.BLOCKED: {PrimaryState.SERVING},  # only by failure recovery's RESUME
}


class PrimarySequencer:
    is_primary = True

    def __init__(self, settings: ReplicaSettings, log: DecidedLog, parking: Parking, out: Outbox,
                 error: ErrorReply, stats: dict[str, int], incarnation: int = 0) -> None:
        self.s = settings
        self.shard = settings.shard
        self.ack_inc = incarnation  # this start's: our ACKs name it (we decide)
        self.log = log
        self.out = out
        self.error = error
        self.stats = stats
        self.admission = Admission(settings, log, parking, error)
        self.fwd = Forwarding(settings, log, out, incarnation)
        self.progress = Progress(settings, out, stats)
        backups = set(range(1, settings.replicas))
        self.state = PrimaryState.STARTING if backups else PrimaryState.SERVING
        #: backups whose HELLO this (re)started primary has not accepted yet
        self.awaiting: set[int] = backups
        #: why this primary refuses to decide (BLOCKED only)
        self.blocked_reason: str | None = None
        #: the last incarnation stopped gracefully holding every record any replica
        #: acknowledged, and the disk this one replayed is all of it (:meth:`restart_clean`)
        self.restarted_clean = False
        # -- the current epoch ------------------------------------------------------------
        self.cur_config: EpochConfig | None = None
        self.cursor: SlotCursor | None = None  # None when not a member of the current epoch
        self.clock: ClockPass | None = None  # passes our slots by inserts' stamps (and time, busy)
        self.next_slot = 0
        self.epoch_start_ns = 0
        self.epoch_count = 0  # records assigned in the current epoch (rate report)
        self.rates = RateReporter(settings.shard)  # when to tell the membership service our rate
        #: the latest broadcast, kept while this primary may not decide
        self.stashed: EpochConfig | None = None
        #: a broadcast waiting for the members of the epochs missed before it
        self.awaiting_history: EpochConfig | None = None

    def _become(self, state: PrimaryState) -> None:
        assert state in _TRANSITIONS[self.state], ("illegal primary transition", self.state, state)
        self.state = state

    # -- what others ask -------------------------------------------------------------------------
    @property
    def deciding(self) -> bool:
        return self.state is PrimaryState.SERVING

    @property
    def qualified(self) -> bool:  # holds every acknowledged record: no backup is ahead
        return self.state is PrimaryState.SERVING

    @property
    def blocked(self) -> str | None:
        return self.blocked_reason

    @property
    def refused(self) -> Memory[tuple[int, int], str]:
        return self.admission.refused

    @property
    def holds_everything_acked(self) -> bool:
        """Every acknowledged record is in our log: we serve, or restarted clean and
        decided nothing since. What a graceful stop may vouch for."""
        return self.state is PrimaryState.SERVING or (self.state is PrimaryState.STARTING and self.restarted_clean)

    def restart_clean(self) -> None:
        """The replayed disk is all the last incarnation decided, and it held every
        acknowledged record: a backup's guess above our frontier was never decided, so
        a backup showing one does not mean this primary lost state."""
        assert self.state is PrimaryState.STARTING or not self.awaiting, self.state
        self.restarted_clean = True

    def current_epoch(self) -> int:
        return self.cur_config.epoch if self.cur_config is not None else -1

    # -- inserts --------------------------------------------------------------------------------
    def insert(self, route: bytes, msg: f.Insert, now: int) -> None:
        blocked = self.blocked_reason if self.state is PrimaryState.BLOCKED else None
        assert self.state is not PrimaryState.BLOCKED or blocked is not None
        admission = self.admission
        if admission.refused_at_once(route, msg, now, blocked):
            return
        cfg, cur = self.cur_config, self.cursor
        if not admission.admit(route, msg, now, cfg, cur is not None):
            return
        assert cfg is not None and cur is not None
        after = msg.after
        k = self.next_slot
        if k < cur.count and cur.gsn(k) <= after:
            k = cur.first_slot_after(after)
        if (clock := self.clock) is not None:
            k = clock.place(k, msg.stamp, now)  # no slot expected before it was sent (the backup guesses alike)
        if k >= cur.count:  # this epoch has no slot left after `after`: wait for the next
            admission.park(route, msg, now, cfg.epoch + 1)
            return
        gsn = cur.gsn(k)
        assert gsn > after, ("InsertAfter must return a gsn above the rid", gsn, after)
        size = record_size(msg.data)
        fwd = self.fwd
        if fwd.full_for(size):
            assert self.state is PrimaryState.SERVING, ("a FORWARD from a primary that does not serve", self.state)
            fwd.forward(now, self.next_slot)  # before this record is applied: the FORWARD's frontier must not pass it
        self.next_slot = k + 1
        self.epoch_count += 1
        ev = RecordEvent(gsn, k, msg.client_id, msg.seq, msg.data)
        log = self.log
        log.apply_record(ev)
        log.advance_frontier(cur.gsn(k + 1) - 1)
        self.out.send(route, f.Ack(req_id=msg.req_id, gsn=gsn, replica=0, stable=log.stable, decided=True, final=False,
                                   inc=self.ack_inc))
        fwd.add_record(ev, size)
        self.progress.decided(gsn)
        fwd.stable_changed()

    def parked_insert_expired(self, p: Parked, now: int) -> None:
        self.admission.parked_insert_expired(p, now)

    # -- epochs ---------------------------------------------------------------------------------
    def on_epoch(self, config: EpochConfig, now: int, stamp: int = 0) -> bool:
        """A broadcast (its sender's stamp ``stamp``, 0: unknown); True when it began here
        (inserts waiting for it may go on). Epochs are decided in order with no gap: one
        that follows a gap waits for the members of the missed epochs (``ReadHistory``)."""
        log = self.log
        if config.epoch <= log.last_epoch:
            return False
        if not self.deciding:
            # Until every backup has said where it is, we cannot know that we did not
            # lose decisions it holds: decide nothing, not even an epoch's start.
            self.stashed = config
            return False
        if config.epoch > log.last_epoch + 1:
            # Missed broadcasts (start-up, restart, or a slow moment): the history in
            # ZooKeeper names the members of the epochs we never saw.
            if self.awaiting_history is None or config.epoch > self.awaiting_history.epoch:
                self.awaiting_history = config
                self.out.coordinate.append(ReadHistory(log.last_epoch + 1, config.epoch - 1))
            return False
        self._close_epoch(now)
        log.apply_epochs(config.epoch, config.epoch, config.shards)
        self.cur_config = config
        self.epoch_start_ns = now
        self.epoch_count = 0
        self.next_slot = 0
        if self.shard in config.shards:
            self.cursor = cur = SlotCursor(EpochSchedule(config), self.shard)
            self.clock = ClockPass.of(self.s, cur, stamp, now, self.stats)
            log.advance_frontier(cur.gsn(0) - 1)  # what lies below our first slot is others'
        else:
            self.cursor = self.clock = None
            log.advance_frontier(config.end)  # nothing of ours in this epoch
        self.fwd.add(EpochEvent(config.epoch, config.epoch, tuple(config.shards)))
        if (early := self.progress.epoch_began(config.epoch)) is not None:
            self._pass(early)
        self.fwd.stable_changed()
        return True

    def on_history(self, ranges: list[tuple[int, int, Members]], now: int) -> bool:
        """The members of the epochs missed before the broadcast that waits for them (the
        answer to ``ReadHistory``): they close at once; then that broadcast begins."""
        config, self.awaiting_history = self.awaiting_history, None
        if config is None or not self.deciding:
            if config is not None:
                self.stashed = config
            return False
        for first, last, members in ranges:
            if last < config.epoch:
                self._on_missed_epochs(first, min(last, config.epoch - 1), members, now)
        if config.epoch > self.log.last_epoch + 1:
            # the history did not reach that far yet: ask again
            self.awaiting_history = config
            self.out.coordinate.append(ReadHistory(self.log.last_epoch + 1, config.epoch - 1))
            return False
        return self.on_epoch(config, now)

    def _on_missed_epochs(self, first: int, last: int, members: Members, now: int) -> None:
        """Epochs this primary never saw broadcast (it was down or slow): it assigned
        nothing in them, so they close at once."""
        log = self.log
        if last <= log.last_epoch:
            return
        self._close_epoch(now)
        first = max(first, log.last_epoch + 1)
        log.apply_epochs(first, last, members)
        self.fwd.add(EpochEvent(first, last, tuple(members)))
        log.advance_frontier(epoch_end(last))
        self.cur_config = None
        self.cursor = self.clock = None
        self.fwd.stable_changed()

    def _close_epoch(self, now: int) -> None:
        """End-of-epoch token: every gsn of the current epoch past our last one is a no-op."""
        cfg = self.cur_config
        if cfg is None:
            return
        if self.cursor is not None:
            if (report := self.rates.on_epoch_closed(cfg.epoch, self.epoch_count, now - self.epoch_start_ns)):
                self.out.send(Peer.MMS, report.frame(self.shard))  # the driver sends a turn's in one frame
        self.log.advance_frontier(cfg.end)
        self.cur_config = None
        self.cursor = self.clock = None

    def _take_stashed(self, now: int) -> None:
        if self.stashed is not None:
            config, self.stashed = self.stashed, None
            self.on_epoch(config, now)

    # -- backups --------------------------------------------------------------------------------
    def on_hello(self, route: bytes, msg: f.Hello, now: int) -> None:
        """A backup (re)connected, or found a gap in the forwards: catch it up, unless it
        is ahead of us."""
        log = self.log
        replica, frontier = msg.replica, msg.frontier
        # Guesses above our frontier are normal while we run (inserts in flight); right
        # after our (re)start they may be acknowledged records we lost, unless the last
        # incarnation vouched at a graceful stop that it wrote every one.
        starting = replica in self.awaiting
        if (self.state is PrimaryState.BLOCKED or frontier > log.frontier
                or (starting and msg.guessed_top > log.frontier and not self.restarted_clean)):
            # The backup holds decisions (or acked guesses) above all we know: we lost
            # state, and an acknowledged record may live only there. Going on would fork
            # the shard's log: we stop deciding until failure recovery reconciles us.
            if self.state is not PrimaryState.BLOCKED:
                self.blocked_reason = (f"backup {replica} is ahead (frontier {frontier}, guesses up to "
                                       f"{msg.guessed_top}) of this primary (frontier {log.frontier}): "
                                       f"failure recovery needed")
                self._become(PrimaryState.BLOCKED)
            self.stats["conflicting_hellos"] = self.stats.get("conflicting_hellos", 0) + 1
            assert self.blocked_reason is not None
            self.error(route, None, f.E_NOT_READY, self.blocked_reason)
            return
        fwd = self.fwd
        fwd.backup_at(replica, route, frontier, msg.inc)
        if self.state is PrimaryState.STARTING:
            # A catch-up makes a backup QUALIFIED (holding every acknowledged record): a
            # starting primary cannot vouch for that (another backup's HELLO may yet show
            # it lost records), so every catch-up waits until each backup is heard from.
            self.awaiting.discard(replica)
            if not self.awaiting:
                # No backup is ahead of us: we hold everything acknowledged; decide again.
                self._become(PrimaryState.SERVING)
                for r in sorted(fwd.backup_routes):
                    self._catch_up(r, fwd.prefixes[r])
                self._take_stashed(now)
            return
        self._catch_up(replica, frontier)

    def _catch_up(self, replica: int, frontier: int) -> None:
        """Only a SERVING primary may put a backup in step (see :mod:`.forwarding`)."""
        assert self.state is PrimaryState.SERVING, ("a catch-up from a primary that does not serve", self.state)
        self.fwd.catch_up(replica, frontier, self.next_slot)

    def on_prefix(self, msg: f.Prefix, now: int) -> None:
        self.fwd.on_prefix(msg)

    # -- progress on demand -----------------------------------------------------------------------
    def on_notice(self, msg: f.Notice, now: int) -> None:
        """Another shard decided a record at ``msg.gsn``: pass it (see :mod:`.progress`)."""
        gsn = self.progress.on_notice(msg, self.cur_config, self.log.last_epoch)
        if gsn is not None:
            self._pass(gsn)

    def _pass(self, gsn: int) -> None:
        """Make every slot of ours up to ``gsn`` (in the current epoch) a no-op."""
        cur, cfg = self.cursor, self.cur_config
        if cur is None or cfg is None:
            return  # no slot of ours in this epoch
        k = cur.passed(self.next_slot, gsn)
        if k == self.next_slot:
            return  # nothing of ours at or below it is left
        self.next_slot = k
        log, fwd = self.log, self.fwd
        log.advance_frontier(cur.gsn(k) - 1 if k < cur.count else cfg.end)
        fwd.add(FrontierEvent(log.frontier, log.last_epoch, self.next_slot))
        fwd.demanded = max(fwd.demanded, min(gsn, log.frontier))
        self.stats["passed_on_notice"] = self.stats.get("passed_on_notice", 0) + 1
        fwd.stable_changed()

    # -- time -----------------------------------------------------------------------------------
    def tick(self, now: int) -> None:
        """Slots whose records never came become no-ops, by time (:mod:`.clock_pass`)."""
        cur, clock, k = self.cursor, self.clock, self.next_slot
        if cur is not None and self.s.noop_timeout_ns > 0:
            k = timeout_expiry(cur, now - self.epoch_start_ns, self.s.noop_timeout_ns, k)
        elif clock is not None:
            k = clock.expire(now, k)
        if cur is not None and k > self.next_slot:
            self.next_slot = k
            self.log.advance_frontier(cur.gsn(k) - 1)
            self.fwd.add(FrontierEvent(self.log.frontier, self.log.last_epoch, k))
            self.fwd.stable_changed()

    def prune(self, now: int) -> None:
        self.admission.refused.prune(now)

    def flush(self, now: int) -> None:
        """End of a turn: the turn's decisions in one FORWARD, its news in NOTICEs. Only a
        SERVING primary sends FORWARDs (see :mod:`.forwarding`)."""
        if self.state is not PrimaryState.SERVING:
            return
        self.fwd.flush(now, self.next_slot)
        self.progress.flush(now, self.cur_config, self.cursor)

    def next_deadline(self, now: int) -> int | None:
        best = self.admission.refused.next_prune()
        cur, clock, timeout = self.cursor, self.clock, self.s.noop_timeout_ns
        t = (timeout_deadline(cur, self.epoch_start_ns, self.next_slot, timeout) if cur is not None and timeout > 0
             else clock.deadline(self.next_slot) if clock is not None else None)
        if t is not None and (best is None or t < best):
            best = t
        return self.progress.next_deadline(self.fwd.next_deadline(best))

    # -- failure recovery -------------------------------------------------------------------------
    def frozen(self) -> None:
        """Frozen for a recovery (nothing decided until RESUME)."""

    def holds(self, key: tuple[int, int]) -> int | None:
        """The gsn this replica holds the record at, decided or guessed."""
        return self.log.dedup.get(key)

    def guesses_above(self, frontier: int) -> list[list[object]]:
        return []

    def on_authority(self, now: int) -> None:
        """This replica's frozen state is the one the recovery keeps."""

    def refused_for_recovery(self, key: tuple[int, int], now: int) -> None:
        self.admission.refused_for_recovery(key, now)

    def installing(self) -> None:
        """Recovery replaces the log above some point: the current epoch is gone."""
        self.cur_config = None
        self.cursor = None
        self.fwd.drop_pending()

    def installed(self) -> None:
        self.fwd.mark_point()

    def resumed(self, now: int) -> None:
        """Recovery is over: every replica holds exactly the recovered state."""
        if self.state is not PrimaryState.SERVING:
            self._become(PrimaryState.SERVING)
        self.blocked_reason = None
        self.awaiting = set()
        self.fwd.in_step_after_recovery()
        self._take_stashed(now)

    def status(self) -> dict[str, object]:
        return {"backups_connected": sorted(self.fwd.backup_routes), "blocked": self.blocked_reason,
                "state": self.state.value}
