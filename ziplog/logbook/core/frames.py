"""The LogBook index tier's wire frames (IndiLog's index nodes, their feeder, the
aggregator, and the engines that ask them).

One msgpack array per ZeroMQ frame, its first element the kind (a tag); requests carry
a ``req`` id the answer repeats. Index nodes and aggregators answer on a ROUTER; the
feeder and the engines talk from DEALERs.

* ``Feed`` (feeder -> index node) carries authority (it decides what a node's answers
  are): a node takes it only inside a ``Signed`` envelope whose MAC the cluster key
  checks (:mod:`ziplog.protocol.auth`); a bare one is answered UNAUTHENTICATED.
* ``Lookup`` and ``Status`` (anyone -> index node or aggregator) read only. A Lookup
  may ask for the hit's record with the answer (``record``): an index node keeps the
  bytes of its recent entries that the feeder sent with them (``Feed.records``), so a
  read by tag costs one round instead of a round to the index and one to the log.

Every decoder is total: a frame that does not decode gets ``Failed(code=BAD_REQUEST)``
(at an index node, one of a Feed's or a Signed's kind ``UNAUTHENTICATED``:
:func:`claims_authority`) and the server keeps serving.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

from ziplog.logbook.core.records import MAX_TAGS
from ziplog.protocol.frames import MAX_DETAIL_CHARS, element_int
from ziplog.protocol.keys import Right

U64 = Annotated[int, msgspec.Meta(ge=0)]

#: entries and trims one Feed carries at most (the feeder splits bigger batches)
MAX_FEED_ITEMS = 4096
#: a node's assignment history is at most this long (one step per node added)
MAX_HISTORY = 1024
#: the largest record an index node keeps to answer a lookup with (a bigger one is not
#: fed: its reader reads it from the log)
RECORD_IN_ANSWER_MAX = 32 << 10
#: the record bytes one Feed carries at most (the feeder splits a batch that has more)
FEED_RECORD_BYTES = 1 << 20
#: the largest frame an index node reads (a full Feed, every item an entry at MAX_TAGS
#: tags, with its records, fits; a Feed of more items is refused BAD_FEED)
REQUEST_LIMIT = 2 * MAX_FEED_ITEMS * (MAX_TAGS + 4) * 9 + FEED_RECORD_BYTES + MAX_FEED_ITEMS * 16 + (64 << 10)
#: the largest frame an aggregator reads (Lookup and Status), and the largest answer an
#: engine, the aggregator or the feeder reads (a Found with its record fits)
ANSWER_LIMIT = (64 << 10) + RECORD_IN_ANSWER_MAX

#: ``Lookup.how``
NEXT = 0
PREV = 1


class _Frame(msgspec.Struct, array_like=True, tag_field="kind", forbid_unknown_fields=True, gc=False):
    pass


#: (gsn, shard, book, tags) of an entry record
FedEntry = tuple[U64, U64, U64, Annotated[tuple[U64, ...], msgspec.Meta(max_length=MAX_TAGS)]]
#: (gsn, book, seqnum) of a trim record
FedTrim = tuple[U64, U64, U64]
#: (gsn, the record's bytes as the log holds them) of an entry the node may answer with
FedRecord = tuple[U64, Annotated[bytes, msgspec.Meta(max_length=RECORD_IN_ANSWER_MAX)]]


# -- feeder -> index node ----------------------------------------------------------------------
class Feed(_Frame, tag=1):
    """The log's LogBook records in ``(from_gsn, watermark]`` that the node must know:
    the entries of its epochs and every trim, gsns increasing. The node takes it only if
    it already knows everything up to ``from_gsn`` (else it answers ``Fed(accepted=False)``
    with its watermark, and the feeder goes back there); records it already has are
    skipped, so a feed sent twice, or by two feeders, changes nothing. ``history`` is the
    assignment the feeder routed by (``[(first_epoch, nodes), ...]``); ``gen`` counts the
    feeder's rewinds (its answer repeats it). ``records`` (optional): the bytes of some
    of the feed's entries (gsns increasing, each an entry's of this feed, at most
    FEED_RECORD_BYTES in all), which the node keeps to answer lookups with."""
    gen: U64
    from_gsn: U64
    watermark: U64
    history: Annotated[list[tuple[U64, U64]], msgspec.Meta(min_length=1, max_length=MAX_HISTORY)]
    entries: Annotated[list[FedEntry], msgspec.Meta(max_length=MAX_FEED_ITEMS)]
    trims: Annotated[list[FedTrim], msgspec.Meta(max_length=MAX_FEED_ITEMS)]
    records: Annotated[list[FedRecord], msgspec.Meta(max_length=MAX_FEED_ITEMS)] = []


class Signed(_Frame, tag=2):
    """An authority frame from a cluster member: ``frame`` is the whole inner frame,
    ``mac`` its keyed BLAKE2b-256 under the cluster's frame key."""
    frame: bytes
    mac: bytes


# -- anyone -> index node or aggregator ---------------------------------------------------------
class Lookup(_Frame, tag=3):
    """The first (``how=NEXT``: seqnum >= ``seqnum``) or last (``PREV``: <= ``seqnum``)
    entry of ``book`` with ``tag`` (None: any). ``exact``: at exactly ``cut`` (an
    aggregator asking every node at one cut; the node waits until it reached it);
    otherwise at a cut at or above ``cut`` of the server's choosing (an engine's
    session position). ``record``: answer the hit's record with it, if the server
    keeps it."""
    req: U64
    how: Annotated[int, msgspec.Meta(ge=0, le=1)]
    book: U64
    tag: U64 | None
    seqnum: U64
    cut: U64
    exact: bool = False
    record: bool = False


class Status(_Frame, tag=4):
    req: U64


Request = Union[Feed, Signed, Lookup, Status]


# -- answers ------------------------------------------------------------------------------------
class Fed(_Frame, tag=16):
    """A node's answer to a Feed: its watermark after it, and whether it took it."""
    gen: U64
    node: U64
    watermark: U64
    accepted: bool


class Found(_Frame, tag=17):
    """A lookup's answer at ``cut``: the entry ``(gsn, shard)`` if ``found``, and the
    book's trim point at that cut; ``watermark``: the answerer's (a lower bound of what
    it can answer at next); ``nodes``: an index node's count of nodes in the assignment
    at the cut (an aggregate at that cut needs that many nodes' answers; 0 from an
    aggregator); ``trimmed_top`` (optional): the highest seqnum of an entry of the
    lookup's (book, tag) that a trim in force at the cut took (0: none), so that a
    replay can tell it lost records; ``record`` (optional): the hit's record as the log
    holds it, when the lookup asked for it and the server keeps it (None: read it from
    the log)."""
    req: U64
    cut: U64
    found: bool
    gsn: U64
    shard: U64
    trim_point: U64
    watermark: U64
    nodes: U64 = 0
    trimmed_top: U64 = 0
    record: Annotated[bytes, msgspec.Meta(max_length=RECORD_IN_ANSWER_MAX)] | None = None


class NodeState(_Frame, tag=18):
    """``node``: the index node's number (an aggregator says ``nodes``, its count, and
    ``node`` 0); ``size``: seqnums it holds; ``kept``: records it keeps to answer with;
    ``keeps``: the record bytes it may keep (0: it keeps none, so the feeder sends it
    none)."""
    req: U64
    node: U64
    watermark: U64
    floor: U64
    size: U64
    nodes: U64 = 1
    kept: U64 = 0
    keeps: U64 = 0


class Failed(_Frame, tag=19):
    """``floor``: with TOO_OLD, the lowest cut the server answers at."""
    req: U64
    code: str
    message: str
    floor: U64 = 0


Answer = Union[Fed, Found, NodeState, Failed]

#: error codes of :class:`Failed`
BAD_REQUEST = "BAD_REQUEST"  # the frame does not decode, or is not one this server serves
UNAUTHENTICATED = "UNAUTHENTICATED"  # a Feed not sealed by a cluster member
BAD_FEED = "BAD_FEED"  # a sealed Feed that contradicts itself (order, ranges, another node's epochs)
TOO_OLD = "TOO_OLD"  # the cut is below what this server keeps: ask again at ``floor`` or above
BEHIND = "BEHIND"  # the server did not reach the cut in time
BUSY = "BUSY"  # too many lookups wait here: ask again later
INTERNAL = "INTERNAL"  # handling the request failed: the server goes on serving
FORBIDDEN = "FORBIDDEN"  # under CURVE: the client's key lacks the request's right (REQUEST_RIGHTS), or is not registered

#: the right each client request needs under CURVE (a Feed is sealed by a member
#: instead): a lookup reads the index, which gsns hold a tag
REQUEST_RIGHTS: dict[type, Right] = {Lookup: Right.READ, Status: Right.ADMIN}

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_answer_decoder = msgspec.msgpack.Decoder(Answer)
_feed_decoder = msgspec.msgpack.Decoder(Feed)


class BadFrame(ValueError):
    pass


def encode(frame: Request | Answer) -> bytes:
    return _encoder.encode(frame)


def _decode(decoder: "msgspec.msgpack.Decoder[Any]", data: bytes) -> Any:
    try:
        return decoder.decode(data)
    except (msgspec.MsgspecError, RecursionError) as exc:  # the depth limit surfaces as RecursionError
        raise BadFrame(str(exc)[:MAX_DETAIL_CHARS]) from None


def decode_request(data: bytes) -> Request:
    """Total: a request, or :class:`BadFrame`."""
    return _decode(_request_decoder, data)  # type: ignore[return-value]


def decode_answer(data: bytes) -> Answer:
    """Total: an answer, or :class:`BadFrame`."""
    return _decode(_answer_decoder, data)  # type: ignore[return-value]


def decode_feed(data: bytes) -> Feed:
    """Total: the Feed inside a checked Signed envelope, or :class:`BadFrame`."""
    return _decode(_feed_decoder, data)  # type: ignore[return-value]


#: the kinds that carry authority: a Feed, taken only inside a Signed
AUTHORITY_KINDS = frozenset((Feed.__struct_config__.tag, Signed.__struct_config__.tag))


def claims_authority(data: bytes) -> bool:
    """Whether ``data``'s kind is Feed or Signed, read from the kind's own header (nothing
    else is read): such a frame that does not decode is refused UNAUTHENTICATED, not
    BAD_REQUEST, whatever else is wrong with it."""
    return element_int(data, 0) in AUTHORITY_KINDS


def check_feed(feed: Feed) -> str | None:
    """What is wrong with a Feed's shape (None: nothing): gsns increasing within
    ``(from_gsn, watermark]``, the history starting at epoch 0 with increasing first
    epochs and at least one node."""
    if len(feed.entries) + len(feed.trims) > MAX_FEED_ITEMS:
        return f"more than {MAX_FEED_ITEMS} entries and trims"
    if feed.watermark < feed.from_gsn:
        return "the watermark is below from_gsn"
    firsts = [f for f, _ in feed.history]
    if firsts[0] != 0 or any(a >= b for a, b in zip(firsts, firsts[1:])) or any(n < 1 for _, n in feed.history):
        return "the history must start at epoch 0, first epochs increasing, at least one node each"
    for items in (feed.entries, feed.trims):
        last = feed.from_gsn
        for item in items:
            gsn = item[0]
            if not last < gsn <= feed.watermark:
                return f"gsn {gsn} out of order or outside ({feed.from_gsn}, {feed.watermark}]"
            last = gsn
    if {e[0] for e in feed.entries} & {t[0] for t in feed.trims}:
        return "an entry and a trim at one gsn"
    if feed.records:
        entries = {e[0] for e in feed.entries}
        gsns = [g for g, _ in feed.records]
        if any(a >= b for a, b in zip(gsns, gsns[1:])) or not entries.issuperset(gsns):
            return "records must be of the feed's entries, gsns increasing"
        if sum(len(data) for _, data in feed.records) > FEED_RECORD_BYTES:
            return f"more than {FEED_RECORD_BYTES} record bytes"
    return None
