"""Structure-aware junk for the decoders' property tests and the real-cluster fuzz test:
Hypothesis strategies for arbitrary msgpack (nested arrays and maps in every position,
maps keyed by arrays, every scalar type, 64-bit edges, extension types, deep nesting),
every op of every edge with every field count, and valid frames with one element
replaced."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
from hypothesis import strategies as st

from ziplog.protocol import frames as wire


# -- a msgpack writer for any structure (Python's dicts cannot hold array keys) ------------------
class Ext:
    def __init__(self, code: int, data: bytes) -> None:
        self.code, self.data = code, data


class Map:
    """A msgpack map as its pairs: keys may be arrays or maps."""

    def __init__(self, pairs: list[tuple[Any, Any]]) -> None:
        self.pairs = pairs


def _head(n: int, fix: int, fix_max: int, b16: int, b32: int) -> bytes:
    if n <= fix_max:
        return bytes([fix | n])
    return bytes([b16]) + struct.pack(">H", n) if n < 1 << 16 else bytes([b32]) + struct.pack(">I", n)


def pack(v: Any) -> bytes:
    if v is None:
        return b"\xc0"
    if v is True or v is False:
        return b"\xc3" if v else b"\xc2"
    if isinstance(v, int):
        return msgpack.packb(v)
    if isinstance(v, float):
        return b"\xcb" + struct.pack(">d", v)
    if isinstance(v, str):
        raw = v.encode("utf-8", "surrogatepass")  # lone surrogates: invalid UTF-8 on the wire, on purpose
        if len(raw) < 32:
            return bytes([0xA0 | len(raw)]) + raw
        return (b"\xd9" + bytes([len(raw)]) if len(raw) < 256 else b"\xda" + struct.pack(">H", len(raw))) + raw
    if isinstance(v, bytes):
        return msgpack.packb(v, use_bin_type=True)
    if isinstance(v, Ext):  # ext 8: any type code, -1 (timestamp) included
        return b"\xc7" + bytes([len(v.data)]) + struct.pack(">b", v.code) + v.data
    if isinstance(v, dict):
        return pack(Map(list(v.items())))
    if isinstance(v, list):
        return _head(len(v), 0x90, 15, 0xDC, 0xDD) + b"".join(pack(x) for x in v)
    if isinstance(v, Map):
        return _head(len(v.pairs), 0x80, 15, 0xDE, 0xDF) + b"".join(pack(k) + pack(x) for k, x in v.pairs)
    raise TypeError(type(v))


# -- strategies ---------------------------------------------------------------------------------------
scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, 1, -1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), wire.PROTOCOL_VERSION]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.binary(max_size=24),
    st.builds(Ext, st.integers(-128, 127), st.binary(max_size=12)),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=6),
                            st.lists(st.tuples(inner, inner), max_size=4).map(Map)),
    max_leaves=12,
)
#: every op any edge knows, and some no edge knows
every_op = sorted({*wire.REQUESTS, *wire.MEMBER_REQUESTS, *wire.REPLIES, *wire.FROM_PRIMARY,
                   *wire.RECOVERY_REPLIES, *wire.EPOCHS, *wire.RATES, *wire.SUSPECTS, *wire.SIGNED_ONLY,
                   *wire.MEMBER_OPS, 0, 8, 15, 51, 127, 255, 2**16})
ops = st.one_of(st.sampled_from(every_op), values)
versions = st.one_of(st.just(wire.PROTOCOL_VERSION), values)


@st.composite
def structured_frames(draw: st.DrawFn) -> bytes:
    """[version, op, fields...]: every op with fewer, as many or more fields than it takes,
    each field anything."""
    op = draw(ops)
    n = draw(st.integers(0, 12))
    return pack([draw(versions), op, *draw(st.lists(values, min_size=n, max_size=n))])


VALID: list[wire.Frame] = [
    wire.Insert(req_id=1, client_id=2, seq=3, after=4, data=b"d"), wire.Read(req_id=1, gsn=2),
    wire.Trim(req_id=1, gsn=5), wire.Subscribe(sub_id=1, from_gsn=2, credit=3), wire.Credit(sub_id=1, credit=2),
    wire.Unsubscribe(sub_id=1), wire.Status(req_id=1), wire.Range(req_id=1, lo=1, hi=2, max_bytes=3),
    wire.Count(req_id=1, lo=1, hi=2, nth=0), wire.Hello(shard=0, replica=1, frontier=5, guessed_top=7),
    wire.Prefix(replica=1, frontier=3), wire.Probe(req_id=1, gen=2), wire.Acquired(req_id=1, gen=2),
    wire.Fetch(req_id=1, gen=2, lo=0, hi=9, max_bytes=99),
    wire.Install(req_id=1, gen=2, base=0, trim=0, events=[], end=0), wire.Resume(req_id=1, gen=2, stable=0, refused=[]),
    wire.Error(req_id=1, code="X", message="m"), wire.Suspect(shard=0, replica=1, reason="silent"),
    wire.Rate(reports=[wire.RateEntry(shard=0, epoch=1, rate=2, busy=True)]), wire.StatusOk(req_id=1, status={"a": 1}),
    wire.EpochStart(epoch=3, shards=(0, 1), rates=(100, 100)), wire.EpochSame(epoch=4, base=3, leader=1),
]


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    """A valid frame of some op with one element replaced by anything."""
    msg = draw(st.sampled_from(VALID))
    arr = msgpack.unpackb(wire.encode(msg), raw=False, strict_map_key=False)
    i = draw(st.integers(0, len(arr) - 1))
    arr[i] = draw(values)
    return pack(arr)


frames = st.one_of(st.binary(max_size=64), values.map(pack), structured_frames(), mutated_frames(),
                   st.integers(1, 5000).map(lambda d: b"\x93\x01\x07" + b"\x91" * d + b"\x01"),  # deep nesting
                   st.integers(1, 5000).map(lambda d: b"\x94\x01\x14\x05\x81\xa1a" + b"\x91" * d + b"\x01"))
