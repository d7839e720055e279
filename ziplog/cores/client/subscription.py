"""A subscription's lifecycle (sans-I/O): which replica of which shard to read from,
credit, lease renewal, and resuming where a moved replica left off. The merge of the
shards' streams into one gap-free stream in gsn order is :class:`SubscriberMerge`.

A subscription reads every shard ZooKeeper knows and every shard named in the
membership it receives from the replica that learns stability first
(:func:`first_to_know`: the backup of a two-replica shard, else replica 0); from a
shard's next registered replica when the one it reads from falls silent
(``SUB_SILENCE_NS``), until the preferred one comes back at a new address. It grants ``SUB_CREDIT_BYTES`` of credit, and
returns credit as records are consumed (plus ``SUB_BATCH_COST`` per batch), so what a
server queues for a reader that stops is bounded. Servers drop a subscription they
have not heard from for their lease (60 s): a CREDIT of 0 renews it every
``SUB_KEEPALIVE``, and a reader that was away longer than ``SUB_LEASE`` subscribes
again everywhere from where each shard left off. When a shard's preferred replica
moves (a restart), the subscription subscribes there again from just past what that
shard sent.

Its effects are messages (:mod:`ziplog.cores.effects`) to a shard's stream
(:class:`Stream`): :class:`Open` (a connection to a replica's address), frames on it,
:class:`Close`, in order.
"""

from __future__ import annotations

import enum
from typing import Any, Callable

from ziplog.cores.effects import Close, Message, Open, Stream
from ziplog.cores.merge import SubscriberMerge
from ziplog.protocol import frames as wire
from ziplog.protocol.errors import from_reply
from ziplog.protocol.topology import TopologyView

#: Credit a subscription grants each shard (bytes), returned after a quarter of it is read.
SUB_CREDIT_BYTES = 8 << 20
#: A CREDIT of 0 renews the servers' lease this often.
SUB_KEEPALIVE_NS = 10_000_000_000
#: Subscribe again everywhere when not read for this long: a little under the servers'
#: lease on a silent subscription (ReplicaSettings.subscription_lease_ns, 60 s).
SUB_LEASE_NS = 50_000_000_000
#: How often a subscription looks for shards it is not connected to yet.
SUB_RECONNECT_NS = 200_000_000
#: A shard's replica that sent nothing for this long, while the reader keeps up, may be
#: gone (a SIGKILLed process stays registered until its ZooKeeper session expires, 10 s):
#: the subscription moves to the shard's next registered replica. A live replica sends a
#: batch at least every epoch (progress moves even with no records).
SUB_SILENCE_NS = 1_000_000_000

Effect = Message


class SubState(enum.Enum):
    #: RID_RECENT: waiting for the position (a status round trip)
    POSITIONING = "positioning"
    OPEN = "open"
    #: a shard answered with an error: it is raised to the reader
    FAILED = "failed"
    CLOSED = "closed"


#: (shard, gsns of the batch's records, delivered up to before, delivered up to after)
BatchObserver = Callable[[int, list[int], int, int], None]


def first_to_know(shard: int, replicas: int) -> int:
    """The replica a subscription reads a shard from by default: the one that learns
    first that a gsn is stable. With two replicas that is the backup (everything it
    applies is held by both, so it knows at once, while the primary waits for its PREFIX);
    with more, the primary (only it hears every backup)."""
    return 1 if replicas == 2 else 0


class SubscriptionCore:
    def __init__(self, sub_id: int, from_gsn: int | None, explicit: bool,
                 pick: Callable[[int, int], int] | None = None) -> None:
        self.sub_id = sub_id
        #: which replica of a shard (of how many) to read from, unless told: the one that
        #: learns stability first (:func:`first_to_know`)
        self.pick = pick or first_to_know
        self.explicit = explicit
        self.from_gsn = from_gsn or 0
        self.state = SubState.POSITIONING if from_gsn is None else SubState.OPEN
        self.merge: SubscriberMerge | None = SubscriberMerge(from_gsn) if from_gsn is not None else None
        self.addrs: dict[int, str] = {}  # shard -> the replica address subscribed to
        #: shard -> the preferred replica's address we left because it fell silent (we
        #: stay away until the preferred replica registers elsewhere)
        self.left: dict[int, str] = {}
        #: shard -> batches received; and (that count, since when) at the last look
        self.batches: dict[int, int] = {}
        self._quiet: dict[int, tuple[int, int]] = {}
        self._looked_at = 0
        self.consumed: dict[int, int] = {}
        self.error: BaseException | None = None
        self.last_keepalive = 0
        self.last_read = 0
        self.next_look = 0
        self.resubscribes = 0
        #: a diagnostic hook, called after each batch (see :data:`BatchObserver`)
        self.observer: BatchObserver | None = None

    # -- position -------------------------------------------------------------------------------
    def positioned(self, from_gsn: int, now: int, topo: TopologyView) -> list[Effect]:
        """RID_RECENT: the position is known now."""
        assert self.state is SubState.POSITIONING
        self.from_gsn = from_gsn
        self.merge = SubscriberMerge(from_gsn)
        self.state = SubState.OPEN
        return self.start(now, topo)

    def failed(self, error: BaseException) -> list[Effect]:
        if self.state in (SubState.POSITIONING, SubState.OPEN):
            self.error = error
            self.state = SubState.FAILED
        return []

    def start(self, now: int, topo: TopologyView) -> list[Effect]:
        self.last_keepalive = self.last_read = now
        self.next_look = now + SUB_RECONNECT_NS
        return self.connect_known(topo)

    @property
    def wake_at(self) -> int | None:
        if self.state is not SubState.OPEN:
            return None
        return min(self.last_keepalive + SUB_KEEPALIVE_NS, self.next_look)

    # -- connections ----------------------------------------------------------------------------
    def connect_known(self, topo: TopologyView) -> list[Effect]:
        """Subscribe on every shard we know of; subscribe again where a shard's serving
        replica moved (restarted), from just past what that shard already sent us."""
        if self.state is not SubState.OPEN:
            return []
        merge = self.merge
        assert merge is not None
        out: list[Effect] = []
        for shard in sorted(set(topo.replica_counts) | merge.known_shards()):
            addrs = topo.replica_addrs(shard)
            if addrs is None:
                continue
            addr = addrs[self.pick(shard, len(addrs))]
            old = self.addrs.get(shard)
            if old == addr:
                continue
            if self.left.get(shard) == addr and old:
                continue  # we left it because it was silent: stay where we are
            self.left.pop(shard, None)
            if old is not None:
                out.append((Stream(shard), Close()))
                start = merge.resume_point(shard)
                self.resubscribes += 1
            else:
                # 0 asks for the start of the log (no TrimmedError); an explicit position must exist.
                start = self.from_gsn if self.explicit else (0 if self.from_gsn == 1 else self.from_gsn)
            self.addrs[shard] = addr
            self.consumed[shard] = 0
            out.append((Stream(shard), Open(addr)))
            out.append((Stream(shard), wire.Subscribe(sub_id=self.sub_id, from_gsn=start, credit=SUB_CREDIT_BYTES)))
        return out

    def resubscribe_all(self, topo: TopologyView) -> list[Effect]:
        """Every shard looks moved: subscribe again everywhere from where each left off."""
        self.addrs = {s: "" for s in self.addrs}
        return self.connect_known(topo)

    # -- input ----------------------------------------------------------------------------------
    def on_frame(self, shard: int, msg: wire.Reply, topo: TopologyView) -> list[Effect]:
        if self.state is not SubState.OPEN:
            return []
        merge = self.merge
        assert merge is not None
        if isinstance(msg, wire.SubBatch):
            if msg.sub_id != self.sub_id:
                return []
            before = merge.delivered
            self.batches[shard] = self.batches.get(shard, 0) + 1
            merge.on_batch(shard, msg.records, msg.epochs, msg.progress)
            if self.observer is not None:
                self.observer(shard, [g for g, _ in msg.records], before, merge.delivered)
            out = self._credit(shard, wire.SUB_BATCH_COST)
            if merge.known_shards() - set(self.addrs):
                out.extend(self.connect_known(topo))
            return out
        if isinstance(msg, wire.Error) and msg.req_id == self.sub_id:
            return self.failed(from_reply(msg.code, msg.message))
        return []

    def on_timer(self, now: int, topo: TopologyView) -> list[Effect]:
        out: list[Effect] = []
        if self.state is not SubState.OPEN:
            return out
        if now >= self.last_keepalive + SUB_KEEPALIVE_NS:
            # renew the servers' lease even while nothing is consumed
            self.last_keepalive = now
            out.extend((Stream(s), wire.Credit(sub_id=self.sub_id, credit=0)) for s in self.addrs)
        if now >= self.next_look:
            self.next_look = now + SUB_RECONNECT_NS
            out.extend(self.connect_known(topo))
            out.extend(self._move_from_silent(now, topo))
        return out

    def _move_from_silent(self, now: int, topo: TopologyView) -> list[Effect]:
        """Move off a replica that sent nothing for SUB_SILENCE_NS while we kept reading."""
        merge = self.merge
        assert merge is not None
        looked_at, self._looked_at = self._looked_at, now
        if now - looked_at > 2 * SUB_RECONNECT_NS:
            # We were not looking (a blocking client between reads: its frames wait
            # unread): a quiet connection says nothing. Start counting afresh.
            self._quiet = {}
            return []
        out: list[Effect] = []
        for shard, addr in list(self.addrs.items()):
            n = self.batches.get(shard, 0)
            seen = self._quiet.get(shard)
            if seen is None or seen[0] != n or self._credit_spent(shard):
                # It sent a batch, or most of its credit is in our hands (records the
                # reader has not taken, or that wait in the merge for another shard's
                # progress): its server waits for credit, and its quiet says nothing.
                # Judged per shard: a replica that fell silent while the others' records
                # piled up behind it must still be left, or the merge waits for good.
                self._quiet[shard] = (n, now)
                continue
            if now - seen[1] < SUB_SILENCE_NS:
                continue
            self._quiet[shard] = (n, now)
            order = [a for _, a in sorted(topo.replicas.get(shard, {}).items())]
            if not order:
                continue  # no replica registered: nowhere to go yet
            # The next replica; a shard of one replica is subscribed again on a new
            # connection to the same address: a replica restarted on a fixed port keeps
            # its address, and knows nothing of the subscription the old connection
            # held (the old one ends with its lease; the resume point repeats nothing).
            nxt = order[(order.index(addr) + 1) % len(order)] if addr in order else order[0]
            preferred = topo.replicas.get(shard, {}).get(self.pick(shard, len(order)))
            if preferred == addr and nxt != addr:
                self.left[shard] = addr
            self.addrs[shard] = nxt
            self.consumed[shard] = 0
            out.append((Stream(shard), Close()))
            out.append((Stream(shard), Open(nxt)))
            out.append((Stream(shard), wire.Subscribe(sub_id=self.sub_id, from_gsn=merge.resume_point(shard),
                                                      credit=SUB_CREDIT_BYTES)))
        return out

    def _credit_spent(self, shard: int) -> bool:
        """More than half of the credit ``shard``'s server had is held here: received and
        not yet taken by the reader, or taken and not yet granted back."""
        merge = self.merge
        held = merge.held_bytes.get(shard, 0) if merge is not None else 0
        return held + self.consumed.get(shard, 0) > SUB_CREDIT_BYTES // 2

    # -- reading --------------------------------------------------------------------------------
    def read(self, now: int, topo: TopologyView) -> list[Effect]:
        """The reader is here: if it was away longer than the servers' lease, they may
        have dropped the subscription: subscribe again from where each shard left off."""
        out: list[Effect] = []
        if self.state is SubState.OPEN and now - self.last_read > SUB_LEASE_NS:
            self.last_keepalive = now
            out = self.resubscribe_all(topo)
        self.last_read = now
        return out

    def pop(self) -> tuple[tuple[int, int, bytes] | None, list[Effect]]:
        """The next record (gsn, shard, data) if one is ready, and the credit to return."""
        if self.merge is None:
            return None, []
        item = self.merge.pop()
        if item is None:
            return None, []
        return item, self._credit(item[1], len(item[2]))

    def has_record(self) -> bool:
        return self.merge is not None and len(self.merge) > 0

    def has_record_upto(self, gsn: int) -> bool:
        """A record at or below ``gsn`` waits to be read."""
        first = self.merge.first_ready_gsn() if self.merge is not None else None
        return first is not None and first <= gsn

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def _credit(self, shard: int, nbytes: int) -> list[Effect]:
        c = self.consumed.get(shard, 0) + nbytes
        out: list[Effect] = []
        if c >= SUB_CREDIT_BYTES // 4:
            if shard in self.addrs:
                out.append((Stream(shard), wire.Credit(sub_id=self.sub_id, credit=c)))
            c = 0
        self.consumed[shard] = c
        return out

    def close(self) -> list[Effect]:
        if self.state is SubState.CLOSED:
            return []
        self.state = SubState.CLOSED
        out: list[Effect] = []
        for s in self.addrs:
            out.append((Stream(s), wire.Unsubscribe(sub_id=self.sub_id)))
            out.append((Stream(s), Close()))
        self.addrs = {}
        return out

    # -- what a reader may look at -------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Every gsn up to here has been returned to the reader, or holds no record
        (0 before the start position is known)."""
        return self.merge.position if self.merge is not None else 0

    @property
    def buffered(self) -> int:
        """Records received and not yet read."""
        return len(self.merge) if self.merge is not None else 0

    @property
    def buffered_bytes(self) -> int:
        return self.merge.buffered_bytes if self.merge is not None else 0
