"""Byte vectors of the client protocol: every frame a client sends and every answer it
takes, as the exact bytes the codecs make beside the fields they hold, written to
``docs/vectors.json`` for ports in other languages (docs/CLIENT.md says how to use it).

``python -m ziplog.tools.vectors`` rewrites the file; ``--check`` fails when the file is
not what the codecs make now (tests/test_vectors.py runs it, and decodes every vector
back), so the document cannot drift from the code.

A value in the file is typed, so that no language's JSON reader has to guess: ``{"uint":
"4294967301"}`` (a decimal string: JSON numbers lose integers above 2^53 in many
readers), ``{"bin": "68656c6c6f"}`` (hex), ``{"str": ...}``, ``{"bool": ...}``,
``{"nil": null}``, ``{"array": [value, ...]}``, ``{"map": [[key, value], ...]}`` (in
the order the bytes hold them), and ``{"int": "-1"}`` for a negative integer (STATUS_OK's
``epoch`` before any). A vector marked ``"decode_only": true`` holds bytes the codecs
do not write but every server takes (INSERT without its optional stamp).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgpack

from ziplog.protocol import frames as fr

PATH = Path(__file__).resolve().parents[2] / "docs" / "vectors.json"

#: gsn 5 of epoch 1: every gsn from epoch 1 on is above 2^32 (docs/CLIENT.md, gsns)
GSN = (1 << 32) + 5
REQUEST_ID = 7
#: an incarnation, as a primary's registration names it (a nonce above 2^32)
PRIMARY_INC = 6_917_529_027_641_081_857


def typed(value: Any) -> dict[str, Any]:
    """A msgpack value (as msgpack-python reads it, raw=False) as a typed JSON value."""
    if value is None:
        return {"nil": None}
    if type(value) is bool:
        return {"bool": value}
    if type(value) is int:
        return {"uint": str(value)} if value >= 0 else {"int": str(value)}
    if type(value) is bytes:
        return {"bin": value.hex()}
    if type(value) is str:
        return {"str": value}
    if type(value) is list:
        return {"array": [typed(v) for v in value]}
    if type(value) is dict:
        return {"map": [[typed(k), typed(v)] for k, v in value.items()]}
    raise TypeError(f"no typed form for {type(value).__name__}")


def untyped(value: dict[str, Any]) -> Any:
    """The inverse of :func:`typed`."""
    ((kind, v),) = value.items()
    if kind in ("uint", "int"):
        return int(v)
    if kind == "bin":
        return bytes.fromhex(v)
    if kind == "array":
        return [untyped(x) for x in v]
    if kind == "map":
        return {untyped(k): untyped(x) for k, x in v}
    assert kind in ("nil", "bool", "str"), kind
    return v


def _examples() -> list[tuple[str, str, str, fr.Frame]]:
    """(name, direction, what it shows, frame) for each vector, in the file's order."""
    ack = fr.Ack(req_id=REQUEST_ID, gsn=GSN, replica=0, stable=GSN - 1, decided=True, final=False, inc=PRIMARY_INC)
    guess = fr.Ack(req_id=REQUEST_ID, gsn=GSN, replica=1, stable=GSN - 1, decided=False, final=False, inc=PRIMARY_INC)
    status = {"shard": 0, "replica": 0, "primary": True, "epoch": 1, "stable": GSN, "blocked": None}
    starting = {"shard": 1, "replica": 1, "primary": False, "epoch": -1, "stable": 0, "link": "down"}
    out: list[tuple[str, str, str, fr.Frame]] = [
        ("INSERT", "request", "insert b'hello' after gsn 0, with a send stamp",
         fr.Insert(req_id=REQUEST_ID, client_id=3, seq=1, after=0, data=b"hello", stamp=1_764_000_000_000_000_000)),
        ("INSERT", "request", "after a gsn above 2^32 (uint 64), empty data, stamp 0 (none)",
         fr.Insert(req_id=8, client_id=3, seq=2, after=GSN, data=b"")),
        ("READ", "request", "read the record at a gsn above 2^32 (uint 64)", fr.Read(req_id=REQUEST_ID, gsn=GSN)),
        ("TRIM", "request", "trim every record below gsn 100", fr.Trim(req_id=REQUEST_ID, gsn=100)),
        ("SUBSCRIBE", "request", "from gsn 0 (the oldest record kept) with a credit of 8 MiB (bytes)",
         fr.Subscribe(sub_id=2, from_gsn=0, credit=8 << 20)),
        ("CREDIT", "request", "add 2 MiB (bytes) to subscription 2's credit", fr.Credit(sub_id=2, credit=2 << 20)),
        ("CREDIT", "request", "credit 0: renews the lease only", fr.Credit(sub_id=2, credit=0)),
        ("UNSUBSCRIBE", "request", "end subscription 2", fr.Unsubscribe(sub_id=2)),
        ("STATUS", "request", "ask a replica's status", fr.Status(req_id=REQUEST_ID)),
        ("RANGE", "request", "stable records from gsn 1 to 2^32 + 5, about 64 KiB at most",
         fr.Range(req_id=REQUEST_ID, lo=1, hi=GSN, max_bytes=65536)),
        ("COUNT", "request", "a shard's stable watermark: lo = hi = 2^63 - 1",
         fr.Count(req_id=REQUEST_ID, lo=(1 << 63) - 1, hi=(1 << 63) - 1, nth=0)),
        ("ACK", "reply", "the primary's decision, naming the primary's incarnation", ack),
        ("ACK", "reply", "a backup's guess (decided false) of that incarnation's decision", guess),
        ("ACK", "reply", "final: failure recovery keeps the record at this gsn",
         fr.Ack(req_id=REQUEST_ID, gsn=GSN, replica=1, stable=GSN, decided=True, final=True)),
        ("ACKS", "reply", "two ACKs of one turn in one frame",
         fr.Acks(acks=[ack, fr.Ack(req_id=8, gsn=GSN + 1, replica=0, stable=GSN - 1, decided=True, final=False,
                                   inc=PRIMARY_INC)])),
        ("READ_OK", "reply", "the record and the replica's stable watermark",
         fr.ReadOk(req_id=REQUEST_ID, gsn=GSN, data=b"hello", stable=GSN + 3)),
        ("TRIM_OK", "reply", "the shard's trim point after the trim", fr.TrimOk(req_id=REQUEST_ID, trim_point=100)),
        ("SUB_BATCH", "reply", "two records, the membership of epochs 0 to 1 (shards 0 and 1), and progress",
         fr.SubBatch(sub_id=2, records=[(3, b"a"), (GSN, b"bc")], epochs=[(0, 1, (0, 1))], progress=GSN + 1)),
        ("SUB_BATCH", "reply", "the first batch of a subscription from gsn 0: epoch 0 had no member",
         fr.SubBatch(sub_id=2, records=[], epochs=[(0, 0, ()), (1, 1, (0,))], progress=GSN)),
        ("SUB_BATCH", "reply", "progress only: no record, no new epoch range", fr.SubBatch(sub_id=2, records=[], epochs=[], progress=GSN + 9)),
        ("STATUS_OK", "reply", "a status map (a few of its keys)", fr.StatusOk(req_id=REQUEST_ID, status=status)),
        ("STATUS_OK", "reply", "a backup that has seen no epoch yet: epoch -1 (a negative fixint)",
         fr.StatusOk(req_id=REQUEST_ID, status=starting)),
        ("RANGE_OK", "reply", "records up to upto; ask again from upto + 1",
         fr.RangeOk(req_id=REQUEST_ID, records=[(3, b"a"), (GSN, b"bc")], upto=GSN, stable=GSN + 3)),
        ("COUNT_OK", "reply", "nothing asked but the watermark",
         fr.CountOk(req_id=REQUEST_ID, count=0, nth_gsn=0, upto=GSN + 3)),
        ("ERROR", "reply", "an answer to request 7", fr.Error(req_id=REQUEST_ID, code=fr.E_NOT_FOUND, message="no record at gsn 4294967301")),
        ("ERROR", "reply", "an answer to subscription 2: its sub_id in the req_id place",
         fr.Error(req_id=2, code=fr.E_TRIMMED, message="gsn 3 is below the trim point 100")),
        ("ERROR", "reply", "an answer to a frame whose request id could not be read",
         fr.Error(req_id=None, code=fr.E_MALFORMED, message="frame must be a msgpack array [version, op, ...]")),
    ]
    return out


#: bytes the codecs never write but a peer takes: (name, direction, what it shows, the fields)
DECODE_ONLY: list[tuple[str, str, str, list[Any]]] = [
    ("INSERT", "request", "without the optional stamp: seven elements, read as stamp 0", [1, fr.INSERT, 9, 3, 3, 0, b"x"]),
    ("ACK", "reply", "from a server of a build before incarnations: eight elements, read as inc 0 (names none)",
     [1, fr.ACK, 7, GSN, 0, GSN - 1, True, False]),
]


def vectors() -> dict[str, Any]:
    """The file's content, made by the codecs."""
    items = []
    for name, direction, note, frame in _examples():
        raw = fr.encode(frame)
        fields = list(frame.__struct_fields__)
        values = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        assert len(values) == len(fields)
        items.append({
            "name": name, "op": values[1], "direction": direction, "note": note, "hex": raw.hex(),
            "fields": [{"name": f, "value": typed(v)} for f, v in zip(fields, values)],
        })
    for name, direction, note, values in DECODE_ONLY:
        raw = msgpack.packb(values, use_bin_type=True)
        op = values[1]
        assert type(op) is int
        cls = (fr.REQUESTS if direction == "request" else fr.REPLIES)[op]
        fields = list(cls.__struct_fields__)[:len(values)]
        items.append({"name": name, "op": values[1], "direction": direction, "note": note, "decode_only": True,
                      "hex": raw.hex(), "fields": [{"name": f, "value": typed(v)} for f, v in zip(fields, values)]})
    return {
        "protocol_version": fr.PROTOCOL_VERSION,
        "about": "Every client frame and answer as the bytes ziplog's codecs make (hex), beside its fields in order "
                 "(the first two are the version and the op). Values are typed, so no JSON reader has to guess: "
                 "uint and int as decimal strings (JSON numbers lose integers above 2^53), bin as hex, "
                 "str, bool, nil as themselves, array as a list of values, map as a list of [key, value]. "
                 "A port should decode each hex to these fields and encode these fields to this hex "
                 "(decode_only: bytes ziplog never writes but a peer takes; decode them only). "
                 "Generated by python -m ziplog.tools.vectors; see docs/CLIENT.md.",
        "vectors": items,
    }


def render() -> str:
    """The file's text: one vector per line, so a diff names the frame that changed."""
    doc = vectors()
    head = {k: v for k, v in doc.items() if k != "vectors"}
    lines = [json.dumps(head)[:-1] + ', "vectors": [']
    lines += [json.dumps(v) + ("," if i < len(doc["vectors"]) - 1 else "") for i, v in enumerate(doc["vectors"])]
    return "\n".join(lines) + "\n]}\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="fail if docs/vectors.json is not what the codecs make")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not PATH.exists() or PATH.read_text() != text:
            print(f"{PATH.name} is stale: run python -m ziplog.tools.vectors", file=sys.stderr)
            return 1
        return 0
    PATH.write_text(text)
    print(f"wrote {len(vectors()['vectors'])} vectors to docs/{PATH.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
