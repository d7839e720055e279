"""Every decoder of every receiving edge is total: any byte string gives a typed frame of
that edge or raises the protocol's own error, never anything else, bare and inside a
correctly signed envelope. Hypothesis generates arbitrary msgpack structures (nested
arrays and maps in every position, maps whose keys are arrays or maps, every scalar
type, integers from -2**63 to 2**64-1, floats with NaN and infinities, extension types,
nesting deeper than any decoder's limit), every op of every edge with every field count
and wrong types in its fields, valid frames with one field replaced, and raw bytes."""

from __future__ import annotations

from typing import Any, Callable

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.junk import Map, frames, pack, values
from ziplog.logbook.core import frames as tier
from ziplog.logdb.core import frames as ldb
from ziplog.protocol import frames as wire
from ziplog.protocol.auth import ClusterKey

KEY = ClusterKey(b"a test cluster's secret")


# -- the edges ----------------------------------------------------------------------------------------
EDGES: dict[str, tuple[Any, dict[int, type[wire.Frame]]]] = {
    "request": (wire.decode_request, wire.REQUESTS),
    "member_request": (wire.decode_member_request, wire.MEMBER_REQUESTS),
    "reply": (wire.decode_reply, wire.REPLIES),
    "from_primary": (wire.decode_from_primary, wire.FROM_PRIMARY),
    "recovery_reply": (wire.decode_recovery_reply, wire.RECOVERY_REPLIES),
    "epoch": (wire.decode_epoch, wire.EPOCHS),
    "signed": (wire.decode_signed, wire.SIGNED_ONLY),
    "rate": (wire.decode_rate, wire.RATES),
    "suspect": (wire.decode_suspect, wire.SUSPECTS),
}


def check_total(decode: Callable[[bytes], Any], table: dict[int, type[wire.Frame]], frame: bytes) -> None:
    try:
        msg = decode(frame)
    except wire.ProtocolError as exc:
        assert exc.code in {wire.E_MALFORMED, wire.E_VERSION, wire.E_UNKNOWN_OP, wire.E_BAD_ARGUMENT,
                            wire.E_UNAUTHENTICATED}, exc
        assert exc.req_id is None or (type(exc.req_id) is int and 0 <= exc.req_id <= wire.MAX_U64)
        return
    assert type(msg) in table.values(), msg


@settings(max_examples=450, deadline=None)
@given(frame=frames)
def test_every_edge_decodes_any_bytes_or_refuses_them(frame: bytes) -> None:
    """Each frame through every edge: bare, through the slow path alone (total by itself:
    the decoder's last-resort catch is never what saves it), and sealed with the cluster
    key (what a member, or a stolen key, seals is decoded by the same rules)."""
    sealed = wire.seal(KEY, frame)
    for decode, table in EDGES.values():
        check_total(decode, table, frame)
        try:
            decode._slow(frame)
        except wire.ProtocolError:
            pass
        check_total(lambda fr: wire.open_signed(KEY, fr, decode), table, sealed)


@settings(max_examples=160, deadline=None)
@given(inner=frames, mac=st.one_of(st.binary(max_size=40), values), version=st.one_of(st.just(1), values),
       extra=st.lists(values, max_size=3), drop=st.integers(0, 2))
def test_a_forged_or_misshapen_envelope_is_refused_unauthenticated(inner: bytes, mac: Any, version: Any,
                                                                   extra: list[Any], drop: int) -> None:
    """Whatever the envelope's shape and whatever it carries, an envelope whose MAC is
    not the cluster's earns UNAUTHENTICATED, as a storage ROUTER opens it: nothing
    inside is read before the MAC vouches for it (a bad inner frame's own code would say
    what the server made of unauthenticated bytes)."""
    fields = [inner, mac, *extra][:max(0, 2 + len(extra) - drop)] if drop else [inner, mac, *extra]
    env = pack([version, wire.SIGNED, *fields])
    with pytest.raises(wire.ProtocolError) as exc:
        msg = wire.decode_request(env)
        assert type(msg) is wire.Signed
        wire.open_envelope(KEY, msg, wire.decode_member_request)
    assert exc.value.code == wire.E_UNAUTHENTICATED, exc.value


@settings(max_examples=160, deadline=None)
@given(op=st.sampled_from(sorted(wire.MEMBER_OPS)), version=st.one_of(st.just(1), values),
       fields=st.lists(values, max_size=7))
def test_a_bare_sealed_op_is_refused_unauthenticated_whatever_it_holds(op: int, version: Any, fields: list[Any]) -> None:
    """An authority op sent bare at a storage ROUTER earns UNAUTHENTICATED before its
    version or fields are judged (and whether or not msgpack can build them)."""
    with pytest.raises(wire.ProtocolError) as exc:
        wire.decode_request(pack([version, op, *fields]))
    assert exc.value.code == wire.E_UNAUTHENTICATED, exc.value


def test_the_frames_found_by_hand_are_refused() -> None:
    """The 5-byte frame that killed replicas, MMS and failure handlers (an op that is an
    array), a map as op, and a nesting past msgspec's depth limit in an Any field."""
    for frame in (bytes.fromhex("9301910105"), pack([1, Map([(1, 2)]), 5]),
                  b"\x94\x01\x14\x05\x81\xa1a" + b"\x91" * 100_000 + b"\x01",
                  pack([1, 1] + [1] * 200_000), pack([1, 1, 5, [[0] * 1000] * 200])):
        for decode, table in EDGES.values():
            check_total(decode, table, frame)
    with pytest.raises(wire.ProtocolError) as exc:
        wire.decode_request(bytes.fromhex("9301910105"))
    assert exc.value.code == wire.E_UNKNOWN_OP


# -- LogDB's frames -----------------------------------------------------------------------------------
@settings(max_examples=320, deadline=None)
@given(frame=st.one_of(frames, st.builds(lambda tag, fs: pack([tag, *fs]), st.one_of(st.integers(0, 16), values),
                                         st.lists(values, max_size=6))))
def test_logdb_decoders_are_total(frame: bytes) -> None:
    for decode in (ldb.decode_request, ldb.decode_answer):
        try:
            msg = decode(frame)
        except ldb.BadFrame:
            continue
        assert isinstance(msg, msgspec.Struct)


# -- the LogBook index tier's frames ------------------------------------------------------------------
_tier_frames = st.one_of(frames, st.builds(lambda tag, fs: pack([tag, *fs]),
                                           st.one_of(st.sampled_from([1, 2, 3, 4, 16, 17, 18, 19]), values),
                                           st.lists(values, max_size=8)))


@settings(max_examples=320, deadline=None)
@given(frame=_tier_frames)
def test_logbook_tier_decoders_are_total(frame: bytes) -> None:
    for decode in (tier.decode_request, tier.decode_answer, tier.decode_feed):
        try:
            msg = decode(frame)
        except tier.BadFrame:
            continue
        assert isinstance(msg, msgspec.Struct)
        if type(msg) is tier.Feed:
            tier.check_feed(msg)  # total too: a shape it does not like is a reason, not an exception


@settings(max_examples=320, deadline=None)
@given(frame=_tier_frames, sealed=st.booleans())
def test_an_index_node_answers_any_frame_and_serves_on(frame: bytes, sealed: bool) -> None:
    """Bare, or sealed with the cluster key (what a member seals is checked by the same
    rules): every frame gets one answer or none (a parked lookup), never an exception,
    and the node still answers its state."""
    from ziplog.logbook.core.node import NodeCore
    from ziplog.logbook.index_node import IndexNodeDriver

    sent: list[bytes] = []
    driver = IndexNodeDriver(NodeCore(0), KEY, lambda route, data: sent.append(data), lambda: 0)
    if sealed:
        frame = tier.encode(tier.Signed(frame=frame, mac=KEY.mac(frame)))
    driver.on_frame(b"route", frame)
    assert len(sent) <= 1
    for answer in sent:
        assert isinstance(tier.decode_answer(answer), (tier.Fed, tier.Found, tier.NodeState, tier.Failed))
    driver.on_frame(b"route", tier.encode(tier.Status(req=7)))
    state = tier.decode_answer(sent[-1])
    assert type(state) is tier.NodeState and state.req == 7


def test_an_index_node_takes_a_feed_only_sealed_by_a_member() -> None:
    from ziplog.logbook.core.node import NodeCore
    from ziplog.logbook.index_node import IndexNodeDriver

    sent: list[bytes] = []
    driver = IndexNodeDriver(NodeCore(0), KEY, lambda route, data: sent.append(data), lambda: 0)
    feed = tier.encode(tier.Feed(gen=0, from_gsn=0, watermark=10, history=[(0, 1)], entries=[(5, 0, 1, (9,))],
                                 trims=[]))
    for frame in (feed, tier.encode(tier.Signed(frame=feed, mac=b"\0" * 32)),
                  tier.encode(tier.Signed(frame=feed, mac=ClusterKey(b"another cluster's secret").mac(feed)))):
        driver.on_frame(b"r", frame)
        ans = tier.decode_answer(sent[-1])
        assert type(ans) is tier.Failed and ans.code == tier.UNAUTHENTICATED
    assert driver.core.watermark == 0
    driver.on_frame(b"r", tier.encode(tier.Signed(frame=feed, mac=KEY.mac(feed))))
    fed = tier.decode_answer(sent[-1])
    assert type(fed) is tier.Fed and fed.accepted and fed.watermark == 10
    driver.on_frame(b"r", tier.encode(tier.Lookup(req=3, how=tier.NEXT, book=1, tag=9, seqnum=0, cut=10)))
    found = tier.decode_answer(sent[-1])
    assert type(found) is tier.Found and found.found and found.gsn == 5
