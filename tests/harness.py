"""Shard 0's replica cores and the failure handler's core wired by hand: no network, no
clock, no driver. Core-level tests step them one event at a time; every message crosses
the codec (encoded, then decoded at its edge), as it would on the wire."""

from __future__ import annotations

from typing import Any, cast

from failure_handler.recovery import RecoveryCore
from ziplog.cores.effects import Peer, ReadHistory, ReplicaOf, ShardReplicas, WriteRecovery
from ziplog.cores.replica import ReplicaCore, ReplicaSettings
from ziplog.protocol import frames as wire
from ziplog.protocol.events import DiskEvent
from ziplog.protocol.gsna import EpochConfig
from ziplog.protocol.membership import history_ranges
from ziplog.protocol.topology import TopologyView
from ziplog.server.links import ReplicaLinks

MS = 1_000_000


def request(core: ReplicaCore, route: bytes, msg: wire.Request, now: int) -> None:
    """``msg`` alone in a turn, as the core's driver hands it over: the request, then
    the end of the turn's input (an INSERT is held until then)."""
    core.on_request(route, msg, now)
    core.end_input(now)


def backup_route(replica: int) -> bytes:
    """The route a backup's messages reach the primary by (b"backup" for replica 1)."""
    return b"backup" if replica == 1 else b"backup%d" % replica


class _Backup:
    """Backup 1's core as a test holds it (every attribute its core's), whose
    ``connect_primary(now)`` names no incarnation: it links to the primary incarnation
    up now, as its driver does when ZooKeeper shows that incarnation's registration."""

    __slots__ = ("_harness", "_core")

    def __init__(self, harness: ShardHarness, core: ReplicaCore) -> None:
        object.__setattr__(self, "_harness", harness)
        object.__setattr__(self, "_core", core)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._core, name, value)

    def connect_primary(self, now: int, primary_inc: int | None = None) -> None:
        primary = self._harness.cores[0]
        inc = primary_inc if primary_inc is not None else primary.incarnation if primary is not None else 0
        self._core.connect_primary(now, inc)


class ShardHarness:
    """Replicas 0 (primary) and 1 (backup) of shard 0 (and 2.. with ``replicas``), a
    client route, and the failure handler. A core set to None is down: it hears nothing."""

    def __init__(self, settings: dict[str, Any] | None = None, history: list[list[Any]] | None = None,
                 replicas: int = 2, fenced: bool = False) -> None:
        # No clock turns here unless a test ticks it: a backup answers every FORWARD
        # (a test of the periodic PREFIX sets prefix_interval_ns=None, the shipped default)
        self.settings = {"prefix_interval_ns": 0, **(settings or {})}
        self.replicas = replicas
        #: each new core is a new incarnation (1, 2, ...), as a server's start is: a backup
        #: links to the primary's with :meth:`connect`, or ``B.connect_primary(now)``
        #: (unfenced, every core is 0, as a build before incarnations)
        self.fenced = fenced
        self.incarnations = 0
        self.now = 0
        self.cores: dict[int, ReplicaCore | None] = {i: self.new_core(i) for i in range(replicas)}
        self.disk: dict[int, list[DiskEvent]] = {i: [] for i in range(replicas)}
        self.client: list[tuple[int, wire.Reply]] = []
        self.suspects: list[wire.Suspect] = []
        self.rates: list[wire.RateEntry] = []
        self.notices: list[tuple[int, wire.Frame]] = []
        self.history: list[list[Any]] = history if history is not None else [[0, [0]]]
        self.handler = RecoveryCore()
        self.handler.load(0, 2, None, 0)
        self.persisted: list[WriteRecovery] = []
        #: called with each WriteRecovery once written (a test may drop the shard then)
        self.on_persist: Any = None
        self.epoch = -1
        #: every message a replica sent, in order: (replica, destination, message)
        self.sent: list[tuple[int, Any, wire.Frame]] = []

    def new_core(self, replica: int) -> ReplicaCore:
        self.incarnations += 1
        return ReplicaCore(ReplicaSettings(0, replica, self.replicas, **self.settings),
                           self.incarnations if self.fenced else 0)

    def connect(self, replica: int) -> None:
        """Backup ``replica`` links to the primary incarnation up now, as its driver does
        when ZooKeeper shows it (its HELLO names that incarnation)."""
        core = self.cores[replica]
        assert core is not None and replica > 0
        core.connect_primary(self.now, self.P.incarnation)

    @property
    def P(self) -> ReplicaCore:
        core = self.cores[0]
        assert core is not None
        return core

    @P.setter
    def P(self, core: ReplicaCore | None) -> None:
        self.cores[0] = core

    @property
    def B(self) -> ReplicaCore:
        core = self.cores[1]
        assert core is not None
        return cast(ReplicaCore, _Backup(self, core))

    @B.setter
    def B(self, core: ReplicaCore | None) -> None:
        self.cores[1] = core

    # -- inputs ---------------------------------------------------------------------------------
    def config(self, epoch: int, members: tuple[int, ...]) -> EpochConfig:
        return EpochConfig(epoch, members, tuple(1000 for _ in members))

    def send_epoch(self, e: int, members: tuple[int, ...], to: tuple[int, ...] | None = None) -> None:
        cfg = self.config(e, members)
        for i in (tuple(self.cores) if to is None else to):
            core = self.cores[i]
            if core is not None:
                core.on_epoch(cfg, self.now)

    def next_epoch(self) -> None:
        """The MMS broadcasts the next epoch with the history's latest members."""
        self.epoch += 1
        self.send_epoch(self.epoch, tuple(self.history[-1][1]))
        self.pump()

    def insert(self, seq: int, data: bytes, to: tuple[int, ...] = (0, 1), after: int = 0, client: int = 7,
               stamp: int = 0) -> None:
        """One INSERT, alone in its turn at each replica of ``to``."""
        msg = wire.Insert(req_id=seq, client_id=client, seq=seq, after=after, data=data, stamp=stamp)
        for i in to:
            core = self.cores[i]
            if core is not None:
                self.turn(core, [msg])

    def turn(self, core: ReplicaCore, inserts: list[wire.Insert]) -> None:
        """``inserts`` reach ``core`` in one turn, in this order (as its driver does: each
        request as it is read, then the held inserts once the input is read)."""
        for msg in inserts:
            core.on_request(b"client", wire.decode_request(wire.encode(msg)), self.now)
        core.end_input(self.now)

    def replies(self, req_id: int) -> list[tuple[int, wire.Reply]]:
        return [(i, m) for i, m in self.client if m.req_id == req_id]

    # -- the network, by hand ---------------------------------------------------------------------
    def pump(self, lose: tuple[str, ...] = (), drop_from: set[int] | frozenset[int] = frozenset()) -> None:
        """Deliver every message until quiet. ``lose``: "forward" (primary -> backup) and
        "hello" (backup -> primary) messages are lost; messages from replicas in
        ``drop_from`` are all lost (it "crashed" before they left)."""
        for _ in range(200):
            moved = False
            for i, core in list(self.cores.items()):
                if core is None:
                    continue
                core.flush(self.now)
                moved = self._deliver(i, core, lose, drop_from) or moved
            moved = self.run_handler() or moved
            if not moved:
                return
        raise AssertionError("the cores keep talking: no quiet after 200 rounds")

    def _deliver(self, i: int, core: ReplicaCore, lose: tuple[str, ...], drop_from: Any) -> bool:
        moved = False
        while True:
            ready = core.ready()
            self.disk[i].extend(ready.persist)
            # The harness's disk takes every batch at once: what waits for it leaves now.
            for dest, msg in ready.messages + ready.durable:
                moved = True
                self.sent.append((i, dest, msg))
                if i in drop_from:
                    continue
                frame = wire.encode(msg)
                if dest is Peer.PRIMARY:
                    if "hello" in lose and isinstance(msg, wire.Hello):
                        continue
                    if self.cores[0] is not None:
                        self.P.on_request(backup_route(i), wire.decode_member_request(frame), self.now)
                elif dest is Peer.HANDLER:
                    self.suspects.append(wire.decode_suspect(frame))
                elif dest is Peer.MMS:
                    self.rates.extend(wire.decode_rate(frame).reports)
                elif isinstance(dest, ShardReplicas):  # another shard's replicas: only recorded here
                    self.notices.append((dest.shard, wire.decode_member_request(frame)))
                elif isinstance(dest, bytes) and dest.startswith(b"backup"):
                    backup = self.cores.get(int(dest[6:] or 1))
                    if "forward" not in lose and backup is not None:
                        msg2 = wire.decode_from_primary(frame)
                        if isinstance(msg2, wire.Forward):
                            backup.on_forward(msg2, self.now)
                elif dest == b"client":
                    reply = wire.decode_reply(frame)
                    self.client.extend((i, m) for m in (reply.acks if isinstance(reply, wire.Acks) else [reply]))
                elif dest == b"handler":
                    self.handler.on_reply(0, i, wire.decode_recovery_reply(frame), self.now)
                else:
                    raise AssertionError(f"a message to an unknown route {dest!r}")
            if not ready.coordinate:
                return moved
            for req in ready.coordinate:
                assert isinstance(req, ReadHistory)
                core.on_history(history_ranges(self.history, req.first, req.last), self.now)

    def run_handler(self) -> bool:
        """Perform the handler's effects as its driver does: the writes (answered at
        once), then the messages."""
        ready = self.handler.ready()
        for a in ready.coordinate:
            assert isinstance(a, WriteRecovery)
            self.persisted.append(a)
            self.handler.on_persisted(a.shard, int(a.record["gen"]), self.now)
            if self.on_persist is not None:
                self.on_persist(a)
        for dest, msg in ready.messages:
            assert isinstance(dest, ReplicaOf)
            core = self.cores.get(dest.replica)
            if core is not None:  # a replica that is down never hears it
                core.on_request(b"handler", wire.decode_member_request(wire.encode(msg)), self.now)
        return bool(ready)

    def tick(self, advance_ns: int = 0) -> None:
        self.now += advance_ns
        for core in self.cores.values():
            if core is not None:
                core.tick(self.now)
        self.pump()


# -- a storage driver's links to its peers, on a fake network ------------------------------------
class RecordingEndpoint:
    """A connection that keeps the frames sent on it."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, frame: bytes) -> None:
        self.sent.append(frame)


class RecordingNet:
    """A network whose DEALERs are :class:`RecordingEndpoint`s, one per address."""

    def __init__(self) -> None:
        self.endpoints: dict[str, RecordingEndpoint] = {}

    def dealer(self, addr: str, *args: Any, **kwargs: Any) -> RecordingEndpoint:
        return self.endpoints.setdefault(addr, RecordingEndpoint())


def links_over(topology: TopologyView, settings: ReplicaSettings | None = None) -> tuple[ReplicaLinks, RecordingNet]:
    """Shard 0 replica 0's :class:`ReplicaLinks` following ``topology``, and the network
    they send on."""
    class Coord:
        def __init__(self) -> None:
            self.topology = topology

    class Guard:
        def frames(self, *args: Any) -> Any:
            return None

    net = RecordingNet()
    links = ReplicaLinks(settings or ReplicaSettings(shard=0, replica=0), net, Coord(), Guard(),  # type: ignore[arg-type]
                         None, lambda b: None, lambda b: None)  # type: ignore[arg-type]
    return links, net
