"""Serving readers and subscribers from the decided log.

A read of a decided gsn is answered at once; of a gsn not decided yet, it waits
(:mod:`.parking`) until the frontier passes it. A subscription is served only stable
positions: records up to the stable watermark, then a ``progress`` watermark and the
members of every epoch up to it (the subscriber's merge needs them). A batch costs its
records' bytes plus ``SUB_BATCH_COST`` of the subscriber's credit, and a subscription
with no credit gets nothing, not even progress: a stalled reader bounds what is queued
for it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

from ziplog.cores.effects import Outbox
from ziplog.cores.replica.log import DecidedLog
from ziplog.cores.replica.parking import Parked, Parking
from ziplog.cores.replica.settings import ReplicaSettings
from ziplog.protocol import frames as f
from ziplog.protocol.gsna import epoch_of

ErrorReply = Callable[[bytes, "int | None", str, str], None]
#: leases are looked at this many times per lease
LEASE_CHECKS = 4


@dataclass(slots=True)
class Subscription:
    route: bytes
    sub_id: int
    credit: int  # bytes the subscriber can still take
    progress_sent: int  # last progress reported: every record at or below it was sent
    epoch_sent: int  # membership sent for every epoch <= this
    last_heard_ns: int


class Fanout:
    def __init__(self, settings: ReplicaSettings, log: DecidedLog, parking: Parking, out: Outbox,
                 error: ErrorReply, stats: dict[str, int]) -> None:
        self.s = settings
        self.log = log
        self.parking = parking
        self.out = out
        self.error = error
        self.stats = stats
        self.subs: dict[tuple[bytes, int], Subscription] = {}
        #: subscriptions per route (only routes with some: bounded by ``max_subscriptions``)
        self.subs_by_route: dict[bytes, int] = {}
        #: something subscriptions may not have seen yet (stable, trim, an epoch)
        self.dirty = False
        #: when to look for subscriptions whose lease ran out (None: there are none)
        self.next_lease_check: int | None = None
        log.stable_listeners.append(self.mark_dirty)

    def mark_dirty(self) -> None:
        self.dirty = True

    # -- reads ----------------------------------------------------------------------------------
    def on_read(self, route: bytes, msg: f.Read, now: int) -> None:
        self.stats["reads"] += 1
        log = self.log
        if msg.gsn > log.frontier:
            if log.membership and epoch_of(msg.gsn) > log.last_epoch + self.s.max_epochs_ahead:
                self.error(route, msg.req_id, f.E_UNKNOWN_RID, f"gsn {msg.gsn} lies far beyond this shard's log")
                return
            if not self.parking.park(Parked(route, msg, now + self.s.park_timeout_ns, need_frontier=msg.gsn, arrived_ns=now)):
                self.error(route, msg.req_id, f.E_OVERLOADED, "too many requests are waiting on this replica")
            return
        self.answer_read(route, msg.req_id, msg.gsn)

    def answer_read(self, route: bytes, req_id: int, gsn: int) -> None:
        log = self.log
        if gsn < log.trim_point:
            self.error(route, req_id, f.E_TRIMMED, f"gsn {gsn} is below the trim point {log.trim_point}")
            return
        rec = log.records.get(gsn)
        if rec is None:
            self.error(route, req_id, f.E_NOT_FOUND, f"shard {self.s.shard} holds no record at gsn {gsn}")
            return
        self.out.send(route, f.ReadOk(req_id=req_id, gsn=gsn, data=rec.data, stable=log.stable))

    def on_range(self, route: bytes, msg: f.Range, now: int) -> None:
        """Stable records of ``[lo, hi]``, a batch at a time (never beyond what
        subscribers may be served: the same positions a subscription would show)."""
        self.stats["reads"] += 1
        log = self.log
        if msg.lo < log.trim_point and msg.lo <= msg.hi:
            self.error(route, msg.req_id, f.E_TRIMMED, f"gsn {msg.lo} is below the trim point {log.trim_point}")
            return
        limit = min(msg.hi, log.servable)
        gsns, records_by_gsn = log.gsns, log.records
        i = bisect.bisect_left(gsns, msg.lo)
        out: list[tuple[int, bytes]] = []
        size = 0
        upto = limit
        cap = min(max(msg.max_bytes, 1), self.s.sub_batch_bytes)
        while i < len(gsns) and gsns[i] <= limit:
            if out and size >= cap:
                upto = out[-1][0]
                break
            g = gsns[i]
            data = records_by_gsn[g].data
            out.append((g, data))
            size += len(data) + f.RANGE_RECORD_OVERHEAD
            i += 1
        self.out.send(route, f.RangeOk(req_id=msg.req_id, records=out, upto=max(upto, msg.lo - 1),
                                       stable=log.servable))

    def on_count(self, route: bytes, msg: f.Count, now: int) -> None:
        log = self.log
        if msg.lo < log.trim_point and msg.lo <= msg.hi:
            self.error(route, msg.req_id, f.E_TRIMMED, f"gsn {msg.lo} is below the trim point {log.trim_point}")
            return
        upto = min(msg.hi, log.servable)
        gsns = log.gsns
        first = bisect.bisect_left(gsns, msg.lo)
        count = max(0, bisect.bisect_right(gsns, upto) - first)
        nth = gsns[first + msg.nth - 1] if 0 < msg.nth <= count else 0
        self.out.send(route, f.CountOk(req_id=msg.req_id, count=count, nth_gsn=nth, upto=upto))

    def serve_parked_reads(self) -> None:
        for p in self.parking.reads_upto(self.log.frontier):
            assert isinstance(p.msg, f.Read)
            self.answer_read(p.route, p.msg.req_id, p.msg.gsn)

    # -- subscriptions --------------------------------------------------------------------------
    def on_subscribe(self, route: bytes, msg: f.Subscribe, now: int) -> None:
        trim = self.log.trim_point
        if 0 < msg.from_gsn < trim:
            self.error(route, msg.sub_id, f.E_TRIMMED, f"subscription start {msg.from_gsn} is below the trim point {trim}")
            return
        key = (route, msg.sub_id)
        if key not in self.subs:
            if len(self.subs) >= self.s.max_subscriptions:
                self.error(route, msg.sub_id, f.E_OVERLOADED,
                           f"this replica serves {len(self.subs)} subscriptions, its limit")
                return
            held = self.subs_by_route.get(route, 0)
            if held >= self.s.max_subscriptions_per_connection:
                self.error(route, msg.sub_id, f.E_OVERLOADED,
                           f"this connection holds {held} subscriptions, the limit per connection")
                return
            self.subs_by_route[route] = held + 1
        start = max(msg.from_gsn, 1)
        sub = Subscription(route, msg.sub_id, msg.credit, start - 1, epoch_of(start) - 1, now)
        self.subs[key] = sub
        if self.next_lease_check is None:
            self.next_lease_check = now + self.s.subscription_lease_ns // LEASE_CHECKS
        self.serve(sub)

    def on_credit(self, route: bytes, msg: f.Credit, now: int) -> None:
        sub = self.subs.get((route, msg.sub_id))
        if sub is not None:
            sub.credit += msg.credit
            sub.last_heard_ns = now
            self.dirty = True

    def on_unsubscribe(self, route: bytes, msg: f.Unsubscribe) -> None:
        self._drop((route, msg.sub_id))

    def _drop(self, key: tuple[bytes, int]) -> None:
        if self.subs.pop(key, None) is None:
            return
        route = key[0]
        n = self.subs_by_route[route] - 1
        if n:
            self.subs_by_route[route] = n
        else:
            del self.subs_by_route[route]

    def serve(self, sub: Subscription) -> None:
        if sub.credit <= 0:
            return  # the subscriber has not caught up: it grants credit as it reads
        log = self.log
        gsns, records_by_gsn = log.gsns, log.records
        limit = log.servable
        # Never again at or below what the subscription was shown: those positions are
        # stable, and an install that brings their records back (in parts, after
        # truncating below them) brings back the same records it already sent.
        i = bisect.bisect_left(gsns, max(sub.progress_sent + 1, log.trim_point))
        records: list[tuple[int, bytes]] = []
        size = 0
        progress = limit
        max_bytes = self.s.sub_batch_bytes
        while i < len(gsns):
            g = gsns[i]
            if g > limit:
                break
            if sub.credit <= 0 or size >= max_bytes:
                progress = g - 1
                break
            data = records_by_gsn[g].data
            records.append((g, data))
            size += len(data) + f.RANGE_RECORD_OVERHEAD
            sub.credit -= len(data)
            i += 1
        if progress <= sub.progress_sent and not records:
            return
        epochs: list[tuple[int, int, tuple[int, ...]]] = []
        target_epoch = epoch_of(progress) if progress > 0 else -1
        if target_epoch > sub.epoch_sent:
            for first, last, members in log.membership:
                if last <= sub.epoch_sent:
                    continue
                if first > target_epoch:
                    break
                epochs.append((max(first, sub.epoch_sent + 1), min(last, target_epoch), tuple(members)))
            sub.epoch_sent = target_epoch
        sub.progress_sent = max(progress, sub.progress_sent)
        sub.credit -= f.SUB_BATCH_COST
        self.out.send(sub.route, f.SubBatch(sub_id=sub.sub_id, records=records, epochs=epochs, progress=sub.progress_sent))

    def flush(self) -> None:
        if self.parking:
            self.serve_parked_reads()
        if self.dirty:
            self.dirty = False
            for sub in list(self.subs.values()):
                self.serve(sub)

    def expire_leases(self, now: int) -> None:
        """Drop subscriptions not heard from for the lease (looked for a few times per
        lease, so one may outlive it by a fraction of it)."""
        check = self.next_lease_check
        if check is None or now < check:
            return
        lease = self.s.subscription_lease_ns
        for key in [k for k, sub in self.subs.items() if now - sub.last_heard_ns > lease]:
            self._drop(key)
        self.next_lease_check = now + lease // LEASE_CHECKS if self.subs else None
