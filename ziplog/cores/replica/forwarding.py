"""A primary's stream to its backups, and the stability it learns back (dissertation
4.2.4): its decisions in order, batched per turn into FORWARDs that end with its frontier;
a catch-up for a backup that (re)connected or found a gap; the backups' PREFIX reports,
whose minimum with the primary's frontier is the stable watermark.

Only a SERVING primary forwards (a catch-up ending with its frontier makes a backup
QUALIFIED, which a primary that may have lost records cannot vouch for): the sequencer
checks its state before it calls :meth:`Forwarding.catch_up` or :meth:`Forwarding.flush`.
"""

from __future__ import annotations

import bisect

from ziplog.cores.effects import Outbox
from ziplog.cores.replica.log import DecidedLog, epoch_hint
from ziplog.cores.replica.settings import ReplicaSettings
from ziplog.protocol import frames as f
from ziplog.protocol.events import (
    RECORD_EVENT_OVERHEAD,
    RECORD_REF_SIZE,
    FrontierEvent,
    RecordEvent,
    RecordRefEvent,
    StreamEvent,
    event_size,
    record_digest,
)


class Forwarding:
    def __init__(self, settings: ReplicaSettings, log: DecidedLog, out: Outbox, incarnation: int = 0) -> None:
        self.s = settings
        self.log = log
        self.out = out
        #: our incarnation: every FORWARD names it as its sender's
        self.inc = incarnation
        #: backup -> the route its HELLO came on
        self.backup_routes: dict[int, bytes] = {}
        #: backup -> the incarnation its HELLO named as its own (0: a backup of a build
        #: before incarnations): every FORWARD to it names it as the one it is meant for
        self.backup_incs: dict[int, int] = {}
        #: backup -> the frontier it reported (never above ours)
        self.prefixes: dict[int, int] = {}
        #: the decisions of this turn, not forwarded yet
        self.events: list[StreamEvent] = []
        #: bytes of the records in ``events`` (a FORWARD stays within forward_batch_bytes)
        self.bytes = 0
        #: (frontier, last epoch) a backup is at after every FORWARD sent so far
        self.mark: tuple[int, int] = (0, -1)
        #: the highest stable gsn the backups were told of that holds a record (a FORWARD
        #: of the stable watermark alone is worth it only when it makes a record stable)
        self.stable_record_sent = 0
        #: the highest gsn we passed on a NOTICE: another shard's record waits for our
        #: no-ops up to it to be stable, so their stability is news worth a FORWARD too
        #: (subscribers that read from a backup learn it from there)
        self.demanded = 0
        self.last_forward_ns = 0
        #: records of at least this many bytes go by reference (a backup has their
        #: data from the client: see :mod:`.received`); catch-ups always carry data
        self.reference_min = settings.reference_min_bytes if settings.forward_by_reference else 1 << 63

    # -- stability --------------------------------------------------------------------------------
    def stable_changed(self) -> None:
        new = self.log.frontier
        for r in range(1, self.s.replicas):
            new = min(new, self.prefixes.get(r, 0))
        self.log.advance_stable(new)

    def prefix_fenced(self, route: bytes, msg: f.Prefix) -> bool:
        """A PREFIX counts only from the backup whose HELLO we took, on that HELLO's
        connection, and (a backup that names incarnations) meant for this incarnation: a
        frontier reported to the incarnation before us, or by the backup's incarnation
        before its restart (its tail lost since), must not make positions stable that the
        backup may not hold (ARCHITECTURE, Fencing)."""
        replica = msg.replica
        if self.backup_routes.get(replica) != route:
            return False
        return msg.to_inc == self.inc or (msg.to_inc == 0 and self.backup_incs.get(replica, 0) == 0)

    def on_prefix(self, msg: f.Prefix) -> None:
        replica, frontier = msg.replica, msg.frontier
        if frontier > self.prefixes.get(replica, 0):
            self.prefixes[replica] = min(frontier, self.log.frontier)
            self.stable_changed()

    def stable_news(self) -> bool:
        """The stable watermark moved past a record the backups do not know is stable, or
        past no-ops another shard's record waits for. (Never with a single backup: it
        knows everything it applied is stable.)"""
        log = self.log
        if log.stable <= self.stable_record_sent or self.s.backup_knows_stable:
            return False
        if self.demanded > self.stable_record_sent:
            return True
        gsns = log.gsns
        i = bisect.bisect_right(gsns, self.stable_record_sent)
        return i < len(gsns) and gsns[i] <= log.stable

    # -- backups ----------------------------------------------------------------------------------
    def backup_at(self, replica: int, route: bytes, frontier: int, inc: int = 0) -> None:
        """A backup's HELLO: where it is, the route it is reached on, and its incarnation."""
        self.backup_routes[replica] = route
        self.backup_incs[replica] = inc
        self.prefixes[replica] = frontier

    def _forward_to(self, replica: int, stable: int, body: f.ForwardBody) -> f.Forward:
        """A FORWARD meant for ``replica``'s incarnation, from ours (to a backup that named
        no incarnation, one that names none either: the frame of the builds before)."""
        to = self.backup_incs.get(replica, 0)
        return f.Forward(stable=stable, body=body, to_inc=to, inc=self.inc if to else 0)

    def catch_up(self, replica: int, frontier: int, next_slot: int) -> None:
        """Send backup ``replica`` at ``frontier`` everything decided above it, in parts of at most
        forward_batch_bytes. A part ends with a record and no FRONTIER event (the backup's
        frontier is then that record's gsn, and it asks for the next part at once); the
        last part ends with our frontier, which puts the backup in step (QUALIFIED)."""
        log = self.log
        events: list[StreamEvent] = []
        size, records, partial = 0, 0, False
        for ev in log.stream_after(frontier):
            n = event_size(ev)
            if type(ev) is RecordEvent:
                if records and size + n > self.s.forward_batch_bytes:
                    partial = True
                    break
                records += 1
            events.append(ev)
            size += n
        if not partial:
            events.append(FrontierEvent(log.frontier, log.last_epoch, next_slot))
        self.out.send(self.backup_routes[replica],
                      self._forward_to(replica, log.stable, f.ForwardBody(frontier, epoch_hint(frontier), events)))

    # -- the turn's decisions ---------------------------------------------------------------------
    def _wire_size(self, size: int) -> int:
        """What a record event of ``size`` encoded bytes takes in a FORWARD."""
        return RECORD_REF_SIZE if size - RECORD_EVENT_OVERHEAD >= self.reference_min else size

    def full_for(self, size: int) -> bool:
        """A record event of ``size`` bytes would take this turn's FORWARD past its bound."""
        return bool(self.events) and self.bytes + self._wire_size(size) > self.s.forward_batch_bytes

    def add_record(self, ev: RecordEvent, size: int) -> None:
        data = ev.data
        if len(data) >= self.reference_min:
            self.events.append(RecordRefEvent(ev.gsn, ev.slot, ev.client_id, ev.seq, len(data), record_digest(data)))
            self.bytes += RECORD_REF_SIZE
        else:
            self.events.append(ev)
            self.bytes += size

    def add(self, ev: StreamEvent) -> None:
        """An epoch or frontier event (no record bytes)."""
        self.events.append(ev)

    def drop_pending(self) -> None:
        """A recovery replaces the log above some point: this turn's decisions are gone."""
        self.events = []
        self.bytes = 0

    def flush(self, now: int, next_slot: int) -> None:
        """End of a turn: one FORWARD with the turn's decisions. Batching per turn keeps
        the per-record message count low under load without delaying anything when
        idle."""
        log = self.log
        s = self.s
        # Every FORWARD carries the stable watermark; a FORWARD of its own is only
        # worth it when no records have gone out for a while.
        since = now - self.last_forward_ns
        # (not when only no-ops nobody waits for became stable: an idle shard's heartbeat
        # carries that)
        push_stable = since >= s.stable_push_ns and self.stable_news()
        # A backup that lags with nothing new to send may have lost a FORWARD: a
        # periodic (empty) FORWARD names our state so it can spot the gap and ask ...
        lagging = since >= s.lag_probe_ns and any(self.prefixes.get(r, 0) < log.frontier for r in self.backup_routes)
        # ... and an idle primary's heartbeat is an empty FORWARD.
        lagging = lagging or (since >= s.heartbeat_ns and bool(self.backup_routes))
        # Records wait up to forward_interval so that under load one FORWARD (and one
        # PREFIX back) carries several: fewer messages per insert, at the price of that
        # much more time until records are stable.
        due = not self.events or since >= s.forward_interval_ns
        if (self.events and due) or push_stable or lagging:
            self.forward(now, next_slot)

    def forward(self, now: int, next_slot: int) -> None:
        """Send the buffered decisions, ending with our frontier, to every backup."""
        log = self.log
        prev_f, prev_e = self.mark
        events = self.events
        events.append(FrontierEvent(log.frontier, log.last_epoch, next_slot))
        body = f.ForwardBody(prev_f, prev_e, events)
        for r in sorted(self.backup_routes):
            self.out.send(self.backup_routes[r], self._forward_to(r, log.stable, body))
        self.events = []
        self.bytes = 0
        self.stable_record_sent = log.stable
        self.last_forward_ns = now
        self.mark_point()

    def mark_point(self) -> None:
        """Remember (frontier, last epoch): the state a backup is in after applying every
        forward sent so far. The next FORWARD names it so a backup can spot a gap."""
        self.mark = (self.log.frontier, self.log.last_epoch)

    def in_step_after_recovery(self) -> None:
        """Recovery is over: every replica holds exactly the recovered state."""
        self.prefixes = {r: self.log.frontier for r in range(1, self.s.replicas)}
        self.stable_record_sent = self.log.stable
        self.mark_point()

    def next_deadline(self, best: int | None) -> int | None:
        """The earlier of ``best`` and when :meth:`flush` next has something to send: a
        heartbeat or a lag probe, a stable push, this turn's batch."""
        s, log = self.s, self.log
        last = self.last_forward_ns
        if self.backup_routes:
            t = last + (s.lag_probe_ns if log.stable < log.frontier and s.lag_probe_ns < s.heartbeat_ns else s.heartbeat_ns)
            if best is None or t < best:
                best = t
        if self.stable_news():
            t = last + s.stable_push_ns
            if best is None or t < best:
                best = t
        if self.events:
            t = last + s.forward_interval_ns
            if best is None or t < best:
                best = t
        return best
