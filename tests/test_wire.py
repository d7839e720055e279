from __future__ import annotations

import pytest

from ziplog.protocol import frames as wire


def test_roundtrip_valid_insert() -> None:
    frame = wire.pack([wire.PROTOCOL_VERSION, wire.INSERT, 1, 2, 3, 4, b"data"])
    assert wire.decode_request(frame) == [wire.PROTOCOL_VERSION, wire.INSERT, 1, 2, 3, 4, b"data"]


@pytest.mark.parametrize("msg, code", [
    ([wire.PROTOCOL_VERSION, wire.READ, 1, True], wire.E_BAD_ARGUMENT),  # bool is not a uint
    ([wire.PROTOCOL_VERSION, wire.READ, 1, 1 << 64], None),  # too big for msgpack uint64: packing fails
    ([wire.PROTOCOL_VERSION, wire.TRIM, 1], wire.E_MALFORMED),
    ([None, wire.READ, 1, 1], wire.E_VERSION),
])
def test_rejects(msg: list, code: str | None) -> None:
    try:
        frame = wire.pack(msg)
    except OverflowError:
        assert code is None
        return
    with pytest.raises(wire.ProtocolError) as exc:
        wire.decode_request(frame)
    assert exc.value.code == code
