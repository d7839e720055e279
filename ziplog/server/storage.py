"""The storage driver: one replica of one shard, a thin driver over :class:`ReplicaCore`
(the process that hosts one or several is :mod:`ziplog.server.process`).

:class:`StorageDriver` moves frames between the ports and the core and performs the
core's effects; it runs unchanged in production (pyzmq, segment files, kazoo) and in
the simulation (``tests/sim``). It binds a ROUTER
(clients, the failure handler, and the backups' HELLO/PREFIX when this is the primary);
its connections out are :class:`~ziplog.server.links.ReplicaLinks`.
"""

from __future__ import annotations

import errno
import logging
from typing import TYPE_CHECKING, Any, Callable

from ziplog.cores.effects import Messages, Peer, ReadHistory, Ready, ShardReplicas
from ziplog.cores.replica import ReplicaCore, ReplicaSettings
from ziplog.cores.replica.core import Ordered
from ziplog.cores.replica.parking import Parked
from ziplog.cores.replica.primary import PrimarySequencer
from ziplog.shell.inbound import InboundGuard
from ziplog.server.client_rights import ClientRights
from ziplog.server.epoch_subscription import EpochSubscription
from ziplog.server.fences import MemberGate, new_incarnation, to_backup, to_primary
from ziplog.server.frame_counts import FrameCounts
from ziplog.server.links import NEW_PRIMARY_LINK, PRIMARY_GONE, ReplicaLinks
from ziplog.server.notices import NoticeFanout
from ziplog.server.replica_metrics import replica_metrics
from ziplog.shell.metrics import Durations
from ziplog.shell.throttled_log import ThrottledLog
from ziplog.io.ports import (
    CoordinationUnavailable,
    Disk,
    Network,
    Runtime,
    StorageCoordination,
)
from ziplog.protocol import frames as f
from ziplog.protocol.access import AccessTable
from ziplog.protocol.addresses import advertised
from ziplog.protocol.auth import ClusterKey
from ziplog.protocol.events import DiskEvent
from ziplog.protocol.keys import ClientEntry
from ziplog.protocol.membership import history_ranges

if TYPE_CHECKING:
    from prometheus_client.core import Metric

log = logging.getLogger("ziplog.server")

#: Buffered decided-stream events are written this often (one write per batch).
DISK_FLUSH_NS = 5_000_000
#: While the disk cannot be written, the buffered batch is tried again this often.
DISK_RETRY_NS = 200_000_000
#: The core's timers are looked at no more often than this.
MIN_TICK_NS = 500_000
#: answers waiting for the disk (:attr:`Ready.durable`: a replica's INSTALL answers) kept
#: at most; the failure handler resends an INSTALL it has no answer to, so the latest do
MAX_DURABLE_WAITING = 64
#: ``ziplog_replica_insert_turn_seconds``'s buckets: a turn's inserts take tens of
#: microseconds, a stalled turn milliseconds
INSERT_TURN_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


def replica_logger(shard: int, replica: int) -> logging.Logger:
    """The logger of one replica's driver: a child of this module's, so the process's
    handler formats it, and its name says which replica a line is about."""
    return logging.getLogger(f"{log.name}.{shard}.{replica}")


class StorageDriver:
    def __init__(self, settings: ReplicaSettings, rt: Runtime, net: Network, coord: StorageCoordination,
                 disk: Disk | None, key: ClusterKey, host: str = "127.0.0.1", port: int = 0,
                 advertise: str | None = None, access: AccessTable | None = None,
                 incarnation: int | None = None) -> None:
        self.settings = settings
        #: this start's nonce (:func:`new_incarnation`; the simulation draws its own)
        self.incarnation = new_incarnation() if incarnation is None else incarnation
        #: this replica's logger (``ziplog.server.<shard>.<replica>``, named in every line):
        #: a process may serve replicas of several shards
        self.log = replica_logger(settings.shard, settings.replica)
        #: seals what this replica tells its peers and the control plane, and opens what
        #: they tell it
        self.key = key
        self.rt = rt
        self.net = net
        self.coord = coord
        self.disk = disk
        self.core = ReplicaCore(settings, self.incarnation)
        #: what a member's frame must show before the core takes it (:mod:`.fences`)
        self.gate = MemberGate(settings.shard, self.incarnation, coord)
        self.core.driver_stats.update(inbound_failures=0, notices_handed_on=0, notices_by_clock=0)  # NoticeFanout's
        self.frames = FrameCounts(self.core.driver_stats)
        #: requests refused before they reached the core (undecodable, unsigned, an
        #: uncommitted recovery generation), by error code
        self.refused_frames: dict[str, int] = {}
        #: how long parked requests waited, from arrival to release, by kind
        self.park_waits = {"insert": Durations(), "read": Durations()}
        #: the server's share of an insert's latency: from the first INSERT a turn read to
        #: the end of the turn's ordered handling, when its ACKs have left (one sample per
        #: turn that read an INSERT, taken at the turn's end); and when this turn's first
        #: INSERT was read (0: none yet)
        self.insert_turns = Durations(INSERT_TURN_BUCKETS)
        self._turn_first_insert_ns = 0
        self._time_parking()
        #: contains a failure in handling one inbound message (see ziplog.shell.inbound)
        self.guard = InboundGuard(self.log, rt, self._count_inbound_failure)
        self.router = net.router(self.guard.routed("its ROUTER", self.on_request, self._internal_error),
                                 self.on_multipart, host, port, max_bytes=f.request_limit(settings.max_record_bytes))
        #: what this replica registers for peers and clients to dial
        self.addr = advertised(self.router.addr, advertise)
        #: under CURVE, the client keys' rights (None: NULL, every op is served)
        self.rights = None if access is None else ClientRights(access, self.core, self.router, self.refused_frames)
        self._disk_buf: list[DiskEvent] = []
        #: messages that leave once everything persisted before them is written
        self._durable: Messages = []
        #: this turn's rate reports (one RATE frame at the turn's end), and the membership
        #: service's leader as the last epoch broadcast named it (-1: none yet)
        self._rate_reports: list[f.RateEntry] = []
        self.mms_leader = -1
        self._last_disk_ns = rt.now()
        #: why the last write failed (None: writing works); the batch stays buffered
        self.disk_fault: str | None = None
        self._disk_retry_at = 0
        self.trouble_log = ThrottledLog(self.log, rt)
        self.epochs = EpochSubscription(coord, self.trouble_log)
        self.links = ReplicaLinks(settings, net, coord, self.guard, self.trouble_log, self.on_epoch_frame,
                                  self.on_primary_frame)
        self.notices = NoticeFanout(self.links, key, self.frames, self.core.driver_stats)
        self._dropped_below = 0
        self._next_tick = 0
        self._wakeup: Any = None
        self._wakeup_at: int | None = None
        #: this turn sent something to a client (:meth:`answer_turn` says so)
        self._answered = False
        self.closed = False
        #: the process is stopping on request (a signal), not on a failure: its close may
        #: vouch for what it wrote
        self.stopping_on_request = False
        if disk is not None:
            # The marker is taken (and gone from the disk) before this replica decides
            # anything: it vouches for one start only.
            self.core.replay(disk.load(), clean_frontier=disk.take_clean_close())
            if self.core.restarted_clean:
                self.log.info("restarted clean at frontier %d: the last incarnation wrote every record it decided",
                         self.core.frontier)
            disk.start(self.core.snapshot())
        rt.at_turn_answers(self.answer_turn)
        rt.at_turn_end(self.end_turn)

    def _time_parking(self) -> None:
        """Time parked requests as the core releases them (an epoch began, the frontier
        moved): only requests that waited cost anything."""
        waits = self.park_waits

        def released(p: Parked) -> None:
            waits["insert" if type(p.msg) is f.Insert else "read"].observe((self.rt.now() - p.arrived_ns) / 1e9)

        self.core.parking.on_release = released

    # -- start-up ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Register in ZooKeeper and connect to the control plane (and the primary)."""
        s = self.settings
        self.coord.on_change(lambda: self.rt.call_soon_threadsafe(self.on_topology))
        self.on_topology()
        self.coord.register_replica(s.shard, s.replica, s.replicas, self.addr, s.clock_pass_rate, self.incarnation)
        self.log.info("shard %d replica %d serving on %s", s.shard, s.replica, self.addr)

    def on_topology(self) -> None:
        """Something moved in ZooKeeper: follow it (:class:`~ziplog.server.links.ReplicaLinks`)."""
        if self.closed:
            return
        moved = self.links.follow_topology()
        if moved == NEW_PRIMARY_LINK:
            self.core.connect_primary(self.rt.now(), self.links.primary_inc)
            self._perform(self.core.ready())
        elif moved == PRIMARY_GONE:
            self.core.primary_unregistered(self.rt.now())

    # -- input ------------------------------------------------------------------------------------
    def on_request(self, route: bytes, frame: bytes) -> None:
        core = self.core
        try:
            msg = f.decode_request(frame)
            if type(msg) is f.Signed:  # a cluster member's: a peer or the failure handler
                msg = self.gate.admit(f.open_envelope(self.key, msg, f.decode_member_request))
            elif self.rights is not None:
                self.rights.check(route, msg)
            self.frames.received(type(msg))
        except f.ProtocolError as exc:
            self.refused_frames[exc.code] = self.refused_frames.get(exc.code, 0) + 1
            core.error(route, exc.req_id, exc.code, exc.message)
        else:
            now = self.rt.now()
            if type(msg) is f.Insert and not self._turn_first_insert_ns:
                self._turn_first_insert_ns = now
            core.on_request(route, msg, now)
            if type(msg) is f.Notice and msg.hosted:
                self.notices.hand_on(msg, now)
        # Replies leave now (an INSERT's at the turn's end: the core holds inserts until
        # the turn's input is read), before forwards and bookkeeping.
        self._perform(core.ready())

    def on_access(self, entries: list[ClientEntry], version: int) -> None:
        """The client key registry changed (:meth:`ClientRights.load`)."""
        if self.rights is not None and not self.closed:
            self.rights.load(entries, version)
            self._perform(self.core.ready())

    def _count_inbound_failure(self, edge: str) -> None:
        self.core.driver_stats["inbound_failures"] += 1

    def _internal_error(self, route: bytes, frame: bytes, exc: Exception) -> None:
        """The sender of a request whose handling failed hears so (and may resend it)."""
        self.router.send_to(route, f.error_frame(f.request_id_of(frame), f.E_INTERNAL,
                                                 f"{type(exc).__name__} while handling the request"))

    def on_multipart(self, route: bytes, extra_parts: int) -> None:
        self.refused_frames[f.E_MALFORMED] = self.refused_frames.get(f.E_MALFORMED, 0) + 1
        self.core.error(route, None, f.E_MALFORMED, f"a request is one frame, got {extra_parts + 1}")
        self._perform(self.core.ready())

    def on_primary_frame(self, frame: bytes) -> None:
        try:
            msg = f.decode_from_primary(frame)
        except f.ProtocolError as exc:
            self.log.warning("bad frame from the primary: %s", exc)
            return
        self.frames.received(type(msg))
        if type(msg) is f.Forward:
            self.core.on_forward(msg, self.rt.now())
            self._perform(self.core.ready())
        else:
            assert isinstance(msg, f.Error)
            self.log.error("primary refused us: %s %s", msg.code, msg.message)

    def on_epoch_frame(self, frame: bytes) -> None:
        self.frames.received(f.EpochStart)  # EPOCH or EPOCH_SAME: one broadcast each
        got = self.epochs.take(frame)  # None: a bad frame, or an epoch that counts as missed
        if got is None:
            return
        cfg, leader, stamp = got
        self.core.hold_epoch(cfg, self.rt.now(), stamp)  # the turn's end takes it
        if leader is not None and leader != self.mms_leader:
            self.mms_leader = leader  # rate reports go to it alone (ReplicaLinks.report_rates)
            role = self.core.role
            if type(role) is PrimarySequencer:
                role.rates.on_leader(leader)  # a new leader is owed this shard's rate

    def answer_turn(self) -> bool:
        """After every turn, before any driver's :meth:`end_turn` (a process may serve
        several replicas): the inserts, notices and epochs the turn's input held are taken
        in stamp order, and their ACKs leave. True when this turn sent anything to a
        client (its runtime may then let that client run before the bookkeeping)."""
        if self.closed:
            return False
        core, rt = self.core, self.rt
        if core.held:
            self._take_ordered(rt.now())
        if self._turn_first_insert_ns:
            # The turn's inserts are handled and their ACKs have left (those the core took
            # in a flood, before the turn's input ended, too): one sample, and the next
            # turn starts afresh.
            self.insert_turns.observe((rt.now() - self._turn_first_insert_ns) / 1e9)
            self._turn_first_insert_ns = 0
        return self._answered

    def end_turn(self) -> None:
        """After every turn, once every driver's answers left: the core's timers (at most
        every MIN_TICK_NS), its batched forwards and subscription pushes, the disk batch
        (every DISK_FLUSH_NS), and the next wake-up."""
        if self.closed:
            return
        core, rt = self.core, self.rt
        now = rt.now()
        if now >= self._next_tick:
            core.tick(now)
            self._next_tick = now + MIN_TICK_NS
        core.flush(now)
        self._perform(core.ready())
        if self._rate_reports:
            reports, self._rate_reports = self._rate_reports, []
            self.frames.sent(f.Rate, self.links.report_rates(reports, self.mms_leader, self.key))
        disk = self.disk
        if disk is not None:
            # An answer waiting for the disk does not wait for the batch interval too.
            if (self._disk_buf or disk.error is not None) and now >= self._disk_retry_at \
                    and (now - self._last_disk_ns >= DISK_FLUSH_NS or self._durable):
                self._flush_disk(now)
        else:
            self._disk_buf.clear()
        if (self._durable and not self._disk_buf and self.disk_fault is None and now >= self._disk_retry_at
                and self._synced(now)):
            durable, self._durable = self._durable, []
            self._send(durable)
        self._schedule(now)
        self._answered = False  # what this turn end sent to clients is not the next turn's

    def _synced(self, now: int) -> bool:
        """Everything written so far is on stable storage (a durable answer says so,
        whatever the fsync policy); False when the sync failed: the answers wait, and the
        sync is tried again after DISK_RETRY_NS (the failure handler resends what it has
        no answer to)."""
        disk = self.disk
        if disk is None:
            return True
        try:
            disk.sync()
        except OSError as exc:
            self.trouble_log("cannot sync the segment files for a durable answer", exc)
            self._disk_retry_at = now + DISK_RETRY_NS
            return False
        return True

    def _take_ordered(self, now: int) -> None:
        """The turn's input is read: the core takes the inserts, notices and epochs it
        held, in stamp order, and the ACKs leave before the turn's forwards and
        bookkeeping."""
        self.core.end_input(now, self._contain_ordered)
        self._perform(self.core.ready())

    def _contain_ordered(self, take: Callable[[bytes, Ordered, int], None], route: bytes, msg: Ordered,
                         now: int) -> None:
        self.guard.call("its ROUTER", take, route, msg, now, reply=self._ordered_failed)

    def _ordered_failed(self, exc: Exception, route: bytes, msg: Ordered, now: int) -> None:
        if type(msg) is f.Insert:  # a NOTICE or an epoch is answered by nothing
            self.router.send_to(route, f.error_frame(msg.req_id, f.E_INTERNAL,
                                                     f"{type(exc).__name__} while handling the request"))

    def _schedule(self, now: int) -> None:
        deadline = self.core.next_deadline(now)
        t = None if deadline is None else max(deadline, self._next_tick)
        if self.disk is not None and (self._disk_buf or self.disk.error is not None):
            d = max(self._last_disk_ns + DISK_FLUSH_NS, self._disk_retry_at)
            t = d if t is None else min(t, d)
        armed = self._wakeup_at
        if t is None or (armed is not None and armed <= t):
            # A wake-up at or before the one needed is kept: it costs one early turn
            # (which schedules again), where moving it would cost a cancelled timer in
            # the runtime's heap every turn (most deadlines move later with every
            # message: the peer was heard, a forward went out).
            return
        if self._wakeup is not None:
            self._wakeup.cancel()
        self._wakeup_at = t
        self._wakeup = self.rt.call_at(t, self._on_wakeup)

    def _on_wakeup(self) -> None:
        self._wakeup = self._wakeup_at = None  # the turn that follows does the work

    # -- effects ----------------------------------------------------------------------------------
    def _send(self, messages: Messages) -> None:
        encode = f.encode
        router, sent = self.router, self.frames.sent
        for dest, msg in messages:
            if type(dest) is bytes:
                router.send_to(dest, encode(msg) if type(msg) is not f.Forward else to_backup(msg))
                self._answered = True
                sent(type(msg))
            elif dest is Peer.MMS:
                assert type(msg) is f.Rate
                self._rate_reports.extend(msg.reports)  # one RATE frame at the turn's end
            elif type(dest) is ShardReplicas:
                self.notices.add(dest, msg)  # one copy per process, once all its shards are known
            else:
                peers = self.links.endpoints_for(dest)
                frame = f.seal(self.key, encode(msg) if dest is not Peer.PRIMARY
                               else to_primary(msg, self.links.primary_fences))
                for ep in peers:
                    ep.send(frame)
                sent(type(msg), len(peers))
        self.notices.flush()

    def _perform(self, ready: Ready) -> None:
        while True:
            self._send(ready.messages)
            if ready.persist:
                self._disk_buf.extend(ready.persist)
            if ready.durable:
                self._durable.extend(ready.durable)
                del self._durable[:-MAX_DURABLE_WAITING]
            if not ready.coordinate:
                return
            for req in ready.coordinate:
                assert isinstance(req, ReadHistory)
                try:
                    history = self.coord.membership_history()
                except CoordinationUnavailable as exc:
                    # The core still waits for it and asks again at the next broadcast.
                    self.trouble_log("cannot read the membership history now", exc)
                    continue
                self.core.on_history(history_ranges(history, req.first, req.last), self.rt.now())
            ready = self.core.ready()

    def _flush_disk(self, now: int) -> None:
        """Write the buffered batch. A write that fails is a state, not a crash: the batch
        stays buffered (everything in it is also in memory, and on the peers), the core
        takes no new records, and the write is tried again every DISK_RETRY_NS until it
        goes through (a trim freed segments, or the operator freed space)."""
        disk = self.disk
        assert disk is not None
        core = self.core
        # Whole segment files below that point can go (every segment opens with a
        # snapshot, so recovery never needs an older one); first, as it may be what
        # gives the write its space.
        cut = core.deletable_below
        if cut > self._dropped_below:
            try:
                disk.drop_below(cut)
                self._dropped_below = cut
            except OSError as exc:
                self.trouble_log("could not delete old segments", exc)
        self._disk_buf.extend(core.flush_marks())
        try:
            disk.append(self._disk_buf, core.snapshot())
        except OSError as exc:
            self._last_disk_ns = now
            self._disk_retry_at = now + DISK_RETRY_NS
            fault = f"{errno.errorcode.get(exc.errno or 0, 'EIO')}: {exc.strerror or exc}"
            if self.disk_fault is None:
                self.log.error("cannot write the segment files (%s): taking no new records, serving what we hold, "
                          "%d events buffered; trying again every %d ms", fault, len(self._disk_buf),
                          DISK_RETRY_NS // 1_000_000)
                core.on_disk(fault, now)
            else:
                self.trouble_log("still cannot write the segment files", f"{fault}; {len(self._disk_buf)} events buffered")
            self.disk_fault = fault
            return
        self._disk_buf = []
        self._last_disk_ns = now
        if self.disk_fault is not None:
            self.log.warning("segment files writable again (%s before): taking new records", self.disk_fault)
            self.disk_fault = None
            core.on_disk(None, now)

    # -- metrics ----------------------------------------------------------------------------------
    def metrics(self) -> list[Metric]:
        """Prometheus families (:mod:`ziplog.server.replica_metrics`), at scrape time."""
        return replica_metrics(self)

    @property
    def buffered_events(self) -> int:
        """Decided-stream events waiting to be written."""
        return len(self._disk_buf)

    def stop_requested(self) -> None:
        """The process was asked to stop (SIGTERM, SIGINT): :meth:`close` may vouch for
        what it writes. Not called when the loop ends by a failure."""
        self.stopping_on_request = True

    def close(self) -> None:
        """Write what is buffered and let go of every endpoint (not the runtime's own).

        On a requested stop a primary that holds every record any replica acknowledged
        also vouches, once all of it is written, that its segments are all it decided
        (the clean-close marker): its next incarnation then need not take a backup's
        guesses above its frontier for records it lost, and serves again without a
        failure recovery."""
        if self.closed:
            return
        self.closed = True
        if self.disk is not None:
            self._disk_buf.extend(self.core.ready().persist)
            self._flush_disk(self.rt.now())
            clean = None
            if self.disk_fault is not None:
                self.log.error("stopping with %d events not written (%s): the next start replays less than this "
                          "replica held; only a peer that is up still holds the rest", len(self._disk_buf),
                          self.disk_fault)
            elif self.stopping_on_request and not self._disk_buf:
                clean = self.core.clean_close_frontier()
            try:
                self.disk.close(clean_frontier=clean)
            except OSError as exc:
                self.log.error("closing the segment files: %s", exc)
        self.router.close()
        self.links.close()
        if self._wakeup is not None:
            self._wakeup.cancel()


