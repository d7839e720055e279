"""The storage replica's protocol core (sans-I/O): one replica of one shard.

:class:`ReplicaCore` composes the parts, each owning its state:

* :class:`~.log.DecidedLog`: records, membership, frontier/stable/trim;
* the role: :class:`~.primary.PrimarySequencer` (replica 0, decides) or
  :class:`~.backup.BackupFollower` (guesses, applies the primary's stream);
* :class:`~.recovery.RecoveryParticipant`: freezing, answering for an acquired state,
  installing, resuming;
* :class:`~.fanout.Fanout`: reads and subscriptions;
* :class:`~.parking.Parking`: requests waiting for an epoch or a position;
* :class:`~.liveness.Liveness`: heartbeats heard, failure suspicion.

Inputs are typed messages and the passage of time; every effect (messages, events to
persist, coordination reads) waits in the core until :meth:`ready` hands the batch
over. The turn protocol, the same for every driver (the storage driver, the simulation
through it, the core tests' harness): each request of a turn goes to ``on_request`` as it
is read (an epoch broadcast to ``hold_epoch``); once the turn's input is read,
``end_input`` takes what was held (inserts, notices, epochs) in stamp order, and
``ready`` hands over the answers; then ``tick`` and ``flush``, and ``ready`` again. :meth:`next_deadline` says when :meth:`tick` has work. No sockets, clocks or
threads: ``ziplog.server.storage`` drives it in production and ``tests/sim`` drives the
same driver in simulation.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple, Union

from ziplog.cores.effects import Messages, Outbox, Ready
from ziplog.cores.replica import restart
from ziplog.cores.replica.backup import BackupFollower
from ziplog.cores.replica.fanout import Fanout
from ziplog.cores.replica.liveness import Liveness
from ziplog.cores.replica.log import DecidedLog
from ziplog.cores.replica.parking import Parking
from ziplog.cores.replica.primary import PrimarySequencer
from ziplog.cores.replica.recovery import RecoveryParticipant, RecoveryPhase
from ziplog.cores.replica.settings import ReplicaSettings
from ziplog.protocol import frames as f
from ziplog.protocol.events import DiskEvent, Members, SnapshotEvent
from ziplog.protocol.gsna import EpochConfig

Role = Union[PrimarySequencer, BackupFollower]


class HeldEpoch(NamedTuple):
    """An epoch broadcast held for the turn's order, stamped with the wall-clock time
    its sender sent it, or else that it reached this replica (``ReplicaCore.hold_epoch``)."""

    config: EpochConfig
    stamp: int


#: what a replica takes in stamp order (``ReplicaCore.take_ordered``)
Ordered = Union[f.Insert, f.Notice, HeldEpoch]
#: how a driver has the held messages taken (``ReplicaCore.end_input``)
Contain = Callable[[Callable[[bytes, Ordered, int], None], bytes, Ordered, int], None]


def _stamp_of(held: tuple[bytes, Ordered]) -> int:
    return held[1].stamp


def coalesce_acks(messages: Messages) -> Messages:
    """``messages`` with every route's ACKs, when it has two or more, in one ACKS frame at
    the place of the first (their order kept): a turn that took a pipelining client's
    inserts answers them in one frame, and with one ACK per route nothing changes.
    Other messages keep their places; ACKs are only ever reordered past replies to
    other requests."""
    counts: dict[bytes, int] = {}
    for dest, msg in messages:
        if type(msg) is f.Ack and type(dest) is bytes:
            counts[dest] = counts.get(dest, 0) + 1
    if not counts or max(counts.values()) < 2:
        return messages
    out: Messages = []
    batches: dict[bytes, list[f.Ack]] = {}
    for dest, msg in messages:
        if type(msg) is f.Ack and type(dest) is bytes and counts[dest] > 1:
            batch = batches.get(dest)
            if batch is None:
                batch = batches[dest] = []
                out.append((dest, f.Acks(acks=batch)))
            batch.append(msg)
        else:
            out.append((dest, msg))
    return out


class ReplicaCore:
    def __init__(self, settings: ReplicaSettings, incarnation: int = 0) -> None:
        """``incarnation``: this start's nonce, which its registration names (0: none, for
        tests that build cores by hand): no message meant for another is acted on."""
        assert 0 <= incarnation <= f.MAX_U64, incarnation
        self.s = settings
        self.shard = settings.shard
        self.incarnation = incarnation
        self.out = Outbox()
        self.stats: dict[str, int] = {"inserts": 0, "fast_acks": 0, "confirmed_guesses": 0, "reacks": 0, "reads": 0,
                                      "errors": 0, "wrong_guesses_epoch": 0, "wrong_guesses_ahead": 0,
                                      "wrong_guesses_behind": 0, "guesses_displaced": 0, "reference_misses": 0,
                                      "stale_links": 0}
        #: error replies by code (the codes are the protocol's few constants: bounded)
        self.errors_by_code: dict[str, int] = {}
        #: counters the driver keeps about its own work, reported in STATUS beside ours
        self.driver_stats: dict[str, int] = {}
        #: this turn's inserts and notices, held until :meth:`end_input` (see :meth:`take_ordered`)
        self.held: list[tuple[bytes, Ordered]] = []
        self.log = DecidedLog(self.out)
        self.parking = Parking(settings.max_parked, settings.max_parked_per_connection)
        self.role: Role = (PrimarySequencer(settings, self.log, self.parking, self.out, self.error, self.stats,
                                            incarnation)
                           if settings.is_primary else BackupFollower(settings, self.log, self.out, self.error, self.stats,
                                                                      incarnation))
        self.fanout = Fanout(settings, self.log, self.parking, self.out, self.error, self.stats)
        #: a backup keeps each insert's data as it arrives: a FORWARD read later in the
        #: same turn, before the turn's inserts are taken, may name it (by reference)
        self._received = self.role.received if isinstance(self.role, BackupFollower) else None
        self._waiting = self.role.waiting if isinstance(self.role, BackupFollower) else None
        self.liveness = Liveness(settings.shard, settings.replica, settings.suspect_timeout_ns, self.out)
        self.recovery = RecoveryParticipant(settings.shard, settings.replica, self.log, self.role, self.parking,
                                            self.out, self.error, self._resumed)
        self._handlers: dict[type, Callable[[bytes, Any, int], None]] = {
            f.Read: self.fanout.on_read,
            f.Range: self.fanout.on_range,
            f.Count: self.fanout.on_count,
            f.Subscribe: self.fanout.on_subscribe,
            f.Credit: self.fanout.on_credit,
            f.Unsubscribe: lambda route, msg, now: self.fanout.on_unsubscribe(route, msg),
            f.Trim: self._on_trim,
            f.Status: self._on_status,
            f.Hello: self._on_hello,
            f.Prefix: self._on_prefix,
            f.Probe: self.recovery.on_op,
            f.Acquired: self.recovery.on_op,
            f.Fetch: self.recovery.on_op,
            f.Install: self.recovery.on_op,
            f.Resume: self.recovery.on_op,
        }

    # -- what the driver reads ------------------------------------------------------------------
    def ready(self) -> Ready:
        """The effects of everything since the last call, in order; two or more ACKs to
        one route travel as one ACKS frame (see :func:`coalesce_acks`)."""
        r = self.out.ready()
        if len(r.messages) > 1:
            r.messages = coalesce_acks(r.messages)
        return r

    @property
    def is_primary(self) -> bool:
        return self.s.is_primary

    @property
    def frozen(self) -> bool:
        return self.recovery.frozen

    @property
    def qualified(self) -> bool:
        return self.role.qualified

    @property
    def blocked(self) -> str | None:
        return self.role.blocked

    @property
    def frontier(self) -> int:
        return self.log.frontier

    @property
    def stable(self) -> int:
        return self.log.stable

    @property
    def last_epoch(self) -> int:
        return self.log.last_epoch

    def snapshot(self) -> SnapshotEvent:
        return self.log.snapshot()

    def flush_marks(self) -> list[DiskEvent]:
        return self.log.flush_marks()

    @property
    def deletable_below(self) -> int:
        return self.log.deletable_below

    # -- inputs ---------------------------------------------------------------------------------
    def on_request(self, route: bytes, msg: f.Request, now: int) -> None:
        """A frame on the replica's ROUTER (clients, backups, the failure handler). An
        INSERT or a NOTICE is held until the turn's input ends (:meth:`end_input`; the
        turn protocol is in the module's documentation)."""
        t = type(msg)
        if t is f.Insert or t is f.Notice:
            if t is f.Insert and self._received is not None and self._waiting is not None:
                self._received.add((msg.client_id, msg.seq), msg.data, now)  # type: ignore[union-attr]
                if self._waiting.waiting:  # a FORWARD may have waited for it
                    self._waiting.retry(now)
            self._hold(route, msg, now)  # type: ignore[arg-type]
            return
        self._handlers[t](route, msg, now)

    def _hold(self, route: bytes, item: Ordered, now: int) -> None:
        held = self.held
        held.append((route, item))
        if len(held) >= self.s.max_turn_inserts:  # a flood: take these now, in order
            self.end_input(now)

    def end_input(self, now: int, contain: Contain | None = None) -> None:
        """The turn's input is read: take what was held, in :meth:`take_ordered`'s order,
        each through ``contain(take, route, msg, now)`` if given (a driver's guard)."""
        take = self.on_ordered
        for route, msg in self.take_ordered():
            if contain is None:
                take(route, msg, now)
            else:
                contain(take, route, msg, now)

    def take_ordered(self) -> list[tuple[bytes, Ordered]]:
        """The inserts, notices and epochs held since the last call, in the order to take
        them (:meth:`end_input` takes them): by their senders' stamps, arrival order among
        equal ones. Both replicas then take a turn's in the same order, though their
        sockets were read in different orders, and across turns in the order they were
        sent, which is most of the time the order both replicas received them in: each
        pair the two would take in opposite orders costs slow-path inserts
        (docs/ARCHITECTURE.md, Life of an insert)."""
        held = self.held
        if len(held) > 1:
            held.sort(key=_stamp_of)
        self.held = []
        return held

    def hold_epoch(self, config: EpochConfig, now: int, sent: int = 0) -> None:
        """An epoch broadcast that reached this replica at ``now``, which its sender
        stamped ``sent`` (0: not stamped): taken in stamp order with the turn's inserts
        (:meth:`take_ordered`). Each replica of a shard then places or guesses the inserts
        its clients sent before that moment in the epoch that ends, and those sent after
        in the next, rather than whichever way its sockets were read. The sender's stamp
        is the same moment at every replica, however late each one read the broadcast (a
        process serving several replicas may read it a turn later than its peer's);
        without one (or with ``epoch_stamp_sent`` off) the moment is the arrival here.
        Two broadcasts held in one turn keep the order they came in, whatever their
        stamps say (two leaders' clocks may disagree)."""
        stamp = sent if sent and self.s.epoch_stamp_sent else f.wall_stamp(now, self.s.wall_offset_ns)
        for _, item in reversed(self.held):
            if type(item) is HeldEpoch:
                stamp = max(stamp, item.stamp)
                break
        self._hold(b"", HeldEpoch(config, stamp), now)

    def on_ordered(self, route: bytes, msg: Ordered, now: int) -> None:
        """Take one INSERT, NOTICE or held epoch (from :meth:`end_input`)."""
        t = type(msg)
        if t is f.Insert:
            self._on_insert(route, msg, now)  # type: ignore[arg-type]
        elif t is f.Notice:
            self._on_notice(route, msg, now)  # type: ignore[arg-type]
        else:
            self.on_epoch(msg.config, now, msg.stamp)  # type: ignore[union-attr]

    def error(self, route: bytes, req_id: int | None, code: str, message: str) -> None:
        self.stats["errors"] += 1
        self.errors_by_code[code] = self.errors_by_code.get(code, 0) + 1
        self.out.send(route, f.Error(req_id=req_id, code=code, message=message))

    def _on_insert(self, route: bytes, msg: f.Insert, now: int) -> None:
        key = (msg.client_id, msg.seq)
        if self.recovery.frozen:
            self.recovery.frozen_insert(route, msg.req_id, key, now)
            return
        decided = self.log.dedup.get(key)
        if decided is not None:  # a retry, or the primary's decision arrived first
            self.out.send(route, f.Ack(req_id=msg.req_id, gsn=decided, replica=self.s.replica, stable=self.log.stable,
                                       decided=True, final=False, inc=self.role.ack_inc))
            return
        if len(msg.data) > self.s.max_record_bytes:
            self.error(route, msg.req_id, f.E_TOO_LARGE,
                       f"record of {len(msg.data)} bytes exceeds the limit of {self.s.max_record_bytes}")
            return
        self.stats["inserts"] += 1
        self.role.insert(route, msg, now)

    def _on_trim(self, route: bytes, msg: f.Trim, now: int) -> None:
        if self.log.raise_trim(msg.gsn):
            self.fanout.mark_dirty()
        self.out.send(route, f.TrimOk(req_id=msg.req_id, trim_point=self.log.trim_point))

    def _on_status(self, route: bytes, msg: f.Status, now: int) -> None:
        self.out.send(route, f.StatusOk(req_id=msg.req_id, status=self.status()))

    def _on_hello(self, route: bytes, msg: f.Hello, now: int) -> None:
        if not self.is_primary or msg.shard != self.shard or not (1 <= msg.replica < self.s.replicas):
            return
        if msg.to_inc != self.incarnation:  # a picture of the backup meant for another (ARCHITECTURE, Fencing)
            self.stats["stale_links"] += 1
            return
        self.liveness.hear(msg.replica, now)
        if self.recovery.frozen:
            return  # recovery, not a catch-up, will bring the backup in line
        was_deciding = self.role.deciding
        self.role.on_hello(route, msg, now)
        if self.role.deciding and not was_deciding:
            self._began_epochs(now)

    def _on_prefix(self, route: bytes, msg: f.Prefix, now: int) -> None:
        if not self.is_primary or not (1 <= msg.replica < self.s.replicas):
            return
        if not self.role.fwd.prefix_fenced(route, msg):  # type: ignore[union-attr]
            self.stats["stale_links"] += 1
            return
        self.liveness.hear(msg.replica, now)
        if self.recovery.frozen:
            return
        self.role.on_prefix(msg, now)

    def _on_notice(self, route: bytes, msg: f.Notice, now: int) -> None:
        # A primary that decides nothing now (starting, blocked, frozen for recovery)
        # has nothing to pass: the notice is dropped (the epoch's close is the backstop).
        # A backup moves its guesses along (the primary it follows passes alike).
        if self.recovery.frozen:
            return
        if not self.is_primary:
            self.role.on_notice(msg, now)  # type: ignore[union-attr]
        elif self.role.deciding:
            self.role.on_notice(msg, now)  # type: ignore[union-attr]

    def on_forward(self, msg: f.Forward, now: int) -> None:
        """A FORWARD on a backup's own connection to its primary."""
        if self.is_primary or self.recovery.frozen:
            return  # frozen: we promised to store nothing new
        if not self.role.link.forward_fenced(msg):  # type: ignore[union-attr]
            self.stats["stale_links"] += 1
            return
        self.liveness.hear(0, now)
        self.role.on_forward(msg, now)  # type: ignore[union-attr]

    def on_epoch(self, config: EpochConfig, now: int, stamp: int = 0) -> None:
        """A broadcast from the membership service, stamped ``stamp`` where it was held
        for the turn's order (a member's slot clock counts from it: :mod:`.clock_pass`)."""
        if self.recovery.frozen:
            if self.is_primary and config.epoch > self.log.last_epoch:
                self.role.stashed = config  # type: ignore[union-attr]
            return
        if self.role.on_epoch(config, now, stamp):
            self._began_epochs(now)

    def on_history(self, ranges: Iterable[tuple[int, int, Members]], now: int) -> None:
        """The answer to a ``ReadHistory``: members of the epochs it named."""
        if self.role.on_history(list(ranges), now):
            self._began_epochs(now)

    def _began_epochs(self, now: int) -> None:
        """A new epoch began: subscriptions learn its members; inserts waiting for it go on."""
        self.fanout.mark_dirty()
        epoch = self.role.current_epoch()
        for p in self.parking.inserts_for(epoch):
            assert isinstance(p.msg, f.Insert)
            self._on_insert(p.route, p.msg, now)

    def on_disk(self, fault: str | None, now: int) -> None:
        """The decided stream cannot be written (``fault``) or can again (None): while it
        cannot, no new records (DISK_FULL from a primary, no guesses); the rest serves."""
        self.log.disk_fault = fault

    def connect_primary(self, now: int, primary_inc: int = 0) -> None:
        """(Re)connected to the primary (a new address, or another incarnation, which its
        registration names ``primary_inc``): its silence counts from now."""
        if not self.is_primary:
            self.liveness.restart_clock(0, now)
            self.role.connect_primary(now, self.recovery.frozen, primary_inc)  # type: ignore[union-attr]

    def primary_unregistered(self, now: int) -> None:
        """The primary left ZooKeeper (a graceful stop does at once): silence counts from now."""
        self.liveness.restart_clock(0, now)  # a primary's own clock: no entry 0, no effect

    def _resumed(self, now: int) -> None:
        peers = list(range(1, self.s.replicas)) if self.is_primary else [0]
        self.liveness.reset(now, peers)
        self.fanout.mark_dirty()
        if self.role.deciding:
            self._began_epochs(now)

    # -- time -----------------------------------------------------------------------------------
    def tick(self, now: int) -> None:
        frozen = self.recovery.frozen
        if not frozen:
            self.role.tick(now)
        for p in self.parking.expired(now):
            insert = type(p.msg) is f.Insert
            if insert:
                self.role.parked_insert_expired(p, now)
            self.error(p.route, p.msg.req_id, f.E_TIMEOUT,
                       f"timed out waiting for the {'epoch' if insert else 'position'} the request names")
        self.role.prune(now)
        if not frozen:
            self.liveness.check(now, self.role.blocked)
        self.fanout.expire_leases(now)

    def flush(self, now: int) -> None:
        """End of a turn: the batched forward or prefix report, then reads, subscriptions."""
        if not self.recovery.frozen:  # a frozen replica stores nothing new: nothing to tell its peers
            self.role.flush(now)
        self.fanout.flush()

    def next_deadline(self, now: int) -> int | None:
        """Earliest time :meth:`tick` has work; None when only events can make progress."""
        best = self.fanout.next_lease_check
        if self.parking.waiting:
            t = self.parking.next_deadline()
            if t is not None and (best is None or t < best):
                best = t
        if self.recovery.phase is RecoveryPhase.NORMAL:
            for t in (self.role.next_deadline(now), self.liveness.next_deadline()):
                if t is not None and (best is None or t < best):
                    best = t
        return best

    # -- disk -----------------------------------------------------------------------------------
    def replay(self, events: Iterable[DiskEvent], clean_frontier: int | None = None) -> None:
        """Rebuild the decided log from persisted events (:func:`.restart.replay`)."""
        restart.replay(self, events, clean_frontier)

    @property
    def restarted_clean(self) -> bool:
        """A replica whose last incarnation vouched for the log it replayed."""
        return self.role.restarted_clean

    def clean_close_frontier(self) -> int | None:
        """What a graceful stop may vouch for (:func:`.restart.clean_close_frontier`)."""
        return restart.clean_close_frontier(self)

    # -- status ---------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return replica_status(self)


def replica_status(core: ReplicaCore) -> dict[str, Any]:
    """What STATUS reports of a replica."""
    log = core.log
    return {
        "shard": core.shard,
        "replica": core.s.replica,
        "primary": core.is_primary,
        "epoch": log.last_epoch,
        "frontier": log.frontier,
        "stable": log.stable,
        "trim_point": log.trim_point,
        "records": len(log.gsns),
        "log_bytes": log.held_bytes,
        "max_log_bytes": core.s.max_log_bytes,
        "subscriptions": len(core.fanout.subs),
        "parked": len(core.parking),
        "qualified": core.role.qualified,
        "frozen": core.recovery.frozen,
        "recovery": core.recovery.phase.value,
        "recovery_gen": core.recovery.gen,
        "suspicions": core.liveness.suspicions,
        "disk": log.disk_fault or "ok",
        **core.role.status(),
        **core.stats,
        **core.driver_stats,
    }
