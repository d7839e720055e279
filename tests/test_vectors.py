"""docs/vectors.json, the client protocol's byte vectors, both ways: the file is what the
codecs make now, every vector's bytes decode to its fields through the edge a client or
a server uses, and its fields encode to its bytes, with the codecs and with a plain
msgpack encoder (what a port in another language has)."""

from __future__ import annotations

import json

import msgpack
import msgspec
import pytest

from ziplog.protocol import frames as fr
from ziplog.tools import vectors as vec

DOC = json.loads(vec.PATH.read_text())


def test_the_file_is_what_the_codecs_make(capsys: pytest.CaptureFixture[str]) -> None:
    assert vec.main(["--check"]) == 0, capsys.readouterr().err


def test_every_client_frame_and_answer_has_a_vector() -> None:
    ops = {v["op"] for v in DOC["vectors"]}
    client_ops = set(fr.REQUESTS) - {fr.SIGNED}
    assert client_ops | set(fr.REPLIES) == ops
    assert {v["op"] for v in DOC["vectors"] if v["direction"] == "request"} == client_ops


@pytest.mark.parametrize("item", DOC["vectors"], ids=lambda v: f"{v['name']}-{v['note'][:24]}")
def test_a_vector_decodes_to_its_fields_and_encodes_to_its_bytes(item: dict) -> None:
    raw = bytes.fromhex(item["hex"])
    values = [vec.untyped(f["value"]) for f in item["fields"]]
    decode = fr.decode_request if item["direction"] == "request" else fr.decode_reply
    msg = decode(raw)
    assert type(msg) is (fr.REQUESTS if item["direction"] == "request" else fr.REPLIES)[item["op"]]
    names = [f["name"] for f in item["fields"]]
    assert names == list(msg.__struct_fields__)[:len(names)]
    assert msgspec.to_builtins(msg) == msgspec.to_builtins(msgspec.convert(values, type(msg)))
    if item.get("decode_only"):  # what the codecs write instead holds every field
        assert len(names) < len(msg.__struct_fields__)
        assert msgpack.packb(values, use_bin_type=True) == raw
        return
    assert fr.encode(msg) == raw
    # a generic msgpack writer (bin for bytes, the smallest integer form) makes the same bytes
    assert msgpack.packb(values, use_bin_type=True) == raw
    assert msgpack.unpackb(raw, raw=False, strict_map_key=False) == values


def test_the_typed_values_round_trip() -> None:
    sample = [None, True, 0, -1, (1 << 64) - 1, b"\x00\xff", "é", [1, [b""]], {"k": [2]}]
    assert vec.untyped(vec.typed(sample)) == sample
    with pytest.raises(TypeError):
        vec.typed(1.5)
    assert vec.typed(-1) == {"int": "-1"} and vec.typed(5) == {"uint": "5"}
