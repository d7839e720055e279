"""The simulation's ports: a seeded world with one clock and one event queue, in which
the production drivers run unchanged.

* :class:`SimProcess` is one process incarnation: the ``Runtime`` (clock, timers,
  turn-end hooks) and the ``Network`` (ROUTER, DEALER, PUB/SUB, PUSH/PULL endpoints)
  a driver is given. Every event for a process is one turn; a killed process hears
  nothing more and its bound addresses vanish.
* Frames cross a lossy network: per connection kind (``NetParams``) a seeded delay,
  reordering, duplication and loss; a subscription's connection is one TCP stream (in
  order, nothing lost).
* :class:`SimDisk` keeps what a replica wrote across its incarnations (a model of the
  disk port); the system simulation runs the production segment log instead, on
  ``tests/sim/files.py``'s files that lose what was not synced at a power loss.
* A process may be given a fixed host name: its next incarnation then binds the same
  addresses (a server restarted with ``--port``), and frames its peers' DEALERs queued
  while it was down may reach the new incarnation (ZeroMQ reconnects and sends them).
* :class:`ZooKeeper` models the coordination service: versioned nodes, ephemeral
  registrations owned by sessions that expire a while after their process dies,
  elections, watches that reach each process's view after a delay. The per-process
  adapters implement the drivers' coordination ports on it.

Nothing here decides anything a driver decides: these are the ports and nothing else.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import itertools
import logging
import random
from dataclasses import dataclass
from typing import Any, Callable

from ziplog.cores.effects import CommitBlock
from ziplog.protocol.membership import EpochState
from ziplog.protocol import layout
from ziplog.protocol.auth import ClusterKey
from ziplog.protocol.frames import READS
from ziplog.protocol.events import DiskEvent, SnapshotEvent
from ziplog.protocol.topology import TopologyView

MS = 1_000_000
US = 1_000
S = 1_000_000_000
#: the simulated cluster's key: its processes seal and open authority frames with it
CLUSTER_KEY = ClusterKey(b"the simulated cluster's secret")


@dataclass
class NetParams:
    min_delay: int = 20 * US
    max_delay: int = 200 * US
    reorder: float = 0.1  # chance a message gets an extra delay of up to 5 x max_delay
    duplicate: float = 0.02  # chance a message is delivered twice
    client_loss: float = 0.01  # client <-> replica
    peer_loss: float = 0.002  # primary <-> backup
    epoch_loss: float = 0.01  # an MMS broadcast missed by one replica
    control_loss: float = 0.0  # failure handler <-> replicas, suspicions, rate reports
    notice_loss: float = 0.02  # a primary's NOTICE to another shard's primary


#: connection label -> the NetParams loss field that applies (None: a reliable stream)
LOSS_OF_LABEL = {"replica": "client_loss", "primary": "peer_loss", "handler": "control_loss", "notice": "notice_loss",
                 "subscription": None}


class World:
    def __init__(self, seed: int, net: NetParams, trace: bool = False) -> None:
        self.rng = random.Random(seed)
        self.p = net
        self.now = 0
        self._q: list[tuple[int, int, Callable[..., None], tuple[Any, ...]]] = []
        self._n = itertools.count()
        self.tracing = trace
        self.trace: list[str] = []
        self.bound: dict[str, Any] = {}  # address -> a bound endpoint
        self.routes: dict[bytes, "SimDealer"] = {}
        self.subscribers: dict[str, list["SimSubscriber"]] = {}
        self.fifo_last: dict[Any, int] = {}
        self._route_ids = itertools.count(1)
        #: observers of deliveries: fn(kind, endpoint, frame, route) before a frame reaches
        #: its process; what one returns (a callable) is called right after
        self.taps: list[Callable[[str, Any, bytes, bytes | None], Callable[[], None] | None]] = []
        #: hold-backs: fn(endpoint, frame, route) -> ns to hold a frame back before it
        #: reaches a ROUTER (0: deliver now); a frame is held at most once
        self.holds: list[Callable[[Any, bytes, bytes], int]] = []
        #: queue hold-backs: fn(dealer, frame) -> ns a frame a DEALER sends waits in its
        #: queue before it goes (0: at once), as one does while its connection is down or
        #: slow, and every frame sent after it waits behind it (the queue is in order): it
        #: then reaches whoever is bound at the address by then (a next incarnation at the
        #: same address), unless the DEALER was closed meanwhile
        self.queue_holds: list[Callable[["SimDealer", bytes], int]] = []
        #: delivery hold-backs: fn(dealer, frame) -> ns a frame to a DEALER is held back
        #: before it reaches its process (0: now), on the same connection; held at most once
        self.dealer_holds: list[Callable[["SimDealer", bytes], int]] = []
        #: chance that a frame reaching an address nothing is bound to (its process is
        #: down) waits in its sender's queue and is tried again, as ZeroMQ's DEALER keeps
        #: what it could not send while it reconnects (for up to REQUEUE_FOR_NS)
        self.requeue_unbound = 0.0
        self.requeued = 0
        #: every address ever bound
        self.ever_bound: set[str] = set()
        #: processes cut from their peers (every frame on a backup's link to its primary,
        #: either way, is lost while one end is cut): process -> until when
        self.cut_from_peers: dict["SimProcess", int] = {}
        self.events = 0

    # -- scheduling -------------------------------------------------------------------------------
    def at(self, t: int, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._q, (t, next(self._n), fn, args))

    def step(self) -> bool:
        if not self._q:
            return False
        t, _, fn, args = heapq.heappop(self._q)
        self.now = t
        self.events += 1
        fn(*args)
        return True

    def next_time(self) -> int | None:
        return self._q[0][0] if self._q else None

    def tr(self, text: str) -> None:
        if self.tracing:
            self.trace.append(f"{self.now / MS:10.3f} {text}")

    @contextlib.contextmanager
    def logs_in_trace(self) -> Any:
        """The drivers' log lines go into the trace (when tracing), not to stderr."""
        world = self

        class ToTrace(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                world.tr(f"log {record.name}: {record.getMessage()}")

        handler = ToTrace(logging.INFO)
        loggers = [logging.getLogger(n) for n in ("ziplog", "mms", "failure_handler")]
        saved = [(lg.handlers, lg.propagate, lg.level) for lg in loggers]
        for lg in loggers:
            lg.handlers, lg.propagate = [handler], False
            lg.setLevel(logging.INFO if self.tracing else logging.CRITICAL)
        try:
            yield
        finally:
            for lg, (handlers, propagate, level) in zip(loggers, saved):
                lg.handlers, lg.propagate = handlers, propagate
                lg.setLevel(level)

    # -- transport --------------------------------------------------------------------------------
    def datagram(self, loss: float, deliver: Callable[..., None], *args: Any) -> None:
        """A message on a lossy connection: seeded delay, maybe reordered, duplicated or lost."""
        p = self.p
        rand = self.rng.random
        if loss and rand() < loss:
            return
        copies = 2 if p.duplicate and rand() < p.duplicate else 1
        lo, span = p.min_delay, p.max_delay - p.min_delay + 1
        for _ in range(copies):
            d = lo + int(rand() * span)
            if p.reorder and rand() < p.reorder:
                d += p.max_delay + int(rand() * (4 * p.max_delay + 1))
            self.at(self.now + d, deliver, *args)

    def stream(self, key: Any, deliver: Callable[..., None], *args: Any) -> None:
        """A message on one TCP stream: in order, no loss, no duplicates."""
        p = self.p
        t = max(self.now + p.min_delay + int(self.rng.random() * (p.max_delay - p.min_delay + 1)),
                self.fifo_last.get(key, 0) + 1)
        self.fifo_last[key] = t
        self.at(t, deliver, *args)

    def peer_link_cut(self, a: "SimProcess", b: "SimProcess | None") -> bool:
        cut = self.cut_from_peers
        if not cut:
            return False
        now = self.now
        return cut.get(a, -1) > now or (b is not None and cut.get(b, -1) > now)

    def tap(self, kind: str, endpoint: Any, frame: bytes, route: bytes | None = None) -> list[Callable[[], None]]:
        after = []
        for fn in self.taps:
            post = fn(kind, endpoint, frame, route)
            if post is not None:
                after.append(post)
        return after


#: how long a frame waits in a DEALER's queue for its peer to be back
REQUEUE_FOR_NS = 200 * MS


class _Timer:
    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class SimProcess:
    """One process incarnation: the Runtime and Network ports of its drivers."""

    def __init__(self, world: World, name: str, host: str | None = None) -> None:
        self.world = world
        self.name = name
        #: what its addresses are named after: the incarnation's name, or a fixed host
        #: that every incarnation binds again
        self.host = host or name
        self.alive = True
        self._turn_answers: list[Callable[[], bool]] = []
        self._turn_end: list[Callable[[], None]] = []
        self._endpoints: list[Any] = []
        self._n = itertools.count()
        #: a fault to inject in the middle of the next turn: after its input was handled,
        #: before the turn-end hooks send or write anything of it
        self.doomed: Callable[[], None] | None = None
        #: its loop runs no turn before this (a stall): the turns wait, in order
        self.stalled_until = 0
        #: its other threads (ZooKeeper's: the topology view) stall with it (SIGSTOP),
        #: rather than its loop alone (a loop stuck in a long turn)
        self.threads_stalled = False

    # -- Runtime ----------------------------------------------------------------------------------
    def now(self) -> int:
        return self.world.now

    def run(self, fn: Callable[..., object], *args: Any) -> None:
        """One turn: ``fn``, then the answer hooks and the turn-end hooks (nothing if the
        process died; later, in order, while it is stalled)."""
        if not self.alive:
            return
        if self.world.now < self.stalled_until:
            self.world.at(self.stalled_until, self.run, fn, *args)
            return
        fn(*args)
        if self.doomed is not None:
            doomed, self.doomed = self.doomed, None
            doomed()
        if self.alive:
            for answers in self._turn_answers:
                answers()
            for hook in self._turn_end:
                hook()

    def stall(self, until: int, threads: bool) -> None:
        """Nothing of its loop runs until ``until`` (and, with ``threads``, nothing of its
        other threads either: SIGSTOP); what reaches it meanwhile waits in its sockets."""
        self.stalled_until = max(self.stalled_until, until)
        self.threads_stalled = threads

    def run_in_thread(self, fn: Callable[[], None]) -> None:
        """``fn`` on another of its threads (ZooKeeper's: a topology refresh), which runs
        while its loop is stalled (unless the whole process is); else one of its turns."""
        if self.alive and self.world.now < self.stalled_until and not self.threads_stalled:
            fn()
        else:
            self.run(fn)

    def call_at(self, when_ns: int, fn: Callable[[], None]) -> _Timer:
        h = _Timer()
        self.world.at(max(when_ns, self.world.now), self._fire, h, fn)
        return h

    def _fire(self, h: _Timer, fn: Callable[[], None]) -> None:
        if not h.cancelled:
            h.cancelled = True
            self.run(fn)

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        self.world.at(self.world.now, self.run, fn)

    def at_turn_answers(self, fn: Callable[[], bool]) -> None:
        self._turn_answers.append(fn)

    def at_turn_end(self, fn: Callable[[], None]) -> None:
        self._turn_end.append(fn)

    def kill(self) -> None:
        """SIGKILL: nothing more happens in this process; its addresses are gone."""
        self.alive = False
        for ep in self._endpoints:
            ep.close()

    # -- Network ----------------------------------------------------------------------------------
    def _addr(self, kind: str) -> str:
        return f"sim://{self.host}/{kind}{next(self._n)}"

    def router(self, on_frame: Callable[[bytes, bytes], None], on_multipart: Callable[[bytes, int], None],
               host: str = "", port: int = 0, max_bytes: int = -1) -> "SimRouter":
        r = SimRouter(self, self._addr("router"), self._within(max_bytes, on_frame, "router"))
        self._endpoints.append(r)
        return r

    def dealer(self, addr: str, on_frame: Callable[[bytes], None], label: str = "",
               max_bytes: int = -1) -> "SimDealer":
        d = SimDealer(self, addr, self._within(max_bytes, on_frame, label), label,
                      f"r{next(self.world._route_ids)}".encode())
        self._endpoints.append(d)
        return d

    @staticmethod
    def _within(max_bytes: int, handler: Any, edge: str) -> Any:
        """Every process in the simulation is honest: a frame beyond its edge's limit
        (which libzmq would refuse) is a batch the code failed to bound."""
        if max_bytes < 0:
            return handler

        def check(*args: Any) -> None:
            frame = args[-1]
            assert len(frame) <= max_bytes, (f"a {len(frame)}-byte frame on the {edge} edge, "
                                             f"beyond its {max_bytes}-byte limit")
            handler(*args)
        return check

    def publisher(self, host: str = "") -> "SimPublisher":
        p = SimPublisher(self, self._addr("pub"))
        self._endpoints.append(p)
        return p

    def subscriber(self, addr: str, on_frame: Callable[[bytes], None], max_bytes: int = -1) -> "SimSubscriber":
        s = SimSubscriber(self, addr, self._within(max_bytes, on_frame, "subscriber"))
        self._endpoints.append(s)
        return s

    def puller(self, on_frame: Callable[[bytes], None], host: str = "", paused: bool = False,
               max_bytes: int = -1) -> "SimPuller":
        p = SimPuller(self, self._addr("pull"), self._within(max_bytes, on_frame, "pull"), paused)
        self._endpoints.append(p)
        return p

    def pusher(self, addr: str) -> "SimPusher":
        p = SimPusher(self, addr)
        self._endpoints.append(p)
        return p


class SimRouter:
    def __init__(self, proc: SimProcess, addr: str, on_frame: Callable[[bytes, bytes], None]) -> None:
        self.proc = proc
        self.addr = addr
        self.on_frame = on_frame
        self.closed = False
        proc.world.bound[addr] = self
        proc.world.ever_bound.add(addr)

    def deliver(self, route: bytes, frame: bytes, held: bool = False) -> None:
        world = self.proc.world
        if not held and world.holds:
            for hold in world.holds:
                delay = hold(self, frame, route)
                if delay > 0:
                    world.at(world.now + delay, self.deliver, route, frame, True)
                    return
        if not self.closed:
            after = self.proc.world.tap("router", self, frame, route)
            self.proc.run(self.on_frame, route, frame)
            for fn in after:
                fn()

    def peer_key(self, route: bytes) -> bytes | None:
        return None  # NULL only

    def send_to(self, route: bytes, frame: bytes) -> bool:
        world = self.proc.world
        d = world.routes.get(route)
        if d is None or d.closed or self.closed:
            return False
        loss = LOSS_OF_LABEL.get(d.label, "client_loss")
        if d.label == "primary" and world.peer_link_cut(self.proc, d.proc):
            return True  # lost on a cut link
        if loss is None:
            world.stream((route, "down"), d.deliver, frame)
        else:
            world.datagram(getattr(world.p, loss), d.deliver, frame)
        return True

    def close(self, linger_ms: int = 0) -> None:
        self.closed = True
        if self.proc.world.bound.get(self.addr) is self:
            del self.proc.world.bound[self.addr]


class SimDealer:
    def __init__(self, proc: SimProcess, addr: str, on_frame: Callable[[bytes], None], label: str, route: bytes) -> None:
        self.proc = proc
        self.addr = addr
        self.on_frame = on_frame
        self.label = label
        self.route = route
        self.closed = False
        #: frames sent before this time wait in the queue, in order (a queue hold-back)
        self.queued_until = 0
        proc.world.routes[route] = self

    def send(self, frame: bytes) -> bool:
        if self.closed:
            return False
        world = self.proc.world
        until = self.queued_until
        for hold in world.queue_holds:
            delay = hold(self, frame)
            if delay > 0:
                until = max(until, world.now + delay)
                break
        if until > world.now:  # held, or behind a frame held: the queue goes in order
            self.queued_until = until
            world.at(until, self._unqueue, frame)
            return True
        self._go(frame)
        return True

    def _unqueue(self, frame: bytes) -> None:
        """A frame held in the queue goes now, unless the DEALER was closed (its queue
        dies with it: linger 0)."""
        if not self.closed:
            self._go(frame)

    def _go(self, frame: bytes) -> None:
        world = self.proc.world
        loss = LOSS_OF_LABEL.get(self.label, "client_loss")
        if loss is None:
            world.stream((self.route, "up"), self._arrive, frame)
        else:
            world.datagram(getattr(world.p, loss), self._arrive, frame)

    def _arrive(self, frame: bytes, since: int | None = None) -> None:
        world = self.proc.world
        if since is not None and self.closed:
            return  # requeued while its peer was down, and the DEALER closed since: gone with its queue
        r = world.bound.get(self.addr)
        if isinstance(r, SimRouter):
            if self.label == "primary" and world.peer_link_cut(self.proc, r.proc):
                return  # lost on a cut link
            r.deliver(self.route, frame)
        elif (r is None and not self.closed and self.addr in world.ever_bound and world.requeue_unbound
              and world.now - (since if since is not None else world.now) < REQUEUE_FOR_NS
              and world.rng.random() < world.requeue_unbound):
            world.requeued += 1
            world.at(world.now + world.rng.randint(1, 20) * MS, self._arrive, frame,
                     world.now if since is None else since)

    def deliver(self, frame: bytes, held: bool = False) -> None:
        world = self.proc.world
        if not held and world.dealer_holds and not self.closed:
            for hold in world.dealer_holds:
                delay = hold(self, frame)
                if delay > 0:
                    world.at(world.now + delay, self.deliver, frame, True)
                    return
        if not self.closed:
            world.tap("dealer", self, frame)
            self.proc.run(self.on_frame, frame)

    def connect(self, addr: str) -> None:
        raise NotImplementedError("a DEALER connects to one address")

    def close(self, linger_ms: int = 0) -> None:
        self.closed = True
        self.proc.world.routes.pop(self.route, None)


class SimPublisher:
    def __init__(self, proc: SimProcess, addr: str) -> None:
        self.proc = proc
        self.addr = addr
        self.closed = False
        proc.world.bound[addr] = self

    def send(self, frame: bytes) -> bool:
        if self.closed:
            return False
        world = self.proc.world
        world.tap("publish", self, frame)
        p, rng = world.p, world.rng
        for sub in list(world.subscribers.get(self.addr, ())):
            if p.epoch_loss and rng.random() < p.epoch_loss:
                continue
            world.at(world.now + rng.randint(p.min_delay, p.max_delay), sub.deliver, frame)
        return True

    def connect(self, addr: str) -> None:
        raise NotImplementedError("a PUB is bound, not connected")

    def close(self, linger_ms: int = 0) -> None:
        self.closed = True
        self.proc.world.bound.pop(self.addr, None)


class SimSubscriber:
    def __init__(self, proc: SimProcess, addr: str, on_frame: Callable[[bytes], None]) -> None:
        self.proc = proc
        self.addr = addr
        self.addrs = [addr]
        self.on_frame = on_frame
        self.closed = False
        proc.world.subscribers.setdefault(addr, []).append(self)

    def connect(self, addr: str) -> None:
        self.addrs.append(addr)
        self.proc.world.subscribers.setdefault(addr, []).append(self)

    def deliver(self, frame: bytes) -> None:
        if not self.closed:
            after = self.proc.world.tap("epoch", self, frame)
            self.proc.run(self.on_frame, frame)
            for fn in after:
                fn()

    def send(self, frame: bytes) -> bool:
        return False

    def close(self, linger_ms: int = 0) -> None:
        self.closed = True
        for addr in self.addrs:
            subs = self.proc.world.subscribers.get(addr, [])
            if self in subs:
                subs.remove(self)


class SimPuller:
    def __init__(self, proc: SimProcess, addr: str, on_frame: Callable[[bytes], None], paused: bool = False) -> None:
        self.proc = proc
        self.addr = addr
        self.on_frame = on_frame
        self.closed = False
        self.paused = paused
        proc.world.bound[addr] = self
        proc.world.ever_bound.add(addr)

    def pause(self) -> None:
        self.paused = True

    def resume(self, discard_queued: bool = False) -> None:
        self.paused = False  # (nothing queues while paused: frames are dropped)

    def connect(self, addr: str) -> None:
        raise NotImplementedError("a PULL is bound, not connected")

    def deliver(self, frame: bytes) -> None:
        if not self.closed and not self.paused:
            self.proc.world.tap("pull", self, frame)
            self.proc.run(self.on_frame, frame)

    def send(self, frame: bytes) -> bool:
        return False

    def close(self, linger_ms: int = 0) -> None:
        self.closed = True
        self.proc.world.bound.pop(self.addr, None)


class SimPusher:
    def __init__(self, proc: SimProcess, addr: str) -> None:
        self.proc = proc
        self.addr = addr
        self.closed = False

    def send(self, frame: bytes) -> bool:
        if self.closed:
            return False
        world = self.proc.world
        world.datagram(world.p.control_loss, self._arrive, frame)
        return True

    def _arrive(self, frame: bytes) -> None:
        p = self.proc.world.bound.get(self.addr)
        if isinstance(p, SimPuller):
            p.deliver(frame)

    def connect(self, addr: str) -> None:
        raise NotImplementedError("a PUSH connects to one address")

    def close(self, linger_ms: int = 0) -> None:
        self.closed = True


class SimDisk:
    """A replica's disk: what its incarnations wrote, and how much of it was synced. A
    SIGKILL keeps what was written; a power loss (:meth:`lose_tail`) may lose what was
    written since the last sync; a graceful stop syncs all of it, and leaves the
    clean-close marker it may write."""

    def __init__(self) -> None:
        self.written: list[DiskEvent] = []
        #: how many of ``written`` are on stable storage
        self.synced = 0
        self.syncs = 0
        #: the clean-close marker: the frontier the last incarnation vouched for
        self.clean_frontier: int | None = None
        self.error: BaseException | None = None
        #: the disk is full: every append fails (nothing written) until it is not
        self.full = False
        self.refused_writes = 0

    def load(self) -> list[DiskEvent]:
        return list(self.written)

    def start(self, snapshot: SnapshotEvent) -> None:
        pass

    def append(self, events: list[DiskEvent], snapshot: SnapshotEvent) -> None:
        if self.full:
            self.refused_writes += 1
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        self.written.extend(events)

    def sync(self) -> None:
        self.syncs += 1
        self.synced = len(self.written)

    def drop_below(self, gsn: int) -> int:
        return 0

    def take_clean_close(self) -> int | None:
        frontier, self.clean_frontier = self.clean_frontier, None
        return frontier

    def close(self, clean_frontier: int | None = None) -> None:
        self.sync()
        self.clean_frontier = clean_frontier

    def lose_tail(self, n: int) -> None:
        """A power loss: at most the last ``n`` events, of those not synced, are gone."""
        if n > 0:
            del self.written[max(self.synced, len(self.written) - n):]


# ================================================================================================
# ZooKeeper
class Session:
    def __init__(self, zk: "ZooKeeper", name: str) -> None:
        self.zk = zk
        self.name = name
        self.alive = True
        self.id = next(zk._session_ids)


class ZooKeeper:
    """The coordination service's state: nodes with versions, ephemeral registrations,
    elections. Every change reaches every live view after a short delay."""

    def __init__(self, world: World) -> None:
        self.world = world
        self._session_ids = itertools.count(1)
        self.epoch_block: dict[str, Any] | None = None
        self.epoch_version = 0
        #: reads of the epoch block by storage replicas that missed an EPOCH_SAME's base
        self.block_reads = 0
        self.history: list[list[Any]] = []
        self.history_version = 0
        self.meta: dict[int, dict[str, Any]] = {}  # /ziplog/shards/<s>
        self.records: dict[int, dict[str, Any]] = {}  # /ziplog/recovery/<s>
        self.record_versions: dict[int, int] = {}
        self.replicas: dict[tuple[int, int], tuple[str, Session]] = {}
        #: (shard, replica) -> the rate from which its registration says it passes by the clock
        self.replica_clock: dict[tuple[int, int], int] = {}
        #: (shard, replica) -> the incarnation its registration names
        self.replica_incs: dict[tuple[int, int], int] = {}
        self.mms: dict[str, tuple[dict[str, str], Session]] = {}
        self.fh: dict[str, tuple[dict[str, str], Session]] = {}
        self.elections: dict[str, list[tuple[Session, "SimElection"]]] = {}
        self.leaders: dict[str, "SimElection | None"] = {}
        #: names each contender's lock node (a new one per time it joins, as ZooKeeper's
        #: sequential nodes are)
        self._locks = itertools.count(1)
        #: leaders' writes refused because the writer's lock node was gone (deposed)
        self.stale_leader_writes = 0
        self.views: list["SimTopology"] = []
        #: observers of every write: (what, data)
        self.watchers: list[Callable[[str, Any], None]] = []

    def session(self, name: str) -> Session:
        return Session(self, name)

    def changed(self, what: str, data: Any = None) -> None:
        for fn in self.watchers:
            fn(what, data)
        rng = self.world.rng
        for view in list(self.views):
            if view.proc.alive:
                view.schedule(rng.randint(100, 1000) * US)
        self.views = [v for v in self.views if v.proc.alive]

    def expire(self, session: Session) -> None:
        """The session is gone: its ephemeral nodes and election entries with it."""
        if not session.alive:
            return
        session.alive = False
        gone = False
        for key, (_, s) in list(self.replicas.items()):
            if s is session:
                del self.replicas[key]
                gone = True
        for d in (self.mms, self.fh):
            for name, (_, s) in list(d.items()):
                if s is session:
                    del d[name]
                    gone = True
        for path, cands in self.elections.items():
            if any(s is session for s, _ in cands):
                self.elections[path] = [(s, e) for s, e in cands if s is not session]
                self._elect(path)
        if gone:
            self.changed(f"session {session.name} expired")

    def lock_held(self, path: str, fence: str | None) -> bool:
        """The lock node ``fence`` still exists (its holder was neither deposed nor did
        its session end): what a leader's transaction checks beside its versions."""
        return fence is not None and any(e.lock == fence for _, e in self.elections.get(path, []))

    def depose(self, path: str) -> "SimElection | None":
        """The next in line deletes the leader's lock node (its beat went silent): the
        next contender leads; the deposed one learns it at its next heartbeat."""
        cands = self.elections.get(path, [])
        if len(cands) < 2:
            return None  # nobody in line watches the leader
        _, leader = cands[0]
        self.elections[path] = cands[1:]
        self._elect(path)
        return leader

    def _elect(self, path: str) -> None:
        cands = self.elections.get(path, [])
        leader = cands[0][1] if cands else None
        if self.leaders.get(path) is not leader:
            self.leaders[path] = leader
            if leader is not None:
                leader.proc.call_soon_threadsafe(leader.on_elected)

    # -- reads everyone does ------------------------------------------------------------------------
    def fill(self, view: TopologyView) -> None:
        """Make ``view`` show the current state (fields replaced whole)."""
        view.replica_counts = {s: int(m.get("replicas", 0)) for s, m in self.meta.items()}
        reps: dict[int, dict[int, str]] = {s: {} for s in self.meta}
        owners: dict[int, dict[int, int]] = {s: {} for s in self.meta}
        for (s, i), (addr, session) in self.replicas.items():
            reps.setdefault(s, {})[i] = addr
            owners.setdefault(s, {})[i] = session.id
        view.replicas = reps
        view.replica_owners = owners
        # every simulated replica runs this build: it reads what this build's senders add
        view.replica_reads = {s: {i: READS for i in reps[s]} for s in reps}
        view.replica_clock = {s: {i: self.replica_clock.get((s, i), 0) for i in reps[s]} for s in reps}
        view.replica_incs = {s: {i: self.replica_incs.get((s, i), 0) for i in reps[s]} for s in reps}
        view.removed = frozenset(s for s, m in self.meta.items() if m.get("removed"))
        view.recovering = frozenset(s for s, m in self.meta.items() if m.get("recovering") is not None)
        view.history = [list(h) for h in self.history]
        view.mms = {k: dict(a) for k, (a, _) in self.mms.items()}
        view.fh = {k: dict(a) for k, (a, _) in self.fh.items()}


class SimTopology(TopologyView):
    """A process's view of ZooKeeper: refreshed (and its listeners told) a short while
    after each change, on the process's own clock."""

    def __init__(self, zk: ZooKeeper, proc: SimProcess) -> None:
        super().__init__()
        self.zk = zk
        self.proc = proc
        self._pending = False
        zk.fill(self)
        zk.views.append(self)

    def schedule(self, delay: int) -> None:
        if not self._pending:
            self._pending = True
            self.proc.world.at(self.proc.world.now + delay, self.proc.run_in_thread, self._refresh)

    def _refresh(self) -> None:
        self._pending = False
        self.zk.fill(self)
        self.changed()


class SimElection:
    """The ``ElectionPort`` on the model: candidates in order of arrival; the first one
    whose session lives leads."""

    def __init__(self, zk: ZooKeeper, proc: SimProcess, session: Session) -> None:
        self.zk = zk
        self.proc = proc
        self.session = session
        self.path = ""
        self.on_elected: Callable[[], None] = lambda: None
        self.on_lost: Callable[[], None] = lambda: None
        #: this contender's lock node (a new one each time it joins)
        self.lock = ""

    def run_election(self, path: str, identifier: str, on_elected: Callable[[], None],
                     on_lost: Callable[[], None]) -> None:
        self.path = path
        self.on_elected = on_elected
        self.on_lost = on_lost
        self._join()

    def _join(self) -> None:
        self.lock = f"{self.path}/lock-{next(self.zk._locks)}"
        self.zk.elections.setdefault(self.path, []).append((self.session, self))
        self.zk._elect(self.path)

    def fence(self) -> str | None:
        return self.lock if self.zk.leaders.get(self.path) is self else None

    def heartbeat(self) -> None:
        """A leader deposed (its lock node deleted while its loop stalled) learns it here,
        from its beat's answer a moment later, and contends again with a new lock node.
        (The simulated ZooKeeper ends a dead leader's session itself.)"""
        if self.session.alive and not self.zk.lock_held(self.path, self.lock):
            world = self.zk.world
            world.at(world.now + world.rng.randint(100, 2000) * US, self._deposed, self.lock)

    def _deposed(self, lock: str) -> None:
        if self.lock != lock or not self.proc.alive or self.zk.lock_held(self.path, lock):
            return
        self.proc.run(self.on_lost)
        self._join()

    def resign(self) -> None:
        """Let go of the lock and contend again, with a new lock node, behind the others."""
        cands = self.zk.elections.get(self.path, [])
        self.zk.elections[self.path] = [(s, e) for s, e in cands if e is not self]
        self.zk.leaders[self.path] = None
        self._join()


class _Coordination:
    def __init__(self, zk: ZooKeeper, proc: SimProcess, session: Session) -> None:
        self.zk = zk
        self.proc = proc
        self.session = session
        self.topology = SimTopology(zk, proc)

    def on_change(self, fn: Callable[[], None]) -> None:
        self.topology.on_change(fn)

    def close(self) -> None:
        self.zk.expire(self.session)


class SimStorageCoordination(_Coordination):
    def register_replica(self, shard: int, replica: int, replicas: int, addr: str, clock: int = 0,
                         inc: int = 0) -> None:
        zk = self.zk
        zk.meta.setdefault(shard, {"replicas": replicas})
        zk.replicas[(shard, replica)] = (addr, self.session)
        zk.replica_clock[(shard, replica)] = clock
        zk.replica_incs[(shard, replica)] = inc
        zk.changed(f"replica {shard}.{replica} registered at {addr}")

    def membership_history(self) -> list[list[Any]]:
        return [list(h) for h in self.zk.history]

    def epoch_block(self) -> Any:
        self.zk.block_reads += 1
        return dict(self.zk.epoch_block) if self.zk.epoch_block else None

    def recovery_generation(self, shard: int) -> int:
        rec = self.zk.records.get(shard)
        return int(rec["gen"]) if rec else -1


class SimMembershipCoordination(_Coordination):
    def register_mms(self, replica_id: int, addrs: dict[str, str]) -> None:
        self.zk.mms[str(replica_id)] = (dict(addrs), self.session)
        self.zk.changed(f"mms {replica_id} registered")

    def read_epoch_state(self) -> EpochState:
        zk = self.zk
        return EpochState(dict(zk.epoch_block) if zk.epoch_block else None, zk.epoch_version,
                          [list(h) for h in zk.history], zk.history_version)

    def commit_block(self, commit: CommitBlock, on_done: Callable[[bool], None]) -> None:
        world = self.zk.world
        world.at(world.now + world.rng.randint(200, 2000) * US, self._answer, commit, on_done)

    def _answer(self, commit: CommitBlock, on_done: Callable[[bool], None]) -> None:
        zk = self.zk
        # A leader that died with its transaction in flight: it may or may not commit.
        if not self.proc.alive and zk.world.rng.random() < 0.5:
            return
        fenced = zk.lock_held(layout.MMS_ELECTION, commit.fence)
        zk.stale_leader_writes += not fenced
        ok = (fenced and commit.block_version == zk.epoch_version
              and (commit.history is None or commit.history_version == zk.history_version))
        if ok:
            zk.epoch_block = dict(commit.block)
            zk.epoch_version += 1
            if commit.history is not None:
                zk.history = [list(h) for h in commit.history]
                zk.history_version += 1
                zk.changed("membership", commit.history[-1])
            else:
                zk.changed("epoch block", commit.block)
        self.proc.run(on_done, ok)


class SimHandlerCoordination(_Coordination):
    def register_fh(self, group: int, replica_id: int, addr: str) -> None:
        self.zk.fh[f"{group}-{replica_id}"] = ({"pull": addr}, self.session)
        self.zk.changed(f"failure handler {replica_id} registered")

    def sync_records(self) -> None:
        pass

    def read_record(self, shard: int) -> tuple[dict[str, Any] | None, int]:
        rec = self.zk.records.get(shard)
        return (layout.dec(layout.enc(rec)) if rec else None), self.zk.record_versions.get(shard, -1)

    def write_record(self, shard: int, record: dict[str, Any], recovering: bool, version: int,
                     on_done: Callable[[int | None], None], fence: str | None = None) -> None:
        world = self.zk.world
        world.at(world.now + world.rng.randint(200, 2000) * US, self._answer, shard, record, recovering, version,
                 on_done, fence)

    def _answer(self, shard: int, record: dict[str, Any], recovering: bool, version: int,
                on_done: Callable[[int | None], None], fence: str | None) -> None:
        zk = self.zk
        if not self.proc.alive and zk.world.rng.random() < 0.5:
            return  # the leader died while its transaction was in flight: it may or may not commit
        fenced = zk.lock_held(layout.fh_election_path(0), fence)
        zk.stale_leader_writes += not fenced
        if zk.record_versions.get(shard, -1) != version or not fenced:
            self.proc.run(on_done, None)
            return
        zk.records[shard] = layout.dec(layout.enc(record))
        new = version + 1 if version >= 0 else 1
        zk.record_versions[shard] = new
        meta = zk.meta.setdefault(shard, {"replicas": 0})
        if recovering:
            meta["recovering"] = record["gen"]
        else:
            meta.pop("recovering", None)
        zk.changed("recovery record", (shard, record))
        self.proc.run(on_done, new)
