"""Every frame of the wire protocol: typed messages in, typed messages out, validated
at the edge. ``docs/PROTOCOL.md`` is the reference; keep the two in step.

A frame is one ZeroMQ message part holding a msgpack array ``[version, op, ...fields]``.
Each op is a msgspec struct here (``array_like``: its fields in order are the array, so
the bytes are exactly the documented layout), and each receiving edge has one decoder:

* :func:`decode_request`: what a storage server's ROUTER takes (clients, backups, the
  failure handler);
* :func:`decode_reply`: what a client's DEALER takes;
* :func:`decode_from_primary`, :func:`decode_epoch`, :func:`decode_rate`,
  :func:`decode_suspect`, :func:`decode_recovery_reply`: the other edges.

Frames that carry authority (``MEMBER_OPS``) are accepted only inside a SIGNED envelope
whose MAC the receiver checks with the cluster key (:mod:`ziplog.protocol.auth`):
:func:`seal` makes one, :func:`open_signed` opens one and decodes what it holds. The
same op sent bare earns UNAUTHENTICATED.

A decoder returns a typed message or raises :class:`ProtocolError` with the error code
the frame earns (and its request id when one can be read), so a bad frame becomes an
ERROR reply or a dropped frame, never an exception in a loop. Typed decoding validates
as it goes: a uint field takes only a non-negative integer (not a bool, a float or a
string), a data field only msgpack ``bin``, and an array of the wrong length is refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgpack
import msgspec

from ziplog.protocol.auth import ClusterKey
from ziplog.protocol.events import InstallEvent, Members, StreamEvent

PROTOCOL_VERSION = 1

# -- client -> storage server ----------------------------------------------------------
INSERT = 1
READ = 2
TRIM = 3
SUBSCRIBE = 4
CREDIT = 5
UNSUBSCRIBE = 6
STATUS = 7
RANGE = 8
COUNT = 9
# -- storage server -> client ----------------------------------------------------------
ACK = 16
READ_OK = 17
TRIM_OK = 18
SUB_BATCH = 19
STATUS_OK = 20
RANGE_OK = 21
COUNT_OK = 22
ACKS = 23
ERROR = 31
# -- replica <-> replica ---------------------------------------------------------------
HELLO = 32
FORWARD = 33
PREFIX = 34
# -- primary -> the other shards' primaries ------------------------------------------------
NOTICE = 35
# -- failure handler <-> storage server (dissertation 4.2.5) ------------------------------
SUSPECT = 40
PROBE = 41
ACQUIRED = 42
FETCH = 43
INSTALL = 44
RESUME = 45
RECOVERY_OK = 46
# -- membership service ------------------------------------------------------------------
EPOCH = 48
RATE = 49
EPOCH_SAME = 51
# -- between cluster members --------------------------------------------------------------
SIGNED = 50

# Error codes (strings on the wire so other languages need no table).
E_MALFORMED = "MALFORMED"
E_VERSION = "UNSUPPORTED_VERSION"
E_UNKNOWN_OP = "UNKNOWN_OP"
E_BAD_ARGUMENT = "BAD_ARGUMENT"
E_TOO_LARGE = "TOO_LARGE"
E_NOT_FOUND = "NOT_FOUND"
E_TRIMMED = "TRIMMED"
E_NOT_MEMBER = "NOT_MEMBER"
E_UNKNOWN_RID = "UNKNOWN_RID"
E_TIMEOUT = "TIMEOUT"
E_NOT_READY = "NOT_READY"
#: The shard is frozen for failure recovery; this replica cannot say yet whether the
#: record will be in the log. Not final: ask again.
E_FROZEN = "FROZEN"
#: Final: the recovered shard will not hold this record. Insert it on another shard.
E_NOT_HELD = "NOT_HELD"
#: A backup's answer: it holds no copy of the record and will not guess one; only the
#: primary's decision can place it.
E_NO_GUESS = "NO_GUESS"
E_STALE = "STALE"
#: The replica holds its limit of waiting requests or of subscriptions: try again later.
E_OVERLOADED = "OVERLOADED"
#: The op is accepted only sealed by a cluster member, and this frame was not (or its
#: MAC is wrong).
E_UNAUTHENTICATED = "UNAUTHENTICATED"
#: The replica cannot write its disk (full, or failing): it takes no new records until
#: it can. From a primary a final refusal; from a backup, like NO_GUESS (it holds no copy).
E_DISK_FULL = "DISK_FULL"
#: The replica holds its limit of record bytes in memory (``--max-log-memory-mb``): it
#: takes no new records until a trim frees some. From a primary a final refusal; from a
#: backup, like NO_GUESS (it holds no copy).
E_LOG_FULL = "LOG_FULL"
#: The recovery generation is not the one the failure handler committed in ZooKeeper.
E_UNCOMMITTED = "UNCOMMITTED"
#: The connection's CURVE key lacks the right the op needs (append, read, trim, admin),
#: or is not registered (``ziplog client add``). Nothing of the request took effect.
E_FORBIDDEN = "FORBIDDEN"
#: Under CURVE: the server cannot show that it holds the current client key registry
#: (its registry lease lapsed), so it judges no client key now. Nothing of the request
#: took effect; not final: ask again (another replica, or later).
E_REGISTRY_LAPSED = "REGISTRY_LAPSED"
#: The server failed while handling this request (a bug: it dropped the request, logged
#: it and goes on serving). Nothing of the request took effect; resending it is safe.
E_INTERNAL = "INTERNAL"

MAX_U64 = (1 << 64) - 1

# -- how large a frame each receiving edge takes ------------------------------------------
# Every socket refuses a message larger than its edge's limit before reading it into
# memory (libzmq's ZMQ_MAXMSGSIZE): the sender is disconnected. Batches are bounded so
# that no legitimate frame comes near: a FORWARD carries at most forward_batch_bytes of
# events (or one record), an INSTALL at most INSTALL_PART_BYTES of records.

#: The largest record a storage server takes by default (``--max-record-bytes``).
MAX_RECORD_BYTES = 1 << 20
#: An INSTALL carries at most this many bytes of records (or one larger record).
INSTALL_PART_BYTES = 1 << 20
#: Room for everything in a frame beside its records (ids, epochs, memberships).
FRAME_HEADROOM = 1 << 20
#: SUSPECT and RATE, sealed (the MMS's and the failure handler's PULLs).
CONTROL_FRAME_LIMIT = 64 << 10
#: EPOCH broadcasts (a few bytes per member shard).
EPOCH_FRAME_LIMIT = 16 << 20
#: the most reports one RATE frame carries (each at most 30 bytes: well within a
#: control frame)
MAX_RATE_REPORTS = 1000
#: What a client takes from a storage server (READ_OK, SUB_BATCH, RANGE_OK carry up to
#: about 1 MiB, or one record): servers must not take records near it.
CLIENT_REPLY_LIMIT = 64 << 20
#: What the failure handler takes from a replica (a PROBE answer holds every record
#: above the replica's stable point; a FETCH answer up to its max_bytes).
RECOVERY_REPLY_LIMIT = 256 << 20


def request_limit(max_record_bytes: int) -> int:
    """A storage server's ROUTER: an INSERT of the largest record, an INSTALL part."""
    return max(max_record_bytes, INSTALL_PART_BYTES) + FRAME_HEADROOM


def forward_limit(forward_batch_bytes: int, max_record_bytes: int) -> int:
    """A backup's link to its primary: a FORWARD."""
    return max(forward_batch_bytes, max_record_bytes) + FRAME_HEADROOM


#: Every SUB_BATCH costs this many bytes of the subscriber's credit on top of its
#: records, so a subscriber that stops reading stops receiving even progress-only
#: batches: nothing queues up without bound, and nothing is dropped on a full queue.
SUB_BATCH_COST = 1024

#: What batches of records are bounded by: a record's encoding beyond its data, an
#: estimate within a few bytes. In RANGE_OK and SUB_BATCH a record is ``[gsn, data]``
#: (an array header, a 64-bit integer, a bin header); in FETCH_OK it is ``[gsn,
#: client_id, seq, data]``.
RANGE_RECORD_OVERHEAD = 16
FETCH_RECORD_OVERHEAD = 32

#: how much of a decoder's complaint an error message quotes (a hostile frame must not
#: make a long one)
MAX_DETAIL_CHARS = 200

#: A non-negative integer that fits msgpack (whose widest integer is uint64).
U64 = Annotated[int, msgspec.Meta(ge=0)]
#: An epoch number that is -1 before the first epoch.
Epoch = Annotated[int, msgspec.Meta(ge=-1)]


class Frame(msgspec.Struct, array_like=True, gc=False, kw_only=True, forbid_unknown_fields=True):
    """Base of every frame: the version, then (in each subclass) the op."""

    v: int = PROTOCOL_VERSION


# -- client -> storage server ----------------------------------------------------------
class Insert(Frame, kw_only=True):
    """Insert ``data`` anywhere after gsn ``after``; ``(client_id, seq)`` names the record
    across resends and redirects. ``stamp`` (optional, 0: none) is when the client sent
    it, in wall-clock nanoseconds: the replicas take the inserts that reach them in one
    turn in stamp order, so that they place concurrent inserts alike (the fast path).
    It orders nothing else and decides nothing."""
    op: int = INSERT
    req_id: U64
    client_id: U64
    seq: U64
    after: U64
    data: bytes
    stamp: U64 = 0


class Read(Frame, kw_only=True):
    op: int = READ
    req_id: U64
    gsn: U64


class Trim(Frame, kw_only=True):
    op: int = TRIM
    req_id: U64
    gsn: U64


class Subscribe(Frame, kw_only=True):
    op: int = SUBSCRIBE
    sub_id: U64
    from_gsn: U64
    credit: U64


class Credit(Frame, kw_only=True):
    op: int = CREDIT
    sub_id: U64
    credit: U64


class Unsubscribe(Frame, kw_only=True):
    op: int = UNSUBSCRIBE
    sub_id: U64


class Status(Frame, kw_only=True):
    op: int = STATUS
    req_id: U64


class Range(Frame, kw_only=True):
    """This shard's stable records with ``lo <= gsn <= hi``, from ``lo`` on, up to about
    ``max_bytes`` of data (at least one record)."""
    op: int = RANGE
    req_id: U64
    lo: U64
    hi: U64
    max_bytes: U64


class Count(Frame, kw_only=True):
    """How many stable records this shard holds with ``lo <= gsn <= hi``, and the gsn of
    the ``nth`` of them (1-based; 0: not asked). Moves no data."""
    op: int = COUNT
    req_id: U64
    lo: U64
    hi: U64
    nth: U64


# -- storage server -> client ----------------------------------------------------------
class Ack(Frame, kw_only=True):
    """``gsn`` for the insert ``req_id``: the decision when ``decided`` (always from the
    primary), a backup's guess otherwise; ``final`` from the replica a recovery keeps.
    ``inc`` (optional, 0: not said) names the primary incarnation whose decision ``gsn``
    is, or a backup's guess of: the primary's own, the one a backup follows. A client
    counts a backup's ACK as agreeing with the primary's only when both name the same
    incarnation (a guess made for a restarted primary never matches a decision its
    previous incarnation took and lost)."""
    op: int = ACK
    req_id: U64
    gsn: U64
    replica: U64
    stable: U64
    decided: bool
    final: bool
    inc: U64 = 0


class Acks(Frame, kw_only=True):
    """Several ACKs to one client from one replica's turn, in one frame: each element is
    exactly an ACK frame's array. A replica sends this instead of two or more ACK frames
    to the same connection (a pipelining client's inserts, read in one turn)."""
    op: int = ACKS
    acks: list[Ack]


class ReadOk(Frame, kw_only=True):
    op: int = READ_OK
    req_id: U64
    gsn: U64
    data: bytes
    stable: U64


class TrimOk(Frame, kw_only=True):
    op: int = TRIM_OK
    req_id: U64
    trim_point: U64


class SubBatch(Frame, kw_only=True):
    """Records in gsn order, the members of every epoch up to ``progress``, and
    ``progress``: every position of the shard up to it is stable and was sent."""
    op: int = SUB_BATCH
    sub_id: U64
    records: list[tuple[U64, bytes]]
    epochs: list[tuple[U64, U64, Members]]
    progress: U64

    @property
    def req_id(self) -> int:
        """Answers to a subscription name it by its ``sub_id`` (an ERROR does too)."""
        return self.sub_id


class StatusOk(Frame, kw_only=True):
    op: int = STATUS_OK
    req_id: U64
    status: dict[str, Any]


class RangeOk(Frame, kw_only=True):
    """``records`` (gsn order) are every record of the range up to ``upto``: the next
    request starts at ``upto + 1``. ``upto < hi`` when the batch was full, or when the
    replica's stable watermark (``stable``) is below ``hi``."""
    op: int = RANGE_OK
    req_id: U64
    records: list[tuple[U64, bytes]]
    upto: U64
    stable: U64


class CountOk(Frame, kw_only=True):
    """``count`` records with ``lo <= gsn <= min(hi, upto)``; ``nth_gsn`` the gsn of the
    ``nth`` (0 if there are fewer); ``upto`` = min(hi, the replica's stable watermark)."""
    op: int = COUNT_OK
    req_id: U64
    count: U64
    nth_gsn: U64
    upto: U64


class Error(Frame, kw_only=True):
    """The request ``req_id`` (None when it could not be read) failed with ``code``."""
    op: int = ERROR
    req_id: U64 | None
    code: str
    message: str


# -- replica <-> replica ---------------------------------------------------------------
class Hello(Frame, kw_only=True):
    """A backup's state (its frontier, its highest guess) for the primary incarnation
    ``to_inc`` (as the primary's registration names it), from backup incarnation
    ``inc``. Both optional (0: a backup of a build before them, which cannot say): a
    primary acts only on a HELLO meant for its own incarnation."""
    op: int = HELLO
    shard: U64
    replica: U64
    frontier: U64
    guessed_top: U64
    to_inc: U64 = 0
    inc: U64 = 0


class ForwardBody(msgspec.Struct, array_like=True, gc=False, forbid_unknown_fields=True):
    """The backup must be at ``(prev_frontier, prev_epoch)`` to apply ``events``."""
    prev_frontier: U64
    prev_epoch: Epoch
    events: list[StreamEvent]


class Forward(Frame, kw_only=True):
    """The primary's decided stream. ``to_inc``: the backup incarnation it is meant for
    (the one whose HELLO the primary took); ``inc``: the primary incarnation that sent it.
    Both optional (0: left out, for a backup whose HELLO did not name its incarnation);
    a backup applies only a FORWARD meant for it from the primary it follows."""
    op: int = FORWARD
    stable: U64
    body: ForwardBody
    to_inc: U64 = 0
    inc: U64 = 0


class Prefix(Frame, kw_only=True):
    """A backup's frontier, for the primary incarnation ``to_inc`` (optional, 0: not
    said); a primary takes it only on the connection whose HELLO it took."""
    op: int = PREFIX
    replica: U64
    frontier: U64
    to_inc: U64 = 0


class Notice(Frame, kw_only=True):
    """Shard ``shard`` decided a record at ``gsn`` in ``epoch``: a receiving primary with
    nothing of its own below it passes ``gsn`` now (its unused slots up to it become
    no-ops) rather than when its schedule's clock says so, and a receiving backup guesses
    past it as its primary will. ``stamp`` (optional): when it was sent, in wall-clock
    nanoseconds; a replica takes it in stamp order with the turn's inserts. ``hosted``
    (optional): it is for every replica the receiving process serves (of a shard other
    than ``shard``), not only the one it reached: a sender sends one NOTICE to a process
    that serves several of the replicas it tells."""
    op: int = NOTICE
    shard: U64
    epoch: U64
    gsn: U64
    stamp: U64 = 0
    hosted: bool = False


# -- failure handler <-> storage server ---------------------------------------------------
class Suspect(Frame, kw_only=True):
    op: int = SUSPECT
    shard: U64
    replica: U64
    reason: str


class Probe(Frame, kw_only=True):
    op: int = PROBE
    req_id: U64
    gen: U64


class Acquired(Frame, kw_only=True):
    op: int = ACQUIRED
    req_id: U64
    gen: U64


class Fetch(Frame, kw_only=True):
    op: int = FETCH
    req_id: U64
    gen: U64
    lo: U64
    hi: U64
    max_bytes: U64


class Install(Frame, kw_only=True):
    op: int = INSTALL
    req_id: U64
    gen: U64
    base: U64
    trim: U64
    events: list[InstallEvent]
    end: U64


class Resume(Frame, kw_only=True):
    """``refused``: (client_id, seq) of records the recovery's source told clients this
    shard will not hold: the replica refuses them from now on."""
    op: int = RESUME
    req_id: U64
    gen: U64
    stable: U64
    refused: list[tuple[U64, U64]]


class Signed(Frame, kw_only=True):
    """An authority frame from a cluster member: ``frame`` is the whole inner frame, and
    ``mac`` is its keyed BLAKE2b-256 under the cluster's frame key."""
    op: int = SIGNED
    frame: bytes
    mac: bytes


class RecoveryOk(Frame, kw_only=True):
    op: int = RECOVERY_OK
    req_id: U64
    payload: dict[str, Any]


# -- membership service ------------------------------------------------------------------
class EpochStart(Frame, kw_only=True):
    """EPOCH: the configuration of ``epoch`` (members sorted, one rate each), and the id
    of the membership service replica that leads (primaries send their rate reports to
    it alone; None: not said, send to every replica). ``stamp`` (0: none) is when the
    leader sent it, in wall-clock nanoseconds: both replicas of a shard take the epoch at
    that place among the inserts their turn holds (by the inserts' stamps), however late
    each read it. It orders nothing else and decides nothing."""
    op: int = EPOCH
    epoch: U64
    shards: Members
    rates: tuple[U64, ...]
    leader: U64 | None = None
    stamp: U64 = 0


class EpochSame(Frame, kw_only=True):
    """EPOCH_SAME: ``epoch`` has the configuration of epoch ``base``, an earlier epoch of
    the same committed block whose EPOCH carried it (``ziplog.protocol.epoch_feed``);
    ``leader`` and ``stamp`` as in EPOCH. A few bytes whatever the number of shards."""
    op: int = EPOCH_SAME
    epoch: U64
    base: U64
    leader: U64 | None = None
    stamp: U64 = 0


class RateEntry(msgspec.Struct, array_like=True, gc=False, forbid_unknown_fields=True):
    """One primary's report: its smoothed rate (records/s) as of ``epoch``, and whether
    it took records lately (``ziplog.cores.replica.rate_report``)."""
    shard: U64
    epoch: U64
    rate: U64
    busy: bool


class Rate(Frame, kw_only=True):
    """RATE: the reports of one storage process's turn (one or more of its primaries)."""
    op: int = RATE
    reports: list[RateEntry]


ClientRequest = Union[Insert, Read, Trim, Subscribe, Credit, Unsubscribe, Status, Range, Count]
PeerRequest = Union[Hello, Prefix, Notice]
RecoveryRequest = Union[Probe, Acquired, Fetch, Install, Resume]
Request = Union[ClientRequest, PeerRequest, RecoveryRequest]
Reply = Union[Ack, ReadOk, TrimOk, SubBatch, StatusOk, RangeOk, CountOk, Error]
#: What a client's DEALER takes: a reply, or several ACKs in one frame.
ReplyFrame = Union[Reply, Acks]

#: Frames a storage server's ROUTER takes bare, by op (FORWARD is not one of them: it
#: comes only from the primary, on a backup's own connection).
REQUESTS: dict[int, type[Frame]] = {
    INSERT: Insert, READ: Read, TRIM: Trim, SUBSCRIBE: Subscribe, CREDIT: Credit, UNSUBSCRIBE: Unsubscribe,
    STATUS: Status, RANGE: Range, COUNT: Count, SIGNED: Signed,
}
#: Frames a storage server's ROUTER takes only sealed by a cluster member.
MEMBER_REQUESTS: dict[int, type[Frame]] = {
    HELLO: Hello, PREFIX: Prefix, NOTICE: Notice, PROBE: Probe, ACQUIRED: Acquired, FETCH: Fetch, INSTALL: Install, RESUME: Resume,
}
#: Every op that carries authority: accepted only in a SIGNED envelope.
MEMBER_OPS = frozenset((*MEMBER_REQUESTS, SUSPECT, RATE))
#: Frames a client's DEALER takes.
REPLIES: dict[int, type[Frame]] = {
    ACK: Ack, READ_OK: ReadOk, TRIM_OK: TrimOk, SUB_BATCH: SubBatch, STATUS_OK: StatusOk, RANGE_OK: RangeOk,
    COUNT_OK: CountOk, ERROR: Error, ACKS: Acks,
}
FROM_PRIMARY: dict[int, type[Frame]] = {FORWARD: Forward, ERROR: Error}
RECOVERY_REPLIES: dict[int, type[Frame]] = {RECOVERY_OK: RecoveryOk, ERROR: Error}
EPOCHS: dict[int, type[Frame]] = {EPOCH: EpochStart, EPOCH_SAME: EpochSame}
RATES: dict[int, type[Frame]] = {RATE: Rate}
SUSPECTS: dict[int, type[Frame]] = {SUSPECT: Suspect}
SIGNED_ONLY: dict[int, type[Frame]] = {SIGNED: Signed}


class ProtocolError(Exception):
    """A frame that cannot be served; carries the error code and the request id if known."""

    def __init__(self, code: str, message: str, req_id: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.req_id = req_id


def wall_stamp(now: int, wall_offset_ns: int) -> int:
    """The ``stamp`` of an INSERT, NOTICE or held epoch taken at monotonic ``now``: that
    moment on the wall clock (``ports.wall_offset_ns`` gives the offset), never below 0."""
    return max(now + wall_offset_ns, 0)


_encoder = msgspec.msgpack.Encoder()
#: A typed message as its frame.
encode = _encoder.encode


class _EdgeDecoder:
    """Decodes the frames one edge takes. The fast path reads the op from the frame's
    third byte (a msgpack fixarray whose first element is the positive fixint version
    1 puts a small op there) and decodes straight into that op's struct, which checks
    every field as it goes. Anything else, and any frame the typed decoder refuses,
    takes the slow path, which finds the precise error code."""

    def __init__(self, table: dict[int, type[Frame]], check_version: bool = True) -> None:
        self.table = table
        self.check_version = check_version
        #: ops this edge takes, but only sealed (a bare one earns UNAUTHENTICATED)
        self.sealed_ops = MEMBER_OPS if SIGNED in table else frozenset()
        self.decoders: dict[int, Any] = {op: msgspec.msgpack.Decoder(cls) for op, cls in table.items()}

    def __call__(self, frame: bytes) -> Any:
        """Total: any bytes give a typed message or raise :class:`ProtocolError`."""
        if len(frame) > 2 and 0x90 <= frame[0] <= 0x9F and frame[1] == PROTOCOL_VERSION:
            dec = self.decoders.get(frame[2])
            if dec is not None:
                try:
                    return dec.decode(frame)
                except (msgspec.MsgspecError, RecursionError):  # msgspec's depth limit is a RecursionError
                    pass
        try:
            return self._slow(frame)
        except ProtocolError:
            raise
        except Exception as exc:  # a shape no check above foresaw: still the frame's fault
            raise ProtocolError(E_MALFORMED, f"undecodable frame ({type(exc).__name__})") from None

    def _slow(self, frame: bytes) -> Any:
        """The frame's message, or the ProtocolError it earns, checked in this order:
        authority (below), msgpack, an array of two or more, the version, the op, the
        number of fields, their types. (A frame gets here when it is bad, or when a field
        is encoded in an unusual but valid way, such as a version of an edge that does
        not check it.)
        Every value read from the frame may be any msgpack value (an array where an int
        belongs, a map, a float, a huge integer): each is type-checked before it is used."""
        # Authority is judged first, by the op alone (read without building the version
        # before it or anything after it): a SIGNED frame is exactly [1, SIGNED, frame:bin,
        # mac:bin] or earns UNAUTHENTICATED, and a sealed op sent bare earns it, whatever
        # else is wrong with either (its version, its fields, bytes msgpack cannot build).
        # Nothing an outsider sends as authority is parsed further.
        if self.sealed_ops:  # (so SIGNED is in the table, and no sealed op is)
            peeked = element_int(frame, 1)
            if peeked == SIGNED:
                return _exact_envelope(frame)
            if peeked in self.sealed_ops:
                req_id = element_int(frame, 2)
                raise ProtocolError(E_UNAUTHENTICATED, f"op {peeked} is accepted only sealed by a cluster member",
                                    req_id if req_id is not None and req_id >= 0 else None)
        try:
            msg = msgpack.unpackb(frame, raw=False, use_list=True, strict_map_key=False)
        except Exception as exc:  # msgpack raises several types; all mean the same here
            raise ProtocolError(E_MALFORMED, f"not a msgpack frame ({type(exc).__name__})") from None
        if type(msg) is not list or len(msg) < 2:
            raise ProtocolError(E_MALFORMED, "frame must be a msgpack array [version, op, ...]")
        version, op = msg[0], msg[1]
        req_id = msg[2] if len(msg) > 2 and type(msg[2]) is int and 0 <= msg[2] <= MAX_U64 else None
        if self.check_version and (type(version) is not int or version != PROTOCOL_VERSION):
            raise ProtocolError(E_VERSION, f"protocol version {_show(version)} unsupported, want {PROTOCOL_VERSION}",
                                req_id)
        if type(op) is not int:
            raise ProtocolError(E_UNKNOWN_OP, f"op must be an integer, got {type(op).__name__}", req_id)
        cls = self.table.get(op)
        if cls is None and op in self.sealed_ops:
            raise ProtocolError(E_UNAUTHENTICATED, f"op {op} is accepted only sealed by a cluster member", req_id)
        if cls is None:
            raise ProtocolError(E_UNKNOWN_OP, f"unknown op {_show(op)}", req_id)
        nfields = len(cls.__struct_fields__)
        optional = _optional_tail(cls)
        if not nfields - optional <= len(msg) <= nfields:
            takes = f"{nfields - 2}" if not optional else f"{nfields - 2 - optional} to {nfields - 2}"
            raise ProtocolError(E_MALFORMED, f"op {op} takes {takes} fields, got {len(msg) - 2}", req_id)
        try:  # the typed decoder again, on the frame as it would be with version 1
            return msgspec.msgpack.decode(msgpack.packb([PROTOCOL_VERSION, *msg[1:]], use_bin_type=True), type=cls)
        except msgspec.ValidationError as exc:
            raise ProtocolError(E_BAD_ARGUMENT, f"op {op}: {_field_error(str(exc), cls)}", req_id) from None
        except (msgspec.MsgspecError, ValueError, TypeError, OverflowError) as exc:
            raise ProtocolError(E_BAD_ARGUMENT, f"op {op}: a field cannot be read ({type(exc).__name__})",
                                req_id) from None


def element_int(frame: bytes, index: int) -> int | None:
    """Element ``index`` of ``frame``, a msgpack array, if it is an integer, or None (not
    an array, too few elements, cut short, another type). Read from its own header:
    nothing before it is built (msgpack skips it, following up to 1024 levels of
    nesting), nothing after it is read."""
    if frame and 0x90 + index < frame[0] <= 0x9F and all(b <= 0x7F or b >= 0xE0 for b in frame[1:1 + index]):
        return _int_at(frame, 1 + index)  # the usual shape: a fixarray, fixints before the element
    try:
        # (nothing is built, so no count needs a bound but the frame's length: msgpack's widest)
        unpacker = msgpack.Unpacker(max_buffer_size=max(len(frame), 1 << 10), max_array_len=(1 << 32) - 1,
                                    max_map_len=(1 << 32) - 1)
        unpacker.feed(frame)
        if unpacker.read_array_header() <= index:
            return None
        for _ in range(index):
            unpacker.skip()
        at = unpacker.tell()
    except Exception:  # not an array, or cut short or not msgpack before the element
        return None
    return _int_at(frame, at)


#: msgpack's integer formats beyond the fixints: type byte -> (bytes that follow, signed)
_INT_FORMATS = {0xCC: (1, False), 0xCD: (2, False), 0xCE: (4, False), 0xCF: (8, False),
                0xD0: (1, True), 0xD1: (2, True), 0xD2: (4, True), 0xD3: (8, True)}


def _int_at(frame: bytes, i: int) -> int | None:
    """The integer whose header is at ``frame[i]``, in any of msgpack's encodings; None
    when no whole integer is there."""
    if i >= len(frame):
        return None
    b = frame[i]
    if b <= 0x7F or b >= 0xE0:  # positive and negative fixint
        return b if b <= 0x7F else b - 0x100
    fmt = _INT_FORMATS.get(b)
    if fmt is None or i + 1 + fmt[0] > len(frame):
        return None
    return int.from_bytes(frame[i + 1:i + 1 + fmt[0]], "big", signed=fmt[1])


_signed_decoder = msgspec.msgpack.Decoder(Signed)


def _exact_envelope(frame: bytes) -> Signed:
    """``frame``, whose op is SIGNED, as its envelope if it is exactly ``[1, SIGNED,
    frame:bin, mac:bin]`` with nothing after it (its integers and headers in any of
    msgpack's encodings); UNAUTHENTICATED otherwise. The typed decoder reads it header
    by header and stops at the first that departs from that shape (an array of another
    length, a field of another type): the inner frame and the MAC are copied, never
    parsed, and nothing else is built. :func:`open_envelope` checks the MAC."""
    try:
        msg = _signed_decoder.decode(frame)
    except (msgspec.MsgspecError, RecursionError):
        msg = None
    if msg is None or msg.v != PROTOCOL_VERSION or msg.op != SIGNED:
        raise ProtocolError(E_UNAUTHENTICATED, "a SIGNED frame must be exactly [1, 50, frame:bin, mac:bin]")
    return msg


def _optional_tail(cls: type[Frame]) -> int:
    """How many of a frame's last fields may be left out (they have defaults; the
    version and op, which lead every frame, are never among them)."""
    n = 0
    for default in reversed(cls.__struct_defaults__[2:]):
        if default is msgspec.NODEFAULT:
            break
        n += 1
    return n


def _show(value: Any) -> str:
    """A value from a frame, for an error message: short whatever it is."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _field_error(text: str, cls: type[Frame]) -> str:
    """msgspec's ``Expected `int`, got `str` - at `$[3]``` with the field's name."""
    head, sep, where = text.partition(" - at `$[")
    if not sep:
        return text
    index = where.split("]", 1)[0]
    if index.isdigit() and int(index) < len(cls.__struct_fields__):
        return f"field {cls.__struct_fields__[int(index)]}: {head}"
    return text


#: A frame sent to a storage server (clients; cluster members' frames come SIGNED).
decode_request = _EdgeDecoder(REQUESTS)
#: What a SIGNED frame to a storage server may hold (backups, the failure handler).
decode_member_request = _EdgeDecoder(MEMBER_REQUESTS)
#: A storage server's answer to a client.
decode_reply = _EdgeDecoder(REPLIES)
#: What a backup's connection to its primary carries (the version is not checked).
decode_from_primary = _EdgeDecoder(FROM_PRIMARY, check_version=False)
#: A storage replica's answer to the failure handler.
decode_recovery_reply = _EdgeDecoder(RECOVERY_REPLIES)
#: An epoch broadcast (the version is not checked).
decode_epoch = _EdgeDecoder(EPOCHS, check_version=False)
#: What the membership service's PULL and the failure handler's PULL take: SIGNED only.
decode_signed = _EdgeDecoder(SIGNED_ONLY)
#: A primary's rate report, inside a SIGNED envelope (the version is not checked).
decode_rate = _EdgeDecoder(RATES, check_version=False)
#: A replica's suspicion report, inside a SIGNED envelope.
decode_suspect = _EdgeDecoder(SUSPECTS)


def seal(key: ClusterKey, frame: bytes) -> bytes:
    """``frame`` in a SIGNED envelope under the cluster's key."""
    return encode(Signed(frame=frame, mac=key.mac(frame)))


def open_signed(key: ClusterKey, envelope: bytes, inner: _EdgeDecoder) -> Any:
    """The message a SIGNED frame holds, decoded by ``inner``; ProtocolError when the
    frame is not SIGNED, its MAC is wrong, or what it holds is bad."""
    msg = decode_signed(envelope)
    return open_envelope(key, msg, inner)


def open_envelope(key: ClusterKey, msg: Signed, inner: _EdgeDecoder) -> Any:
    """The message a decoded SIGNED frame holds (see :func:`open_signed`): the MAC is
    checked over the inner frame's raw bytes before anything of them is read."""
    if not key.verify(msg.frame, msg.mac):
        raise ProtocolError(E_UNAUTHENTICATED, "bad MAC: not sealed with this cluster's key")
    return inner(msg.frame)


def request_id_of(frame: bytes) -> int | None:
    """The request id a frame carries in the third place, if it can be read (for an
    ERROR to a request whose handling failed after it decoded)."""
    try:
        msg = msgpack.unpackb(frame, raw=False, use_list=True, strict_map_key=False)
    except Exception:
        return None
    if type(msg) is list and len(msg) > 2 and type(msg[2]) is int and 0 <= msg[2] <= MAX_U64:
        return msg[2]
    return None


def error_frame(req_id: int | None, code: str, message: str) -> bytes:
    return encode(Error(req_id=req_id, code=code, message=message))


#: What a storage server of this build reads beyond the frames of the builds before it
#: (its registration says so, ``"reads"``): a level, each including those below it. A
#: sender puts those fields in only for receivers that read them; without them the
#: frames are byte for byte those of the builds before, so a rolling upgrade never sends
#: a server a frame it refuses.
#:
#: 1 (:data:`READS_STAMP`): an EPOCH's and an EPOCH_SAME's ``stamp``, a NOTICE's ``hosted``;
#: 2 (:data:`READS_FENCE`): the incarnations a HELLO, FORWARD and PREFIX name (``to_inc``,
#: ``inc``). A server of this level also acts on a HELLO that names none only from a
#: backup whose registration says it cannot (a level below 2).
READS_STAMP = 1
READS_FENCE = 2
READS = READS_FENCE


def encode_compact(msg: Frame) -> bytes:
    """``msg`` without its trailing fields that hold their defaults (a receiver takes
    an optional tail left out): EPOCH, EPOCH_SAME and NOTICE grew fields, and a server
    of an earlier build refuses a frame longer than it knows."""
    fields = msg.__struct_fields__
    defaults = msg.__struct_defaults__
    values = [getattr(msg, name) for name in fields]
    n = len(values)
    while n > 2 and defaults[n - 1] is not msgspec.NODEFAULT and values[n - 1] == defaults[n - 1]:
        n -= 1
    return encode(values[:n])


class EpochEncoder:
    """EPOCH frames of a sequence of epochs that share one configuration: only the
    epoch number differs, so the rest is encoded once per configuration (a membership
    of thousands of shards costs more to encode than an epoch lasts)."""

    def __init__(self, leader: int | None = None) -> None:
        #: the broadcasting replica's id, named in every frame (None: not named)
        self.leader = leader
        self._key: tuple[Members, tuple[int, ...]] | None = None
        self._middle = b""
        #: the array's header and the version and op: six elements, seven with a stamp
        self._heads = {False: b"\x96" + encode(PROTOCOL_VERSION) + encode(EPOCH),
                       True: b"\x97" + encode(PROTOCOL_VERSION) + encode(EPOCH)}

    def encode(self, epoch: int, shards: Members, rates: tuple[int, ...], stamp: int = 0) -> bytes:
        """The EPOCH of ``epoch``; ``stamp`` 0 leaves it out (:data:`READS_STAMP`)."""
        key = (shards, rates)
        tail = encode(stamp) if stamp else b""
        if self._key is None or self._key[0] is not shards or self._key[1] is not rates:
            self._middle = encode(shards) + encode(rates) + encode(self.leader)
            self._key = key
            frame = self._heads[bool(stamp)] + encode(epoch) + self._middle + tail
            assert decode_epoch(frame) == EpochStart(epoch=epoch, shards=shards, rates=rates, leader=self.leader,
                                                     stamp=stamp), frame
            return frame
        return self._heads[bool(stamp)] + encode(epoch) + self._middle + tail

    def encode_same(self, epoch: int, base: int, stamp: int = 0) -> bytes:
        """The EPOCH_SAME of ``epoch``, whose configuration is that of ``base`` (``stamp``
        0 leaves it out, and so does a nil ``leader`` then)."""
        return encode_compact(EpochSame(epoch=epoch, base=base, leader=self.leader, stamp=stamp))
