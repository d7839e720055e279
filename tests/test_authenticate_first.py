"""Authority is judged before anything it would vouch for is read (PROTOCOL.md §2.1, §7,
§11 Sealed Feeds), at every edge that takes sealed frames, where the answer is decided:
a storage replica's ROUTER (the driver's own request path, on the simulation's ports),
the MMS and failure handler PULLs (``open_member_report``) and a LogBook index node's
ROUTER.

Hypothesis writes the frames byte by byte, so that every msgpack encoding of the same
values is tried: SIGNED envelopes whose MAC is not the cluster's around any inner frame
(junk, other versions, unknown ops, bare and sealed authority ops, nested envelopes,
64-bit edges), envelopes of the wrong shape (another version, too few or too many
fields, a field of another type, ``str`` where ``bin`` belongs, bytes cut off or added)
whatever their MAC, with the version and op in any integer encoding and the array and
bin headers in any width; and authority ops sent bare with any fields. Every one earns
exactly one UNAUTHENTICATED at a ROUTER (never a code the inner frame would earn, and
never no answer) and is dropped as UNAUTHENTICATED at a PULL; nothing escapes the
decoder. A correctly sealed frame, in any of those encodings, still opens to what its
inner frame decodes to.

``ZIPLOG_FUZZ_EXAMPLES`` (default 300) sets how many frames each property draws."""

from __future__ import annotations

import os
import struct
import tracemalloc
from typing import Any, Callable, Iterator

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.junk import VALID, frames, pack, values
from tests.sim.world import (CLUSTER_KEY, NetParams, SimDisk, SimProcess, SimStorageCoordination, World,
                             ZooKeeper)
from ziplog.cores.replica import ReplicaSettings
from ziplog.logbook.core import frames as tier
from ziplog.logbook.core.node import NodeCore
from ziplog.logbook.index_node import IndexNodeDriver
from ziplog.protocol import frames as wire
from ziplog.protocol.auth import ClusterKey
from ziplog.server.storage import StorageDriver
from ziplog.shell.elected import open_member_report

KEY = CLUSTER_KEY
OTHER_KEY = ClusterKey(b"another cluster's secret")
SETTINGS = settings(max_examples=int(os.environ.get("ZIPLOG_FUZZ_EXAMPLES", "300")), deadline=None,
                    suppress_health_check=list(HealthCheck))


# -- msgpack, every encoding of a value -----------------------------------------------------------
def int_encodings(v: int) -> list[bytes]:
    """Every msgpack encoding of the integer ``v`` (the shortest and the wider ones)."""
    out = []
    if 0 <= v <= 0x7F or -32 <= v < 0:
        out.append(struct.pack(">b", v) if v < 0 else bytes([v]))
    for tag, fmt in ((0xCC, ">B"), (0xCD, ">H"), (0xCE, ">I"), (0xCF, ">Q"),
                     (0xD0, ">b"), (0xD1, ">h"), (0xD2, ">i"), (0xD3, ">q")):
        try:
            out.append(bytes([tag]) + struct.pack(fmt, v))
        except struct.error:
            pass
    return out


def _sized(data: bytes, heads: list[tuple[int, int, str]]) -> list[bytes]:
    return [bytes([tag]) + struct.pack(fmt, len(data)) + data for tag, limit, fmt in heads if len(data) < limit]


def bin_encodings(data: bytes) -> list[bytes]:
    return _sized(data, [(0xC4, 1 << 8, ">B"), (0xC5, 1 << 16, ">H"), (0xC6, 1 << 32, ">I")])


def str_encodings(data: bytes) -> list[bytes]:
    """``data`` as a msgpack str (valid UTF-8 or not): what a bin field must not take."""
    fix = [bytes([0xA0 | len(data)]) + data] if len(data) < 32 else []
    return fix + _sized(data, [(0xD9, 1 << 8, ">B"), (0xDA, 1 << 16, ">H"), (0xDB, 1 << 32, ">I")])


def array_headers(n: int) -> list[bytes]:
    fix = [bytes([0x90 | n])] if n < 16 else []
    return fix + [b"\xdc" + struct.pack(">H", n), b"\xdd" + struct.pack(">I", n)]


def one_of_encodings(encodings: Callable[[Any], list[bytes]], v: Any) -> st.SearchStrategy[bytes]:
    return st.sampled_from(encodings(v))


def op_of(msg: wire.Frame) -> int:
    """A frame's op (every frame class sets one; the base names none)."""
    op = getattr(msg, "op")
    assert type(op) is int
    return op


# -- what goes inside --------------------------------------------------------------------------------
#: the ops a storage ROUTER takes only sealed, and the PULLs' (SUSPECT, RATE)
ROUTER_SEALED = sorted(wire.MEMBER_REQUESTS)
ALL_SEALED = sorted(wire.MEMBER_OPS)
MEMBER_VALID = [m for m in VALID if op_of(m) in wire.MEMBER_OPS]
versions = st.one_of(st.integers(-(2**63), 2**64 - 1).flatmap(lambda v: one_of_encodings(int_encodings, v)),
                     st.sampled_from([wire.PROTOCOL_VERSION, 0, 2, -1, 2**64 - 1, True, 1.0, "1", b"\x01", None,
                                      [1], {1: 1}]).map(pack),
                     values.map(pack))


@st.composite
def bare_authority_ops(draw: st.DrawFn, ops: list[int] = ROUTER_SEALED) -> bytes:
    """An authority op as it would be sealed, sent bare: any version, the op in any
    encoding, any fields (or a valid frame's), any array header; sometimes cut short
    after the op or followed by more bytes."""
    if draw(st.booleans()):
        msg = draw(st.sampled_from([m for m in MEMBER_VALID if op_of(m) in ops]))
        fields = [pack(x) for x in msgspec.msgpack.decode(wire.encode(msg))[2:]]
        op = op_of(msg)
    else:
        op = draw(st.sampled_from(ops))
        fields = [pack(x) for x in draw(st.lists(values, max_size=8))]
    version = draw(st.one_of(st.just(b"\x01"), versions))
    head = draw(st.sampled_from(array_headers(2 + len(fields))))
    body = b"".join(fields)
    body = body[:draw(st.one_of(st.just(len(body)), st.integers(0, len(body))))]
    frame = head + version + draw(one_of_encodings(int_encodings, op)) + body
    return frame + draw(st.sampled_from([b"", b"", b"\x00", b"\xc1"]))


#: inner frames: junk of every kind, authority ops bare, valid frames of every op, and
#: envelopes (sealed with the cluster's key, or forged) inside the envelope
inner_frames = st.one_of(
    frames, bare_authority_ops(ALL_SEALED), st.sampled_from(VALID).map(wire.encode),
    frames.map(lambda fr: wire.seal(KEY, fr)), frames.map(lambda fr: wire.seal(OTHER_KEY, fr)),
    st.builds(lambda op, n: pack([1, op, *([2**64 - 1] * n)]), st.sampled_from(ALL_SEALED), st.integers(0, 8)),
)


def forged_macs(inner: bytes) -> st.SearchStrategy[bytes]:
    """MACs that are not the cluster's for ``inner``: random, another key's, another
    frame's, the right one cut short or lengthened, none at all."""
    right = KEY.mac(inner)
    return st.one_of(st.binary(min_size=32, max_size=32), st.binary(max_size=40),
                     st.just(OTHER_KEY.mac(inner)), st.just(KEY.mac(inner + b"\0")),
                     st.just(right[:31]), st.just(right + b"\0"), st.just(b"")).filter(lambda mac: mac != right)


# -- envelopes ------------------------------------------------------------------------------------------
@st.composite
def envelopes(draw: st.DrawFn, lead: Callable[[st.DrawFn], list[bytes]], forged: bool) -> bytes:
    """``lead`` (the version and op of §2.1, or the LogBook kind) then the frame and MAC
    fields, written with any header widths. ``forged``: exact shape, a MAC that is not the
    cluster's; otherwise any shape (a field of another type, fields missing or added,
    bytes cut off or added) with any MAC, the right one included."""
    inner = draw(inner_frames)
    mac = draw(forged_macs(inner)) if forged else draw(st.one_of(st.just(KEY.mac(inner)), forged_macs(inner)))
    head = lead(draw)
    fields = [draw(one_of_encodings(bin_encodings, inner)), draw(one_of_encodings(bin_encodings, mac))]
    tail = b""
    if not forged:
        spoil = draw(st.sampled_from(["frame type", "mac type", "fewer", "more", "cut", "added"]))
        if spoil == "frame type":
            fields[0] = draw(st.one_of(one_of_encodings(str_encodings, inner), values.map(pack),
                                       st.just(inner)))  # the inner frame in place, not as bin
        elif spoil == "mac type":
            fields[1] = draw(st.one_of(one_of_encodings(str_encodings, mac), values.map(pack)))
        elif spoil == "fewer":
            fields = fields[:draw(st.integers(0, 1))]
        elif spoil == "more":
            fields += [pack(x) for x in draw(st.lists(values, min_size=1, max_size=3))]
        elif spoil == "added":
            tail = draw(st.sampled_from([b"\x00", b"\xc0", b"\xc1", b"\x94\x01\x32"]))
        body = b"".join(head + fields) + tail
        count = len(head) + len(fields)
        if spoil == "cut":  # cut anywhere after the op: it is still an envelope
            keep = len(b"".join(head)) + draw(st.integers(0, max(0, len(b"".join(fields)) - 1)))
            return draw(st.sampled_from(array_headers(count))) + body[:keep]
        return draw(st.sampled_from(array_headers(count))) + body
    return draw(st.sampled_from(array_headers(len(head) + 2))) + b"".join(head + fields)


def signed_lead(draw: st.DrawFn) -> list[bytes]:
    return [draw(st.one_of(one_of_encodings(int_encodings, wire.PROTOCOL_VERSION), versions)),
            draw(one_of_encodings(int_encodings, wire.SIGNED))]


def exact_signed_lead(draw: st.DrawFn) -> list[bytes]:
    return [draw(one_of_encodings(int_encodings, wire.PROTOCOL_VERSION)),
            draw(one_of_encodings(int_encodings, wire.SIGNED))]


def tier_lead(draw: st.DrawFn) -> list[bytes]:
    return [draw(one_of_encodings(int_encodings, 2))]  # Signed's kind


forged_envelopes = envelopes(exact_signed_lead, forged=True)
misshapen_envelopes = envelopes(signed_lead, forged=False)
#: what a storage ROUTER must answer UNAUTHENTICATED, and a PULL drop as such
unauthenticated = st.one_of(forged_envelopes, misshapen_envelopes, envelopes(signed_lead, forged=True),
                            bare_authority_ops())


# -- the edges, where each decides its answer --------------------------------------------------------
class Replica:
    """A storage replica's driver on the simulation's ports; :meth:`ask` hands it one
    frame as its ROUTER does (through its InboundGuard) and returns its answers."""

    def __init__(self) -> None:
        world = World(1, NetParams(client_loss=0.0, peer_loss=0.0, epoch_loss=0.0, control_loss=0.0,
                                   reorder=0.0, duplicate=0.0))
        zk = ZooKeeper(world)
        self.proc = SimProcess(world, "rep0.0")
        coord = SimStorageCoordination(zk, self.proc, zk.session(self.proc.name))
        self.driver = StorageDriver(ReplicaSettings(0, 0, 2, suspect_timeout_ns=0), self.proc, self.proc, coord,
                                    SimDisk(), KEY)
        self.proc.run(self.driver.start)
        self.sent: list[tuple[bytes, bytes]] = []
        self.driver.router.send_to = lambda route, frame: self.sent.append((route, frame)) or True  # type: ignore

    def ask(self, frame: bytes) -> list[str]:
        """The answers to ``frame``: each ERROR's code, or the op of anything else."""
        self.sent.clear()
        self.proc.run(self.driver.router.on_frame, b"outsider", frame)  # type: ignore[attr-defined]
        assert self.driver.guard.failures == {}, "handling the frame failed past its decoder"
        return self._answers()

    def ask_multipart(self, parts: int) -> list[str]:
        self.sent.clear()
        self.proc.run(self.driver.on_multipart, b"outsider", parts - 1)
        return self._answers()

    def _answers(self) -> list[str]:
        out = []
        for route, frame in self.sent:
            if route == b"outsider":
                answer = msgspec.msgpack.decode(frame)
                out.append(answer[3] if answer[1] == wire.ERROR else f"op {answer[1]}")
        return out


@pytest.fixture(scope="module")
def replica() -> Iterator[Replica]:
    yield Replica()


def opened_at_router(frame: bytes, decode: Callable[[bytes], Any] = wire.decode_request) -> Any:
    """The decode-and-authenticate step of a storage ROUTER (``StorageDriver.on_request``)."""
    msg = decode(frame)
    if type(msg) is wire.Signed:
        return wire.open_envelope(KEY, msg, wire.decode_member_request)
    return msg


def refused_code(fn: Callable[[bytes], Any], frame: bytes) -> str | None:
    try:
        fn(frame)
    except wire.ProtocolError as exc:
        return exc.code
    return None


def dropped_at_pulls(frame: bytes) -> list[str]:
    """What each PULL (the MMS's RATE, the failure handler's SUSPECT) made of ``frame``."""
    out = []
    for decode, what in ((wire.decode_rate, "rate report"), (wire.decode_suspect, "suspicion report")):
        said: list[tuple[str, Any]] = []
        assert open_member_report(KEY, frame, decode, lambda line, detail: said.append((line, detail)), what) is None
        assert len(said) == 1, said
        assert type(said[0][1]) is wire.ProtocolError
        out.append(said[0][1].code)
    return out


def index_node_answers(frame: bytes) -> list[Any]:
    sent: list[bytes] = []
    driver = IndexNodeDriver(NodeCore(0), KEY, lambda route, data: sent.append(data), lambda: 0)
    driver.on_frame(b"outsider", frame)
    assert driver.core.watermark == 0
    return [tier.decode_answer(a) for a in sent]


# -- the properties -----------------------------------------------------------------------------------------
@SETTINGS
@given(frame=unauthenticated)
def test_what_is_not_sealed_by_the_cluster_earns_unauthenticated_whatever_it_holds(replica: Replica,
                                                                                 frame: bytes) -> None:
    """A forged or misshapen envelope, or an authority op sent bare: UNAUTHENTICATED from
    the decoder alone and from its slow path alone, exactly one ERROR UNAUTHENTICATED
    from a replica's ROUTER, dropped as UNAUTHENTICATED at both PULLs."""
    assert refused_code(opened_at_router, frame) == wire.E_UNAUTHENTICATED
    assert refused_code(lambda fr: opened_at_router(fr, wire.decode_request._slow), frame) == wire.E_UNAUTHENTICATED
    assert replica.ask(frame) == [wire.E_UNAUTHENTICATED]
    assert dropped_at_pulls(frame) == [wire.E_UNAUTHENTICATED] * 2


@SETTINGS
@given(frame=st.one_of(bare_authority_ops([wire.SUSPECT, wire.RATE]),
                       st.sampled_from(MEMBER_VALID).map(wire.encode)))
def test_a_report_sent_bare_is_dropped_unauthenticated_at_the_pulls(frame: bytes) -> None:
    assert dropped_at_pulls(frame) == [wire.E_UNAUTHENTICATED] * 2


@SETTINGS
@given(frame=st.one_of(envelopes(tier_lead, forged=True), envelopes(tier_lead, forged=False)))
def test_an_index_node_answers_a_forged_or_misshapen_signed_unauthenticated(frame: bytes) -> None:
    answers = index_node_answers(frame)
    assert [(type(a), a.code, a.req) for a in answers] == [(tier.Failed, tier.UNAUTHENTICATED, 0)], answers


@SETTINGS
@given(fields=st.lists(values, max_size=9), kind=one_of_encodings(int_encodings, 1))
def test_an_index_node_answers_a_bare_feed_unauthenticated_whatever_it_holds(fields: list[Any], kind: bytes) -> None:
    frame = array_headers(1 + len(fields))[0] + kind + b"".join(pack(x) for x in fields)
    answers = index_node_answers(frame)
    assert [(type(a), a.code) for a in answers] == [(tier.Failed, tier.UNAUTHENTICATED)], answers


@SETTINGS
@given(inner=inner_frames, data=st.data())
def test_a_correctly_sealed_frame_opens_as_its_inner_frame_decodes_in_any_encoding(inner: bytes,
                                                                                   data: st.DataObject) -> None:
    """The right MAC over an exact envelope, however its integers and headers are
    written: the envelope opens to what the inner frame decodes to, or to the code the
    inner frame earns (the same at a PULL)."""
    frame = (data.draw(st.sampled_from(array_headers(4))) + data.draw(one_of_encodings(int_encodings, 1))
             + data.draw(one_of_encodings(int_encodings, wire.SIGNED))
             + data.draw(one_of_encodings(bin_encodings, inner))
             + data.draw(one_of_encodings(bin_encodings, KEY.mac(inner))))
    for decode, open_ in ((wire.decode_member_request, opened_at_router),
                          (wire.decode_rate, lambda fr: wire.open_signed(KEY, fr, wire.decode_rate))):
        try:
            want: Any = decode(inner)
        except wire.ProtocolError as exc:
            want = exc.code
        try:
            got: Any = open_(frame)
        except wire.ProtocolError as exc:
            got = exc.code
        assert got == want


@pytest.mark.parametrize("msg", MEMBER_VALID, ids=lambda m: type(m).__name__)
def test_a_sealed_member_frame_still_reaches_the_core(msg: wire.Frame) -> None:
    """A correctly sealed frame is not UNAUTHENTICATED at a replica's ROUTER; the same
    inner frame with one bit of its MAC flipped is."""
    replica = Replica()
    inner = wire.encode(msg)
    mac = KEY.mac(inner)
    if op_of(msg) in wire.MEMBER_REQUESTS:
        assert opened_at_router(wire.seal(KEY, inner)) == msg
        assert wire.E_UNAUTHENTICATED not in replica.ask(wire.seal(KEY, inner))
    forged = wire.encode(wire.Signed(frame=inner, mac=bytes([mac[0] ^ 1]) + mac[1:]))
    assert replica.ask(forged) == [wire.E_UNAUTHENTICATED]


@pytest.mark.parametrize("parts", [2, 3])
def test_a_multipart_request_is_answered(replica: Replica, parts: int) -> None:
    assert replica.ask_multipart(parts) == [wire.E_MALFORMED]


def test_the_frames_found_by_hand() -> None:
    """UNAUTHENTICATED: an envelope whose version nests 1 024 arrays (msgpack skips it),
    one whose array header counts 2^32 - 1 elements, one with the inner frame written in
    place of its bin, and one with a byte after a right MAC; a bare PROBE (its req_id
    echoed, read from its own header). A frame whose version nests deeper than msgpack
    follows names no op: MALFORMED (PROTOCOL.md §2.1)."""
    inner = wire.encode(wire.Probe(req_id=7, gen=1))
    zeros = bin_encodings(b"\0" * 32)[0]
    rest = int_encodings(wire.SIGNED)[0] + bin_encodings(inner)[0] + zeros
    for frame in (b"\x94" + b"\x91" * 1024 + b"\x01" + rest, b"\xdd\xff\xff\xff\xff\x01" + rest,
                  b"\x94\x01\x32" + inner + zeros, b"\x94\x01\x32" + bin_encodings(inner)[0]
                  + bin_encodings(KEY.mac(inner))[0] + b"\x00"):
        assert refused_code(opened_at_router, frame) == wire.E_UNAUTHENTICATED
    with pytest.raises(wire.ProtocolError) as bare:
        opened_at_router(inner)
    assert (bare.value.code, bare.value.req_id) == (wire.E_UNAUTHENTICATED, 7)
    assert refused_code(opened_at_router, b"\x94" + b"\x91" * 1025 + b"\x01" + rest) == wire.E_MALFORMED


def test_a_refused_envelope_or_bare_authority_op_is_judged_without_building_what_it_holds() -> None:
    """Half a million elements where an envelope's frame belongs, or in a bare INSTALL's
    events: refused UNAUTHENTICATED with no more memory than a copy of the frame
    (building what they hold takes eight times as much)."""
    nils = b"\xdd" + struct.pack(">I", 500_000) + b"\xc0" * 500_000
    envelope = b"\x94\x01\x32" + nils + bin_encodings(b"\0" * 32)[0]
    install = b"\x98\x01" + bytes([wire.INSTALL]) + b"\x07\x01\x00\x00" + nils + b"\x00"
    tracemalloc.start()
    try:
        for frame in (envelope, install):
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            assert refused_code(opened_at_router, frame) == wire.E_UNAUTHENTICATED
            assert tracemalloc.get_traced_memory()[1] - before < 2 * len(frame)
    finally:
        tracemalloc.stop()
