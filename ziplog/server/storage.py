"""Storage server: replicas of shards, each a thin driver over :class:`ReplicaCore`.

    python -m ziplog.server --zk HOSTS --shard S --replica R [--replicas N] [--data-dir D]
    python -m ziplog.server --zk HOSTS --serve S:R[,S:R...] [--replicas N] [--data-dir D]

A process serves one replica, or (``--serve``) replicas of several shards on one loop:
a machine that hosts more replicas than it has CPUs runs one process per CPU, so that
one wake-up serves every shard's messages that arrived together, instead of one
process per replica each paying its own wake-ups and turns (see :func:`hosted_replicas`).

:class:`StorageDriver` moves frames between the ports and the core and performs the
core's effects; it runs unchanged in production (pyzmq, segment files, kazoo) and in
the simulation (``tests/sim``). Endpoints:

* ROUTER (bound): clients, the failure handler, and the backups' HELLO/PREFIX when
  this is the primary
* DEALER -> the primary's ROUTER (backups only): HELLO, PREFIX out; FORWARD in
* SUB -> every MMS replica's PUB: epoch broadcasts
* PUSH -> every MMS replica's PULL: rate reports (only the leader uses them)
* PUSH -> every failure handler replica's PULL: suspicions (only the leader acts)
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ziplog.cores.effects import Messages, Peer, ReadHistory, Ready, ShardReplicas
from ziplog.cores.replica import ReplicaCore, ReplicaSettings
from ziplog.cores.replica.core import Ordered
from ziplog.cores.replica.parking import Parked
from ziplog.cores.replica.primary import PrimaryState
from ziplog.cores.replica.recovery import RecoveryPhase
from ziplog.shell.inbound import InboundGuard
from ziplog.shell.metrics import Durations, add_metrics_arguments, counter, counters, directory_bytes, gauge, \
    histogram, histograms, one_of, serve_metrics
from ziplog.shell.throttled_log import ThrottledLog
from ziplog.io.ports import (
    CoordinationUnavailable,
    Disk,
    Endpoint,
    Network,
    Runtime,
    StorageCoordination,
    wall_offset_ns,
)
from ziplog.io.segments import SEGMENT_BYTES, SegmentLog, replica_dir
from ziplog.protocol import frames as f
from ziplog.protocol.addresses import advertised
from ziplog.protocol.auth import ClusterKey
from ziplog.protocol.events import DiskEvent
from ziplog.protocol.gsna import EpochConfig, epoch_of
from ziplog.protocol.membership import history_ranges
from ziplog.shell.config import parse_args
from ziplog.shell.logs import add_log_arguments, configure_logging
from ziplog.server.takeover import TakeOverRefused, take_over
from ziplog.shell.process import (
    add_address_arguments,
    add_cluster_key_argument,
    check_address_arguments,
    load_cluster_key,
    serve_forever,
)

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
#: ``--poll-us``'s default: off (see ziplog.io.zmq_runtime; 200 is haltpoll's default
#: guest_halt_poll_ns, longer than the gap between one closed-loop client's inserts)
DEFAULT_POLL_US = 0
#: ``--malloc-trim-mb``'s default: glibc's malloc keeps up to this much freed memory at
#: the top of its heap (see retain_freed_memory)
DEFAULT_MALLOC_TRIM_MB = 64
#: allocations up to this size come from malloc's heap, not from mappings of their own
#: (glibc's largest allowed on 64 bits)
MALLOC_MMAP_THRESHOLD = 32 << 20
#: mallopt's parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: ``ziplog_replica_insert_turn_seconds``'s buckets: a turn's inserts take tens of
#: microseconds, a stalled turn milliseconds
INSERT_TURN_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)
#: Requests that carry a recovery generation.
RECOVERY_REQUESTS = frozenset((f.Probe, f.Acquired, f.Fetch, f.Install, f.Resume))


def replica_logger(shard: int, replica: int) -> logging.Logger:
    """The logger of one replica's driver: a child of this module's, so the process's
    handler formats it, and its name says which replica a line is about."""
    return logging.getLogger(f"{log.name}.{shard}.{replica}")


class StorageDriver:
    def __init__(self, settings: ReplicaSettings, rt: Runtime, net: Network, coord: StorageCoordination,
                 disk: Disk | None, key: ClusterKey, host: str = "127.0.0.1", port: int = 0,
                 advertise: str | None = None) -> None:
        self.settings = settings
        #: this replica's logger (``ziplog.server.<shard>.<replica>``, named in every line):
        #: a process may serve replicas of several shards
        self.log = replica_logger(settings.shard, settings.replica)
        #: seals what this replica tells its peers and the control plane, and opens what
        #: they tell it
        self.key = key
        #: the highest recovery generation seen committed in ZooKeeper for this shard
        self.committed_gen = -1
        self.rt = rt
        self.net = net
        self.coord = coord
        self.disk = disk
        self.core = ReplicaCore(settings)
        self.core.driver_stats["inbound_failures"] = 0
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
        self.primary: Endpoint | None = None
        self.primary_addr: str | None = None
        #: the ZooKeeper session that registered the primary we are linked to
        self.primary_owner: int | None = None
        self.epochs: Endpoint | None = None  # one SUB on every MMS replica's PUB
        self.epoch_pubs: set[str] = set()
        self.mms_pushes: dict[str, Endpoint] = {}
        self.fh_pushes: dict[str, Endpoint] = {}
        #: a primary's connections to the other shards' replicas (its NOTICEs): (shard,
        #: replica) -> (address, endpoint); made on the first notice to the shard
        self.peer_replicas: dict[tuple[int, int], tuple[str, Endpoint]] = {}
        self._disk_buf: list[DiskEvent] = []
        #: messages that leave once everything persisted before them is written
        self._durable: Messages = []
        self._last_disk_ns = rt.now()
        #: why the last write failed (None: writing works); the batch stays buffered
        self.disk_fault: str | None = None
        self._disk_retry_at = 0
        self.trouble_log = ThrottledLog(self.log, rt)
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
        self.coord.register_replica(s.shard, s.replica, s.replicas, self.addr)
        self.log.info("shard %d replica %d serving on %s", s.shard, s.replica, self.addr)

    def on_topology(self) -> None:
        """Something moved in ZooKeeper: connect to new control-plane replicas, and (a
        backup) to the primary's new address."""
        if self.closed:
            return
        topo = self.coord.topology
        net = self.net
        for pub in topo.mms_pubs():
            if pub not in self.epoch_pubs:
                self.epoch_pubs.add(pub)
                if self.epochs is None:
                    self.epochs = net.subscriber(pub, self.guard.frames("the epoch broadcast", self.on_epoch_frame),
                                                 max_bytes=f.EPOCH_FRAME_LIMIT)
                else:
                    self.epochs.connect(pub)
        for pull in topo.mms_pulls():
            if pull not in self.mms_pushes:
                self.mms_pushes[pull] = net.pusher(pull)
        for pull in topo.fh_pulls():
            if pull not in self.fh_pushes:
                self.fh_pushes[pull] = net.pusher(pull)
        if not self.settings.is_primary:
            shard = self.settings.shard
            addr = topo.replicas.get(shard, {}).get(0)
            owner = topo.replica_owners.get(shard, {}).get(0)
            # A new address, or another incarnation at the same one (a primary restarted
            # on a fixed port: our old connection would carry on to it, and the restarted
            # primary, waiting for every backup's HELLO, would never hear ours).
            if addr and (addr != self.primary_addr or owner != self.primary_owner):
                if self.primary is not None:
                    self.primary.close()
                self.primary = net.dealer(addr, self.guard.frames("the primary's link", self.on_primary_frame),
                                          "primary", max_bytes=f.forward_limit(self.settings.forward_batch_bytes,
                                                                               self.settings.max_record_bytes))
                self.primary_addr = addr
                self.primary_owner = owner
                self.core.connect_primary(self.rt.now())
                self._perform(self.core.ready())

    # -- input ------------------------------------------------------------------------------------
    def on_request(self, route: bytes, frame: bytes) -> None:
        core = self.core
        try:
            msg = f.decode_request(frame)
            if type(msg) is f.Signed:  # a cluster member's: a peer or the failure handler
                msg = f.open_envelope(self.key, msg, f.decode_member_request)
                if type(msg) in RECOVERY_REQUESTS:
                    self._check_generation(msg)
        except f.ProtocolError as exc:
            self.refused_frames[exc.code] = self.refused_frames.get(exc.code, 0) + 1
            core.error(route, exc.req_id, exc.code, exc.message)
        else:
            now = self.rt.now()
            if type(msg) is f.Insert and not self._turn_first_insert_ns:
                self._turn_first_insert_ns = now
            core.on_request(route, msg, now)
        # Replies leave now (an INSERT's at the turn's end: the core holds inserts until
        # the turn's input is read), before forwards and bookkeeping.
        self._perform(core.ready())

    def _check_generation(self, msg: f.Probe | f.Acquired | f.Fetch | f.Install | f.Resume) -> None:
        """A recovery step counts only under a generation the failure handler committed
        in ZooKeeper (it writes the record before it sends anything): a generation from
        nowhere would freeze the shard under an authority that does not exist. Read once
        per new generation."""
        if msg.gen <= self.committed_gen:
            return
        try:
            committed = self.coord.recovery_generation(self.settings.shard)
        except CoordinationUnavailable as exc:  # the handler asks again
            raise f.ProtocolError(f.E_UNCOMMITTED, f"cannot check generation {msg.gen} now: {exc}", msg.req_id) from None
        self.committed_gen = max(self.committed_gen, committed)
        if msg.gen > self.committed_gen:
            raise f.ProtocolError(f.E_UNCOMMITTED, f"recovery generation {msg.gen} is not committed "
                                  f"(ZooKeeper holds {self.committed_gen})", msg.req_id)

    def _peer_replicas(self, shard: int) -> list[Endpoint]:
        """The connections to ``shard``'s replicas at the addresses ZooKeeper holds now
        (a replica it has none for is skipped: its notice is dropped, and the epoch's
        close is the backstop)."""
        addrs = self.coord.topology.replicas.get(shard, {})
        peers = self.peer_replicas
        out: list[Endpoint] = []
        for replica in range(self.coord.topology.replica_counts.get(shard, len(addrs))):
            addr = addrs.get(replica)
            cur = peers.get((shard, replica))
            if cur is not None and cur[0] == addr:
                out.append(cur[1])
                continue
            if cur is not None:
                cur[1].close()
                del peers[(shard, replica)]
            if addr is None:
                continue
            ep = self.net.dealer(addr, self.guard.frames("a peer replica's link", self._on_peer_replica_frame),
                                 "notice", max_bytes=f.CONTROL_FRAME_LIMIT)
            peers[(shard, replica)] = (addr, ep)
            out.append(ep)
        return out

    def _on_peer_replica_frame(self, frame: bytes) -> None:
        """Nothing is answered to a NOTICE but a refusal: worth a line, not an action."""
        try:
            msg = f.decode_reply(frame)
        except f.ProtocolError as exc:
            msg = exc  # type: ignore[assignment]
        self.trouble_log("a peer replica answered a notice", msg)

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
        if type(msg) is f.Forward:
            self.core.on_forward(msg, self.rt.now())
            self._perform(self.core.ready())
        else:
            assert isinstance(msg, f.Error)
            self.log.error("primary refused us: %s %s", msg.code, msg.message)

    def on_epoch_frame(self, frame: bytes) -> None:
        try:
            msg = f.decode_epoch(frame)
            cfg = EpochConfig(msg.epoch, tuple(msg.shards), tuple(msg.rates))
        except (f.ProtocolError, ValueError) as exc:
            self.trouble_log("bad epoch broadcast dropped", exc)
            return
        self.core.hold_epoch(cfg, self.rt.now())  # the turn's end takes it

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
        core, guard = self.core, self.guard
        for route, msg in core.take_ordered():
            guard.call("its ROUTER", core.on_ordered, route, msg, now, reply=self._ordered_failed)
        self._perform(core.ready())

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
        router = self.router
        for dest, msg in messages:
            if type(dest) is bytes:
                router.send_to(dest, encode(msg))
                self._answered = True
            elif dest is Peer.PRIMARY:
                if self.primary is not None:
                    self.primary.send(f.seal(self.key, encode(msg)))
            elif type(dest) is ShardReplicas:
                frame = f.seal(self.key, encode(msg))
                for ep in self._peer_replicas(dest.shard):
                    ep.send(frame)
            else:
                frame = f.seal(self.key, encode(msg))
                for ep in (self.mms_pushes if dest is Peer.MMS else self.fh_pushes).values():
                    ep.send(frame)

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
        """Prometheus families from the counters and state the core and this driver keep;
        called at scrape time from the metrics server's thread (plain reads: no lock)."""
        core, log_ = self.core, self.core.log
        s = self.settings
        lb = {"shard": str(s.shard), "replica": str(s.replica)}
        stats = dict(core.stats)
        role = core.role
        stable, frontier = log_.stable, log_.frontier
        servable = log_.servable
        subs = list(core.fanout.subs.values())
        lag = max((max(servable - sub.progress_sent, 0) for sub in subs), default=0)
        state = getattr(role, "state", None)
        out: list[Metric] = [
            gauge("ziplog_replica_primary", "1 on the shard's primary (replica 0), 0 on a backup", int(s.is_primary), lb),
            one_of("ziplog_replica_primary_state", "the primary's state (1 for the current one; a backup shows none)",
                   "state", [st.value for st in PrimaryState], state.value if state is not None else None, lb),
            gauge("ziplog_replica_blocked", "1 while this primary refuses every insert until a recovery (it lost "
                  "state a backup holds)", int(core.blocked is not None), lb),
            gauge("ziplog_replica_backups_connected", "backups whose HELLO this primary holds",
                  len(getattr(role, "backup_routes", ())), lb),
            counter("ziplog_replica_inserts", "new inserts this replica took (a duplicate or refused-before-the-role "
                    "insert excluded; a parked insert resent counts again)", stats["inserts"], lb),
            counter("ziplog_replica_fast_acks", "backup: inserts answered with this replica's own guess (the fast "
                    "path's ACK; a guess the primary decided otherwise is also counted in reacks)",
                    stats["fast_acks"], lb),
            counter("ziplog_replica_reacks", "backup: inserts re-acknowledged with the primary's decided gsn because "
                    "this replica's first answer (a guess or NO_GUESS) differed: each is a slow-path insert",
                    stats["reacks"], lb),
            counter("ziplog_replica_confirmed_guesses", "backup: guesses the primary decided the same (each is a "
                    "fast-path insert of a client that waited for this replica): confirmed_guesses + reacks counts "
                    "the inserts this backup answered", stats["confirmed_guesses"], lb),
            counters("ziplog_replica_wrong_guesses", "backup: guesses the primary decided at another gsn, by why: "
                     "epoch (the replicas switched epochs at different moments), ahead or behind (a slot above or "
                     "below the primary's in the same epoch)", "kind",
                     {k: stats[f"wrong_guesses_{k}"] for k in ("epoch", "ahead", "behind")}, lb),
            counter("ziplog_replica_guesses_displaced", "backup: guesses dropped because the primary decided another "
                    "record at their gsn", stats["guesses_displaced"], lb),
            counter("ziplog_replica_reads", "reads and ranges served", stats["reads"], lb),
            counter("ziplog_replica_errors", "error replies sent (every refusal, whatever its code)", stats["errors"], lb),
            counters("ziplog_replica_refused_frames", "requests refused by the driver before the core saw them, by "
                     "error code (undecodable, badly signed, an uncommitted recovery generation)", "code",
                     dict(self.refused_frames), lb),
            counters("ziplog_replica_errors_by_code", "error replies the core sent, by code (NOT_READY, TIMEOUT, "
                     "DISK_FULL, TRIMMED, ...)", "code", dict(core.errors_by_code), lb),
            counter("ziplog_replica_inbound_failures", "inbound messages whose handling failed (contained; see the "
                    "log)", core.driver_stats.get("inbound_failures", 0), lb),
            counter("ziplog_replica_passed_on_notice", "primary: slots passed as no-ops on a NOTICE",
                    stats.get("passed_on_notice", 0), lb),
            gauge("ziplog_replica_records", "decided records held (not trimmed)", len(log_.gsns), lb),
            gauge("ziplog_replica_frontier_gsn", "every slot of this shard up to this gsn is decided here", frontier, lb),
            gauge("ziplog_replica_stable_gsn", "every replica of the shard holds the log up to this gsn", stable, lb),
            gauge("ziplog_replica_stable_lag_gsns", "frontier minus stable, in gsns (an epoch spans 2^32 gsns: "
                  "within one epoch, slots)", max(frontier - stable, 0), lb),
            gauge("ziplog_replica_stable_lag_epochs", "epochs between the stable point and the frontier",
                  max(epoch_of(frontier) - epoch_of(stable), 0), lb),
            gauge("ziplog_replica_trim_gsn", "records below this gsn are trimmed", log_.trim_point, lb),
            gauge("ziplog_replica_epoch", "the last epoch of the decided stream", log_.last_epoch, lb),
            gauge("ziplog_replica_epoch_records", "primary: records assigned in the current epoch (the count its "
                  "RATE report carries at the epoch's close)", getattr(role, "epoch_count", 0), lb),
            gauge("ziplog_replica_subscriptions", "subscriptions open", len(subs), lb),
            gauge("ziplog_replica_subscription_lag_gsns", "the largest gap between what subscribers may be shown and "
                  "the position last reported to them, in gsns", lag, lb),
            gauge("ziplog_replica_parked", "requests waiting for an epoch or a position", len(core.parking), lb),
            histograms("ziplog_replica_parked_wait_seconds", "parked requests only: seconds from a request's arrival "
                       "to its release (an insert: its epoch began, and it is decided in that turn unless it must wait "
                       "again or is refused; a read: its gsn was decided, and it is answered). Requests answered at "
                       "once, and those that time out, are not in it", "kind", self.park_waits, lb),
            histogram("ziplog_replica_insert_turn_seconds", "the server's share of an insert's latency: seconds from "
                      "the first INSERT a loop turn read to its ACKs leaving (one sample per turn with inserts; a "
                      "parked insert's ACK leaves later: ziplog_replica_parked_wait_seconds)", self.insert_turns, lb),
            gauge("ziplog_replica_qualified", "1 once this replica is synchronised with the primary (a backup "
                  "guesses only then)", int(core.qualified), lb),
            one_of("ziplog_replica_recovery_phase", "this replica's part in a failure recovery (1 for the current "
                   "phase)", "phase", [ph.value for ph in RecoveryPhase], core.recovery.phase.value, lb),
            gauge("ziplog_replica_recovery_generation", "the highest recovery generation the failure handler named "
                  "here (-1: none)", core.recovery.gen, lb),
            gauge("ziplog_replica_suspicions", "peers this replica reported to the failure handler as silent",
                  core.liveness.suspicions, lb),
            gauge("ziplog_replica_disk_full", "1 while the segment files cannot be written (DISK_FULL: no new "
                  "records taken)", int(self.disk_fault is not None), lb),
            gauge("ziplog_replica_disk_buffered_events", "decided-stream events waiting to be written",
                  len(self._disk_buf), lb),
        ]
        directory = getattr(self.disk, "dir", None)
        if isinstance(directory, Path):
            out.append(gauge("ziplog_replica_disk_bytes", "bytes of this replica's segment directory",
                             directory_bytes(directory), lb))
        return out

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
        for ep in [self.router, self.primary, self.epochs, *self.mms_pushes.values(),
                   *self.fh_pushes.values(), *(ep for _, ep in self.peer_replicas.values())]:
            if ep is not None:
                ep.close()
        if self._wakeup is not None:
            self._wakeup.cancel()


def set_scheduling(policy: str) -> None:
    """Run this process under SCHED_BATCH (``batch``) or leave it as it is (``normal``).

    Why: a client sends an INSERT to every replica of a shard, one ``send`` after the
    other. Under SCHED_OTHER the replica the first ``send`` wakes may preempt the client
    on its CPU when the other CPUs are busy (the previous insert's forwards, the
    control plane): the client's second copy then leaves only after the first replica's
    whole turn, and the replicas work one after the other instead of side by side. A
    SCHED_BATCH task never preempts on wake-up (it runs when a CPU is free or at the
    next tick) and otherwise gets the same share of the CPU as a SCHED_OTHER task of
    its nice level. Measured on a 2-core machine, one pinned client, the servers' policy
    switched every 800 inserts: the block's p50 lower in 9 of 12 pairs, by about 5 %.
    Policy needs no privilege to set; where the platform has none, this does nothing."""
    if policy != "batch" or not hasattr(os, "SCHED_BATCH"):
        return
    for tid in _own_threads():
        try:
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        except OSError as exc:
            log.warning("could not run thread %d under SCHED_BATCH (%s): its scheduling left as it is", tid, exc)


def retain_freed_memory(trim_mb: int) -> bool:
    """Let glibc's malloc keep what this process frees, up to ``trim_mb`` MiB at the top
    of its heap, and serve allocations up to MALLOC_MMAP_THRESHOLD from the heap instead
    of mapping each afresh (0: leave glibc's own, adaptive thresholds). True when set;
    where the C library is not glibc, this does nothing.

    Why: a loaded replica's every turn allocates, and frees, buffers of 100 KiB and more
    (a FORWARD of the turn's records and its ZMTP frame; the 5 ms disk batch). By default
    glibc maps such a buffer for itself and unmaps it when freed, or trims its heap
    beneath it, so the next turn's buffer is fresh memory, faulted in page by page. A
    replica under the pipelined load of ``bench throughput`` took 2.1 page faults per
    append, 1.1 with this (about one is the log's own growth: each 4 KiB record is kept),
    and 20-25 % less CPU per append; the one-shard rate went up as much."""
    if trim_mb <= 0:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_mb << 20))


def _own_threads() -> list[int]:
    """Every thread of this process (a library may have started some at import:
    numpy's BLAS pool; threads started later inherit what is set on these), or [0]
    (the calling thread) where /proc does not say."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def parse_cpu_list(spec: str) -> set[int]:
    """``taskset -c``'s CPU list: numbers and ranges, comma-separated ("0", "0,2-3")."""
    cpus: set[int] = set()
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            lo, hi = int(first), int(last if dash else first)
        except ValueError:
            raise ValueError(f"not a CPU list: {spec!r}") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"not a CPU list: {spec!r}")
        cpus.update(range(lo, hi + 1))
    return cpus


def runtime_metrics(rt: Any) -> list[Metric]:
    """The process's loop: how often it gave its CPU away after answering, and what
    polling before sleeping costs and finds."""
    return [
        counter("ziplog_server_yields", "turns after which the loop gave its CPU away once their answers had left "
                "(--yield-after-answers)", rt.yields),
        counter("ziplog_server_yields_long", "yields after answering that kept the loop away over 200 us (other "
                "processes wanted the CPU): each pauses yielding for 20 times as long", rt.yields_long),
        counter("ziplog_server_poll_seconds", "time the loop spent polling before sleeping (--poll-us)",
                rt.polled_ns / 1e9),
        counter("ziplog_server_polls_found", "polls before sleeping that found input before their limit",
                rt.polls_found),
        counter("ziplog_server_polls_cut", "polls before sleeping cut short because other tasks wanted a CPU",
                rt.polls_cut),
        gauge("ziplog_server_poll_limit_seconds", "how long the loop polls before it sleeps next (adapts; 0: it "
              "sleeps at once)", rt.poll_limit_ns / 1e9),
    ]


def _cpu_list_argument(spec: str) -> set[int]:
    try:
        return parse_cpu_list(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def set_cpus(cpus: set[int] | None) -> None:
    """Keep every thread of this process on ``cpus`` (None: anywhere).

    Why: on a machine that runs several replicas of a shard beside their clients (the
    local cluster, a test bed), the scheduler often wakes a backup on the CPU its
    primary just used: the two replicas of one insert then run one after the other,
    and both move between CPUs with cold caches. A replica kept on a CPU of its own
    works beside its peer. Measured on a 2-core machine, one pinned client, the two
    replicas' affinity switched every 800 inserts between one CPU each and both: the
    block's p50 lower in 12 of 12 pairs, by about 20 %."""
    if cpus is None:
        return
    for tid in _own_threads():
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError as exc:
            log.warning("could not keep thread %d on CPUs %s (%s): it runs anywhere", tid, sorted(cpus), exc)


def parse_hosted(spec: str) -> list[tuple[int, int]]:
    """``--serve``'s list: ``SHARD:REPLICA`` pairs, comma-separated (``0:0,1:1``)."""
    out: list[tuple[int, int]] = []
    for part in spec.split(","):
        shard, colon, replica = part.strip().partition(":")
        try:
            pair = (int(shard), int(replica))
        except ValueError:
            raise ValueError(f"not SHARD:REPLICA pairs: {spec!r}") from None
        if not colon or pair[0] < 0 or pair[1] < 0:
            raise ValueError(f"not SHARD:REPLICA pairs: {spec!r}")
        out.append(pair)
    return out


def _hosted_argument(spec: str) -> list[tuple[int, int]]:
    try:
        return parse_hosted(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def hosted_replicas(shard: int | None, replica: int | None, serve: list[tuple[int, int]] | None,
                    replicas: int) -> list[tuple[int, int]]:
    """The (shard, replica) pairs one process serves, from ``--shard``/``--replica`` or
    ``--serve`` (ValueError: why not).

    Two replicas of one shard are refused: one process's end would take both, which
    replication across f+1 failure domains exists to prevent. Replicas of different
    shards in one process share its fate as replicas on one machine do: the failure
    handler recovers each shard, which lost one replica."""
    if serve is not None and (shard is not None or replica is not None):
        raise ValueError("give --serve or --shard/--replica, not both")
    if serve is None:
        if shard is None or replica is None:
            raise ValueError("give --shard and --replica (or --serve SHARD:REPLICA,...)")
        serve = [(shard, replica)]
    if not serve:
        raise ValueError("--serve names no replica")
    shards = [s for s, _ in serve]
    if len(set(shards)) != len(shards):
        raise ValueError(f"--serve names two replicas of one shard ({serve}): one process's end would take both")
    for s, r in serve:
        if not 0 <= r < replicas:
            raise ValueError(f"replica {r} of shard {s}: a shard has replicas 0..{replicas - 1} (--replicas)")
    return list(serve)


def main(argv: list[str] | None = None) -> int:
    from ziplog.io import zk
    from ziplog.io.zmq_runtime import ZmqRuntime

    ap = argparse.ArgumentParser(prog="ziplog.server",
                                 description="ziplog storage server (one replica, or replicas of several shards)")
    ap.add_argument("--zk", required=True, help="ZooKeeper hosts, host:port[,host:port...]")
    ap.add_argument("--shard", type=int, default=None)
    ap.add_argument("--replica", type=int, default=None, help="0 is the primary")
    ap.add_argument("--serve", type=_hosted_argument, default=None, metavar="S:R[,S:R...]",
                    help="serve these replicas (of different shards) in this one process, on one loop, each on a "
                         "port of its own (instead of --shard/--replica): one process per CPU on a machine hosting "
                         "more replicas than CPUs")
    ap.add_argument("--replicas", type=int, default=2, help="replicas per shard (f+1)")
    ap.add_argument("--data-dir", type=Path, default=None, help="where segment files live (none: memory only)")
    ap.add_argument("--fsync", choices=["never", "interval", "always"], default="interval",
                    help="when segment writes are fsynced (interval: every --fsync-interval seconds)")
    ap.add_argument("--fsync-interval", type=float, default=1.0)
    ap.add_argument("--segment-bytes", type=int, default=SEGMENT_BYTES,
                    help="a segment file is closed and the next opened past this size (trim deletes whole files)")
    add_address_arguments(ap, port_help="port for clients and peers (0: any free one)")
    ap.add_argument("--noop-timeout-us", type=int, default=0,
                    help="also pass a slot this long after its expected time (0: only on notices and at the epoch's close)")
    ap.add_argument("--notice-interval-us", type=float, default=ReplicaSettings.notice_interval_ns / 1000,
                    help="NOTICEs go out at most this often (a burst's records together)")
    ap.add_argument("--no-notices", action="store_true",
                    help="do not tell other shards' primaries of decided records (they pass slots by clock and epoch)")
    ap.add_argument("--max-record-bytes", type=int, default=1 << 20)
    ap.add_argument("--forward-interval-us", type=int, default=0,
                    help="batch forwarded decisions for up to this long (fewer messages, later stability)")
    ap.add_argument("--prefix-interval-us", type=int, default=None,
                    help="a backup reports what it holds at most this often (0: after every forward; default: "
                         "1000 when it is the shard's only backup, which knows stability without it, else 0)")
    ap.add_argument("--heartbeat-ms", type=float, default=ReplicaSettings.heartbeat_ns / 1e6,
                    help="an idle replica tells its peers it is alive this often")
    ap.add_argument("--suspect-timeout-ms", type=float, default=ReplicaSettings.suspect_timeout_ns / 1e6,
                    help="a peer silent this long is suspected and failure recovery asked for (0: never)")
    ap.add_argument("--transport", choices=["zmq", "native"],
                    default="zmq" if os.environ.get("ZIPLOG_TRANSPORT") == "zmq" else "native",
                    help="serve ZeroMQ's ROUTER and DEALER natively in this process's loop (native: ziplog's ZMTP "
                         "3.1, the default) or with libzmq (zmq); the wire is the same. $ZIPLOG_TRANSPORT=zmq "
                         "switches the default")
    ap.add_argument("--sched", choices=["batch", "normal"], default="batch",
                    help="the process's Linux scheduling policy: batch (the default) lets a client on the same "
                         "machine keep its CPU when its INSERT wakes this replica, so that it sends the other "
                         "replicas' copies at once (the replicas then work in parallel); normal lets the woken "
                         "replica preempt it")
    ap.add_argument("--poll-us", type=int, default=DEFAULT_POLL_US, metavar="US",
                    help="after a turn, poll without blocking (yielding the CPU) for up to this long before sleeping, "
                         "adapting as Linux's haltpoll does: while requests arrive back to back the replica is awake "
                         "when the next one comes (lower latency for few clients; costs CPU, and throughput on a "
                         "machine whose CPUs are busy; 200 is a good value); 0, the default: sleep at once")
    ap.add_argument("--yield-after-answers", action=argparse.BooleanOptionalAction, default=False,
                    help="once a turn's ACKs and other answers have left, give the CPU away (sched_yield) before "
                         "the turn's FORWARDs and bookkeeping, so that a client woken on this CPU reads its answer "
                         "first (lower latency where clients share the replicas' CPUs on a quiet machine; on a busy "
                         "one the FORWARDs wait for other processes, and subscribers with them; off by default)")
    ap.add_argument("--malloc-trim-mb", type=int, default=DEFAULT_MALLOC_TRIM_MB, metavar="MB",
                    help="let glibc's malloc keep up to this much freed memory, and serve buffers up to 32 MiB from "
                         "its heap, so that a loaded replica's per-turn buffers are not page-faulted in afresh every "
                         "turn (0: glibc's own thresholds)")
    ap.add_argument("--cpus", type=_cpu_list_argument, default=None, metavar="LIST",
                    help="keep the process on these CPUs (taskset -c's list: 0 or 0,2-3; default: anywhere); "
                         "the local cluster gives each replica of a shard a CPU of its own")
    ap.add_argument("--take-over", type=int, default=None, metavar="PID",
                    help="replace the storage server PID of this shard and replica on this machine: start up while "
                         "it serves, then stop it (SIGTERM) and take its data directory once it has exited (a "
                         "restart whose gap is the old process's stop, not this one's start)")
    add_cluster_key_argument(ap)
    add_metrics_arguments(ap)
    add_log_arguments(ap)
    args = parse_args(ap, argv, "storage")
    try:
        hosted = hosted_replicas(args.shard, args.replica, args.serve, args.replicas)
    except ValueError as exc:
        ap.error(str(exc))
    check_address_arguments(ap, args, one_port=len(hosted) == 1)
    if len(hosted) > 1 and args.port:
        ap.error("--port names one replica's port: with several (--serve) each listens on a free one")
    if args.poll_us < 0:
        ap.error("--poll-us must be 0 or more")
    if args.malloc_trim_mb < 0:
        ap.error("--malloc-trim-mb must be 0 or more")
    key = load_cluster_key(args.cluster_key_file)
    configure_logging(args, "storage" + "+".join(f"{s}.{r}" for s, r in hosted))
    set_scheduling(args.sched)  # before the process's own threads start: they inherit it
    set_cpus(args.cpus)
    if args.malloc_trim_mb and not retain_freed_memory(args.malloc_trim_mb):
        log.info("this C library has no glibc mallopt: its malloc left as it is")
    rt = ZmqRuntime(native=args.transport == "native", poll_max_ns=args.poll_us * 1000,
                    yield_after_answers=args.yield_after_answers)
    # One ZooKeeper session per replica: each registration lives and ends with its own.
    coords = [zk.StorageCoordination(args.zk, key) for _ in hosted]
    if args.take_over is not None:
        # Everything above ran while the old process served; what follows needs its
        # data directory and its place in ZooKeeper. Every replica served here must be
        # registered by the process taken over.
        registered = [coord.registered_pid(s, r) for coord, (s, r) in zip(coords, hosted)]
        try:
            # the pid ZooKeeper names for every replica served here, or one it names that
            # is not the process to stop (refused)
            take_over(args.take_over, next((pid for pid in registered if pid != args.take_over), args.take_over))
        except TakeOverRefused as exc:
            log.error("not taking over: %s", exc)
            for coord in coords:
                coord.close()
            rt.close()
            return 2
    drivers = [_storage_driver(args, shard, replica, rt, coord, key) for (shard, replica), coord in zip(hosted, coords)]
    for driver in drivers:
        driver.start()
    metrics = serve_metrics(args, lambda: [m for d in drivers for m in d.metrics()] + runtime_metrics(rt))

    def stop_requested() -> None:
        for d in drivers:
            d.stop_requested()

    return serve_forever(rt, metrics, *drivers, *coords, on_stop=stop_requested)


def _storage_driver(args: argparse.Namespace, shard: int, replica: int, rt: Any, coord: StorageCoordination,
                    key: ClusterKey) -> StorageDriver:
    """One hosted replica's driver, from the process's flags."""
    settings = ReplicaSettings(shard=shard, replica=replica, replicas=args.replicas,
                               wall_offset_ns=wall_offset_ns(),
                               max_record_bytes=args.max_record_bytes, noop_timeout_ns=args.noop_timeout_us * 1000,
                               notices=not args.no_notices, notice_interval_ns=int(args.notice_interval_us * 1000),
                               forward_interval_ns=args.forward_interval_us * 1000,
                               prefix_interval_ns=None if args.prefix_interval_us is None else args.prefix_interval_us * 1000,
                               heartbeat_ns=int(args.heartbeat_ms * 1e6), suspect_timeout_ns=int(args.suspect_timeout_ms * 1e6))
    disk = None
    if args.data_dir is not None:
        disk = SegmentLog(replica_dir(args.data_dir, shard, replica), fsync=args.fsync,
                          fsync_interval=args.fsync_interval, segment_bytes=args.segment_bytes)
    return StorageDriver(settings, rt, rt, coord, disk, key, host=args.bind, port=args.port, advertise=args.advertise)


if __name__ == "__main__":
    sys.exit(main())
