"""What a core hands back: one batch of effects per step, in the manner of etcd raft's
``Ready``. A driver performs them (persists, asks ZooKeeper, sends) and never edits a
core's fields. Every core speaks this one vocabulary (the replica, the client's calls and
subscriptions, the failure handler, the membership service, LogDB's coordinator and KV
shard):

* a **message** (:data:`Message`) is ``(Dest, item)``: the item is a frame of the edge's
  protocol (a struct: the driver encodes and, where the edge needs it, seals it) or, on a
  connection the core owns, :class:`Open` or :class:`Close` of it, in order with the
  frames around it;
* a **destination** (:data:`Dest`) names whom, not how: a ROUTER route (bytes), a kind
  of :class:`Peer`, every replica of another shard (:class:`ShardReplicas`), a replica of a shard
  at the address ZooKeeper holds for it now (:class:`ReplicaOf`), a subscription's stream
  from a shard (:class:`Stream`), or replica addresses (a tuple of str: a call's targets);
* a **persist** item goes to the process's stable storage, in order (a replica's
  decided-stream events, a KV shard's apply batch);
* a **durable message** leaves only once every persist item handed over so far is on
  stable storage: written and fsynced, whatever the fsync policy (a replica's answer to
  an INSTALL: what it installed replaced records its disk still holds until then, and a
  power loss would bring them back);
* a **coordination** request goes to ZooKeeper and its answer back to the core
  (:class:`ReadHistory`, :class:`CommitBlock`, :class:`WriteRecovery`).

A core returns a :class:`Ready`; one that only ever sends (the client's calls and
subscriptions, LogDB's coordinator) returns its :data:`Messages` alone. Every driver
performs one the same way: the messages in order, the persist items in order, the
coordination requests; only a coordination *write* (:class:`CommitBlock`,
:class:`WriteRecovery`) holds anything back: the batch's messages and every later batch
wait until ZooKeeper took it. Nothing else waits but durable messages (a replica's
durability is memory on f+1 replicas: its disk is written at the end of the turn)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NamedTuple, Union

from ziplog.protocol.events import DiskEvent
from ziplog.protocol.frames import Frame


class Peer(enum.Enum):
    """A destination that is not a connection the core was spoken to on (those are
    named by their route, the bytes a ROUTER tags them with)."""

    #: the shard's primary, over a backup's own connection to it
    PRIMARY = "primary"
    #: every membership service replica (only the leader reads rate reports)
    MMS = "mms"
    #: every failure handler replica (only the leader acts on suspicions)
    HANDLER = "handler"


class ShardReplicas(NamedTuple):
    """Every replica of another shard (a primary's NOTICE goes there: that shard's
    primary passes the gsn, its backups move their guesses past it alike), which the
    epoch schedules at ``rate`` records/s (0: not said): a shard whose replicas pass
    their slots by the clock at that rate is not told (``NoticeFanout.add``)."""

    shard: int
    rate: int = 0


class ReplicaOf(NamedTuple):
    """Replica ``replica`` of ``shard``, at the address ZooKeeper holds for it now."""

    shard: int
    replica: int


class Stream(NamedTuple):
    """A subscription's connection to one replica of ``shard``."""

    shard: int


class Open(NamedTuple):
    """Item: connect the stream the message is addressed to to ``addr`` (replacing the
    connection it had)."""

    addr: str


class Close(NamedTuple):
    """Item: close the connection the message is addressed to (what is queued on it may
    still leave for a moment)."""


#: whom a message is for (see the module's docstring)
Dest = Union[bytes, Peer, ShardReplicas, ReplicaOf, Stream, tuple[str, ...]]
#: ``(destination, frame or Open/Close)``
Message = tuple[Dest, Any]
Messages = list[Message]


class ReadHistory:
    """Coordination read: the members of epochs ``first..last`` from the committed
    membership history; answer with the core's ``on_history``."""

    __slots__ = ("first", "last")

    def __init__(self, first: int, last: int) -> None:
        self.first = first
        self.last = last

    def __repr__(self) -> str:
        return f"ReadHistory({self.first}, {self.last})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, ReadHistory) and (self.first, self.last) == (other.first, other.last)


@dataclass
class CommitBlock:
    """Coordination write (the membership service): one transaction that sets the epoch
    block node to ``block`` and, when membership changes, the history node to
    ``history``, each only if its version is still the one given, and only while the
    writer still holds its leader's lock ``fence`` (else another leader committed, or this
    one was deposed: it must step down). The core leaves ``fence`` out; the driver names
    the lock of its term (a commit without one is refused)."""

    block: dict[str, Any]
    block_version: int
    history: list[list[Any]] | None
    history_version: int
    fence: str | None = None


@dataclass
class WriteRecovery:
    """Coordination write (the failure handler): the shard's recovery record, durably,
    and its ``recovering`` flag set or cleared in the shard's metadata, in one step;
    answered with ``RecoveryCore.on_persisted``."""

    shard: int
    record: dict[str, Any]
    recovering: bool


Coordinate = Union[ReadHistory, CommitBlock, WriteRecovery]


class Ready:
    """One batch of effects: ``messages`` to send, in order; ``persist``: items for stable
    storage, in order; ``coordinate``: coordination requests to answer; ``durable``:
    messages to send, in order, once every persist item so far is on stable storage."""

    __slots__ = ("messages", "persist", "coordinate", "durable")

    def __init__(self, messages: Messages | None = None, persist: list[Any] | None = None,
                 coordinate: list[Coordinate] | None = None, durable: Messages | None = None) -> None:
        self.messages = [] if messages is None else messages
        self.persist = [] if persist is None else persist
        self.coordinate = [] if coordinate is None else coordinate
        self.durable = [] if durable is None else durable

    def __bool__(self) -> bool:
        return bool(self.messages or self.persist or self.coordinate or self.durable)

    def __repr__(self) -> str:
        return (f"Ready(messages={self.messages!r}, persist={self.persist!r}, coordinate={self.coordinate!r}, "
                f"durable={self.durable!r})")


class Outbox:
    """Where a core's parts put effects as they happen; :meth:`ready` hands them over."""

    __slots__ = ("messages", "persist", "coordinate", "durable")

    def __init__(self) -> None:
        self.messages: Messages = []
        self.persist: list[DiskEvent] = []
        self.coordinate: list[Coordinate] = []
        self.durable: Messages = []

    def send(self, dest: Dest, msg: Frame) -> None:
        self.messages.append((dest, msg))

    def send_durable(self, dest: Dest, msg: Frame) -> None:
        """Send ``msg`` once everything persisted so far is written."""
        self.durable.append((dest, msg))

    def ready(self) -> Ready:
        r = Ready(self.messages, self.persist, self.coordinate, self.durable)
        self.messages, self.persist, self.coordinate, self.durable = [], [], [], []
        return r
