"""LogBook's records in the shared log, and their strict decoding.

Every LogBook record starts with a header that names it (``MAGIC`` and a format
version), so books share a log with anything else: a record without the header, with
another version, or that does not decode exactly, is *not LogBook's*, and every index
skips it the same way (never a crash). Two kinds:

* an **entry** of book ``book`` with its ``tags`` (64-bit integers; a string tag is its
  :func:`tag_of` hash, and the string is kept in ``names`` so the record says what it
  was) and the application's ``data``;
* a **trim** of book ``book`` below ``seqnum``: every entry of the book with a smaller
  seqnum is gone for readers at a cut at or above the trim record's own gsn (Boki's
  ``logTrim`` as a record, so every index applies it at the same point of the log).

A Boki seqnum is the record's gsn.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Union

import msgspec

from ziplog.protocol.app_records import RecordCodec

MAGIC = b"ZLBK"
FORMAT = 1
#: the header every LogBook record starts with
HEADER = MAGIC + bytes([FORMAT])
#: an entry with more tags than this is not LogBook's (keeps every index update bounded)
MAX_TAGS = 64
#: a string tag longer than this is not LogBook's
MAX_TAG_NAME = 1024

#: msgpack integers end at 2**64 - 1: non-negative is all that is left to check
U64 = Annotated[int, msgspec.Meta(ge=0)]
TagName = Annotated[str, msgspec.Meta(max_length=MAX_TAG_NAME)]


class Entry(msgspec.Struct, array_like=True, tag=1, tag_field="kind", forbid_unknown_fields=True, frozen=True):
    book: U64
    tags: Annotated[tuple[U64, ...], msgspec.Meta(max_length=MAX_TAGS)]
    #: tag -> the string it is the hash of (string tags only)
    names: Annotated[dict[U64, TagName], msgspec.Meta(max_length=MAX_TAGS)]
    data: bytes


class Trim(msgspec.Struct, array_like=True, tag=2, tag_field="kind", forbid_unknown_fields=True, frozen=True):
    book: U64
    #: entries of the book below this seqnum are trimmed
    seqnum: U64


Record = Union[Entry, Trim]

_codec: RecordCodec[Record] = RecordCodec(HEADER, Record)


def tag_of(tag: int | str) -> int:
    """A tag as the index keeps it: an integer as it is (0 <= tag < 2**64), a string as
    its BLAKE2b hash with an 8-byte digest (``digest_size=8``, read big-endian; the same in
    every process and language)."""
    if isinstance(tag, str):
        return int.from_bytes(hashlib.blake2b(tag.encode(), digest_size=8).digest(), "big")
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < 1 << 64:
        raise ValueError(f"a tag is a string or an integer in 0..2**64-1, not {tag!r}")
    return tag


def entry(book: int, data: bytes, tags: "list[int | str] | tuple[int | str, ...]" = ()) -> Entry:
    """The entry record of ``data`` in ``book`` with ``tags`` (duplicates dropped, order kept)."""
    if not 0 <= book < 1 << 64:
        raise ValueError(f"a book id is in 0..2**64-1, not {book!r}")
    hashed: list[int] = []
    names: dict[int, str] = {}
    for t in tags:
        h = tag_of(t)
        if isinstance(t, str):
            if len(t) > MAX_TAG_NAME:
                raise ValueError(f"a string tag is at most {MAX_TAG_NAME} characters")
            names[h] = t
        if h not in hashed:
            hashed.append(h)
    if len(hashed) > MAX_TAGS:
        raise ValueError(f"a record has at most {MAX_TAGS} tags")
    return Entry(book=book, tags=tuple(hashed), names=names, data=bytes(data))


def encode(record: Record) -> bytes:
    return _codec.encode(record)


def decode(data: bytes) -> Record | None:
    """The record ``data`` holds, or None when it is not one (another application's
    record, garbage, another format version, a bad field)."""
    return _codec.decode(data)
