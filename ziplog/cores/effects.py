"""What a core hands back: one batch of effects per step, in the manner of etcd raft's
``Ready``. A driver performs them (sends the messages, persists the events, answers the
coordination requests) and never edits a core's fields."""

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


class ShardPrimary(NamedTuple):
    """The primary of another shard (a primary's NOTICE goes there)."""

    shard: int


Dest = Union[bytes, Peer, ShardPrimary]


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
    ``history``, each only if its version is still the one given (else another leader
    committed: this one must step down)."""

    block: dict[str, Any]
    block_version: int
    history: list[list[Any]] | None
    history_version: int


class Ready:
    """One batch of effects: ``messages`` to send, in order; ``persist``: decided-stream
    events to write, in order; ``coordinate``: coordination requests to answer."""

    __slots__ = ("messages", "persist", "coordinate")

    def __init__(self, messages: list[tuple[Dest, Frame]], persist: list[DiskEvent],
                 coordinate: list[ReadHistory]) -> None:
        self.messages = messages
        self.persist = persist
        self.coordinate = coordinate

    def __bool__(self) -> bool:
        return bool(self.messages or self.persist or self.coordinate)

    def __repr__(self) -> str:
        return f"Ready(messages={self.messages!r}, persist={self.persist!r}, coordinate={self.coordinate!r})"


class Outbox:
    """Where a core's parts put effects as they happen; :meth:`ready` hands them over."""

    __slots__ = ("messages", "persist", "coordinate")

    def __init__(self) -> None:
        self.messages: list[tuple[Dest, Frame]] = []
        self.persist: list[DiskEvent] = []
        self.coordinate: list[ReadHistory] = []

    def send(self, dest: Dest, msg: Frame) -> None:
        self.messages.append((dest, msg))

    def ready(self) -> Ready:
        r = Ready(self.messages, self.persist, self.coordinate)
        self.messages, self.persist, self.coordinate = [], [], []
        return r
