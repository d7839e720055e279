"""The records an index node keeps to answer lookups with (sans-I/O): the bytes of its
newest entries, as the feeder sent them, bounded by bytes; the lowest gsns go first.

Why it is safe to answer with them: the feeder reads the log by a subscription, so what
it sends with an entry is the record the log holds at that gsn, stable, and a record
never changes once stable. A node keeps a record only beside the entry it indexes
(same Feed, same gsn), and answers it only for a hit it computed, so the bytes an answer
carries are the bytes ``read_record`` of the hit would return.
"""

from __future__ import annotations

#: record bytes a node keeps at most by default
KEEP_BYTES = 64 << 20
#: what one kept record costs beyond its bytes (its map entry)
PER_RECORD = 128


class KeptRecords:
    def __init__(self, max_bytes: int = KEEP_BYTES) -> None:
        assert max_bytes >= 0
        self.max_bytes = max_bytes
        #: gsn -> record; they come in gsn order, so the map's order is the lowest first
        self._data: dict[int, bytes] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._data)

    def add(self, gsn: int, data: bytes) -> None:
        cost = len(data) + PER_RECORD
        if cost > self.max_bytes:
            return
        last = next(reversed(self._data), None)
        assert last is None or gsn > last, ("records are kept in gsn order", gsn, last)
        self._data[gsn] = data
        self.bytes += cost
        while self.bytes > self.max_bytes:
            self.bytes -= len(self._data.pop(next(iter(self._data)))) + PER_RECORD

    def get(self, gsn: int) -> bytes | None:
        return self._data.get(gsn)

    def clear(self) -> None:
        self._data.clear()
        self.bytes = 0
