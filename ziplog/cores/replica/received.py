"""What a backup keeps of the inserts it received so that the primary's FORWARD may name
a record instead of carrying it (forward by reference).

A client sends each INSERT to every replica of the shard, so a backup already holds the
bytes the primary decides: a FORWARD names a large record by key, size and digest
(:class:`~ziplog.protocol.events.RecordRefEvent`) and the primary's link carries each
record once instead of once per backup. The backup resolves every reference of a
FORWARD before it applies any of it; one it cannot resolve (the INSERT was lost, comes
later, was dropped from this bounded memory, or brought other bytes than the primary's)
leaves the whole FORWARD unapplied, and the backup asks for a catch-up, which carries
the records' data (``BackupFollower.on_forward``). A reference never makes a replica
store bytes the primary did not decide: the digest must match.
"""

from __future__ import annotations

from ziplog.protocol.events import RecordEvent, RecordRefEvent, StreamEvent, record_digest

Key = tuple[int, int]


class ReceivedData:
    """Insert data by key, at least ``min_bytes`` long, for ``ttl_ns`` at most and at
    most ``max_bytes`` in all (the oldest go first), pruned at most every
    ``interval_ns``."""

    def __init__(self, min_bytes: int, ttl_ns: int, max_bytes: int, interval_ns: int) -> None:
        self.min_bytes = min_bytes
        self.ttl_ns = ttl_ns
        self.max_bytes = max_bytes
        self.interval_ns = interval_ns
        #: key -> (when it arrived, data), oldest first
        self._entries: dict[Key, tuple[int, bytes]] = {}
        self.bytes = 0
        self.pruned_at = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: Key, data: bytes, now: int) -> None:
        if len(data) < self.min_bytes:
            return  # sent by value: a reference would save nothing
        self.discard(key)
        entries = self._entries
        entries[key] = (now, data)
        self.bytes += len(data)
        while self.bytes > self.max_bytes:
            self.discard(next(iter(entries)))

    def discard(self, key: Key) -> None:
        e = self._entries.pop(key, None)
        if e is not None:
            self.bytes -= len(e[1])

    def resolve(self, events: list[StreamEvent]) -> list[StreamEvent] | None:
        """``events`` with each reference replaced by the record it names, or None when
        one names bytes we do not hold."""
        out: list[StreamEvent] = []
        entries = self._entries
        for ev in events:
            if type(ev) is RecordRefEvent:
                assert isinstance(ev, RecordRefEvent)
                e = entries.get((ev.client_id, ev.seq))
                if e is None or len(e[1]) != ev.size or record_digest(e[1]) != ev.digest:
                    return None
                out.append(RecordEvent(ev.gsn, ev.slot, ev.client_id, ev.seq, e[1]))
            else:
                out.append(ev)
        return out

    def prune(self, now: int) -> None:
        entries = self._entries
        if not entries or now - self.pruned_at < self.interval_ns:
            return
        self.pruned_at = now
        old = now - self.ttl_ns
        while entries:
            key = next(iter(entries))
            if entries[key][0] >= old:
                break
            self.discard(key)

    def next_prune(self) -> int | None:
        """When :meth:`prune` next has something to drop (None: empty)."""
        if not self._entries:
            return None
        oldest = next(iter(self._entries.values()))[0]
        return max(oldest + self.ttl_ns + 1, self.pruned_at + self.interval_ns)
