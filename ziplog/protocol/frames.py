"""Wire protocol: every frame is one ZeroMQ message part holding a msgpack array
``[version, op, ...fields]``. ``docs/PROTOCOL.md`` is the reference; keep the two in step.

Decoding validates shape and types so a malformed frame becomes a clear
:class:`ProtocolError` (and an ERROR reply), never an exception in a server loop.
"""

from __future__ import annotations

from typing import Any

import msgpack

PROTOCOL_VERSION = 1

# -- client -> storage server ----------------------------------------------------------
INSERT = 1  # [v, op, req_id, client_id, seq, after_gsn, data]
READ = 2  # [v, op, req_id, gsn]
TRIM = 3  # [v, op, req_id, gsn]
SUBSCRIBE = 4  # [v, op, sub_id, from_gsn, credit]
CREDIT = 5  # [v, op, sub_id, credit]
UNSUBSCRIBE = 6  # [v, op, sub_id]
STATUS = 7  # [v, op, req_id]

# -- storage server -> client ----------------------------------------------------------
ACK = 16  # [v, op, req_id, gsn, replica, stable, decided, final]
READ_OK = 17  # [v, op, req_id, gsn, data, stable_watermark]
TRIM_OK = 18  # [v, op, req_id, trim_point]
SUB_BATCH = 19  # [v, op, sub_id, records, epochs, progress]
STATUS_OK = 20  # [v, op, req_id, status_map]
ERROR = 31  # [v, op, req_id, code, message]

# -- replica <-> replica ---------------------------------------------------------------
HELLO = 32  # [v, op, shard, replica, frontier, guessed_top]  backup -> primary
FORWARD = 33  # [v, op, stable, [prev_frontier, prev_epoch, events]]  primary -> backup
PREFIX = 34  # [v, op, replica, frontier]                backup -> primary

# -- failure handler <-> storage server (dissertation 4.2.5) ------------------------------
SUSPECT = 40  # [v, op, shard, replica, reason]           replica PUSH -> handler PULL
PROBE = 41  # [v, op, req_id, gen]                        freeze for recovery gen, report state
ACQUIRED = 42  # [v, op, req_id, gen]                     your state is the recovery's: answer for it
FETCH = 43  # [v, op, req_id, gen, lo, hi, max_bytes]     decided records lo < gsn <= hi
INSTALL = 44  # [v, op, req_id, gen, base, trim, events, end]  truncate to base, apply, frontier end
RESUME = 45  # [v, op, req_id, gen, stable]               recovery done: serve again
RECOVERY_OK = 46  # [v, op, req_id, payload]              answer to PROBE..RESUME

# -- membership service ------------------------------------------------------------------
EPOCH = 48  # [v, op, epoch, shards, rates]              MMS PUB -> shards
RATE = 49  # [v, op, shard, epoch, count, duration_ns]   shard primary -> MMS PULL

# Decided-stream event kinds (inside FORWARD, on disk).
EV_RECORD = 0  # (kind, gsn, slot, client_id, seq, data)
EV_FRONTIER = 1  # (kind, frontier, epoch, next_slot)
EV_EPOCH = 2  # (kind, first_epoch, last_epoch, members)  members None = same as before
EV_TRIM = 3  # (kind, trim_point)
EV_TRUNCATE = 6  # (kind, base)  on disk only: recovery dropped everything decided above base

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

MAX_U64 = (1 << 64) - 1

#: Every SUB_BATCH costs this many bytes of the subscriber's credit on top of its
#: records, so a subscriber that stops reading stops receiving even progress-only
#: batches: nothing queues up without bound, and nothing is dropped on a full queue.
SUB_BATCH_COST = 1024

_packer = msgpack.Packer(use_bin_type=True)
pack = _packer.pack


class ProtocolError(Exception):
    """A frame that cannot be served; carries the error code and the request id if known."""

    def __init__(self, code: str, message: str, req_id: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.req_id = req_id


def unpack(frame: bytes) -> Any:
    return msgpack.unpackb(frame, raw=False, use_list=True, strict_map_key=False)


def _is_uint(x: Any) -> bool:
    return type(x) is int and 0 <= x <= MAX_U64


# field type checkers per client op: (name, checker)
_U = ("uint", _is_uint)
_B = ("bytes", lambda x: type(x) is bytes)

CLIENT_SCHEMAS: dict[int, tuple[tuple[str, Any], ...]] = {
    INSERT: (_U, _U, _U, _U, _B),
    READ: (_U, _U),
    TRIM: (_U, _U),
    SUBSCRIBE: (_U, _U, _U),
    CREDIT: (_U, _U),
    UNSUBSCRIBE: (_U,),
    STATUS: (_U,),
}

PEER_SCHEMAS: dict[int, tuple[tuple[str, Any], ...]] = {
    HELLO: (_U, _U, _U, _U),
    FORWARD: (_U, ("list", lambda x: type(x) is list)),
    PREFIX: (_U, _U),
    PROBE: (_U, _U),
    ACQUIRED: (_U, _U),
    FETCH: (_U, _U, _U, _U, _U),
    INSTALL: (_U, _U, _U, _U, ("list", lambda x: type(x) is list), _U),
    RESUME: (_U, _U, _U),
}


def decode_request(frame: bytes) -> list[Any]:
    """Decode and validate a frame sent to a storage server. Raises ProtocolError."""
    try:
        msg = unpack(frame)
    except Exception as exc:  # msgpack raises several types; all mean the same here
        raise ProtocolError(E_MALFORMED, f"not a msgpack frame ({type(exc).__name__})") from None
    if type(msg) is not list or len(msg) < 2:
        raise ProtocolError(E_MALFORMED, "frame must be a msgpack array [version, op, ...]")
    version, op = msg[0], msg[1]
    req_id = msg[2] if len(msg) > 2 and _is_uint(msg[2]) else None
    if version != PROTOCOL_VERSION:
        raise ProtocolError(E_VERSION, f"protocol version {version!r} unsupported, want {PROTOCOL_VERSION}", req_id)
    schema = CLIENT_SCHEMAS.get(op) if type(op) is int else None
    if schema is None:
        schema = PEER_SCHEMAS.get(op) if type(op) is int else None
    if schema is None:
        raise ProtocolError(E_UNKNOWN_OP, f"unknown op {op!r}", req_id)
    if len(msg) != 2 + len(schema):
        raise ProtocolError(E_MALFORMED, f"op {op} takes {len(schema)} fields, got {len(msg) - 2}", req_id)
    for i, (tname, check) in enumerate(schema):
        if not check(msg[2 + i]):
            raise ProtocolError(E_BAD_ARGUMENT, f"op {op} field {i} must be {tname}, got {type(msg[2 + i]).__name__}", req_id)
    return msg


def error_frame(req_id: int | None, code: str, message: str) -> bytes:
    return pack([PROTOCOL_VERSION, ERROR, req_id, code, message])
