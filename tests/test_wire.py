from __future__ import annotations

import msgpack
import pytest

from ziplog.protocol import frames as wire


def test_roundtrip_valid_insert() -> None:
    frame = msgpack.packb([wire.PROTOCOL_VERSION, wire.INSERT, 1, 2, 3, 4, b"data"], use_bin_type=True)
    assert wire.decode_request(frame) == wire.Insert(req_id=1, client_id=2, seq=3, after=4, data=b"data")
    assert wire.encode(wire.decode_request(frame)) == frame


@pytest.mark.parametrize("msg, code", [
    ([wire.PROTOCOL_VERSION, wire.READ, 1, True], wire.E_BAD_ARGUMENT),  # bool is not a uint
    ([wire.PROTOCOL_VERSION, wire.READ, 1, 1 << 64], None),  # too big for msgpack uint64: packing fails
    ([wire.PROTOCOL_VERSION, wire.TRIM, 1], wire.E_MALFORMED),
    ([None, wire.READ, 1, 1], wire.E_VERSION),
])
def test_rejects(msg: list, code: str | None) -> None:
    try:
        frame = msgpack.packb(msg, use_bin_type=True)
    except OverflowError:
        assert code is None
        return
    with pytest.raises(wire.ProtocolError) as exc:
        wire.decode_request(frame)
    assert exc.value.code == code
