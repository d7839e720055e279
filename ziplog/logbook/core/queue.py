"""BokiQueue's records and replay as a sans-I/O protocol (Boki journal 5.3): a FIFO
queue named by a string, whose pushes and pops are records in a book tagged with the
queue's tag (:func:`queue_tag`). A pop's outcome is not decided by any process: it is
a function of the log alone.

* a **push** appends a push record holding the element;
* a **pop** appends a pop record, then replays the queue's records up to its own. Every
  pop record, in log order, takes the oldest pushed element before it that no earlier
  pop record took (nothing if there is none), and the pop returns what its own record
  took.

Every engine that replays the same records reaches the same takes, because each is a
function of the records below it, and nothing can appear below a cut once served. So
every element is taken by at most one pop record, and a producer's elements are taken
in its push order (its appends follow one another in the log).

A pop that finds the queue empty at the tail it read first returns None without
appending (the pop is placed at that read's cut; an empty pop record would only grow
the log every replay has to read). A pop record whose outcome its consumer did not
return (the pop failed after the record went in) is an *orphan*: the consumer's next
replay meets it, and its next pop returns what it took (before anything its later
records took), so a failure does not lose an element as long as the consumer lives.

The steps yield :class:`ReadTail`, :class:`ReadNext` and :class:`Append`; the library
drives them through a LogBook (:func:`ziplog.logbook.core.session.drive`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Annotated, Any, Generator, Iterable, Iterator, Union

import msgspec

from ziplog.logbook.core.book_ops import Append, ReadNext, ReadTail
from ziplog.protocol.app_records import RecordCodec
from ziplog.protocol.errors import TrimmedError

MAGIC = b"ZLBQ"
FORMAT = 1
HEADER = MAGIC + bytes([FORMAT])
#: the longest queue name (its tag, "queue:" + name, stays far below LogBook's limit)
MAX_NAME = 256
#: consumer ids are drawn from 63 bits (msgpack and every language's signed int hold them)
CONSUMER_BITS = 63
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME)]
ConsumerId = Annotated[int, msgspec.Meta(ge=0, le=(1 << CONSUMER_BITS) - 1)]


class Push(msgspec.Struct, array_like=True, tag=1, tag_field="kind", forbid_unknown_fields=True, frozen=True):
    #: the queue's name: a tag is a hash, so a record names its queue to rule out collisions
    queue: Name
    data: bytes


class Pop(msgspec.Struct, array_like=True, tag=2, tag_field="kind", forbid_unknown_fields=True, frozen=True):
    queue: Name
    #: the consumer that appended it: its replay tells its own pop records from others'
    consumer: ConsumerId


QueueRecord = Union[Push, Pop]
_codec: RecordCodec[QueueRecord] = RecordCodec(HEADER, QueueRecord)
decode = _codec.decode


def encode(record: QueueRecord) -> bytes:
    """The record's bytes. Checked first: msgspec checks constraints only when decoding,
    and a record every replay decodes as not the queue's would be silently ignored."""
    check_name(record.queue)
    if type(record) is Push and not isinstance(record.data, bytes):
        raise TypeError(f"an element is bytes, not {type(record.data).__name__}")
    if type(record) is Pop and not 0 <= record.consumer < 1 << CONSUMER_BITS:
        raise ValueError(f"a consumer id is in 0..2**{CONSUMER_BITS}-1")
    return _codec.encode(record)


def check_name(name: str) -> str:
    """``name`` if it can name a queue (else ValueError)."""
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME:
        raise ValueError(f"a queue name is a string of 1..{MAX_NAME} characters, not {name!r}")
    return name


def queue_tag(name: str) -> str:
    """The tag a queue's records carry (a string tag: the record keeps it readable)."""
    return "queue:" + check_name(name)


Op = ReadTail | ReadNext | Append
Steps = Generator[Op, Any, Any]
#: a pushed element: (the seqnum of its push record, its data)
Element = tuple[int, bytes]


@dataclass(frozen=True, slots=True)
class Take:
    """What the pop record at ``pop`` (appended by ``consumer``) took: an element, or
    None when the queue was empty at that point of the log."""
    pop: int
    consumer: int
    element: Element | None


class QueueState:
    """The queue as of a cursor: every record of the queue at or below ``cursor`` is
    applied, none above. Only the live elements (pushed, not taken) are kept, so the
    state's size is the queue's backlog, whatever the length of its history."""

    __slots__ = ("name", "cursor", "live")

    def __init__(self, name: str) -> None:
        self.name = check_name(name)
        self.cursor = 0
        #: pushed and not taken, oldest first (so in increasing push seqnum)
        self.live: deque[Element] = deque()

    def apply(self, seqnum: int, data: bytes) -> Take | None:
        """Apply the record at ``seqnum`` (the next one of the tag in log order); what it
        took if it is a pop of this queue. A record that is not this queue's (another
        application's under a colliding tag, garbage, another format) only moves the
        cursor: every replayer skips it the same way."""
        assert seqnum > self.cursor, ("records are applied in increasing seqnum order", seqnum, self.cursor)
        self.cursor = seqnum
        rec = decode(data)
        if rec is None or rec.queue != self.name:
            return None
        if type(rec) is Push:
            assert not self.live or self.live[-1][0] < seqnum
            self.live.append((seqnum, rec.data))
            return None
        assert type(rec) is Pop
        return Take(seqnum, rec.consumer, self.live.popleft() if self.live else None)


def takes(name: str, records: Iterable[tuple[int, bytes]]) -> Iterator[Take]:
    """Every pop of queue ``name`` among ``records`` (its tag's records, in increasing
    seqnum order), with what it took: the whole outcome of a history, for checking it."""
    state = QueueState(name)
    for seqnum, data in records:
        take = state.apply(seqnum, data)
        if take is not None:
            yield take


class Consumer(QueueState):
    """One consumer's replay of a queue: the state at its cursor (advanced by every pop,
    so a pop replays only the records since the last one) and its orphans."""

    __slots__ = ("tag", "consumer", "orphans")

    def __init__(self, name: str, consumer: int) -> None:
        super().__init__(name)
        if not 0 <= consumer < 1 << CONSUMER_BITS:
            raise ValueError(f"a consumer id is in 0..2**{CONSUMER_BITS}-1")
        self.tag = queue_tag(name)
        self.consumer = consumer
        #: elements taken by this consumer's pop records whose pops failed, oldest first;
        #: no constant bounds it: each failed pop leaves at most one, each pop returns one
        self.orphans: deque[Element] = deque()

    def pop(self) -> Steps:
        """Pop: the element's data, or None (the queue was empty at the pop's point).
        An orphan of this consumer is returned before what its new pop record takes."""
        if self.orphans:
            return self.orphans.popleft()[1]
        tail = yield ReadTail(self.tag)
        if tail is not None and tail > self.cursor:
            yield from self._replay_to(tail, None)
        if self.orphans:  # an earlier failed pop of this consumer took one
            return self.orphans.popleft()[1]
        if not self.live:
            return None  # empty at the tail read's cut: nothing to take, nothing to append
        seqnum = yield Append(encode(Pop(queue=self.name, consumer=self.consumer)), self.tag)
        assert seqnum > self.cursor, ("a pop record went in at or below what its consumer replayed", seqnum,
                                      self.cursor)
        element = yield from self._replay_to(seqnum, seqnum)
        if element is not None:
            self.orphans.append(element)
        # an orphan met on the way lies before this pop record: returned first, so this
        # consumer's elements come back in the order its records took them
        return self.orphans.popleft()[1] if self.orphans else None

    def _replay_to(self, hi: int, own: int | None) -> Steps:
        """Apply the queue's records in (cursor, ``hi``] (``hi`` is one: the tail read or
        the pop record just appended, so every read here is at a cut at or above it);
        what the pop record at ``own`` took. This consumer's other pop records met on the
        way are orphans."""
        took: Element | None = None
        while self.cursor < hi:
            got = yield ReadNext(self.tag, self.cursor + 1)
            if got is None or got[0] > hi:
                # the record at hi was served at a cut at or below the reads': only a trim removes it
                raise TrimmedError(f"queue {self.name!r}: its record at seqnum {hi} is gone (the book was trimmed "
                                   f"past it)")
            seqnum, data = got
            take = self.apply(seqnum, data)
            if seqnum == own:
                assert take is not None and take.consumer == self.consumer, ("our pop record is not ours", take)
                took = take.element
            elif take is not None and take.consumer == self.consumer and take.element is not None:
                self.orphans.append(take.element)
        assert own is None or self.cursor == own, ("the replay passed its own pop record", own, self.cursor)
        return took
