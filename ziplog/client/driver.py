"""The client driver: the client core's calls and subscriptions over the ports. The
blocking :class:`~ziplog.Client` runs it on a :class:`~ziplog.io.zmq_runtime.ZmqRuntime`
while a call waits, :class:`~ziplog.aio.AsyncClient` on an asyncio runtime, and the
simulation on its simulated network: the same code in all three.

One DEALER per replica address (a DEALER connected to several would round-robin, and a
request must reach every replica), shared by every call; each subscription has its own
DEALER per shard. Replies are routed to calls by their request id.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Sequence

from ziplog.cores.client.calls import (
    Call,
    EachReplicaCall,
    InsertCall,
    ReadCall,
    ShardQueryCall,
    StatusCall,
)
from ziplog.cores.client.state import ClientState
from ziplog.cores.client.subscription import SubscriptionCore
from ziplog.cores.effects import Close, Messages, Open
from ziplog.io.ports import Connector, Endpoint, Runtime, Timer
from ziplog.protocol import frames as wire
from ziplog.protocol.errors import ClientClosedError, UnauthenticatedError, ZiplogError
from ziplog.protocol.topology import TopologyView
from ziplog.protocol.types import RID_RECENT, RecordId

#: How long a closed subscription's connections may take to deliver their UNSUBSCRIBE.
UNSUBSCRIBE_LINGER_MS = 200


def _stable_of(status: object) -> int:
    """The stable point a replica's STATUS reports (0 when it names none)."""
    value = status.get("stable") if isinstance(status, dict) else None
    return value if type(value) is int and value >= 0 else 0


class Record:
    """A record delivered by a subscription."""

    __slots__ = ("rid", "data")

    def __init__(self, rid: RecordId, data: bytes) -> None:
        self.rid = rid
        self.data = data

    def __repr__(self) -> str:
        return f"Record(rid={self.rid!r}, data={self.data[:32]!r}{'...' if len(self.data) > 32 else ''})"


def refusal(conns: Iterable[tuple[str, Endpoint | None]]) -> str | None:
    """Why one of the named connections' servers refused our handshake (no CURVE key
    given to a CURVE cluster, a key file naming another server key), if one did: the
    native endpoints keep it as ``refused``."""
    for name, conn in conns:
        reason = getattr(conn, "refused", None)
        if reason:
            return f"{name} refused the connection ({reason})"
    return None


#: what ``calls.pop`` answers for a call the driver does not hold
_GONE: Any = object()


class ClientDriver:
    def __init__(self, rt: Runtime, net: Connector, topology: TopologyView, state: ClientState) -> None:
        self.rt = rt
        self.net = net
        self.topology = topology
        self.client = state
        self.conns: dict[str, Endpoint] = {}
        #: counts changes to ``conns`` (a cached focus list is good until it moves)
        self._conns_gen = 0
        self._focus: tuple[Sequence[str], int, list[Endpoint]] = ((), -1, [])
        #: request id -> the call that sent it (calls forget theirs when done)
        self.pending: dict[int, Call] = {}
        #: calls in progress -> who to tell when one is done
        self.calls: dict[Call, Callable[[], None] | None] = {}
        # One timer for every call, at the earliest time one of them wants: a call that
        # ends before it needed the timer (nearly every insert) arms and cancels nothing.
        self._tick: Timer | None = None
        self._tick_at: int | None = None
        self.subs: dict[int, "SubscriptionDriver"] = {}
        self.closed = False
        #: what a new connection hands its replies to (a test may put a filter in front
        #: of it before the first call; read once per connection, not per reply)
        self.reply_handler: Callable[[str, bytes], None] = self._on_reply

    # -- calls ------------------------------------------------------------------------------------
    def insert(self, data: bytes, after_gsn: int, key: bytes | None, on_done: Callable[[], None] | None = None) -> InsertCall:
        now = self.rt.now()
        call = InsertCall(self.client, data, after_gsn, key, now + self.client.timeout_ns)
        self.start(call, on_done, now)
        return call

    def read(self, rid: RecordId, on_done: Callable[[], None] | None = None) -> ReadCall:
        now = self.rt.now()
        call = ReadCall(self.client, rid, now + self.client.timeout_ns)
        self.start(call, on_done, now)
        return call

    def shard_query(self, shard: int, make: Callable[[int], wire.Frame], what: str,
                    on_done: Callable[[], None] | None = None) -> ShardQueryCall:
        """RANGE or COUNT: one replica of ``shard`` answers (the primary first)."""
        call = ShardQueryCall(self.client, shard, make, self.rt.now() + self.client.timeout_ns, what)
        self.start(call, on_done)
        return call

    def status(self, wait_ns: int, on_done: Callable[[], None] | None = None) -> StatusCall:
        now = self.rt.now()
        call = StatusCall(self.client, now + self.client.timeout_ns, wait_ns)
        self.start(call, on_done, now)
        return call

    def each_replica(self, shards: list[int], make: Callable[[int], wire.Frame], what: str,
                     on_done: Callable[[], None] | None = None) -> EachReplicaCall:
        call = EachReplicaCall(self.client, shards, make, self.rt.now() + self.client.timeout_ns, what)
        self.start(call, on_done)
        return call

    def start(self, call: Call, on_done: Callable[[], None] | None = None, now: int | None = None) -> None:
        if self.closed:
            call.fail(ClientClosedError("client is closed"))
            if on_done is not None:
                on_done()
            return
        self.calls[call] = on_done
        self._run(call, call.start(self.rt.now() if now is None else now, self.topology))

    def _run(self, call: Call, sends: Messages) -> None:
        """Perform a call's step: send what it asked for (a call's messages go to replica
        addresses), then finish it or (re)arm its timer."""
        if sends:
            encode, conns, pending = wire.encode, self.conns, self.pending
            addrs: Any
            for addrs, msg in sends:
                frame = encode(msg)
                pending[msg.req_id] = call  # type: ignore[attr-defined]
                for addr in addrs:
                    conn = conns.get(addr)
                    if conn is None:
                        conn = conns[addr] = self.net.dealer(addr, functools.partial(self.reply_handler, addr), "replica",
                                                             max_bytes=wire.CLIENT_REPLY_LIMIT)
                        self._conns_gen += 1
                    conn.send(frame)
        if call.done:
            on_done = self.calls.pop(call, _GONE)
            if on_done is _GONE:
                return
            for r in call.req_ids:
                self.pending.pop(r, None)
            if on_done is not None:
                on_done()
            return
        at = call.wake_at
        if at is not None and call in self.calls:
            self._arm_by(at)

    def _arm_by(self, at: int) -> None:
        """The timer fires at ``at`` at the latest."""
        if self._tick_at is None or at < self._tick_at:
            self._arm(at)

    def _arm(self, at: int) -> None:
        if self._tick is not None:
            self._tick.cancel()
        self._tick_at = at
        self._tick = self.rt.call_at(at, self._on_tick)

    def _on_reply(self, addr: str, frame: bytes) -> None:
        try:
            msg = wire.decode_reply(frame)
        except wire.ProtocolError:
            return
        if type(msg) is wire.Acks:  # a replica's turn answered several of our inserts
            for ack in msg.acks:
                self._on_message(addr, ack)
            return
        self._on_message(addr, msg)

    def _on_message(self, addr: str, msg: wire.Reply) -> None:
        if type(msg) is wire.Error and msg.code == wire.E_REGISTRY_LAPSED:
            return  # that server cannot judge our key now: as if it had not answered (asked again, or another)
        req = msg.req_id
        call = None if req is None else self.pending.get(req)
        if call is None or call.done:
            return  # a late answer to a request that is over
        try:
            sends = call.on_reply(addr, msg, self.rt.now(), self.topology)
        except AssertionError:
            raise
        except Exception as exc:  # contained: this call fails, the client goes on
            sends = call.fail(ZiplogError(f"a reply from {addr} could not be handled ({type(exc).__name__}: {exc})"))
        self._run(call, sends)

    def _on_tick(self) -> None:
        """The earliest time a call wanted has come: every call whose time it is steps,
        and the timer moves to the next such time."""
        self._tick = self._tick_at = None
        if self.closed:
            return
        now, topo = self.rt.now(), self.topology
        for call in list(self.calls):
            at = call.wake_at
            if at is not None and at <= now and not call.done:
                refused = refusal((addr, self.conns.get(addr)) for addr in call.waiting_on())
                if refused is not None:  # resending would be refused alike: the client's keys are wrong
                    self._run(call, call.fail(UnauthenticatedError(refused)))
                else:
                    self._run(call, call.on_timer(now, topo))
        later = [at for c in self.calls if (at := c.wake_at) is not None]
        if later:
            # A call's step above may have armed the timer: read in a method of its own,
            # where no narrowing from this one's first line applies (compiled code trusts
            # a narrowing; this one's would say None).
            self._arm_by(min(later))

    def endpoints_of(self, call: Call) -> list[Endpoint]:
        """The connections ``call`` waits on (the replicas it sent to). The same list
        object while neither the call's targets nor the connections change: the blocking
        client asks before every turn, and the runtime keeps its poll set for it."""
        addrs = call.waiting_on()
        cached_addrs, gen, eps = self._focus
        if addrs is cached_addrs and gen == self._conns_gen:
            return eps
        conns = self.conns
        eps = [c for a in addrs if (c := conns.get(a)) is not None]
        self._focus = (addrs, self._conns_gen, eps)
        return eps

    def on_topology(self) -> None:
        """Something moved in ZooKeeper: calls and subscriptions look again; connections
        to addresses no replica has any more are closed."""
        if self.closed:
            return
        now, topo = self.rt.now(), self.topology
        for call in list(self.calls):
            if not call.done:
                self._run(call, call.on_topology(now, topo))
        for sub in list(self.subs.values()):
            sub.on_topology()
        current = {a for reps in topo.replicas.values() for a in reps.values()}
        for addr in [a for a in self.conns if a not in current]:
            self.conns.pop(addr).close()
            self._conns_gen += 1

    # -- subscriptions ----------------------------------------------------------------------------
    def subscribe(self, start: RecordId, pick: Callable[[int, int], int] | None = None) -> "SubscriptionDriver":
        """A subscription from ``start``; ``pick(shard, replicas)`` chooses the replica it
        reads a shard from (default: the one that learns stability first, replica 1 of a
        two-replica shard, else replica 0: ``first_to_know``)."""
        sub_id = self.client.next_req()
        if start == RID_RECENT:
            core = SubscriptionCore(sub_id, None, explicit=False, pick=pick)
        else:
            core = SubscriptionCore(sub_id, max(start.gsn, 1), explicit=start.gsn > 0, pick=pick)
        sub = SubscriptionDriver(self, core)
        self.subs[sub_id] = sub
        if start == RID_RECENT:
            # The position: just past the lowest stable watermark of any shard now (a status
            # round trip), so every record inserted after this returns is seen.
            shards = [s for s in self.topology.shards() if self.topology.replica_addrs(s) is not None]
            if not shards:
                sub.positioned(1)
                return sub
            status = EachReplicaCall(self.client, shards, lambda req: wire.Status(req_id=req),
                                     self.rt.now() + self.client.timeout_ns, "status")

            def positioned() -> None:
                try:
                    replies = status.result()
                except ZiplogError as exc:
                    sub.perform(core.failed(exc))
                    return
                # A reply that names no stable point (another build, a malformed STATUS)
                # counts as 0: the position is never above what a shard made stable.
                stables = [min(_stable_of(r.status) for r in reps) for reps in replies.values() if reps]
                sub.positioned(max(min(stables), 0) + 1 if stables else 1)

            self.start(status, positioned)
        else:
            sub.perform(core.start(self.rt.now(), self.topology))
        return sub

    def close(self) -> None:
        """Every call still waiting fails with ClientClosedError; subscriptions close."""
        if self.closed:
            return
        self.closed = True
        for sub in list(self.subs.values()):
            sub.close()
        for call in list(self.calls):
            if not call.done:
                call.fail(ClientClosedError("client is closed"))
                self._run(call, [])
        if self._tick is not None:
            self._tick.cancel()
            self._tick = self._tick_at = None
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()
        self._conns_gen += 1


class SubscriptionDriver:
    """One subscription's connections and timer, over :class:`SubscriptionCore`.
    ``on_change`` (if set) is told whenever a record, an error or the end may be there."""

    def __init__(self, driver: ClientDriver, core: SubscriptionCore) -> None:
        self.driver = driver
        self.core = core
        self.conns: dict[int, Endpoint] = {}
        self.timer: Timer | None = None
        self.timer_at: int | None = None
        self.on_change: Callable[[], None] | None = None

    @property
    def closed(self) -> bool:
        return self.core.state.value == "closed"

    def positioned(self, from_gsn: int) -> None:
        self.perform(self.core.positioned(from_gsn, self.driver.rt.now(), self.driver.topology))

    def perform(self, effects: Messages) -> None:
        net = self.driver.net
        for stream, item in effects:
            shard = stream.shard  # type: ignore[union-attr]  # a subscription's messages go to its streams
            if type(item) is Open:
                old = self.conns.pop(shard, None)
                if old is not None:
                    old.close()
                self.conns[shard] = net.dealer(item.addr, self._frame_handler(shard), "subscription",
                                               max_bytes=wire.CLIENT_REPLY_LIMIT)
            elif type(item) is Close:
                conn = self.conns.pop(shard, None)
                if conn is not None:
                    conn.close(UNSUBSCRIBE_LINGER_MS)
            else:
                conn = self.conns.get(shard)
                if conn is not None:
                    conn.send(wire.encode(item))
        at = self.core.wake_at
        if at != self.timer_at:
            if self.timer is not None:
                self.timer.cancel()
            self.timer_at = at
            self.timer = None if at is None else self.driver.rt.call_at(at, self._on_timer)
        if self.on_change is not None:
            self.on_change()

    def _frame_handler(self, shard: int) -> Callable[[bytes], None]:
        return lambda frame: self._on_frame(shard, frame)

    def _on_frame(self, shard: int, frame: bytes) -> None:
        try:
            msg = wire.decode_reply(frame)
        except wire.ProtocolError:
            return
        if type(msg) is wire.Error and msg.code == wire.E_REGISTRY_LAPSED:
            # That replica cannot judge our key now and ended the subscription there: it
            # falls silent, and the subscription moves on (or subscribes there again).
            return
        try:
            effects = self.core.on_frame(shard, msg, self.driver.topology)
        except AssertionError:
            raise
        except Exception as exc:  # contained: this subscription fails, the client goes on
            effects = self.core.failed(ZiplogError(
                f"a frame from shard {shard} could not be handled ({type(exc).__name__}: {exc})"))
        self.perform(effects)

    def _on_timer(self) -> None:
        self.timer = self.timer_at = None
        refused = refusal((f"shard {shard}'s replica", conn) for shard, conn in self.conns.items())
        if refused is not None:
            self.perform(self.core.failed(UnauthenticatedError(refused)))
            return
        self.perform(self.core.on_timer(self.driver.rt.now(), self.driver.topology))

    def on_topology(self) -> None:
        self.perform(self.core.connect_known(self.driver.topology))

    def read(self) -> None:
        """The reader is here (it may have been away longer than the servers' lease)."""
        self.perform(self.core.read(self.driver.rt.now(), self.driver.topology))

    def pop(self) -> Record | None:
        item, effects = self.core.pop()
        if effects:
            self.perform(effects)
        if item is None:
            return None
        gsn, shard, data = item
        return Record(RecordId(gsn, shard), data)

    def close(self) -> None:
        self.perform(self.core.close())
        if self.timer is not None:
            self.timer.cancel()
            self.timer = self.timer_at = None
        self.driver.subs.pop(self.core.sub_id, None)
