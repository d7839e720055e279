"""The primary's part (replica 0): it alone decides. Dissertation 4.2.3-4.2.4.

Each INSERT gets the primary's next slot of the current epoch's schedule (or the first
slot after the rid): that is the decision, acknowledged at once (``decided=true``), and
forwarded to the backups in order with the primary's frontier, batched per turn. Slots
whose expected arrival passed ``noop_timeout`` ago become no-ops. The backups' PREFIX
reports make positions stable: ``stable`` = min(every replica's frontier).

Lifecycle (:class:`PrimaryState`): a (re)started primary may have lost decisions its
backups hold, so it is STARTING and decides nothing, not even an epoch's start, until
every backup's HELLO shows it is not ahead; then it is SERVING. A backup ahead of it
makes it BLOCKED for good: it refuses everything (NOT_READY) and asks for failure
recovery, whose RESUME is the only way back to SERVING.
"""

from __future__ import annotations

import bisect
import enum
from typing import Callable

from ziplog.cores.effects import Outbox, Peer, ReadHistory, ShardReplicas
from ziplog.cores.replica.log import DecidedLog, epoch_hint
from ziplog.cores.replica.memory import Memory
from ziplog.cores.replica.parking import Parked, Parking
from ziplog.cores.replica.settings import ReplicaSettings
from ziplog.protocol import frames as f
from ziplog.protocol.events import (
    EpochEvent,
    FrontierEvent,
    Members,
    RecordEvent,
    StreamEvent,
    event_size,
    record_size,
)
from ziplog.protocol.gsna import (
    EpochConfig,
    EpochSchedule,
    SlotCursor,
    epoch_base,
    epoch_end,
    epoch_of,
)

ErrorReply = Callable[[bytes, "int | None", str, str], None]


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
                 error: ErrorReply, stats: dict[str, int]) -> None:
        self.s = settings
        self.shard = settings.shard
        self.log = log
        self.parking = parking
        self.out = out
        self.error = error
        self.stats = stats
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
        self.next_slot = 0
        self.epoch_start_ns = 0
        self.epoch_count = 0  # records assigned in the current epoch (rate report)
        #: the latest broadcast, kept while this primary may not decide
        self.stashed: EpochConfig | None = None
        #: a broadcast waiting for the members of the epochs missed before it
        self.awaiting_history: EpochConfig | None = None
        # -- backups ----------------------------------------------------------------------
        self.backup_routes: dict[int, bytes] = {}
        self.prefixes: dict[int, int] = {}
        self.fwd_events: list[StreamEvent] = []
        #: bytes of the records in ``fwd_events`` (a FORWARD stays within forward_batch_bytes)
        self.fwd_bytes = 0
        #: (frontier, last epoch) a backup is at after every FORWARD sent so far
        self.fwd_mark: tuple[int, int] = (0, -1)
        self.stable_sent = 0
        #: the highest stable gsn the backups were told of that holds a record (a FORWARD
        #: of the stable watermark alone is worth it only when it makes a record stable)
        self.stable_record_sent = 0
        #: the highest gsn we passed on a NOTICE: another shard's record waits for our
        #: no-ops up to it to be stable, so their stability is news worth a FORWARD too
        #: (subscribers that read from a backup learn it from there)
        self.demanded = 0
        self.last_forward_ns = 0
        # -- progress on demand (NOTICE) ----------------------------------------------------
        #: the highest gsn this primary decided a record at and has not announced yet
        self.to_announce = 0
        self.last_notice_ns = -(1 << 62)
        #: another shard -> the highest gsn of this epoch it needs no NOTICE up to: it
        #: announced it (it has passed it), or we told it, or it owns no slot between
        #: that and what it knew before
        self.told: dict[int, int] = {}
        #: notices of epochs not begun here yet: epoch -> the highest gsn named (at most
        #: max_epochs_ahead epochs are kept)
        self.early_notices: dict[int, int] = {}
        # -- refusals ---------------------------------------------------------------------
        #: records refused for good: a client may have moved them to another shard, so a
        #: late duplicate of the INSERT must not place them here too
        #: records refused for good -> the code they were refused with (None: NOT_MEMBER)
        self.refused: Memory[tuple[int, int], str] = Memory(settings.refusal_memory_ns, settings.max_remembered,
                                                             settings.prune_interval_ns)
        #: record -> the epoch it waited in, on a shard that is not a member (it waits one
        #: epoch before a refusal: clients see a rejoin in ZooKeeper before its epoch)
        self.member_wait: dict[tuple[int, int], int] = {}

    def _become(self, state: PrimaryState) -> None:
        assert state in _TRANSITIONS[self.state], ("illegal primary transition", self.state, state)
        self.state = state

    # -- what others ask -------------------------------------------------------------------------
    @property
    def deciding(self) -> bool:
        return self.state is PrimaryState.SERVING

    @property
    def qualified(self) -> bool:
        """Holds every record any replica acknowledged: every backup showed it is not ahead."""
        return self.state is PrimaryState.SERVING

    @property
    def blocked(self) -> str | None:
        return self.blocked_reason

    @property
    def holds_everything_acked(self) -> bool:
        """Every record any replica acknowledged is in this primary's log: it serves
        (every backup showed it is not ahead, or a recovery made the replicas one), or it
        restarted clean and decided nothing since. What a graceful stop may vouch for."""
        return self.state is PrimaryState.SERVING or (self.state is PrimaryState.STARTING and self.restarted_clean)

    def restart_clean(self) -> None:
        """The replayed disk is every record the previous incarnation decided, and that
        one held every record any replica acknowledged: a backup's guess above our
        frontier was then never decided by any primary, so no client holds it
        acknowledged, and a backup showing one does not mean this primary lost state."""
        assert self.state is PrimaryState.STARTING or not self.awaiting, self.state
        self.restarted_clean = True

    def current_epoch(self) -> int:
        return self.cur_config.epoch if self.cur_config is not None else -1

    # -- inserts --------------------------------------------------------------------------------
    def refuse(self, route: bytes, req_id: int, key: tuple[int, int], now: int, code: str, message: str) -> None:
        """A final refusal: this primary will never decide this record."""
        self.refused.add(key, now, code)
        self.error(route, req_id, code, message)

    def insert(self, route: bytes, msg: f.Insert, now: int) -> None:
        key = (msg.client_id, msg.seq)
        if self.state is PrimaryState.BLOCKED:
            assert self.blocked_reason is not None
            self.refuse(route, msg.req_id, key, now, f.E_NOT_READY, self.blocked_reason)
            return
        if key in self.refused:
            # Again with the first refusal's code: a client that asked again meanwhile
            # still learns why (DISK_FULL, TIMEOUT, ...) rather than a bare NOT_MEMBER.
            code = self.refused.get(key) or f.E_NOT_MEMBER
            self.refuse(route, msg.req_id, key, now, code, "this shard refused this record before")
            return
        if self.log.disk_fault is not None:
            # A record it could not persist is one a restart could lose on every replica
            # at once (they fill together): refuse it, for good, so it goes elsewhere.
            self.refuse(route, msg.req_id, key, now, f.E_DISK_FULL, f"this replica cannot write: {self.log.disk_fault}")
            return
        cfg, cur = self.cur_config, self.cursor
        if not self._admit(route, msg, now, cfg, cur is not None):
            return
        assert cfg is not None and cur is not None
        after = msg.after
        k = self.next_slot
        if k < cur.count and cur.gsn(k) <= after:
            k = cur.first_slot_after(after)
        if k >= cur.count:  # this epoch has no slot left after `after`: wait for the next
            self._park(route, msg, now, cfg.epoch + 1)
            return
        gsn = cur.gsn(k)
        assert gsn > after, ("InsertAfter must return a gsn above the rid", gsn, after)
        size = record_size(msg.data)
        if self.fwd_events and self.fwd_bytes + size > self.s.forward_batch_bytes:
            self._forward(now)  # before this record is applied: the FORWARD's frontier must not pass it
        self.next_slot = k + 1
        self.epoch_count += 1
        ev = RecordEvent(gsn, k, msg.client_id, msg.seq, msg.data)
        log = self.log
        log.apply_record(ev)
        log.advance_frontier(cur.gsn(k + 1) - 1)
        self.out.send(route, f.Ack(req_id=msg.req_id, gsn=gsn, replica=0, stable=log.stable, decided=True, final=False))
        self.fwd_events.append(ev)
        self.fwd_bytes += size
        if gsn > self.to_announce:
            self.to_announce = gsn
        self.stable_changed()

    def _park(self, route: bytes, msg: f.Insert, now: int, need_epoch: int) -> None:
        if not self.parking.park(Parked(route, msg, now + self.s.park_timeout_ns, need_epoch=need_epoch, arrived_ns=now)):
            self.refuse(route, msg.req_id, (msg.client_id, msg.seq), now, f.E_OVERLOADED,
                        "too many requests are waiting on this replica")

    def _admit(self, route: bytes, msg: f.Insert, now: int, config: EpochConfig | None, member: bool) -> bool:
        """Park when the rid or our epoch is ahead; refuse when this shard takes no
        inserts. True when the insert can be placed now."""
        need_epoch = epoch_of(msg.after + 1)
        have = config.epoch if config is not None else -1
        log = self.log
        if need_epoch > have:
            # "Far beyond" needs a current epoch to measure from: a replica that has seen
            # none yet (a shard just added, a replica just started) parks instead.
            known = config is not None or bool(log.membership)
            if known and need_epoch > max(have, log.last_epoch) + self.s.max_epochs_ahead:
                self.error(route, msg.req_id, f.E_UNKNOWN_RID,
                           f"rid gsn {msg.after} lies in epoch {need_epoch}, far beyond the current epoch {have}")
                return False
            self._park(route, msg, now, need_epoch)
            return False
        if not member:
            if not log.ever_member(self.shard):
                # Never a member yet: we are joining. Clients learn membership from
                # ZooKeeper, which the MMS writes before it broadcasts, so an insert can
                # reach us just before the epoch that admits us does: wait for it.
                self._park(route, msg, now, have + 1)
                return False
            key = (msg.client_id, msg.seq)
            waited = self.member_wait.pop(key, None)
            if waited is None or waited >= have:
                # It left, but clients see a rejoin in ZooKeeper before its epoch reaches
                # us (after a recovery, say): wait for one more epoch before refusing.
                if len(self.member_wait) >= self.s.max_remembered:
                    self.member_wait.clear()  # requests that timed out while waiting
                self.member_wait[key] = have
                self._park(route, msg, now, have + 1)
                return False
            self.refuse(route, msg.req_id, key, now, f.E_NOT_MEMBER, f"shard {self.shard} takes no inserts in epoch {have}")
            return False
        return True

    def parked_insert_expired(self, p: Parked, now: int) -> None:
        """A parked INSERT timed out: that refusal is final too, and a resend hears it
        again as TIMEOUT (a client counts only the answer to its latest resend)."""
        assert isinstance(p.msg, f.Insert)
        self.refused.add((p.msg.client_id, p.msg.seq), now, f.E_TIMEOUT)

    # -- stability ---------------------------------------------------------------------------------
    def stable_changed(self) -> None:
        new = self.log.frontier
        for r in range(1, self.s.replicas):
            new = min(new, self.prefixes.get(r, 0))
        self.log.advance_stable(new)

    # -- epochs ---------------------------------------------------------------------------------
    def on_epoch(self, config: EpochConfig, now: int) -> bool:
        """A broadcast from the membership service; True when it began here (inserts
        waiting for it may go on). Epochs are decided in order with no gap: one that
        follows a gap waits for the members of the missed epochs (``ReadHistory``)."""
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
            self.cursor = SlotCursor(EpochSchedule(config), self.shard)
        else:
            self.cursor = None
            log.advance_frontier(config.end)  # nothing of ours in this epoch
        self.fwd_events.append(EpochEvent(config.epoch, config.epoch, tuple(config.shards)))
        self.told = {}  # what another shard passed in an earlier epoch says nothing of this one
        early = self.early_notices
        if early:
            self.early_notices = {e: g for e, g in early.items() if e > config.epoch}
            g = early.get(config.epoch)
            if g is not None:
                self._pass(g)
        self.stable_changed()
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
        self.fwd_events.append(EpochEvent(first, last, tuple(members)))
        log.advance_frontier(epoch_end(last))
        self.cur_config = None
        self.cursor = None
        self.stable_changed()

    def _close_epoch(self, now: int) -> None:
        """End-of-epoch token: every gsn of the current epoch past our last one is a no-op."""
        cfg = self.cur_config
        if cfg is None:
            return
        if self.cursor is not None:
            self.out.send(Peer.MMS, f.Rate(shard=self.shard, epoch=cfg.epoch, count=self.epoch_count,
                                           duration_ns=max(now - self.epoch_start_ns, 1)))
        self.log.advance_frontier(cfg.end)
        self.cur_config = None
        self.cursor = None

    # -- backups --------------------------------------------------------------------------------
    def on_hello(self, route: bytes, msg: f.Hello, now: int) -> None:
        """A backup (re)connected, or found a gap in the forwards: catch it up, unless it
        is ahead of us."""
        log = self.log
        replica, frontier = msg.replica, msg.frontier
        # Guesses above our frontier are normal while we run (inserts in flight); right
        # after our (re)start they may be acknowledged records we no longer have, unless
        # the last incarnation vouched at a graceful stop that it wrote every one.
        starting = replica in self.awaiting
        if (self.state is PrimaryState.BLOCKED or frontier > log.frontier
                or (starting and msg.guessed_top > log.frontier and not self.restarted_clean)):
            # The backup holds decisions (or acked guesses) above everything this primary
            # knows: the primary lost state (it restarted from a disk that lagged its
            # memory). A record acknowledged to a client may live only there. Going on
            # would fork the shard's log, so this primary stops deciding for good; only
            # failure recovery may reconcile the replicas.
            if self.state is not PrimaryState.BLOCKED:
                self.blocked_reason = (f"backup {replica} is ahead (frontier {frontier}, guesses up to "
                                       f"{msg.guessed_top}) of this primary (frontier {log.frontier}): "
                                       f"failure recovery needed")
                self._become(PrimaryState.BLOCKED)
            self.stats["conflicting_hellos"] = self.stats.get("conflicting_hellos", 0) + 1
            assert self.blocked_reason is not None
            self.error(route, None, f.E_NOT_READY, self.blocked_reason)
            return
        self.backup_routes[replica] = route
        self.prefixes[replica] = frontier
        if self.state is PrimaryState.STARTING:
            # A catch-up ending with our frontier puts a backup in step and makes it
            # QUALIFIED: it vouches that the backup now holds every record any replica
            # acknowledged. A starting primary cannot vouch for that (it may have lost
            # records another backup still holds, as its HELLO may yet show), so every
            # catch-up waits until each backup said it is not ahead.
            self.awaiting.discard(replica)
            if not self.awaiting:
                # Every backup is known to be behind us: we hold everything any replica
                # acknowledged, and it is safe to decide again, from the latest broadcast.
                self._become(PrimaryState.SERVING)
                for r in sorted(self.backup_routes):
                    self._catch_up(self.backup_routes[r], self.prefixes[r])
                self._take_stashed(now)
            return
        self._catch_up(route, frontier)

    def _catch_up(self, route: bytes, frontier: int) -> None:
        """Send a backup at ``frontier`` everything decided above it, in parts of at most
        forward_batch_bytes. A part ends with a record and no FRONTIER event (the backup's
        frontier is then that record's gsn, and it asks for the next part at once); the
        last part ends with our frontier, which puts the backup in step (QUALIFIED): only
        a SERVING primary may say that."""
        assert self.state is PrimaryState.SERVING, ("a catch-up from a primary that does not serve", self.state)
        log = self.log
        events: list[StreamEvent] = []
        size, records, partial = 0, 0, False
        for ev in log.stream_after(frontier):
            n = event_size(ev)
            if type(ev) is RecordEvent:
                if records and size + n > self.s.forward_batch_bytes:
                    partial = True
                    break
                records += 1
            events.append(ev)
            size += n
        if not partial:
            events.append(FrontierEvent(log.frontier, log.last_epoch, self.next_slot))
        self.out.send(route, f.Forward(stable=log.stable, body=f.ForwardBody(frontier, epoch_hint(frontier), events)))

    def _take_stashed(self, now: int) -> None:
        if self.stashed is not None:
            config, self.stashed = self.stashed, None
            self.on_epoch(config, now)

    def on_prefix(self, msg: f.Prefix, now: int) -> None:
        replica, frontier = msg.replica, msg.frontier
        if frontier > self.prefixes.get(replica, 0):
            self.prefixes[replica] = min(frontier, self.log.frontier)
            self.stable_changed()

    # -- progress on demand -----------------------------------------------------------------------
    def _announce(self, now: int) -> None:
        """End of a turn that decided records: tell the other member shards the highest
        gsn (one NOTICE to each of their replicas), so that their primaries pass it now
        instead of when their schedule's clock says so, and their backups guess past it
        as their primaries will. A shard is not told when it announced a gsn at or above
        it itself, or when it owns no slot between what it was told before and this gsn:
        it would pass nothing, and its backup would guess nothing differently (an idle
        shard at the planner's lowest rate owns a few slots per epoch, so most of a busy
        shard's NOTICEs would wake its replicas for nothing)."""
        g, self.to_announce = self.to_announce, 0
        cfg, cur = self.cur_config, self.cursor
        if cfg is None or cur is None or epoch_of(g) != cfg.epoch:
            return  # decided in an epoch that is closed now: its close passed it everywhere
        sched = cur.schedule
        before = cfg.base - 1
        msg = None
        for s in cfg.shards:
            if s == self.shard:
                continue
            told = self.told.get(s, before)
            if told >= g:
                continue
            self.told[s] = g
            if sched.first_slot_after(s, told) == sched.first_slot_after(s, g):
                continue  # no slot of its in (told, g]: nothing to pass
            msg = msg or f.Notice(shard=self.shard, epoch=cfg.epoch, gsn=g,
                                  stamp=f.wall_stamp(now, self.s.wall_offset_ns))
            self.out.send(ShardReplicas(s), msg)

    def on_notice(self, msg: f.Notice, now: int) -> None:
        """Another shard decided a record at ``msg.gsn``: pass it (unused slots up to it
        become no-ops, replicated like any decision before anyone relies on them). A
        notice of a later epoch waits for it, one of an earlier epoch is dropped, one of
        a shard that is no member or naming a gsn outside its epoch changes nothing: a
        member can burn at most the rest of one epoch of our slots."""
        if msg.shard == self.shard or not (epoch_base(msg.epoch) <= msg.gsn <= epoch_end(msg.epoch)):
            return
        cfg = self.cur_config
        current = cfg.epoch if cfg is not None else self.log.last_epoch
        if msg.epoch > current:
            if msg.epoch <= current + self.s.max_epochs_ahead:
                if msg.gsn > self.early_notices.get(msg.epoch, 0):
                    self.early_notices[msg.epoch] = msg.gsn
            return
        if cfg is None or msg.epoch < cfg.epoch or msg.shard not in cfg.shards:
            return
        if msg.gsn > self.told.get(msg.shard, 0):
            self.told[msg.shard] = msg.gsn  # keys: member shards only
        self._pass(msg.gsn)

    def _pass(self, gsn: int) -> None:
        """Make every slot of ours up to ``gsn`` (in the current epoch) a no-op."""
        cur, cfg = self.cursor, self.cur_config
        if cur is None or cfg is None:
            return  # no slot of ours in this epoch
        k = cur.passed(self.next_slot, gsn)
        if k == self.next_slot:
            return  # nothing of ours at or below it is left
        self.next_slot = k
        self.log.advance_frontier(cur.gsn(k) - 1 if k < cur.count else cfg.end)
        self.fwd_events.append(FrontierEvent(self.log.frontier, self.log.last_epoch, self.next_slot))
        self.demanded = max(self.demanded, min(gsn, self.log.frontier))
        self.stats["passed_on_notice"] = self.stats.get("passed_on_notice", 0) + 1
        self.stable_changed()

    def _stable_news(self) -> bool:
        """The stable watermark moved past a record the backups do not know is stable, or
        past no-ops another shard's record waits for. (Never with a single backup: it
        knows everything it applied is stable.)"""
        log = self.log
        if log.stable <= self.stable_record_sent or self.s.backup_knows_stable:
            return False
        if self.demanded > self.stable_record_sent:
            return True
        gsns = log.gsns
        i = bisect.bisect_right(gsns, self.stable_record_sent)
        return i < len(gsns) and gsns[i] <= log.stable

    # -- time -----------------------------------------------------------------------------------
    def tick(self, now: int) -> None:
        cur = self.cursor
        if cur is not None and self.s.noop_timeout_ns > 0:
            sched, elapsed = cur.schedule, now - self.epoch_start_ns
            if sched.slots_due(self.shard, elapsed - self.s.noop_timeout_ns) > self.next_slot:
                # Expected records that never came: their slots become no-ops. Catch up to
                # the schedule *now*, not just to the timeout: a writer slower than its
                # rate then triggers this once per timeout's worth of lag rather than once
                # per record, and each expiry is a chance for a backup to guess a record's
                # slot before it hears of the no-ops (a slow-path insert).
                due = min(sched.slots_due(self.shard, elapsed), cur.count)
                self.next_slot = due
                self.log.advance_frontier(cur.gsn(due) - 1)
                self.fwd_events.append(FrontierEvent(self.log.frontier, self.log.last_epoch, self.next_slot))
                self.stable_changed()

    def prune(self, now: int) -> None:
        self.refused.prune(now)

    def flush(self, now: int) -> None:
        """End of a turn: one FORWARD with the turn's decisions. Batching per turn keeps
        the per-record message count low under load without delaying anything when
        idle. Only a SERVING primary sends FORWARDs (see :meth:`_catch_up`)."""
        if self.state is not PrimaryState.SERVING:
            return
        log = self.log
        s = self.s
        # Every FORWARD carries the stable watermark; a FORWARD of its own is only
        # worth it when no records have gone out for a while.
        since = now - self.last_forward_ns
        # (not when only no-ops nobody waits for became stable: an idle shard's heartbeat
        # carries that)
        push_stable = since >= s.stable_push_ns and self._stable_news()
        # A backup that lags with nothing new to send may have lost a FORWARD: a
        # periodic (empty) FORWARD names our state so it can spot the gap and ask ...
        lagging = since >= s.lag_probe_ns and any(self.prefixes.get(r, 0) < log.frontier for r in self.backup_routes)
        # ... and an idle primary's heartbeat is an empty FORWARD.
        lagging = lagging or (since >= s.heartbeat_ns and bool(self.backup_routes))
        # Records wait up to forward_interval so that under load one FORWARD (and one
        # PREFIX back) carries several: fewer messages per insert, at the price of that
        # much more time until records are stable.
        due = not self.fwd_events or since >= s.forward_interval_ns
        if (self.fwd_events and due) or push_stable or lagging:
            self._forward(now)
        if self.to_announce:
            if not s.notices:
                self.to_announce = 0
            elif now - self.last_notice_ns >= s.notice_interval_ns:
                self.last_notice_ns = now
                self._announce(now)

    def _forward(self, now: int) -> None:
        """Send the buffered decisions, ending with our frontier, to every backup."""
        assert self.state is PrimaryState.SERVING, ("a FORWARD from a primary that does not serve", self.state)
        log = self.log
        prev_f, prev_e = self.fwd_mark
        events = self.fwd_events
        events.append(FrontierEvent(log.frontier, log.last_epoch, self.next_slot))
        msg = f.Forward(stable=log.stable, body=f.ForwardBody(prev_f, prev_e, events))
        for r in sorted(self.backup_routes):
            self.out.send(self.backup_routes[r], msg)
        self.fwd_events = []
        self.fwd_bytes = 0
        self.stable_sent = self.stable_record_sent = log.stable
        self.last_forward_ns = now
        self.mark_forward_point()

    def mark_forward_point(self) -> None:
        """Remember (frontier, last epoch): the state a backup is in after applying every
        forward sent so far. The next FORWARD names it so a backup can spot a gap."""
        self.fwd_mark = (self.log.frontier, self.log.last_epoch)

    def next_deadline(self, now: int) -> int | None:
        s, log = self.s, self.log
        last = self.last_forward_ns
        best = self.refused.next_prune()
        if self.backup_routes:
            t = last + (s.lag_probe_ns if log.stable < log.frontier and s.lag_probe_ns < s.heartbeat_ns else s.heartbeat_ns)
            if best is None or t < best:
                best = t
        cur = self.cursor
        if cur is not None and self.next_slot < cur.count and s.noop_timeout_ns > 0:
            t = self.epoch_start_ns + cur.schedule.expected_ns(self.shard, self.next_slot) + s.noop_timeout_ns
            if best is None or t < best:
                best = t
        if self._stable_news():
            t = last + s.stable_push_ns
            if best is None or t < best:
                best = t
        if self.fwd_events:
            t = last + s.forward_interval_ns
            if best is None or t < best:
                best = t
        if self.to_announce:
            t = self.last_notice_ns + s.notice_interval_ns
            if best is None or t < best:
                best = t
        return best

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
        """The recovery's source said the shard will not hold this record."""
        self.refused.add(key, now)

    def installing(self) -> None:
        """Recovery replaces the log above some point: the current epoch is gone."""
        self.cur_config = None
        self.cursor = None
        self.fwd_events = []
        self.fwd_bytes = 0

    def installed(self) -> None:
        self.mark_forward_point()

    def resumed(self, now: int) -> None:
        """Recovery is over: every replica holds exactly the recovered state."""
        if self.state is not PrimaryState.SERVING:
            self._become(PrimaryState.SERVING)
        self.blocked_reason = None
        self.awaiting = set()
        self.prefixes = {r: self.log.frontier for r in range(1, self.s.replicas)}
        self.stable_sent = self.stable_record_sent = self.log.stable
        self.mark_forward_point()
        self._take_stashed(now)

    def status(self) -> dict[str, object]:
        return {"backups_connected": sorted(self.backup_routes), "blocked": self.blocked_reason,
                "state": self.state.value}
