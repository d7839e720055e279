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


@settings(max_examples=1500, deadline=None)
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


@settings(max_examples=500, deadline=None)
@given(inner=frames, mac=st.one_of(st.binary(max_size=40), values))
def test_a_forged_or_misshapen_envelope_is_refused(inner: bytes, mac: Any) -> None:
    env = pack([wire.PROTOCOL_VERSION, wire.SIGNED, inner, mac])
    with pytest.raises(wire.ProtocolError):
        wire.open_signed(KEY, env, wire.decode_member_request)


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
@settings(max_examples=1000, deadline=None)
@given(frame=st.one_of(frames, st.builds(lambda tag, fs: pack([tag, *fs]), st.one_of(st.integers(0, 16), values),
                                         st.lists(values, max_size=6))))
def test_logdb_decoders_are_total(frame: bytes) -> None:
    for decode in (ldb.decode_request, ldb.decode_answer):
        try:
            msg = decode(frame)
        except ldb.BadFrame:
            continue
        assert isinstance(msg, msgspec.Struct)
