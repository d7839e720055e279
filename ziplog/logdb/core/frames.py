"""LogDB's wire frames: a client asks the coordinator (the key's latest committed rid, a
transaction's outcome, a read set's validity) and a KV shard (a key's applied value).

One msgpack array per ZeroMQ frame, its first element the kind (a tag), like the log's
own frames; requests carry a ``req`` id the answer repeats. A client talks to a
coordinator or a KV shard from a DEALER socket; they answer on a ROUTER. Every request
is idempotent, so a client resends it to another coordinator replica when one does not
answer. A frame that does not decode gets ``Failed(req=0, code="BAD_REQUEST")`` and the
server keeps serving.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

from ziplog.logdb.core.records import MAX_KEY_BYTES, MAX_KEYS_PER_TXN, Rid
from ziplog.protocol.frames import MAX_DETAIL_CHARS
from ziplog.protocol.keys import Right

U64 = Annotated[int, msgspec.Meta(ge=0)]
Key = Annotated[bytes, msgspec.Meta(max_length=MAX_KEY_BYTES)]


class _Frame(msgspec.Struct, array_like=True, tag_field="kind", forbid_unknown_fields=True, gc=False):
    pass


# -- client -> coordinator ---------------------------------------------------------------------
class Latest(_Frame, tag=1):
    """The rid of ``key``'s latest committed write (``(0, 0)``: none), as of a position at
    or above ``min_gsn`` (the asker's session: it sees its own commits)."""
    req: U64
    key: Key
    min_gsn: U64 = 0


class Outcome(_Frame, tag=2):
    """Transaction ``txn``'s decision; its commit record is at ``commit_gsn`` (the answer
    waits until the coordinator has replayed that far)."""
    req: U64
    txn: U64
    commit_gsn: U64


class Validate(_Frame, tag=3):
    """Does every key of ``reads`` still have the committed write it names, at a position
    at or above ``min_gsn``? (A read-only transaction of several keys commits there.)"""
    req: U64
    reads: Annotated[dict[Key, Rid], msgspec.Meta(max_length=MAX_KEYS_PER_TXN)]
    min_gsn: U64 = 0


# -- client -> KV shard -------------------------------------------------------------------------
class KvGet(_Frame, tag=4):
    """The value this KV shard has applied for ``key`` (it must own the key)."""
    req: U64
    key: Key


# -- answers ------------------------------------------------------------------------------------
class LatestIs(_Frame, tag=11):
    req: U64
    gsn: U64
    shard: U64
    #: the coordinator's position when it answered: every commit up to it is decided
    position: U64


class OutcomeIs(_Frame, tag=12):
    req: U64
    committed: bool
    reason: str
    #: the deciding commit record (a resent commit record is decided by the first one)
    gsn: U64
    shard: U64


class Valid(_Frame, tag=13):
    req: U64
    ok: bool
    reason: str
    position: U64


class KvValue(_Frame, tag=14):
    req: U64
    found: bool
    #: None: the key was deleted (or never written)
    value: bytes | None
    #: the rid of the write applied last for the key ((0, 0): none)
    gsn: U64
    shard: U64
    #: every committed write up to this gsn is applied here
    applied: U64


class Failed(_Frame, tag=19):
    req: U64
    code: str
    message: str


Request = Union[Latest, Outcome, Validate, KvGet]
Answer = Union[LatestIs, OutcomeIs, Valid, KvValue, Failed]

#: The largest request a coordinator or KV shard takes (a Validate of the most keys a
#: transaction may read); larger messages are refused unread (ZMQ_MAXMSGSIZE).
REQUEST_LIMIT = MAX_KEYS_PER_TXN * (MAX_KEY_BYTES + 32) + (64 << 10)
#: The largest answer a client takes (a KvValue holds one value, at most a record).
ANSWER_LIMIT = 64 << 20

#: error codes of :class:`Failed`
BAD_REQUEST = "BAD_REQUEST"  # the frame does not decode, or asks what this server does not serve
BUSY = "BUSY"  # too many requests wait here: ask again later
UNKNOWN_TXN = "UNKNOWN_TXN"  # Outcome: the gsn asked holds no commit record of the transaction
FORGOTTEN = "FORGOTTEN"  # Outcome: the decision is older than this coordinator remembers: it cannot know
NOT_OWNER = "NOT_OWNER"  # this KV shard does not own the key
INTERNAL = "INTERNAL"  # the server failed while handling the request (logged; it goes on serving): ask again
FORBIDDEN = "FORBIDDEN"  # under CURVE: the client's key lacks the request's right (REQUEST_RIGHTS), or is not registered

#: the right each request needs under CURVE (``ziplog client add``): what a key may not
#: read from the log it may not read through LogDB either; an outcome is its committer's
REQUEST_RIGHTS: dict[type, Right] = {Latest: Right.READ, Validate: Right.READ, KvGet: Right.READ,
                                     Outcome: Right.APPEND}

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_answer_decoder = msgspec.msgpack.Decoder(Answer)


class BadFrame(ValueError):
    pass


def encode(frame: Request | Answer) -> bytes:
    return _encoder.encode(frame)


def decode_request(data: bytes) -> Request:
    """Total: a request, or :class:`BadFrame` (msgspec refuses whatever does not fit the
    types, and its depth limit on nesting surfaces as a RecursionError)."""
    try:
        return _request_decoder.decode(data)
    except (msgspec.MsgspecError, RecursionError) as exc:
        raise BadFrame(str(exc)[:MAX_DETAIL_CHARS]) from None


def decode_answer(data: bytes) -> Answer:
    """Total, like :func:`decode_request`."""
    try:
        return _answer_decoder.decode(data)
    except (msgspec.MsgspecError, RecursionError) as exc:
        raise BadFrame(str(exc)[:MAX_DETAIL_CHARS]) from None
