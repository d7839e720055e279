"""The decided log of one replica: records by gsn, the membership of every epoch, and
the watermarks. The primary writes it with its decisions; a backup applies the
primary's stream to it; recovery truncates and refills it. Every change is also an
event to persist.

* ``frontier``: every slot of this shard with gsn <= frontier is decided here (a record
  or a no-op);
* ``stable``: every replica of the shard holds the log up to it, so nothing at or below
  it can change or vanish: only stable positions are ever shown to subscribers;
* ``trim_point``: records below it are logically deleted.
"""

from __future__ import annotations

import bisect
from typing import Any, Callable, Iterable, Iterator

from ziplog.cores.effects import Outbox
from ziplog.protocol import frames as f
from ziplog.protocol.events import (
    DiskEvent,
    EpochEvent,
    FrontierEvent,
    Members,
    RecordEvent,
    RecoveryEvent,
    RefusedEvent,
    SnapshotEvent,
    StableEvent,
    TrimEvent,
    TruncateEvent,
)
from ziplog.protocol.gsna import epoch_base, epoch_of

#: What a record held in memory costs beside its data: its event, its data's bytes
#: object header, its gsn, its entries in ``records``, ``gsns`` and ``dedup`` (about
#: 310 bytes, measured with ``tracemalloc`` on CPython 3.11)
RECORD_OVERHEAD = 320


def held(ev: RecordEvent) -> int:
    """The memory a record takes in the decided log."""
    return len(ev.data) + RECORD_OVERHEAD


class DecidedLog:
    def __init__(self, out: Outbox) -> None:
        self.out = out
        self.records: dict[int, RecordEvent] = {}
        self.gsns: list[int] = []  # sorted gsns of self.records
        self.dedup: dict[tuple[int, int], int] = {}  # (client_id, seq) -> decided gsn
        #: the memory ``records`` takes (:func:`held` of each), bounded by admission
        #: (``ReplicaSettings.max_log_bytes``)
        self.held_bytes = 0
        self.frontier = 0
        self.stable = 0
        self.trim_point = 0
        #: membership history: [first_epoch, last_epoch, members]; contiguous from 0
        self.membership: list[list[Any]] = []
        #: called after ``stable`` advanced (subscriptions have something new to show)
        self.stable_listeners: list[Callable[[], None]] = []
        #: positions up to here are final though not yet stable: a recovery whose state
        #: the failure handler committed in ZooKeeper installed them here, and will
        #: install exactly them on every replica (one may be gone for good until it is
        #: replaced). Subscribers may be served up to it (:attr:`servable`).
        self.fixed_upto = 0
        #: why this replica cannot persist its decided stream now (a full disk, say), or
        #: None: while set, it takes no new records (it keeps, serves and retries writing
        #: everything it holds)
        self.disk_fault: str | None = None
        #: this replica's last step in a failure recovery, as persisted (its disk's
        #: word on it after a restart; every new segment's snapshot repeats it)
        self.recovery_mark: RecoveryEvent | None = None
        #: the records recovery generation ``refused_gen``'s source told their clients
        #: the shard will not hold (this replica, as that source, or the source at
        #: RESUME), as persisted (every new segment's snapshot repeats those of the
        #: mark's generation): never placed here, past a restart too
        self.refused: dict[tuple[int, int], None] = {}
        self.refused_gen = -1

    # -- reading ------------------------------------------------------------------------------
    @property
    def last_epoch(self) -> int:
        """Last epoch of the decided stream (-1 before any)."""
        return self.membership[-1][1] if self.membership else -1

    def members_of(self, epoch: int) -> Members | None:
        i = bisect.bisect_right(self.membership, epoch, key=lambda r: r[0]) - 1
        if i < 0 or epoch > self.membership[i][1]:
            return None
        return tuple(self.membership[i][2])

    def ever_member(self, shard: int) -> bool:
        return any(shard in r[2] for r in self.membership)

    def takes_no_new(self, size: int, limit: int) -> tuple[str, str] | None:
        """Why this replica takes no new record of ``size`` bytes, as an error code and a
        message, or None: its disk cannot be written (DISK_FULL), or the record would take
        its records in memory past ``limit`` bytes (LOG_FULL; ``ReplicaSettings.max_log_bytes``,
        0: no bound)."""
        if self.disk_fault is not None:
            return f.E_DISK_FULL, f"this replica cannot write: {self.disk_fault}"
        if not limit or self.held_bytes + size + RECORD_OVERHEAD <= limit:
            return None
        return f.E_LOG_FULL, f"this replica holds {self.held_bytes} of its {limit} bytes of records in memory: trim the log"

    def records_after(self, gsn: int) -> list[RecordEvent]:
        i = bisect.bisect_right(self.gsns, gsn)
        records = self.records
        return [records[g] for g in self.gsns[i:]]

    @property
    def deletable_below(self) -> int:
        """Records below this gsn may be deleted for good, from memory and from disk:
        trimmed, and stable, so no backup will need them for a catch-up."""
        return min(self.trim_point, self.stable + 1)

    def stream_after(self, frontier: int) -> Iterator[RecordEvent | EpochEvent]:
        """The decided stream above ``frontier`` for a replica at that frontier (it has
        applied every epoch up to ``epoch_of(frontier)`` at least): a catch-up."""
        return stream_events(self.records_after(frontier), self.membership, epoch_hint(frontier))

    # -- the decided stream: the only way state changes -------------------------------------------
    def apply_record(self, ev: RecordEvent) -> bool:
        """Store a decided record; False for a repeat of one already applied."""
        gsn = ev.gsn
        if gsn <= self.frontier:
            return False
        assert not self.gsns or gsn > self.gsns[-1], "decided records must arrive in gsn order"
        assert epoch_of(gsn) == self.last_epoch, ("record outside the current epoch", gsn, self.last_epoch)
        key = (ev.client_id, ev.seq)
        assert key not in self.dedup, ("record decided twice", key, self.dedup.get(key), gsn)
        self._keep(ev)
        self.out.persist.append(ev)
        return True

    def _keep(self, ev: RecordEvent) -> None:
        """Hold a decided record above every one held (a decision or a replayed one)."""
        gsn = ev.gsn
        self.records[gsn] = ev
        self.gsns.append(gsn)
        self.dedup[(ev.client_id, ev.seq)] = gsn
        self.held_bytes += held(ev)
        self.frontier = gsn

    def _forget(self, gsns: list[int]) -> None:
        """Let go of held records (their gsns, which the caller cuts from ``gsns``):
        trimmed, or replaced by a recovery. Their dedup entries go too."""
        for g in gsns:
            rec = self.records.pop(g)
            self.dedup.pop((rec.client_id, rec.seq), None)
            self.held_bytes -= held(rec)
        assert self.held_bytes >= 0, ("memory count", self.held_bytes)

    def advance_frontier(self, frontier: int) -> bool:
        """Every slot up to ``frontier`` is decided (the rest are no-ops)."""
        if frontier <= self.frontier:
            return False
        assert epoch_of(frontier) <= self.last_epoch, "frontier beyond the known epochs"
        self.frontier = frontier
        return True

    def apply_epochs(self, first: int, last: int, members: Iterable[int] | None) -> bool:
        """Record that epochs first..last had ``members`` (None: same as the previous)."""
        if last <= self.last_epoch:
            return False
        if first <= self.last_epoch:
            first = self.last_epoch + 1
        assert first == self.last_epoch + 1 or not self.membership, ("membership gap", first, self.last_epoch)
        if members is None:
            assert self.membership, "first epoch event must carry its members"
            members = self.membership[-1][2]
        m = tuple(members)
        if self.membership and tuple(self.membership[-1][2]) == m and self.membership[-1][1] == first - 1:
            self.membership[-1][1] = last
        else:
            self.membership.append([first, last, m])
        # Epochs before ``first`` are closed: nothing of ours can appear there any more.
        if self.frontier < epoch_base(first) - 1:
            self.frontier = epoch_base(first) - 1
        self.out.persist.append(EpochEvent(first, last, m))
        return True

    @property
    def servable(self) -> int:
        """Subscribers may be shown every position up to here: stable, or fixed by an
        installed recovery, and never past the frontier. (A recovery's install in parts
        truncates at its base, which may lie below ``stable``, and brings the same stable
        records back part by part: between parts, positions above the frontier are not
        in the log, and a subscription shown them would miss their records.)"""
        return min(self.stable if self.fixed_upto <= self.stable else self.fixed_upto, self.frontier)

    def fix_upto(self, end: int) -> None:
        """An installed recovery fixed every position up to ``end`` (see ``fixed_upto``)."""
        if end > self.fixed_upto:
            self.fixed_upto = end
            for fn in self.stable_listeners:
                fn()

    def stable_within_frontier(self) -> None:
        """After a recovery's last install part: ``stable`` back to at most the frontier.
        The install ended at the recovery's end, which may lie below positions this
        replica had made stable: the no-ops of epochs without the shard (its positions
        after it left), taken from a FORWARD its primary sent before the freeze when the
        source never applied those epochs. Positions at or below the source's stable
        point are never truncated (``base = min(frontier, X)``), and no record of the
        shard can lie in an epoch that left it out: only no-ops go, and come back as the
        same no-ops when the shard learns those epochs again. Left above the frontier,
        the next recovery's source would name a stable point no replica holds, and
        wait for it for ever."""
        self.stable = min(self.stable, self.frontier)

    def advance_stable(self, stable: int) -> bool:
        """Every replica holds the log up to ``stable`` (never beyond our frontier)."""
        stable = min(stable, self.frontier)
        if stable <= self.stable:
            return False
        self.stable = stable
        self.drop_trimmed()
        for fn in self.stable_listeners:
            fn()
        return True

    def raise_trim(self, point: int, drop: bool = True) -> bool:
        if point <= self.trim_point:
            return False
        self.trim_point = point
        self.out.persist.append(TrimEvent(point))
        if drop:
            self.drop_trimmed()
        return True

    def drop_trimmed(self) -> None:
        """Drop trimmed records from memory, but only stable ones: an unstable record may
        still be needed to catch a backup up."""
        limit = self.deletable_below
        if not self.gsns or self.gsns[0] >= limit:
            return
        i = bisect.bisect_left(self.gsns, limit)
        self._forget(self.gsns[:i])  # their clients are long done
        del self.gsns[:i]
        assert self.gsns or self.held_bytes == 0, ("memory count", self.held_bytes)

    def truncate(self, base: int) -> None:
        """Forget everything decided above ``base`` (failure recovery replaces it)."""
        i = bisect.bisect_right(self.gsns, base)
        self._forget(self.gsns[i:])
        del self.gsns[i:]
        assert self.gsns or self.held_bytes == 0, ("memory count", self.held_bytes)
        self.frontier = min(self.frontier, base)
        keep_epoch = epoch_of(base) if base > 0 else -1
        kept = []
        for first, last, members in self.membership:
            if first > keep_epoch:
                break
            kept.append([first, min(last, keep_epoch), members])
        self.membership = kept

    def mark_recovery(self, mark: RecoveryEvent) -> None:
        """Persist a step of this replica's part in a failure recovery."""
        self.recovery_mark = mark
        self.out.persist.append(mark)

    def mark_refused(self, gen: int, key: tuple[int, int]) -> None:
        """Persist that recovery generation ``gen``'s source (this replica, or the one
        that handed it over at RESUME) told the client of ``key`` the shard will not
        hold its record."""
        self._note_refused(gen, key)
        self.out.persist.append(RefusedEvent(gen, key[0], key[1]))

    def _note_refused(self, gen: int, key: tuple[int, int]) -> None:
        if gen != self.refused_gen:
            assert gen > self.refused_gen, ("refusals of an older recovery generation", gen, self.refused_gen)
            self.refused, self.refused_gen = {}, gen
        self.refused[key] = None

    # -- disk -----------------------------------------------------------------------------------
    def replay(self, events: Iterable[DiskEvent]) -> None:
        """Rebuild from persisted events (see ``ziplog.io.segments``); nothing is persisted
        again."""
        for ev in events:
            t = type(ev)
            if t is RecordEvent:
                assert isinstance(ev, RecordEvent)
                if ev.gsn > self.frontier:
                    self._keep(ev)
            elif t is FrontierEvent:
                assert isinstance(ev, FrontierEvent)
                self.frontier = max(self.frontier, ev.frontier)
            elif t is EpochEvent:
                assert isinstance(ev, EpochEvent)
                self.apply_epochs(ev.first, ev.last, ev.members)
            elif t is TrimEvent:
                assert isinstance(ev, TrimEvent)
                self.trim_point = max(self.trim_point, ev.point)
            elif t is TruncateEvent:
                assert isinstance(ev, TruncateEvent)
                self.truncate(ev.base)
            elif t is StableEvent:
                assert isinstance(ev, StableEvent)
                self.stable = max(self.stable, ev.stable)
            elif t is SnapshotEvent:
                assert isinstance(ev, SnapshotEvent)
                for first, last, members in ev.ranges:
                    self.apply_epochs(first, last, members)
                self.frontier = max(self.frontier, ev.frontier)
                self.stable = max(self.stable, ev.stable)
                self.trim_point = max(self.trim_point, ev.trim)
                if ev.recovery is not None:
                    self.recovery_mark = ev.recovery
                    if ev.recovery.gen >= self.refused_gen:
                        for client_id, seq in ev.refused:
                            self._note_refused(ev.recovery.gen, (client_id, seq))
            elif t is RecoveryEvent:
                assert isinstance(ev, RecoveryEvent)
                self.recovery_mark = ev
            elif t is RefusedEvent:
                assert isinstance(ev, RefusedEvent)
                if ev.gen >= self.refused_gen:
                    self._note_refused(ev.gen, (ev.client_id, ev.seq))
        self.stable = min(self.stable, self.frontier)
        self.out.persist.clear()
        self.drop_trimmed()

    def snapshot(self) -> SnapshotEvent:
        """What a new segment file opens with."""
        mark = self.recovery_mark
        refused = tuple(self.refused) if mark is not None and mark.gen == self.refused_gen else ()
        return SnapshotEvent([(f, la, tuple(m)) for f, la, m in self.membership], self.frontier, self.stable,
                             self.trim_point, mark, refused)

    def flush_marks(self) -> list[DiskEvent]:
        """The watermarks written with every batch of events on disk."""
        return [FrontierEvent(self.frontier, self.last_epoch, 0), StableEvent(self.stable)]


def epoch_hint(frontier: int) -> int:
    """A replica at ``frontier`` has applied every epoch up to this one at least."""
    return epoch_of(frontier) if frontier > 0 else -1


def stream_events(records: list[RecordEvent], membership: list[list[Any]],
                  known_epoch: int) -> Iterator[RecordEvent | EpochEvent]:
    """A decided stream for a replica that knows every epoch up to ``known_epoch``:
    epoch events and ``records`` (sorted by gsn) in order, a range of epochs split
    wherever records fall so that every record follows the event opening its epoch.
    Used for catch-ups and by failure recovery to build what it installs. Records go
    with slot 0 (a catch-up does not need slots)."""
    i = 0
    n = len(records)

    def record(j: int) -> RecordEvent:
        r = records[j]
        return r if r.slot == 0 else RecordEvent(r.gsn, 0, r.client_id, r.seq, r.data)

    for first, last, members in membership:
        if last <= known_epoch:
            continue
        e = max(first, known_epoch + 1)
        while i < n and epoch_of(records[i].gsn) < e:  # records of epochs it already knows
            yield record(i)
            i += 1
        while e <= last:
            if i < n and epoch_of(records[i].gsn) <= last:
                re = epoch_of(records[i].gsn)
                yield EpochEvent(e, re, tuple(members))
                while i < n and epoch_of(records[i].gsn) == re:
                    yield record(i)
                    i += 1
                e = re + 1
            else:
                yield EpochEvent(e, last, tuple(members))
                e = last + 1
    while i < n:
        yield record(i)
        i += 1
