"""A storage replica's side of failure recovery (dissertation 4.2.5); the failure
handler's side is ``failure_handler.recovery``.

Phases (:class:`RecoveryPhase`): NORMAL; FROZEN once a PROBE names a generation above
any seen (the promise to store nothing new: no FORWARD, PREFIX, HELLO or EPOCH is
applied and INSERTs get FROZEN); ACQUIRED once the handler durably took this replica's
state as the recovery's (it then answers for that state: a record it holds is ACKed
``final`` at that gsn, any other gets NOT_HELD); back to NORMAL on RESUME, after an
INSTALL of the recovered state. A PROBE of a newer generation freezes again from any
phase.

The promise outlives the process: freezing, installing and resuming are each written to
the replica's disk (``RecoveryEvent``), and the answers to PROBE, INSTALL and RESUME
leave only once that is fsynced (durable messages). A replica that restarts frozen for
a recovery that has not resumed it comes back frozen (:meth:`restore`): it says no HELLO
and decides nothing, so a primary that the recovery has not reached yet (it was down
when the PROBEs went out) cannot take the restarted replica's word for where the shard
is, and a restarted primary cannot serve beside a recovery it promised to wait for.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Callable, Union

from ziplog.cores.effects import Outbox
from ziplog.cores.replica.log import DecidedLog
from ziplog.cores.replica.parking import Parking
from ziplog.protocol import frames as f
from ziplog.protocol.events import (
    RECOVERY_FROZEN,
    RECOVERY_INSTALLED,
    RECOVERY_RESUMED,
    EpochEvent,
    RecordEvent,
    RecoveryEvent,
    TruncateEvent,
)
from ziplog.protocol.gsna import epoch_of

if TYPE_CHECKING:
    from ziplog.cores.replica.backup import BackupFollower
    from ziplog.cores.replica.primary import PrimarySequencer

ErrorReply = Callable[[bytes, "int | None", str, str], None]
Key = tuple[int, int]


class RecoveryPhase(enum.Enum):
    NORMAL = "normal"
    #: promised the failure handler, answering its PROBE, to store nothing new
    FROZEN = "frozen"
    #: frozen, and its state is the one the recovery keeps: it answers for it
    ACQUIRED = "acquired"
    #: frozen by the disk's word at start (:meth:`RecoveryParticipant.restore`), not by
    #: this process's PROBE answer: the guesses that answer reported lived in the memory
    #: of a process now gone, so it cannot answer for them (never ACQUIRED) until a
    #: newer PROBE freezes it afresh
    RESTORED = "restored"


#: NOT_HELD answers an authority gives per generation (each a client's record in doubt
#: during one recovery, remembered and written to its disk); beyond it, an insert it
#: would refuse hears FROZEN and waits for the recovery's end
MAX_NOT_HELD = 100_000

_TRANSITIONS = {
    RecoveryPhase.NORMAL: {RecoveryPhase.FROZEN, RecoveryPhase.RESTORED},
    RecoveryPhase.FROZEN: {RecoveryPhase.FROZEN, RecoveryPhase.ACQUIRED, RecoveryPhase.NORMAL},
    RecoveryPhase.ACQUIRED: {RecoveryPhase.FROZEN, RecoveryPhase.NORMAL},
    RecoveryPhase.RESTORED: {RecoveryPhase.FROZEN, RecoveryPhase.NORMAL},
}


class RecoveryParticipant:
    def __init__(self, shard: int, replica: int, log: DecidedLog, role: "Union[PrimarySequencer, BackupFollower]",
                 parking: Parking, out: Outbox, error: ErrorReply, on_resume: Callable[[int], None]) -> None:
        self.shard = shard
        self.replica = replica
        self.log = log
        self.role = role
        self.parking = parking
        self.out = out
        self.error = error
        self.on_resume = on_resume
        self.phase = RecoveryPhase.NORMAL
        self.gen = -1  # highest recovery generation the failure handler named
        self.installed_gen = -1
        #: the end of the last INSTALL (part) applied in ``installed_gen``: an INSTALL
        #: ending at or below it repeats one applied already
        self.installed_end = -1

    @property
    def not_held(self) -> dict[Key, None]:
        """Records the recovery's authority said the shard will not hold (NOT_HELD),
        this generation, as this replica's disk holds them (its own, as the authority,
        or handed over at RESUME): the authority hands them to the others at RESUME (a
        repeat too, and after a restart), and every replica refuses them once resumed."""
        return self.log.refused if self.log.refused_gen == self.gen else {}

    def _become(self, phase: RecoveryPhase) -> None:
        assert phase in _TRANSITIONS[self.phase], ("illegal recovery transition", self.phase, phase)
        self.phase = phase

    def restore(self, mark: RecoveryEvent | None) -> None:
        """At start, the disk's word on this replica's last recovery step: frozen (and
        maybe installed) for generation ``mark.gen`` and not resumed: frozen again.
        Resumed: that generation is over here, as it was for the process that resumed
        it. A handler that runs it again (its leader changed before it wrote "done")
        hears from the PROBE that this replica installed and resumed it, and nothing of
        that generation is applied again over what came after the resume (a repeat of
        its INSTALL would roll the log back below positions since made stable:
        system seed 2069782)."""
        if mark is None:
            return
        self.gen = mark.gen
        if mark.phase == RECOVERY_RESUMED:
            self.installed_gen = mark.gen
            return
        self._become(RecoveryPhase.RESTORED)
        self.role.frozen()
        if mark.phase == RECOVERY_INSTALLED:
            self.installed_gen = mark.gen
            self.installed_end = mark.end

    @property
    def frozen(self) -> bool:
        return self.phase is not RecoveryPhase.NORMAL

    @property
    def authority(self) -> bool:
        return self.phase is RecoveryPhase.ACQUIRED

    # -- inserts while frozen ---------------------------------------------------------------------
    def frozen_insert(self, route: bytes, req_id: int, key: Key, now: int) -> None:
        """An insert reaching a replica frozen for recovery. Only the replica whose state
        the failure handler has durably acquired knows the record's fate: in that state
        (decided or guessed) it will be rolled forward at that gsn; otherwise it will not
        be in this shard's log and the client may place it elsewhere."""
        held = self.role.holds(key)
        # Once an INSTALL has begun, the log above its base holds only the parts applied
        # so far (the acquired state comes back in parts, and a delayed ACQUIRED may land
        # between them): a record not found may be in a part still to come. Its fate is
        # known again at RESUME; until then the client hears FROZEN, as from the others.
        if self.authority and (held is not None or self.installed_gen != self.gen):
            if held is not None:
                self.out.send(route, f.Ack(req_id=req_id, gsn=held, replica=self.replica, stable=self.log.stable,
                                           decided=True, final=True))
            elif len(self.not_held) < MAX_NOT_HELD:
                # A promise the client acts on (it places the record elsewhere): it leaves
                # once written, so that a restart before RESUME still hands the key over
                # for every replica to refuse a delayed copy of this INSERT.
                self.role.refused_for_recovery(key, now)
                self.log.mark_refused(self.gen, key)
                self.out.send_durable(route, f.Error(req_id=req_id, code=f.E_NOT_HELD, message=(
                    f"shard {self.shard} is recovering and will not hold this record")))
            else:  # no room to remember one more promise: the client waits for RESUME
                self.error(route, req_id, f.E_FROZEN, f"shard {self.shard} is frozen for failure recovery")
            return
        if not self.role.is_primary:
            self.role.wait_for_authority(route, req_id, key, now)  # type: ignore[union-attr]
        self.error(route, req_id, f.E_FROZEN, f"shard {self.shard} is frozen for failure recovery")

    # -- the handler's requests ---------------------------------------------------------------------
    def on_op(self, route: bytes, msg: f.RecoveryRequest, now: int) -> None:
        gen = msg.gen
        if gen < self.gen or (type(msg) is not f.Probe and gen != self.gen):
            self.error(route, msg.req_id, f.E_STALE, f"recovery generation {gen} is not the current one ({self.gen})")
            return
        payload: dict[str, Any] | str
        if isinstance(msg, f.Probe):
            payload = self._probe(gen)
        elif isinstance(msg, f.Acquired):
            payload = self._acquired(now)
        elif isinstance(msg, f.Fetch):
            payload = self._fetch(msg.lo, msg.hi, msg.max_bytes)
        elif isinstance(msg, f.Install):
            payload = self._install(msg.base, msg.trim, msg.events, msg.end)
        else:
            assert isinstance(msg, f.Resume)
            payload = self._resume(msg.stable, msg.refused, now)
        if isinstance(payload, str):
            self.error(route, msg.req_id, f.E_STALE, payload)
        elif isinstance(msg, (f.Probe, f.Install, f.Resume)):
            # What the answer says must outlive a power loss, so it waits for the disk
            # (a full one: until it has room), fsynced. An install replaced records above
            # its base that the disk holds until the install's events are written: a
            # restart before that would bring the replaced records back, unseen by the
            # handler, which counted this part done. A freeze and a resume are promises
            # a restart keeps (:meth:`restore`).
            self.out.send_durable(route, f.RecoveryOk(req_id=msg.req_id, payload=payload))
        else:
            self.out.send(route, f.RecoveryOk(req_id=msg.req_id, payload=payload))

    def _probe(self, gen: int) -> dict[str, Any]:
        """Freeze (the promise to store nothing new) and report our state: the decided
        records above the stable point and, for a backup, the records it guessed and
        acknowledged. Only a qualified replica's records may be the basis of recovery."""
        log = self.log
        if gen > self.gen:
            self.gen = gen
            self._become(RecoveryPhase.FROZEN)
            self.installed_gen = -1
            self.installed_end = -1
            self.role.frozen()
            log.mark_recovery(RecoveryEvent(gen, RECOVERY_FROZEN))
            # Inserts parked for an epoch would be decided after the recovery, though the
            # source may tell their clients the shard does not hold them: drop them now.
            for p in self.parking.all_inserts():
                self.error(p.route, p.msg.req_id, f.E_FROZEN, f"shard {self.shard} is frozen for failure recovery")
        role = self.role
        # A backup restarted on its clean-close marker holds everything it acknowledged,
        # as one in step does: its state may be the recovery's. A primary's marker lets
        # it serve again without a recovery; in a recovery it counts only once its
        # backups showed it lacks nothing (it serves).
        qualified = role.qualified if role.is_primary else role.holds_everything_acked
        state: dict[str, Any] = {
            "replica": self.replica, "gen": gen, "qualified": qualified, "frozen": self.frozen,
            "frontier": log.frontier, "stable": log.stable, "trim": log.trim_point,
            "last_epoch": log.last_epoch, "installed": self.installed_gen == gen,
            "resumed": not self.frozen and self.installed_gen == gen,
            "membership": [[fe, la, list(m)] for fe, la, m in log.membership],
        }
        if qualified and self.frozen:
            state["records"] = [[r.gsn, r.client_id, r.seq, r.data] for r in log.records_after(log.stable)]
            state["guesses"] = self.role.guesses_above(log.frontier)
        return state

    def _acquired(self, now: int) -> dict[str, Any] | str:
        if not self.frozen:
            return "not frozen"
        if self.phase is RecoveryPhase.RESTORED:
            # Restarted since it reported its state: the acquired state may hold guesses
            # this process never knew (they died with the last one), and telling a
            # client its record will not be held would let it place the record on
            # another shard while the install brings it back here. Its clients hear
            # FROZEN until RESUME instead (the handler asks again; it installs all the
            # same).
            return "restarted since it reported its state for this recovery: it cannot answer for its guesses"
        if self.phase is RecoveryPhase.FROZEN:
            self._become(RecoveryPhase.ACQUIRED)
        assert self.phase is RecoveryPhase.ACQUIRED, ("answering for a state it did not report", self.phase)
        self.role.on_authority(now)
        # Clients waiting on a record we could not place yet get their final answer now.
        if not self.role.is_primary:
            for key, waiting in self.role.take_waiting():  # type: ignore[union-attr]
                if waiting is not None:
                    self.frozen_insert(waiting[0], waiting[1], key, now)
        return {"authority": True}

    def _fetch(self, lo: int, hi: int, max_bytes: int) -> dict[str, Any] | str:
        log = self.log
        if hi > log.frontier:
            return f"asked for records up to {hi}, frontier is {log.frontier}"
        out: list[list[Any]] = []
        size = 0
        done = True
        for r in log.records_after(lo):
            if r.gsn > hi:
                break
            if size >= max_bytes and out:
                done = False
                break
            out.append([r.gsn, r.client_id, r.seq, r.data])
            size += len(r.data) + f.FETCH_RECORD_OVERHEAD
        return {"trim": log.trim_point, "deleted_below": log.deletable_below, "records": out, "done": done}

    def _install(self, base: int, trim: int, events: list[RecordEvent | EpochEvent], end: int) -> dict[str, Any] | str:
        """Roll forward: replace everything above ``base`` with the recovery's stream
        (records the acquired state held, epochs up to the last one that included the
        shard) and make every other position up to ``end`` a no-op. A large roll-forward
        comes in parts, each based where the one before ended; a part that ends at or
        below one applied already this generation is a repeat (a resend, or a copy
        delayed in the network): it changes nothing."""
        if not self.frozen:
            return "not frozen"
        if base > end:
            return f"install base {base} above its end {end}"
        log = self.log
        if self.installed_gen == self.gen and end <= self.installed_end:
            return {"frontier": log.frontier, "last_epoch": log.last_epoch}
        if base > log.frontier:
            return f"install base {base} above this replica's frontier {log.frontier}: a part is missing"
        # The epochs the log will know afterwards: those it keeps up to the epoch of base,
        # and those the stream brings. Refused before anything changes.
        keep = min(log.last_epoch, epoch_of(base) if base > 0 else -1)
        last = max([keep] + [ev.last for ev in events if type(ev) is EpochEvent])  # type: ignore[union-attr]
        if end > 0 and epoch_of(end) > last:
            return f"install ends at {end}, beyond its epochs (last {last})"
        self.role.installing()
        log.truncate(base)
        self.out.persist.append(TruncateEvent(base))
        log.raise_trim(trim, drop=False)
        for ev in events:
            if type(ev) is RecordEvent:
                log.apply_record(ev)  # type: ignore[arg-type]
            else:
                assert isinstance(ev, EpochEvent)
                log.apply_epochs(ev.first, ev.last, ev.members)
        if end > log.frontier:
            assert epoch_of(end) <= log.last_epoch, ("install ends beyond its epochs", end, log.last_epoch)
            log.frontier = end
        self.out.persist.extend(log.flush_marks()[:1])
        self.installed_gen = self.gen
        self.installed_end = end
        log.mark_recovery(RecoveryEvent(self.gen, RECOVERY_INSTALLED, end))
        self.role.installed()
        # The handler sends INSTALL only once the state it installs is durable in
        # ZooKeeper: these positions are final, and subscribers need not wait for the
        # other replicas (one may be gone until it is replaced) to see them.
        log.fix_upto(log.frontier)
        return {"frontier": log.frontier, "last_epoch": log.last_epoch}

    def _resume(self, stable: int, refused: list[tuple[int, int]], now: int) -> dict[str, Any] | str:
        held = [list(k) for k in self.not_held]
        if not self.frozen:
            return {"resumed": True, "refused": held}  # a repeat
        if self.installed_gen != self.gen:
            return "resume before install"
        # Records the source refused: a copy delayed in the network must not be placed
        # here now that the client has moved it elsewhere. Written, as the source wrote
        # them, before this answer leaves (it is durable): a copy that reaches this
        # replica after it lost power and came back is refused too (system seed 90001806).
        for client_id, seq in refused:
            key = (client_id, seq)
            if key not in self.not_held:
                self.log.mark_refused(self.gen, key)
            self.role.refused_for_recovery(key, now)
        for key in self.not_held:  # ours (restored from the disk after a restart too)
            self.role.refused_for_recovery(key, now)
        self._become(RecoveryPhase.NORMAL)
        self.log.mark_recovery(RecoveryEvent(self.gen, RECOVERY_RESUMED))
        self.log.stable_within_frontier()
        self.log.advance_stable(stable)
        self.role.resumed(now)
        self.on_resume(now)
        return {"resumed": True, "frontier": self.log.frontier, "refused": held}
