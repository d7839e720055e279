"""LogDB's records in the shared log, and their strict decoding.

Every LogDB record starts with a header that names it (``MAGIC`` and a format version),
so LogDB shares a log with anything else: a record without the header, with another
version, or that does not decode exactly, is *not LogDB's* and every replayer skips it
the same way (never a crash). Two kinds:

* a **write**: ``key`` and ``value`` (``None``: a delete) of transaction ``txn``; its
  record id is what the transaction's commit names;
* a **commit**: transaction ``txn``'s read set (key -> the rid of the write it read, or
  none: the key had no committed value) and write set (key -> the rid of its write),
  inserted *after* the largest rid it names, so every replayer has seen all of them
  when it reaches the commit.

Keys and values are bytes. A record id is ``(gsn, shard)``.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

from ziplog.protocol.app_records import RecordCodec
from ziplog.protocol.errors import ZiplogError

MAGIC = b"ZLDB"
FORMAT = 1
#: the header every LogDB record starts with
HEADER = MAGIC + bytes([FORMAT])
#: a key longer than this is not LogDB's (keeps every map bounded per entry)
MAX_KEY_BYTES = 1024
#: a read set or write set larger than this is not LogDB's
MAX_KEYS_PER_TXN = 10_000

U64 = Annotated[int, msgspec.Meta(ge=0)]
Shard = Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)]
Key = Annotated[bytes, msgspec.Meta(max_length=MAX_KEY_BYTES)]
#: (gsn, shard)
Rid = tuple[U64, Shard]
#: a read of a key with no committed value
NO_RID: tuple[int, int] = (0, 0)


class TransactionAborted(ZiplogError):
    """The transaction conflicted with one committed before it (or named writes the log
    does not hold as it said): nothing it wrote is visible. Run it again."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Write(msgspec.Struct, array_like=True, tag=1, tag_field="kind", forbid_unknown_fields=True, frozen=True):
    txn: U64
    key: Key
    value: bytes | None


class Commit(msgspec.Struct, array_like=True, tag=2, tag_field="kind", forbid_unknown_fields=True, frozen=True):
    txn: U64
    reads: Annotated[dict[Key, Rid], msgspec.Meta(max_length=MAX_KEYS_PER_TXN)]
    writes: Annotated[dict[Key, Rid], msgspec.Meta(max_length=MAX_KEYS_PER_TXN)]


Record = Union[Write, Commit]

_codec: RecordCodec[Record] = RecordCodec(HEADER, Record)


def encode(record: Record) -> bytes:
    return _codec.encode(record)


def decode(data: bytes) -> Record | None:
    """The record ``data`` holds, or None when it is not one (another application's
    record, garbage, another format version, a bad field)."""
    return _codec.decode(data)
