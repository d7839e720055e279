"""Decided-stream events: a primary's decisions in order, as it forwards them to its
backups (inside FORWARD), as failure recovery installs them (inside INSTALL), and as a
replica persists them in its segment files. ``docs/PROTOCOL.md`` section 6 is the
reference.

Every event is a msgpack array whose first element is its kind; each kind is one typed
struct here (msgspec's tagged ``array_like`` structs put the tag first, so the bytes are
exactly the documented arrays). The record event doubles as the decided log's record:
one object per record, shared by the log, the forward batch and the disk batch.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Iterator, Union

import msgpack
import msgspec

#: A gsn, slot, id or count on the wire: msgpack's widest integer is uint64, so a
#: lower bound is all it takes.
U64 = Annotated[int, msgspec.Meta(ge=0)]
#: An epoch number that is -1 before the first epoch.
Epoch = Annotated[int, msgspec.Meta(ge=-1)]
Members = tuple[int, ...]

EV_RECORD = 0
EV_FRONTIER = 1
EV_EPOCH = 2
EV_TRIM = 3
EV_STABLE = 4
EV_SNAPSHOT = 5
EV_TRUNCATE = 6
EV_RECOVERY = 7
EV_RECORD_REF = 8
EV_REFUSED = 9

#: :class:`RecoveryEvent` phases
RECOVERY_FROZEN = 0
RECOVERY_INSTALLED = 1
RECOVERY_RESUMED = 2


class _Event(msgspec.Struct, array_like=True, gc=False, frozen=True, forbid_unknown_fields=True):
    pass


class RecordEvent(_Event, tag=EV_RECORD, frozen=True):
    """The record of ``(client_id, seq)`` is decided at ``gsn``; ``slot`` is its slot index
    in the epoch (0 where it is not known: catch-ups and recovery)."""

    gsn: U64
    slot: U64
    client_id: U64
    seq: U64
    data: bytes

    @property
    def key(self) -> tuple[int, int]:
        return (self.client_id, self.seq)


#: bytes of a record's digest in a :class:`RecordRefEvent`
DIGEST_BYTES = 16


def record_digest(data: bytes) -> bytes:
    """What names a record's data in a reference: the first 16 bytes of its SHA-256 (a
    client that sent one replica other bytes under the same key cannot make the
    replicas store different records: the reference does not match)."""
    return hashlib.sha256(data).digest()[:DIGEST_BYTES]


class RecordRefEvent(_Event, tag=EV_RECORD_REF, frozen=True):
    """FORWARD only: the record of ``(client_id, seq)`` is decided at ``gsn`` (as
    :class:`RecordEvent`), and its data is the ``size`` bytes whose digest is ``digest``,
    which the client's INSERT brought the backup too. A backup that holds no such bytes
    applies nothing of the FORWARD and asks for a catch-up, which carries the data."""

    gsn: U64
    slot: U64
    client_id: U64
    seq: U64
    size: U64
    digest: Annotated[bytes, msgspec.Meta(min_length=DIGEST_BYTES, max_length=DIGEST_BYTES)]

    @property
    def key(self) -> tuple[int, int]:
        return (self.client_id, self.seq)


class FrontierEvent(_Event, tag=EV_FRONTIER, frozen=True):
    """Every gsn of this shard up to ``frontier`` is decided; ``next_slot`` is the primary's
    next slot in ``epoch`` (0 on disk)."""

    frontier: U64
    epoch: Epoch
    next_slot: U64


class EpochEvent(_Event, tag=EV_EPOCH, frozen=True):
    """Epochs ``first..last`` had ``members`` (None: the same as the epoch before);
    every gsn before ``epoch_base(first)`` is closed."""

    first: U64
    last: U64
    members: Members | None


class TrimEvent(_Event, tag=EV_TRIM, frozen=True):
    """Disk only: the trim point rose to ``point`` (trim is not forwarded)."""

    point: U64


class StableEvent(_Event, tag=EV_STABLE, frozen=True):
    """Disk only: the stable watermark at a flush."""

    stable: U64


class RecoveryEvent(_Event, tag=EV_RECOVERY, frozen=True):
    """Disk only: this replica's part in failure recovery generation ``gen`` reached
    ``phase``: FROZEN (it promised the failure handler to store nothing new), INSTALLED
    (the recovery's state, up to ``end``, is written before it), RESUMED (the recovery
    is over here). A restart takes it up where the disk says: a replica frozen for a
    recovery that has not resumed it comes back frozen (its promise outlives it)."""

    gen: U64
    phase: Annotated[int, msgspec.Meta(ge=RECOVERY_FROZEN, le=RECOVERY_RESUMED)]
    end: U64 = 0


class RefusedEvent(_Event, tag=EV_REFUSED, frozen=True):
    """Disk only: in failure recovery generation ``gen`` this replica, the recovery's
    source, told the client of ``(client_id, seq)`` that the shard will not hold that
    record (NOT_HELD). Written and fsynced before that answer leaves: the client places
    the record in another shard on its word, so a restart before the recovery ends must
    still hand the key over at RESUME, for every replica to refuse a copy of that INSERT
    delayed in the network."""

    gen: U64
    client_id: U64
    seq: U64


class SnapshotEvent(_Event, tag=EV_SNAPSHOT, frozen=True):
    """Disk only: the state a segment file opens with, so no older segment is needed
    (``recovery``: the last :class:`RecoveryEvent` written, if any)."""

    ranges: list[tuple[U64, U64, Members]]
    frontier: U64
    stable: U64
    trim: U64
    recovery: RecoveryEvent | None = None
    #: the records this replica, as the source of ``recovery``'s generation, told their
    #: clients the shard will not hold (its :class:`RefusedEvent` s of that generation)
    refused: tuple[tuple[U64, U64], ...] = ()


class TruncateEvent(_Event, tag=EV_TRUNCATE, frozen=True):
    """Disk only: failure recovery dropped every record above ``base`` (an INSTALL follows)."""

    base: U64


#: A record event's encoded size beyond its data, at most (five msgpack integers and
#: the array and bin headers).
RECORD_EVENT_OVERHEAD = 56
#: A reference's encoded size, at most (six integers, the digest and the headers).
RECORD_REF_SIZE = 64 + DIGEST_BYTES


def record_size(data: bytes) -> int:
    """A record event's encoded size, at most."""
    return len(data) + RECORD_EVENT_OVERHEAD


def event_size(ev: "StreamEvent") -> int:
    """An event's encoded size, at most: what batches of events are bounded by."""
    if type(ev) is RecordEvent:
        return len(ev.data) + RECORD_EVENT_OVERHEAD
    if type(ev) is EpochEvent:
        return 24 + 9 * len(ev.members or ())
    if type(ev) is RecordRefEvent:
        return RECORD_REF_SIZE
    return 32


#: What a FORWARD carries.
StreamEvent = Union[RecordEvent, RecordRefEvent, FrontierEvent, EpochEvent]
#: What an INSTALL carries.
InstallEvent = Union[RecordEvent, EpochEvent]
#: What a segment file holds.
DiskEvent = Union[RecordEvent, FrontierEvent, EpochEvent, TrimEvent, StableEvent, SnapshotEvent, TruncateEvent,
                  RecoveryEvent, RefusedEvent]

_encoder = msgspec.msgpack.Encoder()
_disk_decoder = msgspec.msgpack.Decoder(DiskEvent)  # type: ignore[arg-type]


def encode_events(events: list[DiskEvent]) -> bytes:
    """Events as concatenated msgpack arrays (a segment file's body)."""
    enc = _encoder.encode
    return b"".join(enc(ev) for ev in events)


def encode_event(event: DiskEvent) -> bytes:
    return _encoder.encode(event)


def encode_events_into(events: list[DiskEvent], buf: bytearray) -> int:
    """``events`` encoded one after another (``encode_events``) into ``buf``, after a
    msgpack array header: one encoder call for a whole batch, into a buffer kept across
    batches. ``buf`` ends just past the last event; the events start at the offset
    returned (the header's length: 1, 3 or 5 bytes). msgspec cuts ``buf`` without giving
    its memory back, so a batch no larger than the one before allocates nothing (a larger
    one grows the buffer once). A bytes object for each 4 KiB record, grown by
    reallocation into memory then page-faulted, cost a loaded primary 12 % of its CPU;
    one ``encode_into`` per event would shrink and regrow the buffer as often."""
    _encoder.encode_into(events, buf, 0)
    first = buf[0]
    return 1 if first <= 0x9F else 3 if first == 0xDC else 5  # fixarray, array 16, array 32


def decode_events(blob: bytes) -> Iterator[tuple[DiskEvent, int]]:
    """Each event of a segment file's bytes with the offset just past it. Stops at the
    first event that is cut short or does not decode (a torn tail): what follows the last
    offset yielded is not a whole event."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(blob), 1 << 20))
    unpacker.feed(blob)
    start = 0
    view = memoryview(blob)
    while True:
        try:
            unpacker.skip()
        except msgpack.OutOfData:
            return
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            return
        end = unpacker.tell()
        try:
            ev = _disk_decoder.decode(view[start:end])
        except msgspec.MsgspecError:
            return
        yield ev, end
        start = end
