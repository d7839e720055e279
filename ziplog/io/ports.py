"""The ports every driver runs on. A driver (a server process or a client) owns a core
and talks to the world only through these; production plugs in pyzmq
(:mod:`ziplog.io.zmq_runtime`), segment files (:mod:`ziplog.io.segments`) and kazoo
(:mod:`ziplog.io.zk`), and the simulation in ``tests/sim`` plugs in its simulated
network, clock, disk and ZooKeeper under the same drivers.

* :class:`Runtime`: the clock, timers, calls from other threads, and the end of a turn.
  A *turn* is one batch of input (the frames one poll found, or a timer); drivers batch
  their work per turn (a FORWARD per turn, say), so the runtime calls every
  :meth:`Runtime.at_turn_answers` hook after each (the answers to clients leave), then
  every :meth:`Runtime.at_turn_end` hook.
* :class:`Network`: message endpoints with ZeroMQ's socket semantics (ROUTER, DEALER,
  PUB/SUB, PUSH/PULL); frames are bytes, one message part each. Replacing the transport
  (a native ZMTP implementation on uvloop, say) means a new :class:`Network` and
  :class:`Runtime`, not new drivers.
* :class:`Disk`: a replica's decided stream on stable storage.
* Coordination (ZooKeeper) ports are per process kind, next to their drivers'
  needs: :class:`StorageCoordination` here, and the views of :mod:`ziplog.protocol.topology`.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Protocol

from ziplog.protocol.events import DiskEvent, SnapshotEvent
from ziplog.protocol.topology import TopologyView


def wall_offset_ns() -> int:
    """The wall clock minus the monotonic clock the runtimes give cores as ``now``, read
    once by a driver: a core adds it to ``now`` for a stamp other hosts can compare
    (``frames.wall_stamp``)."""
    return time.time_ns() - time.monotonic_ns()


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now(self) -> int:
        """Monotonic nanoseconds."""


class Runtime(Protocol):
    def now(self) -> int:
        """Monotonic nanoseconds."""

    def call_at(self, when_ns: int, fn: Callable[[], None]) -> Timer:
        """Call ``fn`` on the runtime's thread at ``when_ns`` (or soon after)."""

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` on the runtime's thread soon; safe from any thread."""

    def at_turn_answers(self, fn: Callable[[], bool]) -> None:
        """Call ``fn`` after every turn, before every :meth:`at_turn_end` hook: it sends
        the turn's answers to clients, and says whether it sent any (a runtime may then
        let a task waiting for this CPU, a client reading its answer, run before the
        turn's bookkeeping)."""

    def at_turn_end(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` after every turn (after every :meth:`at_turn_answers` hook)."""


class Endpoint(Protocol):
    """A connected (DEALER, SUB, PUSH) or bound (PUB, PULL) socket."""

    addr: str

    def send(self, frame: bytes) -> bool:
        """Queue ``frame``; False when the queue is full and it was dropped."""

    def connect(self, addr: str) -> None:
        """Connect to one more peer (a SUB to another publisher)."""

    def close(self, linger_ms: int = 0) -> None:
        """Let go of the socket; frames still queued may leave for ``linger_ms``."""


class Router(Protocol):
    """A bound ROUTER: frames arrive tagged with their sender's route."""

    addr: str

    def send_to(self, route: bytes, frame: bytes) -> bool:
        """Queue ``frame`` for ``route``; False when it was dropped (queue full, peer gone)."""

    def peer_key(self, route: bytes) -> bytes | None:
        """The CURVE key of the client on ``route`` (None: NULL, or the route is gone)."""

    def close(self) -> None: ...


class Puller(Endpoint, Protocol):
    """A bound PULL that may stop reading for a while: frames then wait in its queue (and,
    once that is full, senders drop theirs)."""

    def pause(self) -> None: ...

    def resume(self, discard_queued: bool = False) -> None:
        """Read again; ``discard_queued`` drops what arrived while paused first."""


#: a frame from a route (ROUTER)
RoutedHandler = Callable[[bytes, bytes], None]
#: a frame on a connection (DEALER, SUB, PULL)
FrameHandler = Callable[[bytes], None]
#: a message of more than one part from a route (never valid here)
MultipartHandler = Callable[[bytes, int], None]


# Every receiving endpoint takes ``max_bytes``: a message larger than that is refused
# before it is read into memory and its sender disconnected (libzmq's ZMQ_MAXMSGSIZE;
# -1: no limit). The limits of each edge are in ``ziplog.protocol.frames``.


class Connector(Protocol):
    """The connecting half of a network (what a client needs)."""

    def dealer(self, addr: str, on_frame: FrameHandler, label: str = "", max_bytes: int = -1) -> Endpoint:
        """Connect a DEALER to a ROUTER at ``addr``. ``label`` names what the connection is
        for (``"replica"``, ``"subscription"``, ``"primary"``, ``"handler"``), for logs and
        the simulation's fault model."""


class Network(Connector, Protocol):
    def router(self, on_frame: RoutedHandler, on_multipart: MultipartHandler, host: str = "127.0.0.1",
               port: int = 0, max_bytes: int = -1) -> Router:
        """Bind a ROUTER (port 0: any free port)."""

    def dealer(self, addr: str, on_frame: FrameHandler, label: str = "", max_bytes: int = -1) -> Endpoint:
        """Connect a DEALER to a ROUTER at ``addr``. ``label`` names what the connection is
        for (``"replica"``, ``"subscription"``, ``"primary"``, ``"handler"``), for logs and
        the simulation's fault model."""

    def publisher(self, host: str = "127.0.0.1") -> Endpoint:
        """Bind a PUB."""

    def subscriber(self, addr: str, on_frame: FrameHandler, max_bytes: int = -1) -> Endpoint:
        """Connect a SUB (every topic) to a PUB at ``addr``; ``connect`` adds more."""

    def puller(self, on_frame: FrameHandler, host: str = "127.0.0.1", paused: bool = False,
               max_bytes: int = -1) -> Puller:
        """Bind a PULL (``paused``: not read until resumed)."""

    def pusher(self, addr: str) -> Endpoint:
        """Connect a PUSH to a PULL at ``addr``."""


class Disk(Protocol):
    """A replica's decided stream on stable storage."""

    #: an fsync that failed since the last append (the next append tries again first)
    error: BaseException | None

    def load(self) -> Iterable[DiskEvent]:
        """Every event persisted, oldest first (a torn tail cut off)."""

    def start(self, snapshot: SnapshotEvent) -> None:
        """Begin writing: a fresh segment that opens with ``snapshot``."""

    def append(self, events: list[DiskEvent], snapshot: SnapshotEvent) -> None:
        """Write a batch, all or nothing: OSError (a full disk, say) when nothing of it
        was written, and the caller appends it again later. ``snapshot`` is the state
        after it (a new segment opens with it)."""

    def sync(self) -> None:
        """Block until everything appended so far is on stable storage, whatever the
        fsync policy (OSError when it cannot be): what a durable answer waits for."""

    def drop_below(self, gsn: int) -> int:
        """Delete whole segments whose records all lie below ``gsn``."""

    def take_clean_close(self) -> int | None:
        """The frontier the last incarnation vouched for when it stopped gracefully (None:
        it did not); the vouching is gone from the disk before this returns, so it counts
        for one start only."""

    def close(self, clean_frontier: int | None = None) -> None:
        """Stop writing; with ``clean_frontier``, vouch (after syncing everything) that
        every event this incarnation decided is written and the log ends there."""


class CoordinationUnavailable(Exception):
    """ZooKeeper could not answer now (the connection is lost, the session expired): a
    driver asks again later; it never ends the process."""


class StorageCoordination(Protocol):
    """What a storage replica needs of ZooKeeper. Reads raise
    :class:`CoordinationUnavailable` when ZooKeeper cannot answer now."""

    @property
    def topology(self) -> TopologyView: ...

    def on_change(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (from any thread) whenever the topology view changed."""

    def register_replica(self, shard: int, replica: int, replicas: int, addr: str, clock: int = 0,
                         inc: int = 0) -> None:
        """Create the shard's node if needed and this replica's ephemeral node, naming its
        address, what it reads, its clock-pass rate and its incarnation ``inc``."""

    def membership_history(self) -> list[list[Any]]:
        """The committed membership history, read fresh (synced)."""

    def epoch_block(self) -> Any:
        """The committed epoch block (``{epoch, last, shards, rates}``, as the membership
        service wrote it; None: none yet), read fresh (synced)."""

    def recovery_generation(self, shard: int) -> int:
        """The generation of the shard's recovery record as the failure handler committed
        it, read fresh (synced); -1 when there is none."""

    def close(self) -> None: ...
