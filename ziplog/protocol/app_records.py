"""How the apps on the log (LogDB, LogBook) frame their records: a header that names
the app and its format version, then one msgpack value decoded strictly. A record
without the header, with another version, or that does not decode exactly is not the
app's: every replayer skips it the same way (never a crash)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")


class RecordCodec(Generic[T]):
    def __init__(self, header: bytes, kind: Any) -> None:
        self.header = header
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(kind)

    def encode(self, record: T) -> bytes:
        return self.header + self._encoder.encode(record)

    def decode(self, data: bytes) -> T | None:
        """The record ``data`` holds, or None when it is not one of this app's (another
        application's record, garbage, another format version, a bad field)."""
        if not data.startswith(self.header):
            return None
        try:
            return self._decoder.decode(memoryview(data)[len(self.header):])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
