"""A backup's part (replicas 1..f): it guesses, it never decides. Dissertation 4.2.4.

An INSERT gets the backup's own guess of the slot the primary will give it (the next
slot of its speculation of the current epoch's schedule, above the rid) and an ACK
``decided=false`` at once: when every backup's guess equals the primary's decision the
insert took two message delays. The primary's FORWARDs then arrive in order; the backup
applies them to its log, and where its guess differed it re-ACKs the decided gsn (the
three-delay path). It answers every FORWARD with PREFIX (its frontier), which is how the
primary learns what is stable.

A backup is UNQUALIFIED from (re)start until the primary's first FORWARD shows it in
step (its disk may lag what it acknowledged before a crash): it guesses nothing until
then. Its link to the primary (:class:`~.link.PrimaryLink`) is CONNECTING until the
primary answers its HELLO, then IN_STEP; it names the primary incarnation followed.

A backup stopped gracefully while in step and holding no unconfirmed guess vouches for
its log (the clean-close marker, as a primary does): every record it acknowledged is
then on its disk. Its next incarnation, restarted on the marker, still guesses nothing
until it is in step again, but it holds everything it ever acknowledged, so a failure
recovery may take its state: a shard whose primary crashed (losing what its disk had
not written) while its backup was being restarted recovers from the backup.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

from ziplog.cores.effects import Outbox, Peer
from ziplog.cores.replica.clock_pass import ClockPass
from ziplog.cores.replica.link import Link, PrimaryLink
from ziplog.cores.replica.log import DecidedLog
from ziplog.cores.replica.memory import Memory
from ziplog.cores.replica.received import by_reference
from ziplog.cores.replica.settings import ReplicaSettings
from ziplog.protocol import frames as f
from ziplog.protocol.events import EpochEvent, FrontierEvent, RecordEvent
from ziplog.protocol.gsna import EpochConfig, EpochSchedule, SlotCursor, epoch_of

ErrorReply = Callable[[bytes, "int | None", str, str], None]
Key = tuple[int, int]


class Qualification(enum.Enum):
    #: (re)started: may have lost what it acknowledged before; guesses nothing
    UNQUALIFIED = "unqualified"
    #: holds everything it ever acknowledged
    QUALIFIED = "qualified"


#: Qualification changes: a backup qualifies only by state that vouches for every record
#: any replica acknowledged (a SERVING primary's whole catch-up or FORWARD, or a
#: recovery's RESUME), and no event unqualifies it within an incarnation (a restart is a
#: new incarnation, UNQUALIFIED).
_QUALIFICATIONS = {
    Qualification.UNQUALIFIED: {Qualification.QUALIFIED},
    Qualification.QUALIFIED: {Qualification.QUALIFIED},
}


@dataclass(slots=True)
class Guess:
    key: Key
    slot: int
    data: bytes


@dataclass
class Speculation:
    """A backup's guesses: what it acked but the primary has not yet decided. Slots
    are guessed in the current epoch (``config``); guesses of earlier epochs stay until
    the primary's decisions settle or displace them, because an acknowledged guess is
    state failure recovery must see."""

    config: EpochConfig
    cursor: SlotCursor | None  # None when this shard is not a member
    next_slot: int = 0
    by_key: dict[Key, int] = field(default_factory=dict)  # key -> guessed gsn
    #: guessed gsn -> the guess; its record is kept because a guess acked to a client is
    #: state failure recovery must see
    by_gsn: dict[int, Guess] = field(default_factory=dict)
    #: the clock under our slots in this epoch, as the primary's (None: clock passing off)
    clock: ClockPass | None = None

    def add(self, gsn: int, key: Key, slot: int, data: bytes) -> None:
        self.by_key[key] = gsn
        self.by_gsn[gsn] = Guess(key, slot, data)

    def forget(self, gsn: int) -> None:
        """Drop the guess at ``gsn`` (confirmed, or displaced by the primary's decision)."""
        g = self.by_gsn.pop(gsn, None)
        if g is not None:
            self.by_key.pop(g.key, None)

    def resync(self, primary_next_slot: int) -> None:
        """Follow the primary's slot pointer, backwards too: a guess the primary did not
        take (a record it placed elsewhere, an epoch switch seen at different moments)
        must not leave us one slot off for the rest of the epoch. Never below a slot
        still held by an outstanding guess, so no two guesses share a gsn."""
        lo, hi = self.config.base, self.config.end
        top = max((g.slot for gsn, g in self.by_gsn.items() if lo <= gsn <= hi), default=-1) + 1
        self.next_slot = max(primary_next_slot, top)

    @staticmethod
    def begin(before: Speculation | None, config: EpochConfig, cursor: SlotCursor | None,
              clock: ClockPass | None) -> Speculation:
        """The speculation for a new epoch, keeping every outstanding guess of ``before``."""
        if before is None:
            return Speculation(config, cursor, clock=clock)
        return Speculation(config, cursor, 0, before.by_key, before.by_gsn, clock)

    def pass_notice(self, msg: f.Notice, shard: int) -> None:
        """Another shard decided a record at ``msg.gsn``: our primary passes it when the
        same NOTICE reaches it (``PrimarySequencer.on_notice``), so guess past it now,
        as it will place what follows. Only in the epoch we guess in (a notice of
        another epoch, of a shard that is no member of it, or naming a gsn outside it
        changes nothing; the primary's forwards correct any guess this gets wrong)."""
        cfg, cursor = self.config, self.cursor
        if (cursor is None or msg.epoch != cfg.epoch or msg.shard == shard or msg.shard not in cfg.shards
                or not cfg.base <= msg.gsn <= cfg.end):
            return
        self.next_slot = cursor.passed(self.next_slot, msg.gsn)  # as the primary's _pass moves its own

    def above(self, frontier: int) -> list[list[object]]:
        """Records guessed and acknowledged above ``frontier``: a recovery must keep them."""
        return [[g, q.key[0], q.key[1], q.data] for g, q in sorted(self.by_gsn.items()) if g > frontier]


def wrong_guess_kind(guessed: int, gsn: int) -> str:
    """Why a guess missed, for whoever tunes the fast path: a guess in another epoch than
    the decision (the two replicas switched epochs at different moments), or in the same
    epoch a slot ahead of or behind the primary's. Two records the replicas saw in
    opposite orders show up as one guess ahead and one displaced (the first one's slot
    went to the second, whose guess was one slot higher)."""
    if epoch_of(guessed) != epoch_of(gsn):
        return "wrong_guesses_epoch"
    return "wrong_guesses_ahead" if guessed > gsn else "wrong_guesses_behind"


class BackupFollower:
    is_primary = False

    def __init__(self, settings: ReplicaSettings, log: DecidedLog, out: Outbox, error: ErrorReply,
                 stats: dict[str, int], incarnation: int = 0) -> None:
        self.s = settings
        self.shard = settings.shard
        self.log = log
        self.out = out
        self.error = error
        self.stats = stats
        self.qualification = Qualification.UNQUALIFIED
        #: restarted on the clean-close marker of an incarnation that held everything it
        #: acknowledged, and none of it was lost since (see the module's documentation)
        self.restarted_clean = False
        #: our link to the primary, and the incarnation of it we follow (:mod:`.link`)
        self.link = PrimaryLink(incarnation, settings.hello_retry_ns)
        self.spec: Speculation | None = None
        #: who asked for a record the primary has not decided yet: (route, req_id); when
        #: the decision arrives and differs from our guess we ACK it there
        self.pending_routes: Memory[Key, tuple[bytes, int]] = Memory(settings.route_memory_ns, settings.max_remembered,
                                                                     settings.prune_interval_ns)
        #: records we will never guess (we said NO_GUESS, or our guess was displaced): a
        #: client the primary refused may have moved them to another shard
        self.no_guess: Memory[Key, None] = Memory(settings.refusal_memory_ns, settings.max_remembered,
                                                  settings.prune_interval_ns)
        #: the data of the inserts we received, which the primary's FORWARDs may name, and
        #: the FORWARDs that wait for it
        self.received, self.waiting = by_reference(settings, self._take_forward, self._ask_catch_up, stats)
        self.prefix_dirty = False
        self.last_prefix_ns = 0
        self.prefix_every_ns = settings.prefix_every_ns  # at most one PREFIX per this (read once)

    def _qualify(self) -> None:
        q = Qualification.QUALIFIED
        assert q in _QUALIFICATIONS[self.qualification], ("illegal qualification change", self.qualification, q)
        self.qualification = q

    # -- what others ask ----------------------------------------------------------------------------
    deciding = False
    blocked = None

    @property
    def qualified(self) -> bool:
        return self.qualification is Qualification.QUALIFIED

    @property
    def holds_everything_acked(self) -> bool:
        """Every record this backup ever acknowledged is in its log or its guesses: it is
        in step with the primary, or it restarted clean (a recovery may take its state;
        only being in step lets it guess)."""
        return self.qualification is Qualification.QUALIFIED or self.restarted_clean

    @property
    def guessing(self) -> bool:
        """It holds guesses the primary has not decided yet (only its memory has them)."""
        return self.spec is not None and bool(self.spec.by_gsn)

    def restart_clean(self) -> None:
        """The replayed disk is everything the previous incarnation held, and it held
        every record it acknowledged (in step, no guess outstanding)."""
        self.restarted_clean = True

    def current_epoch(self) -> int:
        return self.spec.config.epoch if self.spec is not None else -1

    @property
    def ack_inc(self) -> int:
        """The incarnation our ACKs name: the primary we follow (a guess of its decision)."""
        return self.link.primary_inc

    # -- the primary ----------------------------------------------------------------------------
    def connect_primary(self, now: int, frozen: bool, primary_inc: int | None = None) -> None:
        """(Re)connected to the primary (incarnation ``primary_inc``; None: the one we
        follow, again): introduce ourselves; :meth:`tick` repeats it until the primary
        answers (it may not be up yet, or the hello may be lost). From a new incarnation
        on, every HELLO, PREFIX and ACK we send names it, and FORWARDs of another are
        refused: the HELLO it acts on shows every guess we made for its predecessors."""
        self.waiting.clear()  # its catch-up brings what they held
        self.link.connect(now, primary_inc)
        if not frozen:  # frozen: our state is the recovery's business, not a primary's
            self.out.send(Peer.PRIMARY, self.hello())

    def hello(self) -> f.Hello:
        sp = self.spec
        guessed_top = max(sp.by_gsn, default=0) if sp is not None else 0
        return self.link.hello(self.shard, self.s.replica, self.log.frontier, guessed_top)

    def on_forward(self, msg: f.Forward, now: int) -> None:
        self.waiting.offer(msg, now)  # now, or once the inserts it names arrived (by reference)

    def _take_forward(self, msg: f.Forward, now: int) -> bool:
        """Apply ``msg``, or say it waits (False): it names bytes we do not hold yet."""
        log = self.log
        body = msg.body
        if body.prev_frontier > log.frontier or body.prev_epoch > log.last_epoch:
            self._ask_catch_up(now)  # we missed a forward (or restarted)
            return True
        events = self.received.resolve(body.events)
        if events is None:
            return False
        self.link.in_step()
        # A FORWARD that does not end with the primary's frontier is one part of a
        # catch-up: more follows, asked for at once. Only a whole one puts us in step.
        partial = not events or type(events[-1]) is not FrontierEvent
        if not partial:
            # In step with the primary: we now hold everything it decided. Only a SERVING
            # primary sends a FORWARD that ends with its frontier (PrimarySequencer.
            # _catch_up), and one serves only once every backup showed it is not ahead:
            # what it decided includes everything any replica acknowledged before we
            # (re)started (ARCHITECTURE, Stability: who may qualify a backup).
            self._qualify()
        changed = False
        sp = self.spec
        for ev in events:
            t = type(ev)
            if t is RecordEvent:
                assert isinstance(ev, RecordEvent)
                if log.apply_record(ev):
                    changed = True
                    self._settle(ev, now)
            elif t is FrontierEvent:
                assert isinstance(ev, FrontierEvent)
                if log.advance_frontier(ev.frontier):
                    changed = True
                sp = self.spec
                if sp is not None and sp.config.epoch == ev.epoch:
                    self._drop_displaced_guesses(now)
                    sp.resync(ev.next_slot)
            else:
                assert isinstance(ev, EpochEvent)
                if log.apply_epochs(ev.first, ev.last, ev.members):
                    changed = True
        self.prefix_dirty = True  # answer every FORWARD: a lost PREFIX must not stall stability
        if changed:
            self._drop_displaced_guesses(now)
        # Stable = held by every replica. With one backup that is everything we applied:
        # the primary decided it and holds it. So we know it the moment a FORWARD lands,
        # a PREFIX round before the primary does (our subscribers hear of it that much
        # sooner, and the primary sends no FORWARD for stability alone). With more
        # backups only the primary sees every PREFIX: it tells us.
        log.advance_stable(log.frontier if self.s.backup_knows_stable else msg.stable)
        if partial:
            self._ask_catch_up(now)  # the next part, at once (no HELLO is unanswered here)
        return True

    def _ask_catch_up(self, now: int) -> None:
        """Ask for everything above our frontier, at most once per hello_retry (it may be in flight)."""
        if self.link.may_ask(now):
            self.out.send(Peer.PRIMARY, self.hello())

    def _settle(self, ev: RecordEvent, now: int) -> None:
        """The primary decided ``ev``: our guess of it (if any) is confirmed or replaced,
        a guess of another record at its gsn is displaced, and a client we answered with
        another gsn gets the decided one."""
        gsn, key = ev.gsn, (ev.client_id, ev.seq)
        self.received.discard(key)
        sp = self.spec
        guessed = None
        if sp is not None:
            guessed = sp.by_key.get(key)
            if guessed is not None:
                sp.forget(guessed)
            other = sp.by_gsn.get(gsn)
            if other is not None and other.key != key:
                self._displaced(other.key, now)
            sp.forget(gsn)  # another record guessed here is displaced: the primary will place it
            if sp.config.epoch == epoch_of(gsn) and ev.slot + 1 > sp.next_slot:
                sp.next_slot = ev.slot + 1
        if guessed is not None and guessed != gsn:
            self.stats[wrong_guess_kind(guessed, gsn)] += 1
        pending = self.pending_routes.pop(key)
        if pending is not None and guessed == gsn:
            self.stats["confirmed_guesses"] += 1  # the client's fast path, as far as this replica can tell
        elif pending is not None:
            self.stats["reacks"] += 1
            self.out.send(pending[0], f.Ack(req_id=pending[1], gsn=gsn, replica=self.s.replica, stable=self.log.stable,
                                            decided=True, final=False, inc=self.link.primary_inc))

    def _drop_displaced_guesses(self, now: int) -> None:
        sp = self.spec
        if sp is None or not sp.by_gsn:
            return
        frontier = self.log.frontier
        for g in [g for g in sp.by_gsn if g <= frontier]:
            self._displaced(sp.by_gsn[g].key, now)
            sp.forget(g)

    def _displaced(self, key: Key, now: int) -> None:
        """The primary filled our guess's slot otherwise: never guess this record again. A
        resend then learns NO_GUESS; if the primary refused the record for good, that tells
        the client the shard has no copy (guessing anew at every resend never would)."""
        self.stats["guesses_displaced"] += 1
        if key not in self.log.dedup:
            self.no_guess.add(key, now)

    # -- inserts --------------------------------------------------------------------------------
    def insert(self, route: bytes, msg: f.Insert, now: int) -> None:
        key = (msg.client_id, msg.seq)
        # Remember who asked: when the primary's decision arrives we ack (again) there.
        self.pending_routes.add(key, now, (route, msg.req_id))
        sp = self.spec
        guessed = sp.by_key.get(key) if sp is not None else None
        if guessed is not None:
            self._ack(route, msg.req_id, guessed)
            return
        refusal = self.log.takes_no_new(len(msg.data), self.s.max_log_bytes)
        if refusal is not None:
            # It still applies the primary's decisions, but takes nothing new on itself.
            self._no_guess(route, msg.req_id, key, now, *refusal)
            return
        if (sp is None or sp.cursor is None or not self.qualified or epoch_of(msg.after + 1) > sp.config.epoch
                or key in self.no_guess or key in self.log.refused or len(sp.by_gsn) >= self.s.max_guesses):
            # No guess possible (not a member by our view, the rid is ahead of us, or we
            # have not synchronised with the primary since we started: a guess acked then
            # would look, to a restarted primary, like a record it lost). The primary
            # decides or refuses; a backup never refuses on its own, but says it holds no
            # copy, so a client the primary refuses knows the shard has none.
            self._no_guess(route, msg.req_id, key, now)
            return
        cur = sp.cursor
        k = sp.next_slot
        floor_gsn = max(msg.after, self.log.frontier)
        if k < cur.count and cur.gsn(k) <= floor_gsn:
            k = cur.first_slot_after(floor_gsn)
        if sp.clock is not None:
            k = sp.clock.place(k, msg.stamp, now)  # as the primary places it
        if k >= cur.count:  # no room left in this epoch by our reckoning: wait for the decision
            self._no_guess(route, msg.req_id, key, now)
            return
        gsn = cur.gsn(k)
        sp.next_slot = k + 1
        sp.add(gsn, key, k, msg.data)
        self.stats["fast_acks"] += 1
        self._ack(route, msg.req_id, gsn)

    def _ack(self, route: bytes, req_id: int, gsn: int) -> None:
        self.out.send(route, f.Ack(req_id=req_id, gsn=gsn, replica=self.s.replica, stable=self.log.stable,
                                   decided=False, final=False, inc=self.link.primary_inc))

    def _no_guess(self, route: bytes, req_id: int, key: Key, now: int, code: str = f.E_NO_GUESS,
                  message: str = "this backup holds no copy; the primary decides") -> None:
        self.no_guess.add(key, now)
        self.error(route, req_id, code, message)

    # -- epochs ---------------------------------------------------------------------------------
    def on_epoch(self, config: EpochConfig, now: int, stamp: int = 0) -> bool:
        """A broadcast: only speculation uses it (the primary's EV_EPOCH decides membership)."""
        sp = self.spec
        if sp is not None and config.epoch <= sp.config.epoch:
            return False
        cursor = SlotCursor(EpochSchedule(config), self.shard) if self.shard in config.shards else None
        self.spec = Speculation.begin(sp, config, cursor, ClockPass.of(self.s, cursor, stamp, now, self.stats))
        return True

    def on_history(self, ranges: list[tuple[int, int, tuple[int, ...]]], now: int) -> bool:
        return False

    def on_notice(self, msg: f.Notice, now: int) -> None:
        if self.spec is not None:
            self.spec.pass_notice(msg, self.shard)

    def on_hello(self, route: bytes, msg: f.Hello, now: int) -> None:
        pass  # only a primary takes HELLO


    def on_prefix(self, msg: f.Prefix, now: int) -> None:
        pass

    # -- time -----------------------------------------------------------------------------------
    def tick(self, now: int) -> None:
        self.waiting.expire(now)
        if self.link.retry_due(now):
            self.connect_primary(now, frozen=False)

    def prune(self, now: int) -> None:
        # Inserts the primary never decided (it refused them, or the client gave up).
        self.pending_routes.prune(now)
        self.no_guess.prune(now)
        self.received.prune(now)

    def flush(self, now: int) -> None:
        if ((self.prefix_dirty and now - self.last_prefix_ns >= self.prefix_every_ns)
                or (self.link.state is Link.IN_STEP and now - self.last_prefix_ns >= self.s.heartbeat_ns)):  # heartbeat
            self.out.send(Peer.PRIMARY, self.link.prefix(self.s.replica, self.log.frontier))
            self.prefix_dirty = False
            self.last_prefix_ns = now

    def next_deadline(self, now: int) -> int | None:
        s = self.s
        best = self.pending_routes.next_prune()
        for t in (self.no_guess.next_prune(), self.received.next_prune(), self.waiting.deadline()):
            if t is not None and (best is None or t < best):
                best = t
        link = self.link.state
        if self.prefix_dirty or link is Link.IN_STEP:
            every = self.prefix_every_ns
            t = self.last_prefix_ns + (min(every, s.heartbeat_ns) if self.prefix_dirty and link is Link.IN_STEP
                                       else every if self.prefix_dirty else s.heartbeat_ns)
            if best is None or t < best:
                best = t
        t = self.link.deadline()
        if t is not None and (best is None or t < best):
            best = t
        return best

    def parked_insert_expired(self, p: object, now: int) -> None:
        pass  # a backup parks no inserts

    # -- failure recovery -------------------------------------------------------------------------
    def frozen(self) -> None:
        self.waiting.clear()  # frozen: we promised to store nothing new

    def holds(self, key: Key) -> int | None:
        held = self.log.dedup.get(key)
        if held is None and self.spec is not None:
            held = self.spec.by_key.get(key)
        return held

    def guesses_above(self, frontier: int) -> list[list[object]]:
        return self.spec.above(frontier) if self.spec is not None else []

    def wait_for_authority(self, route: bytes, req_id: int, key: Key, now: int) -> None:
        """A frozen backup's client: answered once it knows whether the recovery keeps
        the record."""
        self.pending_routes.add(key, now, (route, req_id))

    def take_waiting(self) -> list[tuple[Key, tuple[bytes, int] | None]]:
        return self.pending_routes.take_all()

    def refused_for_recovery(self, key: Key, now: int) -> None:
        self.no_guess.add(key, now)

    def on_authority(self, now: int) -> None:
        pass

    def installing(self) -> None:
        self.spec = None
        self.waiting.clear()
        self.restarted_clean = False  # the recovery's state replaces what the disk vouched for

    def installed(self) -> None:
        pass

    def resumed(self, now: int) -> None:
        self._qualify()  # every replica now holds exactly the recovered state
        self.connect_primary(now, frozen=False)

    def status(self) -> dict[str, object]:
        return {"backups_connected": [], "blocked": None, "link": self.link.state.value}
