"""A bounded, time-limited memory of record keys (``(client_id, seq)``): the records a
primary refused for good, the records a backup will never guess, the clients a backup
owes a corrected ACK. Entries leave after ``ttl_ns`` (pruned at most every
``interval_ns``, on its own clock: one memory's pruning never waits on another's) or,
oldest first, when ``limit`` is reached."""

from __future__ import annotations

from typing import Generic, Iterator, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Memory(Generic[K, V]):
    def __init__(self, ttl_ns: int, limit: int, interval_ns: int = 1_000_000_000) -> None:
        assert limit > 0
        self.ttl_ns = ttl_ns
        self.limit = limit
        self.interval_ns = interval_ns
        #: key -> (when it was added, value), in insertion order: the first is the oldest
        self._entries: dict[K, tuple[int, V | None]] = {}
        self.pruned_at = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        return iter(self._entries)

    def add(self, key: K, now: int, value: V | None = None) -> None:
        entries = self._entries
        entries.pop(key, None)
        entries[key] = (now, value)
        if len(entries) > self.limit:
            del entries[next(iter(entries))]

    def get(self, key: K) -> V | None:
        e = self._entries.get(key)
        return None if e is None else e[1]

    def pop(self, key: K) -> V | None:
        e = self._entries.pop(key, None)
        return None if e is None else e[1]

    def take_all(self) -> list[tuple[K, V | None]]:
        out = [(k, v) for k, (_, v) in self._entries.items()]
        self._entries = {}
        return out

    def prune(self, now: int) -> None:
        if not self._entries or now - self.pruned_at < self.interval_ns:
            return
        self.pruned_at = now
        old = now - self.ttl_ns
        entries = self._entries
        while entries:
            key = next(iter(entries))
            if entries[key][0] >= old:
                break
            del entries[key]

    def next_prune(self) -> int | None:
        """When :meth:`prune` next has something to drop (None: empty)."""
        if not self._entries:
            return None
        oldest = next(iter(self._entries.values()))[0]
        return max(oldest + self.ttl_ns + 1, self.pruned_at + self.interval_ns)
