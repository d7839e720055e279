"""The storage replica's protocol core (sans-I/O).

One :class:`ReplicaCore` is one storage server of one shard: the primary
(replica 0) or a backup. It takes events (a client frame, a peer frame, an
epoch broadcast, the passage of time) and leaves what must happen in
``outbox`` (frames to send), ``disk`` (decided-stream events to persist) and
``next_deadline()`` (when to call :meth:`tick` again). No sockets, clocks or
threads: the transport shell in ``ziplog.server`` owns those, and the
simulation tests drive the same object over a simulated network.

Replication (dissertation 4.2.4):

* Every replica assigns a gsn to a client's record speculatively from the
  epoch schedule and acks at once. Equal acks from all replicas complete the
  insert in two message delays.
* The primary's assignment is the decision. It forwards the decided stream
  (records, epoch starts, frontier moves) to the backups in order. A backup
  that guessed differently stores the record where the primary put it and
  re-acks (three delays). Backups never decide anything themselves.
* ``frontier``: every slot of this shard with gsn <= frontier is decided here
  (record or no-op). Backups report theirs; the primary publishes the minimum
  as ``stable``. Only stable positions are ever shown to subscribers, which
  is what makes a delivered record impossible to lose or move.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Iterator, Union

from ziplog.protocol import frames as wire
from ziplog.protocol.gsna import EpochConfig, EpochSchedule, SlotCursor, epoch_base, epoch_end, epoch_of
from ziplog.protocol.frames import PROTOCOL_VERSION as V
from ziplog.protocol.frames import pack

#: Destination of a frame the backup sends to its primary (over its DEALER).
TO_PRIMARY = "primary"
#: Destination of a rate report to the membership service.
TO_MMS = "mms"
#: Destination of a failure suspicion report to the failure handler.
TO_HANDLER = "handler"

Dest = Union[bytes, str]
Members = tuple[int, ...]


@dataclass
class ReplicaSettings:
    shard: int
    replica: int
    replicas: int = 2
    max_record_bytes: int = 1 << 20
    #: A slot of the primary whose expected arrival passed this long ago
    #: becomes a no-op.
    noop_timeout_ns: int = 1_000_000
    #: How long an InsertAfter or read may wait for a future epoch/position.
    park_timeout_ns: int = 2_000_000_000
    #: InsertAfter/read naming an epoch this far beyond ours is an unknown rid.
    max_epochs_ahead: int = 200
    #: The primary pushes the stable watermark to backups at least this often.
    stable_push_ns: int = 2_000_000
    #: The primary sends at most one FORWARD with records per interval (0: every turn).
    forward_interval_ns: int = 0
    #: A backup reports its prefix at most once per interval (0: after every FORWARD).
    prefix_interval_ns: int = 0
    #: A backup that found a gap in the forwards asks again after this long.
    hello_retry_ns: int = 10_000_000
    #: How often the primary re-announces its state to a backup that lags.
    lag_probe_ns: int = 20_000_000
    #: Subscriptions with no word from their subscriber this long are dropped.
    subscription_lease_ns: int = 60_000_000_000
    #: Largest SUB_BATCH payload.
    sub_batch_bytes: int = 1 << 20
    #: Replicas of a shard hear from each other at least this often: an idle primary
    #: sends an empty FORWARD, an idle backup a PREFIX (the heartbeats).
    heartbeat_ns: int = 50_000_000
    #: A peer silent this long is suspected to have failed and recovery is asked for
    #: (0: never suspect).
    suspect_timeout_ns: int = 500_000_000

    @property
    def is_primary(self) -> bool:
        return self.replica == 0


@dataclass
class Record:
    gsn: int
    client_id: int
    seq: int
    data: bytes


@dataclass
class Subscription:
    route: bytes
    sub_id: int
    next_gsn: int  # records >= next_gsn not yet sent
    credit: int  # bytes the subscriber can still take
    progress_sent: int  # last progress reported
    epoch_sent: int  # membership sent for every epoch <= this
    last_heard_ns: int


@dataclass
class ParkedRequest:
    need_epoch: int  # wait until this epoch is current (inserts) ...
    need_frontier: int  # ... or until frontier reaches this (reads)
    deadline_ns: int
    route: bytes
    msg: list[Any]


@dataclass
class Guess:
    key: tuple[int, int]  # (client id, seq)
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
    by_key: dict[tuple[int, int], int] = field(default_factory=dict)  # key -> guessed gsn
    #: guessed gsn -> the guess; its record is kept because a guess acked to a client is
    #: state failure recovery must see
    by_gsn: dict[int, Guess] = field(default_factory=dict)

    def add(self, gsn: int, key: tuple[int, int], slot: int, data: bytes) -> None:
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

    def carried_into(self, config: EpochConfig, cursor: SlotCursor | None) -> "Speculation":
        """The speculation for a new epoch, keeping every outstanding guess."""
        return Speculation(config, cursor, 0, self.by_key, self.by_gsn)


class ReplicaCore:
    def __init__(self, settings: ReplicaSettings) -> None:
        self.s = settings
        self.shard = settings.shard
        self.outbox: list[tuple[Dest, bytes]] = []
        self.disk: list[tuple[Any, ...]] = []
        # -- decided stream ---------------------------------------------------------
        self.records: dict[int, Record] = {}
        self.gsns: list[int] = []  # sorted gsns of self.records
        self.dedup: dict[tuple[int, int], int] = {}  # (client_id, seq) -> decided gsn
        self.frontier = 0
        self.stable = 0
        self.trim_point = 0  # records below are logically deleted
        #: membership history: [first_epoch, last_epoch, members]; contiguous from 0
        self.membership: list[list[Any]] = []
        # -- primary assignment state (current epoch) ---------------------------------
        self.cur_config: EpochConfig | None = None
        self.cursor: SlotCursor | None = None
        self.next_slot = 0
        self.epoch_start_ns = 0
        self.epoch_count = 0  # records assigned in the current epoch (rate report)
        self.backup_routes: dict[int, bytes] = {}
        #: A (re)started primary decides nothing until every backup's HELLO shows it is
        #: not ahead; then the shell replays ``replay_epoch`` (the latest broadcast).
        self.awaiting_backups: set[int] = set(range(1, settings.replicas)) if settings.is_primary else set()
        self._stashed_epoch: EpochConfig | None = None
        self.replay_epoch: EpochConfig | None = None
        #: Why this primary refuses to decide (it lost state), or None.
        self.blocked: str | None = None
        self.prefixes: dict[int, int] = {}
        self._fwd_events: list[tuple[Any, ...]] = []
        self._fwd_mark: tuple[int, int] = (0, -1)
        self._stable_sent = 0
        self._last_forward_ns = 0
        # -- backup state ---------------------------------------------------------------
        self.spec: Speculation | None = None
        self.pending_routes: dict[tuple[int, int], tuple[bytes, int, int]] = {}
        self._pending_pruned_ns = 0
        self._hello_sent_at: int | None = None
        self._heard_primary = False
        self._prefix_dirty = False
        self._last_prefix_ns = 0
        # -- everyone -------------------------------------------------------------------
        self.parked: list[ParkedRequest] = []
        self.subs: dict[tuple[bytes, int], Subscription] = {}
        self._subs_dirty = False
        # -- failure recovery (dissertation 4.2.5) ------------------------------------------
        #: Holds every record it ever acknowledged, so its state may be the basis of a
        #: recovery. False from (re)start until it has synchronised with its peers:
        #: a restart loses what the disk had not yet written.
        self.qualified = False
        self.recovery_gen = -1  # highest recovery generation the failure handler named
        #: Promised the failure handler to store nothing new until it says RESUME.
        self.frozen = False
        #: Its frozen state is the one the recovery keeps: it answers for that state.
        self.authority = False
        self.installed_gen = -1
        #: peer replica -> when we last heard it (armed once heard in this incarnation)
        self.peer_heard: dict[int, int] = {}
        self._suspect_sent_ns: int | None = None
        #: Keys a primary refused for good (it will never decide them) and keys a
        #: backup answered NO_GUESS (it will never guess them): a client may have moved
        #: the record to another shard, so a late duplicate must not place it here too.
        self.refused: dict[tuple[int, int], int] = {}
        self._member_wait: dict[tuple[int, int], int] = {}  # key -> epoch it waited in (not a member)
        self.no_guess: dict[tuple[int, int], int] = {}
        self.stats = {"inserts": 0, "fast_acks": 0, "reacks": 0, "reads": 0, "errors": 0}

    # ================================================================================
    # properties
    @property
    def is_primary(self) -> bool:
        return self.s.is_primary

    @property
    def last_epoch(self) -> int:
        """Last epoch of the decided stream (-1 before any)."""
        return self.membership[-1][1] if self.membership else -1

    def members_of(self, epoch: int) -> Members | None:
        i = bisect.bisect_right(self.membership, epoch, key=lambda r: r[0]) - 1
        if i < 0 or epoch > self.membership[i][1]:
            return None
        return tuple(self.membership[i][2])

    # ================================================================================
    # decided stream: the only way state changes (primary emits, backup applies)
    def _apply_record(self, gsn: int, slot: int, client_id: int, seq: int, data: bytes) -> bool:
        if gsn <= self.frontier:
            return False  # duplicate delivery of an event already applied
        assert not self.gsns or gsn > self.gsns[-1], "decided records must arrive in gsn order"
        assert epoch_of(gsn) == self.last_epoch, ("record outside the current epoch", gsn, self.last_epoch)
        key = (client_id, seq)
        assert key not in self.dedup, ("record decided twice", key, self.dedup.get(key), gsn)
        self.records[gsn] = Record(gsn, client_id, seq, data)
        self.gsns.append(gsn)
        self.dedup[key] = gsn
        self.frontier = gsn
        ev = (wire.EV_RECORD, gsn, slot, client_id, seq, data)
        self.disk.append(ev)
        return True

    def _apply_frontier(self, frontier: int) -> bool:
        if frontier <= self.frontier:
            return False
        assert epoch_of(frontier) <= self.last_epoch, "frontier beyond the known epochs"
        self.frontier = frontier
        self._serve_parked_reads()
        return True

    def _apply_epochs(self, first: int, last: int, members: Members | list[int] | None) -> bool:
        """Record that epochs first..last had ``members`` (None: same as the previous)."""
        if last <= self.last_epoch:
            return False
        if first <= self.last_epoch:
            first = self.last_epoch + 1
        assert first == self.last_epoch + 1 or not self.membership, ("membership gap", first, self.last_epoch)
        if members is None:
            assert self.membership, "first epoch event must carry its members"
            members = self.membership[-1][2]
        members = tuple(members)
        if self.membership and tuple(self.membership[-1][2]) == members and self.membership[-1][1] == first - 1:
            self.membership[-1][1] = last
        else:
            self.membership.append([first, last, members])
        # Epochs before ``first`` are closed: nothing of ours can appear there any more.
        if self.frontier < epoch_base(first) - 1:
            self.frontier = epoch_base(first) - 1
        self.disk.append((wire.EV_EPOCH, first, last, members))
        return True

    # ================================================================================
    # client requests
    def on_request(self, route: bytes, msg: list[Any], now: int) -> None:
        op = msg[1]
        if op == wire.INSERT:
            self._on_insert(route, msg, now)
        elif op == wire.READ:
            self._on_read(route, msg, now)
        elif op == wire.SUBSCRIBE:
            self._on_subscribe(route, msg, now)
        elif op == wire.CREDIT:
            sub = self.subs.get((route, msg[2]))
            if sub is not None:
                sub.credit += msg[3]
                sub.last_heard_ns = now
                self._subs_dirty = True
        elif op == wire.UNSUBSCRIBE:
            self.subs.pop((route, msg[2]), None)
        elif op == wire.TRIM:
            self._on_trim(route, msg)
        elif op == wire.STATUS:
            self.outbox.append((route, pack([V, wire.STATUS_OK, msg[2], self.status()])))
        elif op == wire.HELLO:
            self._on_hello(route, msg, now)
        elif op == wire.PREFIX:
            self._on_prefix(msg, now)
        elif op in _RECOVERY_OPS:
            self._on_recovery_op(route, msg, now)
        else:  # decode_request rejects these; keep the core total anyway
            self.error(route, msg[2] if len(msg) > 2 else None, wire.E_UNKNOWN_OP, f"op {op}")

    def error(self, route: bytes, req_id: int | None, code: str, message: str) -> None:
        self.stats["errors"] += 1
        self.outbox.append((route, wire.error_frame(req_id, code, message)))

    def _ack(self, route: bytes, req_id: int, gsn: int, decided: bool, final: bool = False) -> None:
        self.outbox.append((route, pack([V, wire.ACK, req_id, gsn, self.s.replica, self.stable, decided, final])))

    def _refuse(self, route: bytes, req_id: int, key: tuple[int, int], now: int, code: str, message: str) -> None:
        """A final refusal by the primary: it will never decide this record."""
        self.refused[key] = now
        self.error(route, req_id, code, message)

    # -- insert -----------------------------------------------------------------------------
    def _on_insert(self, route: bytes, msg: list[Any], now: int) -> None:
        _, _, req_id, client_id, seq, after, data = msg
        key = (client_id, seq)
        if self.frozen:
            self._frozen_insert(route, req_id, key, now)
            return
        decided = self.dedup.get(key)
        if decided is not None:  # a retry, or the primary's decision arrived first
            self._ack(route, req_id, decided, True)
            return
        if len(data) > self.s.max_record_bytes:
            self.error(route, req_id, wire.E_TOO_LARGE, f"record of {len(data)} bytes exceeds the limit of {self.s.max_record_bytes}")
            return
        self.stats["inserts"] += 1
        if self.is_primary:
            self._primary_insert(route, msg, now)
        else:
            self._backup_insert(route, msg, now)

    def _frozen_insert(self, route: bytes, req_id: int, key: tuple[int, int], now: int) -> None:
        """An insert reaching a replica frozen for recovery. Only the replica whose state
        the failure handler has durably acquired knows the record's fate: in that state
        (decided or guessed) it will be rolled forward at that gsn; otherwise it will not
        be in this shard's log and the client may place it elsewhere."""
        held = self.dedup.get(key)
        if held is None and self.spec is not None:
            held = self.spec.by_key.get(key)
        if self.authority:
            if held is not None:
                self._ack(route, req_id, held, True, True)
            else:
                self.refused[key] = now
                self.no_guess[key] = now
                self.error(route, req_id, wire.E_NOT_HELD, f"shard {self.shard} is recovering and will not hold this record")
            return
        if not self.is_primary:
            self.pending_routes[key] = (route, req_id, now)  # answered when we gain authority
        self.error(route, req_id, wire.E_FROZEN, f"shard {self.shard} is frozen for failure recovery")

    def _check_epoch(self, route: bytes, msg: list[Any], now: int, config: EpochConfig | None, member: bool) -> bool:
        """Shared admission for inserts: park when the rid or our epoch is ahead; refuse
        when this shard takes no inserts. True when the insert can be placed now."""
        req_id, after = msg[2], msg[5]
        need_epoch = epoch_of(after + 1)
        have = config.epoch if config is not None else -1
        if need_epoch > have:
            # "Far beyond" needs a current epoch to measure from: a replica that has seen
            # none yet (a shard just added, a replica just started) parks instead.
            known = config is not None or bool(self.membership)
            if known and need_epoch > max(have, self.last_epoch) + self.s.max_epochs_ahead:
                self.error(route, req_id, wire.E_UNKNOWN_RID, f"rid gsn {after} lies in epoch {need_epoch}, far beyond the current epoch {have}")
                return False
            self.parked.append(ParkedRequest(need_epoch, 0, now + self.s.park_timeout_ns, route, msg))
            return False
        if not member:
            if not any(self.shard in r[2] for r in self.membership):
                # Never a member yet: we are joining. Clients learn membership from
                # ZooKeeper, which the MMS writes before it broadcasts, so an insert can
                # reach us just before the epoch that admits us does: wait for it.
                self.parked.append(ParkedRequest(have + 1, 0, now + self.s.park_timeout_ns, route, msg))
                return False
            if self.is_primary:
                key = (msg[3], msg[4])
                waited = self._member_wait.pop(key, None)
                if waited is None or waited >= have:
                    # It left, but clients see a rejoin in ZooKeeper before its epoch reaches
                    # us (after a recovery, say): wait for one more epoch before refusing.
                    self._member_wait[key] = have
                    self.parked.append(ParkedRequest(have + 1, 0, now + self.s.park_timeout_ns, route, msg))
                    return False
                self._refuse(route, req_id, key, now, wire.E_NOT_MEMBER, f"shard {self.shard} takes no inserts in epoch {have}")
            return False
        return True

    def _primary_insert(self, route: bytes, msg: list[Any], now: int) -> None:
        key = (msg[3], msg[4])
        if self.blocked is not None or key in self.refused:
            self._refuse(route, msg[2], key, now, wire.E_NOT_READY if self.blocked else wire.E_NOT_MEMBER,
                         self.blocked or "this shard refused this record before")
            return
        cfg, cur = self.cur_config, self.cursor
        if not self._check_epoch(route, msg, now, cfg, cur is not None):
            return
        assert cfg is not None and cur is not None
        req_id, client_id, seq, after, data = msg[2], msg[3], msg[4], msg[5], msg[6]
        k = self.next_slot
        if k < cur.count and cur.gsn(k) <= after:
            k = cur.first_slot_after(after)
        if k >= cur.count:  # this epoch has no slot left after `after`: wait for the next
            self.parked.append(ParkedRequest(cfg.epoch + 1, 0, now + self.s.park_timeout_ns, route, msg))
            return
        gsn = cur.gsn(k)
        assert gsn > after, ("InsertAfter must return a gsn above the rid", gsn, after)
        self.next_slot = k + 1
        self.epoch_count += 1
        self._apply_record(gsn, k, client_id, seq, data)
        self.frontier = cur.gsn(k + 1) - 1
        self._ack(route, req_id, gsn, True)
        self._forward((wire.EV_RECORD, gsn, k, client_id, seq, data))
        self._primary_stable_changed()

    def _backup_insert(self, route: bytes, msg: list[Any], now: int) -> None:
        req_id, client_id, seq, after, data = msg[2], msg[3], msg[4], msg[5], msg[6]
        key = (client_id, seq)
        # Remember who asked: when the primary's decision arrives we ack (again) there.
        self.pending_routes[key] = (route, req_id, now)
        sp = self.spec
        guessed = sp.by_key.get(key) if sp is not None else None
        if guessed is not None:
            self._ack(route, req_id, guessed, False)
            return
        if (sp is None or sp.cursor is None or not self.qualified or epoch_of(after + 1) > sp.config.epoch
                or key in self.no_guess):
            # No guess possible (not a member by our view, the rid is ahead of us, or we
            # have not synchronised with the primary since we started: a guess acked then
            # would look, to a restarted primary, like a record it lost). The primary
            # decides or refuses; a backup never refuses on its own, but says it holds no
            # copy, so a client the primary refuses knows the shard has none.
            self._no_guess(route, req_id, key, now)
            return
        cur = sp.cursor
        k = sp.next_slot
        floor_gsn = max(after, self.frontier)
        if k < cur.count and cur.gsn(k) <= floor_gsn:
            k = cur.first_slot_after(floor_gsn)
        if k >= cur.count:  # no room left in this epoch by our reckoning: wait for the decision
            self._no_guess(route, req_id, key, now)
            return
        gsn = cur.gsn(k)
        sp.next_slot = k + 1
        sp.add(gsn, key, k, data)
        self.stats["fast_acks"] += 1
        self._ack(route, req_id, gsn, False)

    def _no_guess(self, route: bytes, req_id: int, key: tuple[int, int], now: int) -> None:
        self.no_guess[key] = now
        self.error(route, req_id, wire.E_NO_GUESS, "this backup holds no copy; the primary decides")

    # -- primary: forwarding and stability ----------------------------------------------------
    def _forward(self, ev: tuple[Any, ...]) -> None:
        self._fwd_events.append(ev)

    def _mark_forward_point(self) -> None:
        """Remember (frontier, last epoch): the state a backup is in after applying every
        forward sent so far. The next FORWARD names it so a backup can spot a gap."""
        self._fwd_mark = (self.frontier, self.last_epoch)

    def flush(self, now: int) -> None:
        """End of an event-loop turn: send the batched forwards / prefix reports and push
        subscriptions. Batching per turn keeps the per-record message count low under load
        without delaying anything when idle."""
        if self.frozen:
            pass  # a frozen replica stores nothing new, so it has nothing to tell its peers
        elif self.is_primary:
            # Every FORWARD carries the stable watermark; a FORWARD of its own is only
            # worth it when no records have gone out for a while.
            since = now - self._last_forward_ns
            push_stable = self.stable > self._stable_sent and since >= self.s.stable_push_ns
            # A backup that lags with nothing new to send may have lost a FORWARD: a
            # periodic (empty) FORWARD names our state so it can spot the gap and ask.
            lagging = since >= self.s.lag_probe_ns and any(self.prefixes.get(r, 0) < self.frontier for r in self.backup_routes)
            # ... and an idle primary's heartbeat is an empty FORWARD.
            lagging = lagging or (since >= self.s.heartbeat_ns and bool(self.backup_routes))
            # Records wait up to forward_interval so that under load one FORWARD (and
            # one PREFIX back) carries several: fewer messages per insert, at the price of
            # that much more time until records are stable.
            due = not self._fwd_events or since >= self.s.forward_interval_ns
            if (self._fwd_events and due) or push_stable or lagging:
                prev_f, prev_e = self._fwd_mark
                frame = pack([V, wire.FORWARD, self.stable, [prev_f, prev_e, self._fwd_events + [(wire.EV_FRONTIER, self.frontier, self.last_epoch, self.next_slot)]]])
                for r in sorted(self.backup_routes):
                    self.outbox.append((self.backup_routes[r], frame))
                self._fwd_events = []
                self._stable_sent = self.stable
                self._last_forward_ns = now
                self._mark_forward_point()
        elif ((self._prefix_dirty and now - self._last_prefix_ns >= self.s.prefix_interval_ns)
              or (self._heard_primary and now - self._last_prefix_ns >= self.s.heartbeat_ns)):  # heartbeat
            self.outbox.append((TO_PRIMARY, pack([V, wire.PREFIX, self.s.replica, self.frontier])))
            self._prefix_dirty = False
            self._last_prefix_ns = now
        if self.parked:
            self._serve_parked_reads()
        if self._subs_dirty:
            self._subs_dirty = False
            for sub in list(self.subs.values()):
                self._serve(sub)

    def _primary_stable_changed(self) -> None:
        new = self.frontier
        for r in range(1, self.s.replicas):
            new = min(new, self.prefixes.get(r, 0))
        if new > self.stable:
            self.stable = new
            self._subs_dirty = True
            self._apply_trim_physically()

    def _on_hello(self, route: bytes, msg: list[Any], now: int) -> None:
        _, _, shard, replica, frontier, guessed_top = msg
        if not self.is_primary or shard != self.shard or not (1 <= replica < self.s.replicas):
            return
        self.peer_heard[replica] = now
        if self.frozen:
            return  # recovery, not a catch-up, will bring the backup in line
        # Guesses above our frontier are normal while we run (inserts in flight); right
        # after our (re)start they may be acknowledged records we no longer have.
        starting = replica in self.awaiting_backups
        if self.blocked is not None or frontier > self.frontier or (starting and guessed_top > self.frontier):
            # The backup holds decisions (or acked guesses) above everything this primary
            # knows: the primary lost state (it restarted from a disk that lagged its
            # memory). A record acknowledged to a client may live only there. Going on
            # would fork the shard's log, so this primary stops deciding for good; only
            # failure recovery may reconcile the replicas.
            if self.blocked is None:
                self.blocked = (f"backup {replica} is ahead (frontier {frontier}, guesses up to {guessed_top}) "
                                f"of this primary (frontier {self.frontier}): failure recovery needed")
            self.stats["conflicting_hellos"] = self.stats.get("conflicting_hellos", 0) + 1
            self.error(route, None, wire.E_NOT_READY, self.blocked)
            return
        self.backup_routes[replica] = route
        self.prefixes[replica] = frontier
        if replica in self.awaiting_backups:
            self.awaiting_backups.discard(replica)
            if not self.awaiting_backups:
                # Every backup is known to be behind us: we hold everything any replica
                # acknowledged, and it is safe to decide again.
                self.qualified = True
                if self._stashed_epoch is not None:
                    self.replay_epoch, self._stashed_epoch = self._stashed_epoch, None
        # Catch the backup up: everything decided above its frontier.
        events = list(self._stream_after(frontier, self._backup_epoch_hint(frontier)))
        events.append((wire.EV_FRONTIER, self.frontier, self.last_epoch, self.next_slot))
        prev_epoch = self._backup_epoch_hint(frontier)
        self.outbox.append((route, pack([V, wire.FORWARD, self.stable, [frontier, prev_epoch, events]])))

    def _backup_epoch_hint(self, frontier: int) -> int:
        # A backup at frontier f has applied every epoch up to epoch_of(f) at least.
        return epoch_of(frontier) if frontier > 0 else -1

    def _stream_after(self, frontier: int, known_epoch: int) -> Iterator[tuple[Any, ...]]:
        """The decided stream above (frontier, known_epoch), for a catch-up."""
        i = bisect.bisect_right(self.gsns, frontier)
        recs = [self.records[g] for g in self.gsns[i:]]
        return stream_events([(r.gsn, r.client_id, r.seq, r.data) for r in recs], self.membership, known_epoch)

    def _on_prefix(self, msg: list[Any], now: int) -> None:
        _, _, replica, frontier = msg
        if not self.is_primary or not (1 <= replica < self.s.replicas):
            return
        self.peer_heard[replica] = now
        if self.frozen:
            return
        if frontier > self.prefixes.get(replica, 0):
            self.prefixes[replica] = min(frontier, self.frontier)
            self._primary_stable_changed()

    # -- backup: applying the primary's decisions -------------------------------------------
    def on_forward(self, msg: list[Any], now: int) -> None:
        if self.is_primary or self.frozen:
            return  # frozen: we promised to store nothing new
        self.peer_heard[0] = now
        stable = msg[2]
        body = msg[3]
        try:
            prev_frontier, prev_epoch, events = body
        except (TypeError, ValueError):
            return
        if prev_frontier > self.frontier or prev_epoch > self.last_epoch:
            # We missed a forward (or restarted): ask for a catch-up, not more than once
            # per retry interval (the catch-up itself may be in flight).
            if self._hello_sent_at is None or now - self._hello_sent_at > self.s.hello_retry_ns:
                self.outbox.append((TO_PRIMARY, self.hello_frame()))
                self._hello_sent_at = now
            return
        self._hello_sent_at = None
        self._heard_primary = True
        # In step with the primary: we now hold everything it decided, which includes
        # everything any replica acknowledged before we (re)started.
        self.qualified = True
        changed = False
        for ev in events:
            kind = ev[0]
            if kind == wire.EV_RECORD:
                _, gsn, slot, client_id, seq, data = ev
                if self._apply_record(gsn, slot, client_id, seq, data):
                    changed = True
                    self._backup_settle(gsn, slot, (client_id, seq), now)
            elif kind == wire.EV_FRONTIER:
                _, frontier, epoch, next_slot = ev
                if self._apply_frontier(frontier):
                    changed = True
                sp = self.spec
                if sp is not None and sp.config.epoch == epoch:
                    self._drop_displaced_guesses(now)
                    sp.resync(next_slot)
            elif kind == wire.EV_EPOCH:
                _, first, last, members = ev
                if self._apply_epochs(first, last, members):
                    changed = True
        self._prefix_dirty = True  # answer every FORWARD: a lost PREFIX must not stall stability
        if changed:
            self._drop_displaced_guesses(now)
        new_stable = min(stable, self.frontier)
        if new_stable > self.stable:
            self.stable = new_stable
            self._subs_dirty = True
            self._apply_trim_physically()

    def _backup_settle(self, gsn: int, slot: int, key: tuple[int, int], now: int) -> None:
        sp = self.spec
        if sp is not None:
            guessed = sp.by_key.get(key)
            if guessed is not None:
                sp.forget(guessed)
            other = sp.by_gsn.get(gsn)
            if other is not None and other.key != key:
                self._displaced(other.key, now)
            sp.forget(gsn)  # another record guessed here is displaced: the primary will place it
            if sp.config.epoch == epoch_of(gsn) and slot + 1 > sp.next_slot:
                sp.next_slot = slot + 1
        else:
            guessed = None
        pending = self.pending_routes.pop(key, None)
        if pending is not None and guessed != gsn:
            self.stats["reacks"] += 1
            self._ack(pending[0], pending[1], gsn, True)

    def _drop_displaced_guesses(self, now: int) -> None:
        sp = self.spec
        if sp is None or not sp.by_gsn:
            return
        for g in [g for g in sp.by_gsn if g <= self.frontier]:
            self._displaced(sp.by_gsn[g].key, now)
            sp.forget(g)

    def _displaced(self, key: tuple[int, int], now: int) -> None:
        """The primary filled our guess's slot otherwise: never guess this record again. A
        resend then learns NO_GUESS; if the primary refused the record for good, that tells
        the client the shard has no copy (guessing anew at every resend never would)."""
        if key not in self.dedup:
            self.no_guess[key] = now
    def connect_primary(self, now: int) -> None:
        """(Re)connected to the primary: introduce ourselves; :meth:`tick` repeats it until
        the primary answers (it may not be up yet, or the hello may be lost)."""
        self._heard_primary = False
        self._hello_sent_at = now
        if not self.frozen:  # frozen: our state is the recovery's business, not a primary's
            self.outbox.append((TO_PRIMARY, self.hello_frame()))

    def hello_frame(self) -> bytes:
        sp = self.spec
        guessed_top = max(sp.by_gsn, default=0) if sp is not None else 0
        return pack([V, wire.HELLO, self.shard, self.s.replica, self.frontier, guessed_top])

    # ================================================================================
    # epochs
    def on_epoch(self, config: EpochConfig, now: int) -> None:
        """A broadcast from the membership service. The shell guarantees that for the
        primary, epochs arrive in order with no gap (it fills gaps with
        :meth:`on_missed_epochs` first)."""
        if self.is_primary:
            if config.epoch <= self.last_epoch:
                return
            if self.awaiting_backups or self.blocked is not None or self.frozen:
                # Until every backup has said where it is, we cannot know that we did not
                # lose decisions it holds: decide nothing, not even an epoch's start.
                self._stashed_epoch = config
                return
            assert config.epoch == self.last_epoch + 1 or self.last_epoch == -1, ("epoch gap", config.epoch, self.last_epoch)
            self._close_epoch(now)
            self._apply_epochs(config.epoch, config.epoch, config.shards)
            self.cur_config = config
            self.epoch_start_ns = now
            self.epoch_count = 0
            self.next_slot = 0
            if self.shard in config.shards:
                self.cursor = SlotCursor(EpochSchedule(config), self.shard)
            else:
                self.cursor = None
                self.frontier = config.end  # nothing of ours in this epoch
            self._forward((wire.EV_EPOCH, config.epoch, config.epoch, list(config.shards)))
            self._primary_stable_changed()
            self._subs_dirty = True
        else:
            if self.frozen or (self.spec is not None and config.epoch <= self.spec.config.epoch):
                return
            cursor = SlotCursor(EpochSchedule(config), self.shard) if self.shard in config.shards else None
            self.spec = self.spec.carried_into(config, cursor) if self.spec is not None else Speculation(config, cursor)
        self._unpark(now)

    def missed_before(self, config: EpochConfig) -> tuple[int, int] | None:
        """Epochs (first, last) this primary never saw and must be told of, through
        :meth:`on_missed_epochs`, before ``config``; None when there are none to tell (a
        backup, a duplicate broadcast, or a primary that is not deciding and will only
        keep ``config`` for later)."""
        if (not self.is_primary or self.awaiting_backups or self.blocked is not None or self.frozen
                or config.epoch <= self.last_epoch + 1):
            return None
        return self.last_epoch + 1, config.epoch - 1

    def on_missed_epochs(self, first: int, last: int, members: Members, now: int) -> None:
        """Epochs this primary never saw broadcast (it was down or slow): it assigned
        nothing in them, so they close at once."""
        if not self.is_primary or last <= self.last_epoch:
            return
        assert not self.awaiting_backups and self.blocked is None, "epochs before the backups said hello"
        self._close_epoch(now)
        first = max(first, self.last_epoch + 1)
        self._apply_epochs(first, last, members)
        self._forward((wire.EV_EPOCH, first, last, list(members)))
        self.frontier = epoch_end(last)
        self.cur_config = None
        self.cursor = None
        self._primary_stable_changed()

    def _close_epoch(self, now: int) -> None:
        """End-of-epoch token: every gsn of the current epoch past our last one is a no-op."""
        if self.cur_config is None:
            return
        cfg = self.cur_config
        if self.cursor is not None:
            self.outbox.append((TO_MMS, pack([V, wire.RATE, self.shard, cfg.epoch, self.epoch_count, max(now - self.epoch_start_ns, 1)])))
        self.frontier = max(self.frontier, cfg.end)
        self.cur_config = None
        self.cursor = None

    def _unpark(self, now: int) -> None:
        """Retry inserts that waited for an epoch that has now begun, in arrival order."""
        if not self.parked:
            return
        cfg = self.cur_config if self.is_primary else (self.spec.config if self.spec else None)
        have = cfg.epoch if cfg is not None else -1
        ready = [p for p in self.parked if p.msg[1] == wire.INSERT and p.need_epoch <= have]
        if not ready:
            return
        self.parked = [p for p in self.parked if not (p.msg[1] == wire.INSERT and p.need_epoch <= have)]
        for p in ready:
            self._on_insert(p.route, p.msg, now)

    # ================================================================================
    # time
    def tick(self, now: int) -> None:
        if self.is_primary and self.cursor is not None and not self.frozen:
            cur = self.cursor
            sched, elapsed = cur.schedule, now - self.epoch_start_ns
            if sched.slots_due(self.shard, elapsed - self.s.noop_timeout_ns) > self.next_slot:
                # Expected records that never came: their slots become no-ops. Catch up to
                # the schedule *now*, not just to the timeout: a writer slower than its
                # rate then triggers this once per timeout's worth of lag rather than once
                # per record, and each expiry is a chance for a backup to guess a record's
                # slot before it hears of the no-ops (a slow-path insert).
                due = min(sched.slots_due(self.shard, elapsed), cur.count)
                self.next_slot = due
                self.frontier = cur.gsn(due) - 1
                self._forward((wire.EV_FRONTIER, self.frontier, self.last_epoch, self.next_slot))
                self._primary_stable_changed()
                self._serve_parked_reads()
        if self.parked:
            keep = []
            for p in self.parked:
                if p.deadline_ns <= now:
                    what = "epoch" if p.msg[1] == wire.INSERT else "position"
                    if p.msg[1] == wire.INSERT and self.is_primary:
                        self.refused[(p.msg[3], p.msg[4])] = now
                    self.error(p.route, p.msg[2], wire.E_TIMEOUT, f"timed out waiting for the {what} the request names")
                else:
                    keep.append(p)
            self.parked = keep
        if (not self.is_primary and not self._heard_primary and self._hello_sent_at is not None
                and not self.frozen and now - self._hello_sent_at > self.s.hello_retry_ns):
            self.connect_primary(now)
        if self.pending_routes and now - self._pending_pruned_ns > 1_000_000_000:
            # Inserts the primary never decided (it refused them, or the client gave up).
            self._pending_pruned_ns = now
            old = now - 10 * self.s.park_timeout_ns
            for pkey in [k for k, v in self.pending_routes.items() if v[2] < old]:
                del self.pending_routes[pkey]
        if (self.refused or self.no_guess) and now - self._pending_pruned_ns > 1_000_000_000:
            old = now - 10 * self.s.park_timeout_ns
            if len(self._member_wait) > 10_000:  # requests that timed out while waiting
                self._member_wait.clear()
            for d in (self.refused, self.no_guess):
                for pkey in [k for k, t in d.items() if t < old]:
                    del d[pkey]
        if not self.frozen and self.s.suspect_timeout_ns > 0:
            self._check_peers(now)
        if self.subs:
            for key, sub in list(self.subs.items()):
                if now - sub.last_heard_ns > self.s.subscription_lease_ns:
                    del self.subs[key]

    def _check_peers(self, now: int) -> None:
        """Failure suspicion: a peer silent for the timeout (or our own lost state) makes
        us ask the failure handler for recovery, again every timeout until it acts."""
        limit = now - self.s.suspect_timeout_ns
        silent = sorted(r for r, t in self.peer_heard.items() if t < limit)
        if not silent and self.blocked is None:
            return
        if self._suspect_sent_ns is not None and now - self._suspect_sent_ns < self.s.suspect_timeout_ns:
            return
        self._suspect_sent_ns = now
        reason = self.blocked or f"no word from replicas {silent}"
        self.stats["suspicions"] = self.stats.get("suspicions", 0) + 1
        self.outbox.append((TO_HANDLER, pack([V, wire.SUSPECT, self.shard, self.s.replica, reason])))

    def next_deadline(self, now: int) -> int | None:
        """Earliest time :meth:`tick` has work; None when only events can make progress."""
        best: int | None = None
        if not self.frozen and self.s.suspect_timeout_ns > 0 and self.peer_heard:
            best = min(self.peer_heard.values()) + self.s.suspect_timeout_ns
            if self._suspect_sent_ns is not None:
                best = max(best, self._suspect_sent_ns + self.s.suspect_timeout_ns)
        if not self.frozen and self.is_primary and self.backup_routes:
            t = self._last_forward_ns + self.s.heartbeat_ns
            best = t if best is None else min(best, t)
        if not self.frozen and not self.is_primary and self._heard_primary:
            t = self._last_prefix_ns + self.s.heartbeat_ns
            best = t if best is None else min(best, t)
        if self.is_primary and self.cursor is not None and self.next_slot < self.cursor.count and not self.frozen:
            t = self.epoch_start_ns + self.cursor.schedule.expected_ns(self.shard, self.next_slot) + self.s.noop_timeout_ns
            best = t if best is None else min(best, t)
        if self.is_primary and self.stable > self._stable_sent:
            t = self._last_forward_ns + self.s.stable_push_ns
            best = t if best is None else min(best, t)
        if self.is_primary and self._fwd_events:
            t = self._last_forward_ns + self.s.forward_interval_ns
            best = t if best is None else min(best, t)
        if not self.is_primary and self._prefix_dirty:
            t = self._last_prefix_ns + self.s.prefix_interval_ns
            best = t if best is None else min(best, t)
        if self.is_primary and self.backup_routes and self.stable < self.frontier:
            t = self._last_forward_ns + self.s.lag_probe_ns
            best = t if best is None else min(best, t)
        if not self.is_primary and not self._heard_primary and self._hello_sent_at is not None and not self.frozen:
            t = self._hello_sent_at + self.s.hello_retry_ns
            best = t if best is None else min(best, t)
        for p in self.parked:
            best = p.deadline_ns if best is None else min(best, p.deadline_ns)
        return best

    # ================================================================================
    # failure recovery (dissertation 4.2.5): the failure handler's side is
    # ``failure_handler.recovery``; these answer its requests.
    def _on_recovery_op(self, route: bytes, msg: list[Any], now: int) -> None:
        op, req_id, gen = msg[1], msg[2], msg[3]
        if gen < self.recovery_gen or (op != wire.PROBE and gen != self.recovery_gen):
            self.error(route, req_id, wire.E_STALE, f"recovery generation {gen} is not the current one ({self.recovery_gen})")
            return
        payload: dict[str, Any] | str
        if op == wire.PROBE:
            payload = self._on_probe(gen)
        elif op == wire.ACQUIRED:
            payload = self._on_acquired(now)
        elif op == wire.FETCH:
            payload = self._on_fetch(msg[4], msg[5], msg[6])
        elif op == wire.INSTALL:
            payload = self._on_install(msg[4], msg[5], msg[6], msg[7])
        else:
            payload = self._on_resume(msg[4], now)
        if isinstance(payload, str):
            self.error(route, req_id, wire.E_STALE, payload)
        else:
            self.outbox.append((route, pack([V, wire.RECOVERY_OK, req_id, payload])))

    def _on_probe(self, gen: int) -> dict[str, Any]:
        """Freeze (the promise to store nothing new) and report our state: the decided
        records above the stable point and, for a backup, the records it guessed and
        acknowledged. Only a qualified replica's records may be the basis of recovery."""
        if gen > self.recovery_gen:
            self.recovery_gen = gen
            self.frozen = True
            self.authority = False
            self.installed_gen = -1
            # Inserts parked for an epoch would be decided after the recovery, though the
            # source may tell their clients the shard does not hold them: drop them now.
            for p in [p for p in self.parked if p.msg[1] == wire.INSERT]:
                self.error(p.route, p.msg[2], wire.E_FROZEN, f"shard {self.shard} is frozen for failure recovery")
            self.parked = [p for p in self.parked if p.msg[1] != wire.INSERT]
        state: dict[str, Any] = {
            "replica": self.s.replica, "gen": gen, "qualified": self.qualified, "frozen": self.frozen,
            "frontier": self.frontier, "stable": self.stable, "trim": self.trim_point,
            "last_epoch": self.last_epoch, "installed": self.installed_gen == gen,
            "resumed": not self.frozen and self.installed_gen == gen,
            "membership": [[f, la, list(m)] for f, la, m in self.membership],
        }
        if self.qualified and self.frozen:
            i = bisect.bisect_right(self.gsns, self.stable)
            state["records"] = [[g, r.client_id, r.seq, r.data] for g in self.gsns[i:] for r in (self.records[g],)]
            guesses = []
            if self.spec is not None:
                guesses = [[g, q.key[0], q.key[1], q.data] for g, q in sorted(self.spec.by_gsn.items()) if g > self.frontier]
            state["guesses"] = guesses
        return state

    def _on_acquired(self, now: int) -> dict[str, Any] | str:
        if not self.frozen:
            return "not frozen"
        self.authority = True
        # Clients waiting on a record we could not place yet get their final answer now.
        pending, self.pending_routes = self.pending_routes, {}
        for key, (route, req_id, _) in pending.items():
            self._frozen_insert(route, req_id, key, now)
        return {"authority": True}

    def _on_fetch(self, lo: int, hi: int, max_bytes: int) -> dict[str, Any] | str:
        if hi > self.frontier:
            return f"asked for records up to {hi}, frontier is {self.frontier}"
        gsns, size = self.gsns, 0
        out: list[list[Any]] = []
        i = bisect.bisect_right(gsns, lo)
        while i < len(gsns) and gsns[i] <= hi and (size < max_bytes or not out):
            r = self.records[gsns[i]]
            out.append([r.gsn, r.client_id, r.seq, r.data])
            size += len(r.data) + 32
            i += 1
        done = i >= len(gsns) or gsns[i] > hi
        return {"trim": self.trim_point, "deleted_below": self.deletable_below, "records": out, "done": done}

    def _truncate(self, base: int) -> None:
        """Forget everything decided above ``base`` (recovery replaces it)."""
        i = bisect.bisect_right(self.gsns, base)
        for g in self.gsns[i:]:
            rec = self.records.pop(g)
            self.dedup.pop((rec.client_id, rec.seq), None)
        del self.gsns[i:]
        self.frontier = min(self.frontier, base)
        keep_epoch = epoch_of(base) if base > 0 else -1
        kept = []
        for first, last, members in self.membership:
            if first > keep_epoch:
                break
            kept.append([first, min(last, keep_epoch), members])
        self.membership = kept

    def _on_install(self, base: int, trim: int, events: list[Any], end: int) -> dict[str, Any] | str:
        """Roll forward: replace everything above ``base`` with the recovery's stream
        (records the acquired state held, epochs up to the last one that included the
        shard) and make every other position up to ``end`` a no-op."""
        if not self.frozen:
            return "not frozen"
        assert base <= end, (base, end)
        self.spec = None
        self.cur_config = None
        self.cursor = None
        self._fwd_events = []
        self._truncate(base)
        self.disk.append((wire.EV_TRUNCATE, base))
        if trim > self.trim_point:
            self.trim_point = trim
            self.disk.append((wire.EV_TRIM, trim))
        for ev in events:
            kind = ev[0]
            if kind == wire.EV_RECORD:
                _, gsn, slot, client_id, seq, data = ev
                self._apply_record(gsn, slot, client_id, seq, data)
            elif kind == wire.EV_EPOCH:
                _, first, last, members = ev
                self._apply_epochs(first, last, members)
        if end > self.frontier:
            assert epoch_of(end) <= self.last_epoch, ("install ends beyond its epochs", end, self.last_epoch)
            self.frontier = end
        self.disk.append((wire.EV_FRONTIER, self.frontier, self.last_epoch, 0))
        self.installed_gen = self.recovery_gen
        self._mark_forward_point()
        return {"frontier": self.frontier, "last_epoch": self.last_epoch}

    def _on_resume(self, stable: int, now: int) -> dict[str, Any] | str:
        if not self.frozen:
            return {"resumed": True}  # a repeat
        if self.installed_gen != self.recovery_gen:
            return "resume before install"
        self.frozen = False
        self.authority = False
        self.qualified = True  # every replica now holds exactly the recovered state
        self.peer_heard.clear()
        self._suspect_sent_ns = None
        if min(stable, self.frontier) > self.stable:
            self.stable = min(stable, self.frontier)
            self._apply_trim_physically()
        self._subs_dirty = True
        if self.is_primary:
            self.blocked = None
            self.awaiting_backups = set()
            self.prefixes = {r: self.frontier for r in range(1, self.s.replicas)}
            self._stable_sent = self.stable
            self._mark_forward_point()
            if self._stashed_epoch is not None:
                self.replay_epoch, self._stashed_epoch = self._stashed_epoch, None
        else:
            self.connect_primary(now)
        return {"resumed": True, "frontier": self.frontier}

    # ================================================================================
    # reads
    def _on_read(self, route: bytes, msg: list[Any], now: int) -> None:
        req_id, gsn = msg[2], msg[3]
        self.stats["reads"] += 1
        if gsn > self.frontier:
            if self.membership and epoch_of(gsn) > self.last_epoch + self.s.max_epochs_ahead:
                self.error(route, req_id, wire.E_UNKNOWN_RID, f"gsn {gsn} lies far beyond this shard's log")
                return
            self.parked.append(ParkedRequest(0, gsn, now + self.s.park_timeout_ns, route, msg))
            return
        self._answer_read(route, req_id, gsn)

    def _answer_read(self, route: bytes, req_id: int, gsn: int) -> None:
        if gsn < self.trim_point:
            self.error(route, req_id, wire.E_TRIMMED, f"gsn {gsn} is below the trim point {self.trim_point}")
            return
        rec = self.records.get(gsn)
        if rec is None:
            self.error(route, req_id, wire.E_NOT_FOUND, f"shard {self.shard} holds no record at gsn {gsn}")
            return
        self.outbox.append((route, pack([V, wire.READ_OK, req_id, gsn, rec.data, self.stable])))

    def _serve_parked_reads(self) -> None:
        if not self.parked:
            return
        keep = []
        for p in self.parked:
            if p.msg[1] == wire.READ and p.need_frontier <= self.frontier:
                self._answer_read(p.route, p.msg[2], p.msg[3])
            else:
                keep.append(p)
        self.parked = keep

    # ================================================================================
    # trim
    def _on_trim(self, route: bytes, msg: list[Any]) -> None:
        req_id, gsn = msg[2], msg[3]
        if gsn > self.trim_point:
            self.trim_point = gsn
            self.disk.append((wire.EV_TRIM, gsn))
            self._apply_trim_physically()
            self._subs_dirty = True
        self.outbox.append((route, pack([V, wire.TRIM_OK, req_id, self.trim_point])))

    @property
    def deletable_below(self) -> int:
        """Records below this gsn may be deleted for good, from memory and from disk:
        trimmed, and stable, so no backup will need them for a catch-up."""
        return min(self.trim_point, self.stable + 1)

    def _apply_trim_physically(self) -> None:
        """Drop trimmed records from memory, but only stable ones: an unstable record may
        still be needed to catch a backup up."""
        limit = self.deletable_below
        if not self.gsns or self.gsns[0] >= limit:
            return
        i = bisect.bisect_left(self.gsns, limit)
        for g in self.gsns[:i]:
            rec = self.records.pop(g)
            # dedup entries of trimmed records go too: their clients are long done
            self.dedup.pop((rec.client_id, rec.seq), None)
        del self.gsns[:i]

    # ================================================================================
    # subscriptions
    def _on_subscribe(self, route: bytes, msg: list[Any], now: int) -> None:
        _, _, sub_id, from_gsn, credit = msg
        if 0 < from_gsn < self.trim_point:
            self.error(route, sub_id, wire.E_TRIMMED, f"subscription start {from_gsn} is below the trim point {self.trim_point}")
            return
        start = max(from_gsn, 1)
        sub = Subscription(route, sub_id, start, credit, start - 1, epoch_of(start) - 1, now)
        self.subs[(route, sub_id)] = sub
        self._serve(sub)

    def _serve(self, sub: Subscription) -> None:
        if sub.credit <= 0:
            return  # the subscriber has not caught up: it grants credit as it reads
        limit = self.stable
        i = bisect.bisect_left(self.gsns, max(sub.next_gsn, self.trim_point))
        records: list[list[Any]] = []
        size = 0
        progress = limit
        while i < len(self.gsns):
            g = self.gsns[i]
            if g > limit:
                break
            if sub.credit <= 0 or size >= self.s.sub_batch_bytes:
                progress = g - 1
                break
            data = self.records[g].data
            records.append([g, data])
            size += len(data) + 16
            sub.credit -= len(data)
            i += 1
        if records:
            sub.next_gsn = records[-1][0] + 1
        if progress <= sub.progress_sent and not records:
            return
        epochs: list[list[Any]] = []
        target_epoch = epoch_of(progress) if progress > 0 else -1
        if target_epoch > sub.epoch_sent:
            for first, last, members in self.membership:
                if last <= sub.epoch_sent:
                    continue
                if first > target_epoch:
                    break
                epochs.append([max(first, sub.epoch_sent + 1), min(last, target_epoch), list(members)])
            sub.epoch_sent = target_epoch
        sub.progress_sent = max(progress, sub.progress_sent)
        sub.credit -= wire.SUB_BATCH_COST
        self.outbox.append((sub.route, pack([V, wire.SUB_BATCH, sub.sub_id, records, epochs, sub.progress_sent])))

    # ================================================================================
    def status(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "replica": self.s.replica,
            "primary": self.is_primary,
            "epoch": self.last_epoch,
            "frontier": self.frontier,
            "stable": self.stable,
            "trim_point": self.trim_point,
            "records": len(self.gsns),
            "subscriptions": len(self.subs),
            "backups_connected": sorted(self.backup_routes),
            "blocked": self.blocked,
            "qualified": self.qualified,
            "frozen": self.frozen,
            "recovery_gen": self.recovery_gen,
            **self.stats,
        }

    # ================================================================================
    # recovery from disk
    def replay(self, events: list[tuple[Any, ...]] | Iterator[tuple[Any, ...]]) -> None:
        """Rebuild the decided stream from persisted events (see ``ziplog.io.segments``)."""
        for ev in events:
            kind = ev[0]
            if kind == wire.EV_RECORD:
                _, gsn, slot, client_id, seq, data = ev
                if gsn > self.frontier:
                    self.records[gsn] = Record(gsn, client_id, seq, data)
                    self.gsns.append(gsn)
                    self.dedup[(client_id, seq)] = gsn
                    self.frontier = gsn
            elif kind == wire.EV_FRONTIER:
                self.frontier = max(self.frontier, ev[1])
            elif kind == wire.EV_EPOCH:
                _, first, last, members = ev
                self._apply_epochs(first, last, members)
            elif kind == wire.EV_TRIM:
                self.trim_point = max(self.trim_point, ev[1])
            elif kind == wire.EV_TRUNCATE:
                self._truncate(ev[1])
            elif kind == EV_STABLE:
                self.stable = max(self.stable, ev[1])
            elif kind == EV_SNAPSHOT:
                _, ranges, frontier, stable, trim = ev
                for first, last, members in ranges:
                    self._apply_epochs(first, last, members)
                self.frontier = max(self.frontier, frontier)
                self.stable = max(self.stable, stable)
                self.trim_point = max(self.trim_point, trim)
        self.stable = min(self.stable, self.frontier)
        self.disk.clear()
        self._mark_forward_point()
        self._apply_trim_physically()


    def snapshot(self) -> tuple[Any, ...]:
        """What a new segment file opens with (see ``ziplog.io.segments``)."""
        return (EV_SNAPSHOT, [list(r) for r in self.membership], self.frontier, self.stable, self.trim_point)


def stream_events(records: list[tuple[int, int, int, bytes]], membership: list[list[Any]],
                  known_epoch: int) -> Iterator[tuple[Any, ...]]:
    """A decided stream for a replica that knows every epoch up to ``known_epoch``:
    epoch events and ``records`` (sorted by gsn) in order, a range of epochs split
    wherever records fall so that every record follows the event opening its epoch.
    Used for catch-ups and by failure recovery to build what it installs."""
    i = 0
    n = len(records)

    def record(j: int) -> tuple[Any, ...]:
        g, c, q, d = records[j]
        return (wire.EV_RECORD, g, 0, c, q, d)

    for first, last, members in membership:
        if last <= known_epoch:
            continue
        e = max(first, known_epoch + 1)
        while i < n and epoch_of(records[i][0]) < e:  # records of epochs it already knows
            yield record(i)
            i += 1
        while e <= last:
            if i < n and epoch_of(records[i][0]) <= last:
                re = epoch_of(records[i][0])
                yield (wire.EV_EPOCH, e, re, list(members))
                while i < n and epoch_of(records[i][0]) == re:
                    yield record(i)
                    i += 1
                e = re + 1
            else:
                yield (wire.EV_EPOCH, e, last, list(members))
                e = last + 1
    while i < n:
        yield record(i)
        i += 1


_RECOVERY_OPS = frozenset((wire.PROBE, wire.ACQUIRED, wire.FETCH, wire.INSTALL, wire.RESUME))

#: Persisted only (not on the wire): the stable watermark at a flush.
EV_STABLE = 4
#: Persisted only: the state a segment file opens with.
EV_SNAPSHOT = 5
