"""Record ids, special positions and sharding policies."""

from __future__ import annotations

import random as _random
import zlib
from dataclasses import dataclass
from typing import NamedTuple, Sequence


class RecordId(NamedTuple):
    """A record's identity: its global sequence number and the shard storing it.

    Ordered by gsn (gsns are unique across shards, so the shard never decides)."""

    gsn: int
    shard: int


#: The start of the log: insert anywhere, subscribe from the beginning.
RID_GENESIS = RecordId(0, -1)
#: A recent position: subscribe from a recently inserted record (not necessarily the last).
RID_RECENT = RecordId(-1, -1)


@dataclass(frozen=True)
class Policy:
    """Which shard an insert goes to. Build one with :meth:`random`, :meth:`fixed` or
    :meth:`by_key`."""

    kind: str = "random"
    shard: int | None = None

    @staticmethod
    def random() -> "Policy":
        return Policy("random")

    @staticmethod
    def fixed(shard: int) -> "Policy":
        return Policy("fixed", shard)

    @staticmethod
    def by_key() -> "Policy":
        """Hash of the ``key=`` passed to insert_after (or of the record) picks the shard,
        so equal keys land on the same shard while the shard set is unchanged."""
        return Policy("key")

    def choose(self, live: Sequence[int], key: bytes | None, data: bytes, rng: _random.Random) -> int | None:
        if not live:
            return None
        if self.kind == "fixed":
            return self.shard if self.shard in live else None
        if self.kind == "key":
            h = zlib.crc32(key if key is not None else data)
            return live[h % len(live)]
        return live[rng.randrange(len(live))]
