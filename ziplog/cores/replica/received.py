"""What a backup keeps of the inserts it received so that the primary's FORWARD may name
a record instead of carrying it (forward by reference).

A client sends each INSERT to every replica of the shard, so a backup already holds the
bytes the primary decides: a FORWARD names a large record by key, size and digest
(:class:`~ziplog.protocol.events.RecordRefEvent`) and the primary's link carries each
record once instead of once per backup. The backup resolves every reference of a
FORWARD before it applies any of it. One it cannot resolve waits, with the FORWARDs
after it, for the INSERT to arrive (:class:`WaitingForwards`); if it does not within
``reference_wait_ns`` (lost, dropped from this bounded memory, or it brought other bytes
than the primary's), none of them is applied, and the backup asks for a catch-up, which
carries the records' data (``BackupFollower.on_forward``). A reference never makes a replica
store bytes the primary did not decide: the digest must match.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from ziplog.cores.replica.settings import ReplicaSettings
from ziplog.protocol import frames as f
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
        """``events`` with each reference replaced by the record it names (``events``
        itself when it holds none), or None when one names bytes we do not hold."""
        entries = self._entries
        refs = False
        for ev in events:  # first only look (a FORWARD that waits is tried at each insert)
            if type(ev) is RecordRefEvent:
                assert isinstance(ev, RecordRefEvent)
                if ev.key not in entries:
                    return None
                refs = True
        if not refs:
            return events  # by value: nothing to copy
        out: list[StreamEvent] = []
        for ev in events:
            if type(ev) is RecordRefEvent:
                assert isinstance(ev, RecordRefEvent)
                e = entries.get(ev.key)
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


class WaitingForwards:
    """The FORWARDs a backup holds, in order, while the first of them names bytes it does
    not hold yet: on one machine the primary often decides and forwards before the
    client's INSERT reaches the backup, which then arrives within microseconds. The
    first is retried each time an insert arrives (``take`` applies it or says it still
    waits), the others follow it in order; when the first has waited ``wait_ns``, or
    more than ``limit`` wait, they are dropped and ``give_up`` asks for a catch-up."""

    def __init__(self, take: Callable[[f.Forward, int], bool], give_up: Callable[[int], None], wait_ns: int,
                 limit: int, stats: dict[str, int]) -> None:
        self.take = take
        self.give_up = give_up
        #: the replica's counters: ``reference_misses``, the times it gave up
        self.stats = stats
        self.wait_ns = wait_ns
        self.limit = limit
        self.waiting: deque[f.Forward] = deque()
        #: when the first one began to wait
        self.since = 0

    def offer(self, msg: f.Forward, now: int) -> None:
        """A FORWARD arrived: taken now, or after the ones that wait."""
        if self.waiting:
            self.waiting.append(msg)
            if len(self.waiting) > self.limit:
                self._drop(now)
        elif not self.take(msg, now):
            self.waiting.append(msg)
            self.since = now

    def retry(self, now: int) -> None:
        """An insert arrived: take what waits, in order, until one still waits."""
        waiting = self.waiting
        while waiting:
            if not self.take(waiting[0], now):
                return
            waiting.popleft()
            self.since = now  # the next one waits from now

    def expire(self, now: int) -> None:
        if self.waiting and now - self.since >= self.wait_ns:
            self._drop(now)

    def deadline(self) -> int | None:
        return self.since + self.wait_ns if self.waiting else None

    def clear(self) -> None:
        """A new primary, a recovery: what waits is moot (a catch-up or an install
        brings the state)."""
        self.waiting.clear()

    def _drop(self, now: int) -> None:
        self.waiting.clear()
        self.stats["reference_misses"] += 1
        self.give_up(now)


def by_reference(settings: ReplicaSettings, take: Callable[[f.Forward, int], bool], give_up: Callable[[int], None],
                 stats: dict[str, int]) -> tuple[ReceivedData, WaitingForwards]:
    """A backup's parts for FORWARDs by reference: the insert data it keeps (none when
    the setting is off), and the FORWARDs that wait for it."""
    s = settings
    received = ReceivedData(s.reference_min_bytes if s.forward_by_reference else 1 << 63, s.reference_memory_ns,
                            s.max_reference_bytes, s.prune_interval_ns)
    return received, WaitingForwards(take, give_up, s.reference_wait_ns, s.max_waiting_forwards, stats)
