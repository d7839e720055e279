"""Scalog-style log servers (dissertation 3.2-3.3): storage servers that replicate
first, and one ordering process that orders by periodic cuts.

    python -m bench.baselines.scalog ordering --shape 2,2
    python -m bench.baselines.scalog server --ordering ADDR --shape 2,2 --shard S --server I
                                            --interval-us 100 --data FILE

``--shape`` lists the storage servers per shard. Each process prints ``READY <port>``
once it serves; a storage server only once the whole deployment is wired (the ordering
process sends the peers' addresses after every server said HELLO).

An append:

1. client -> its storage server d (DEALER -> ROUTER): ``[APPEND, req_id, data]``
2. d appends it to its segment and replicates it, FIFO, to every peer of its shard
   (one DEALER per peer): ``[REPLICATE, d, index]`` + the client's frame
3. every ``interval_us`` each server whose holdings changed reports its local cut
   ``[REPORT, shard, server, counts per segment of its shard]`` to the ordering process
4. the ordering process folds the reports into a global cut (per segment, the minimum
   over the shard's servers: records every replica holds) and, when it advanced, sends
   ``[CUT, number, flat cut]`` to every storage server (one ROUTER, so every server gets
   every cut, in order, on its own TCP connection)
5. d computes the gsns of its records the cut covers (:mod:`.scalog_cuts`) and replies
   ``[req_id, gsn]`` to each client

Reports go out on a fixed grid, the multiples of ``interval_us`` (zmq poll timeouts are
whole milliseconds, so a timerfd in the poll set wakes the loop). Scalog reports at
every grid point; a report whose local cut did not change since the last one tells the
ordering process nothing, so a server arms its timer for the next grid point only when
its local cut moves. Every report that carries news leaves at the same instant as in
Scalog, and a server does not spend CPU on 10 000 empty wake-ups a second that, on a
small shared machine, would slow down the very path being measured.

The paper's ordering layer is Paxos-replicated; this one is a single process, so its
latency is a lower bound on Scalog's.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgpack
import zmq

from . import MAX_BLOCK_MS, OneShotTimer, RecordFile, StopFlag, announce_ready
from .scalog_cuts import (
    SegmentOrder,
    check_advance,
    combine,
    flatten,
    interleave,
    unflatten,
    zero_cut,
)

# client -> storage server
APPEND = 1  # [APPEND, req_id, data]      -> [req_id, gsn]
STATS = 2  # [STATS, req_id]              -> [req_id, {name: number}]
READ = 8  # [READ, req_id, gsn]           -> [req_id, data or None]  (a record of this shard, once ordered)
SUBSCRIBE = 9  # [SUBSCRIBE, req_id, gsn] -> [req_id, ordered, [[gsn, data], ...]] now and after every cut:
#                this shard's records from gsn on, and ``ordered``: every gsn below it is assigned
#: ordered records a server keeps for READ and SUBSCRIBE (oldest forgotten first)
KEEP_ORDERED = 2_000_000
# storage server -> peer storage server (two parts: header, then the client's APPEND frame)
REPLICATE = 3  # [REPLICATE, origin_server, index]
# storage server <-> ordering process
HELLO = 4  # [HELLO, shard, server, address]
REPORT = 5  # [REPORT, shard, server, local cut]
CONFIG = 6  # [CONFIG, addresses[shard][server]]
CUT = 7  # [CUT, number, flat global cut]

HWM = 100_000
#: how many recent timing samples a server keeps for its STATS answer
TIMING_SAMPLES = 8192
NEVER = 1 << 63  # a deadline that never comes (monotonic ns)
#: how long a server waits for the rest of the deployment to say HELLO
CONFIG_TIMEOUT_MS = 60_000

POLLIN = int(zmq.POLLIN)
EVENTS = int(zmq.EVENTS)
SNDMORE = int(zmq.SNDMORE)


def parse_shape(text: str) -> tuple[int, ...]:
    shape = tuple(int(x) for x in text.split(","))
    zero_cut(shape)  # validates
    return shape


def server_routing_id(shard: int, server: int) -> bytes:
    return f"s{shard}.{server}".encode()


class RecentSamples:
    """The latest :data:`TIMING_SAMPLES` durations (ns), for percentiles in STATS."""

    def __init__(self) -> None:
        self.ring = [0] * TIMING_SAMPLES
        self.count = 0

    def add(self, ns: int) -> None:
        self.ring[self.count % TIMING_SAMPLES] = ns
        self.count += 1

    def summary_us(self) -> dict[str, float]:
        xs = sorted(self.ring[:min(self.count, TIMING_SAMPLES)])
        if not xs:
            return {}
        return {"p50": xs[len(xs) // 2] / 1000, "p99": xs[len(xs) * 99 // 100] / 1000,
                "mean": sum(xs) / len(xs) / 1000}


# -- storage server ------------------------------------------------------------------------


class StorageServer:
    def __init__(self, ordering: str, shape: tuple[int, ...], shard: int, server: int, interval_us: int,
                 data_path: Path, stop: StopFlag, host: str = "127.0.0.1") -> None:
        self.stop = stop
        self.shape, self.shard, self.server = shape, shard, server
        self.interval_ns = interval_us * 1000
        assert self.interval_ns > 0
        n = shape[shard]
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)  # clients' APPENDs and peers' REPLICATEs
        for opt, val in ((zmq.LINGER, 0), (zmq.SNDHWM, HWM), (zmq.RCVHWM, HWM)):
            self.router.setsockopt(opt, val)
        self.port = self.router.bind_to_random_port(f"tcp://{host}")
        self.addr = f"tcp://{host}:{self.port}"
        self.ordering = self.ctx.socket(zmq.DEALER)  # reports out, cuts in
        for opt, val in ((zmq.LINGER, 0), (zmq.SNDHWM, HWM), (zmq.RCVHWM, HWM)):
            self.ordering.setsockopt(opt, val)
        self.ordering.setsockopt(zmq.ROUTING_ID, server_routing_id(shard, server))
        self.ordering.connect(ordering)
        self.peers: list[zmq.Socket[Any]] = []
        self.disk = RecordFile(data_path)
        self.timer = OneShotTimer()
        self.tick_due = 0  # the grid point the timer is armed for
        #: local cut: records held per segment of this shard (own at [server])
        self.held = [0] * n
        self.reported = [0] * n
        self.order = SegmentOrder(shape, shard, server)
        #: (client routing id, req_id, arrival ns) of own records not acknowledged yet, in index order
        self.waiting: deque[tuple[bytes, int, int]] = deque()
        #: when our local cut first moved after the last report (0: it has not)
        self.dirty_since = 0
        #: how long a moved local cut waited for its report (ideal: uniform 0..interval)
        self.report_wait = RecentSamples()
        #: how late the loop handled a tick after its grid point (timer + scheduling)
        self.tick_late = RecentSamples()
        #: from an append's arrival to the cut that orders it: replication + report + cut
        self.order_wait = RecentSamples()
        #: reused: msgpack.packb builds a new Packer per call (about 1.5 us here)
        self.pack = msgpack.Packer().pack
        self.stats = {"appends": 0, "replicated": 0, "reports": 0, "ticks": 0, "cuts": 0}
        #: for READ and SUBSCRIBE: the data of this shard's records by segment and index
        #: until a cut orders them, then by gsn
        self.unordered: list[dict[int, bytes]] = [{} for _ in range(n)]
        self.ordered: dict[int, bytes] = {}
        self.cut = zero_cut(shape)
        self.ordered_total = 0
        #: subscribers: client routing id -> (req_id, next gsn to send)
        self.subscribers: dict[bytes, tuple[int, int]] = {}

    def wire_up(self) -> bool:
        """HELLO to the ordering process, then connect to the peers it names; False if
        stopped meanwhile."""
        self.ordering.send(msgpack.packb([HELLO, self.shard, self.server, self.addr]))
        deadline = time.monotonic() + CONFIG_TIMEOUT_MS / 1000
        while not self.ordering.poll(MAX_BLOCK_MS):
            if self.stop.requested:
                return False
            if time.monotonic() > deadline:
                raise RuntimeError(f"no CONFIG from the ordering process within {CONFIG_TIMEOUT_MS} ms")
        op, addrs = msgpack.unpackb(self.ordering.recv())
        assert op == CONFIG, op
        for i, a in enumerate(addrs[self.shard]):
            if i == self.server:
                continue
            d = self.ctx.socket(zmq.DEALER)
            for opt, val in ((zmq.LINGER, 0), (zmq.SNDHWM, HWM)):  # full: block, never drop
                d.setsockopt(opt, val)
            d.setsockopt(zmq.ROUTING_ID, server_routing_id(self.shard, self.server))
            d.connect(a)
            self.peers.append(d)
        return True

    # -- handlers --------------------------------------------------------------------------

    def _changed(self, now: int) -> None:
        """Our local cut moved at ``now``: a report goes out at the next grid point."""
        self.disk.dirty = True
        if not self.dirty_since:
            self.dirty_since = now
        if not self.timer.armed:
            due = -(-now // self.interval_ns) * self.interval_ns  # the grid: multiples of the interval
            self.timer.at(due)
            self.tick_due = due

    def _on_tick(self, woke: int) -> None:
        """The timer fired (``woke``: when the loop noticed): report our local cut."""
        if not self.timer.fired():
            return
        st = self.stats
        st["ticks"] += 1
        self.tick_late.add(woke - self.tick_due)
        if self.held != self.reported:  # the timer is armed only after a change
            self.ordering.send(self.pack([REPORT, self.shard, self.server, self.held]))
            self.reported = self.held[:]
            st["reports"] += 1
            self.report_wait.add(woke - self.dirty_since)
            self.dirty_since = 0

    def _on_cut(self, frame: bytes) -> None:
        op, number, flat = msgpack.unpackb(frame)
        assert op == CUT, op
        new = unflatten(self.shape, flat)
        span = self.order.on_cut(number, new)
        self._order_shard(new)
        self.stats["cuts"] += 1
        if not span.count:
            return
        waiting = self.waiting
        if span.first_index + span.count > self.held[self.server]:
            raise AssertionError(f"cut {number} covers {span.first_index + span.count} records of our segment, "
                                 f"we have {self.held[self.server]}")
        send = self.router.send
        packb = self.pack
        gsn = span.first_gsn
        now = time.monotonic_ns()
        for _ in range(span.count):
            client, req_id, arrived = waiting.popleft()
            try:
                send(client, SNDMORE)
                send(packb([req_id, gsn]))
            except zmq.ZMQError:
                pass  # the client is gone
            gsn += 1
            self.order_wait.add(now - arrived)

    def _order_shard(self, new: Any) -> None:
        """Give this shard's newly ordered records their gsns; send subscribers what is new."""
        fresh: list[list[Any]] = []
        for sp in interleave(self.cut, new):
            if sp.shard != self.shard:
                continue
            seg = self.unordered[sp.server]
            for k in range(sp.count):
                data = self.ordered[sp.first_gsn + k] = seg.pop(sp.first_index + k)
                fresh.append([sp.first_gsn + k, data])
        before = self.ordered_total
        self.cut = new
        self.ordered_total = sum(sum(row) for row in new)
        while len(self.ordered) > KEEP_ORDERED:
            del self.ordered[next(iter(self.ordered))]
        self._publish(before, fresh)

    def _publish(self, before: int = -1, fresh: list[list[Any]] | None = None) -> None:
        """Send each subscriber what it has not seen (``fresh``: the records ordered
        since ``before``, which is where a subscriber that kept up is)."""
        if not self.subscribers:
            return
        pack, send = self.pack, self.router.send_multipart
        for client, (req_id, nxt) in list(self.subscribers.items()):
            if nxt >= self.ordered_total:
                batch: list[list[Any]] = []
            elif nxt == before and fresh is not None:
                batch = fresh
            else:
                batch = [[g, d] for g, d in self.ordered.items() if g >= nxt]
            try:
                send([client, pack([req_id, self.ordered_total, batch])])
            except zmq.ZMQError:
                del self.subscribers[client]
                continue
            self.subscribers[client] = (req_id, self.ordered_total)

    def _stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.stats)
        out["interval_us"] = self.interval_ns // 1000
        out["tick_late_us"] = self.tick_late.summary_us()
        out["report_wait_us"] = self.report_wait.summary_us()
        out["order_wait_us"] = self.order_wait.summary_us()
        return out

    # -- loop ------------------------------------------------------------------------------

    def serve(self) -> None:
        router, ordering, timer_fd, disk = self.router, self.ordering, self.timer.fd, self.disk
        poller = zmq.Poller()
        poller.register(ordering, zmq.POLLIN)
        poller.register(router, zmq.POLLIN)
        poller.register(timer_fd, zmq.POLLIN)
        held, me = self.held, self.server
        waiting, peers, write = self.waiting, self.peers, disk.write
        packb, unpackb, clock = self.pack, msgpack.unpackb, time.monotonic_ns
        recv_router = router.recv_multipart
        send_router = router.send_multipart
        st = self.stats
        stop, timer = self.stop, self.timer
        while not stop.requested:
            events = dict(poller.poll(disk.ms_until_due(clock())))
            # Cuts first: they release acknowledgements, the clients' critical path.
            if ordering in events:
                while int(ordering.getsockopt(EVENTS)) & POLLIN:
                    self._on_cut(ordering.recv())
            if router in events:
                # A long drain must not hold back a due report: stop at its grid point.
                limit = self.tick_due if timer.armed else NEVER
                for _ in range(256):
                    if not int(router.getsockopt(EVENTS)) & POLLIN:
                        break
                    parts = recv_router()
                    now = clock()
                    if len(parts) == 2:  # [client, APPEND or STATS frame]
                        client, frame = parts
                        msg = unpackb(frame)
                        if msg[0] == APPEND:
                            index = held[me]
                            held[me] = index + 1
                            waiting.append((client, msg[1], now))
                            self.unordered[me][index] = msg[2]
                            header = packb([REPLICATE, me, index])
                            for peer in peers:  # replicate before anything else: FIFO per peer
                                peer.send(header, SNDMORE)
                                peer.send(frame)
                            write(header)  # header + frame: a msgpack stream, origin and index kept
                            write(frame)
                            st["appends"] += 1
                            self._changed(now)
                            limit = self.tick_due
                        elif msg[0] == STATS:
                            send_router([client, packb([msg[1], self._stats()])])
                        elif msg[0] == READ:
                            send_router([client, packb([msg[1], self.ordered.get(msg[2])])])
                        elif msg[0] == SUBSCRIBE:
                            self.subscribers[client] = (msg[1], msg[2])
                            self._publish()
                    elif len(parts) == 3:  # [peer, REPLICATE header, client frame]
                        header = parts[1]
                        op, origin, index = unpackb(header)
                        assert op == REPLICATE, op
                        if index != held[origin]:
                            raise AssertionError(f"replication from server {origin} skipped: got record {index}, "
                                                 f"holding {held[origin]}")
                        held[origin] = index + 1
                        self.unordered[origin][index] = unpackb(parts[2])[2]
                        write(header)
                        write(parts[2])
                        st["replicated"] += 1
                        self._changed(now)
                        limit = self.tick_due
                    if now >= limit:
                        break
            if timer_fd in events or (timer.armed and clock() >= self.tick_due):
                self._on_tick(clock())
            disk.flush_if_due(clock())

    def close(self) -> None:
        self.disk.close()
        self.timer.close()
        self.ctx.destroy(linger=0)


def run_server(ordering: str, shape: tuple[int, ...], shard: int, server: int, interval_us: int,
               data_path: Path, stop: StopFlag) -> None:
    srv = StorageServer(ordering, shape, shard, server, interval_us, data_path, stop)
    try:
        if srv.wire_up():
            announce_ready(srv.port)
            srv.serve()
    finally:
        print(f"server {shard}.{server}: {srv._stats()}", flush=True)
        srv.close()


# -- ordering process ----------------------------------------------------------------------


def run_ordering(shape: tuple[int, ...], stop: StopFlag, host: str = "127.0.0.1") -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    for opt, val in ((zmq.LINGER, 0), (zmq.SNDHWM, HWM), (zmq.RCVHWM, HWM)):
        router.setsockopt(opt, val)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a cut that cannot be delivered is an error
    router.setsockopt(zmq.RCVTIMEO, MAX_BLOCK_MS)  # idle: return now and then to see stop signals
    port = router.bind_to_random_port(f"tcp://{host}")
    announce_ready(port)
    packb, unpackb = msgpack.Packer().pack, msgpack.unpackb  # reused Packer: cheaper than packb
    cuts_sent = 0
    try:
        # Wiring: every server says HELLO with its address; then all get everyone's.
        addrs: list[list[str | None]] = [[None] * n for n in shape]
        idents: list[bytes] = []
        while any(a is None for row in addrs for a in row):
            if stop.requested:
                return
            try:
                ident, frame = router.recv_multipart()
            except zmq.Again:
                continue
            op, s, i, addr = unpackb(frame)
            assert op == HELLO and addrs[s][i] is None, (op, s, i)
            addrs[s][i] = addr
            idents.append(ident)
        config = packb([CONFIG, addrs])
        for ident in idents:
            router.send_multipart([ident, config])

        local: list[list[list[int]]] = [[[0] * n for _ in range(n)] for n in shape]
        cut = zero_cut(shape)
        recv = router.recv_multipart
        send = router.send
        while not stop.requested:
            # Block for one report, fold in every other one already queued, then cut once.
            try:
                ident, frame = recv()
            except zmq.Again:
                continue
            while True:
                op, s, i, vec = unpackb(frame)
                assert op == REPORT, op
                prev = local[s][i]
                if len(vec) != len(prev) or any(a < b for a, b in zip(vec, prev)):
                    raise AssertionError(f"server {s}.{i} reported {vec} after {prev}: reports go forward only")
                local[s][i] = vec
                if not int(router.getsockopt(EVENTS)) & POLLIN:
                    break
                ident, frame = recv()
            new = combine(local)
            if check_advance(cut, new):
                cut = new
                cuts_sent += 1
                msg = packb([CUT, cuts_sent, flatten(cut)])
                for ident in idents:
                    send(ident, SNDMORE)
                    send(msg)
    finally:
        print(f"ordering: {cuts_sent} cuts", flush=True)
        ctx.destroy(linger=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.baselines.scalog")
    sub = ap.add_subparsers(dest="role", required=True)
    op = sub.add_parser("ordering", help="the ordering process (one, not replicated)")
    op.add_argument("--shape", type=parse_shape, required=True, help="storage servers per shard, e.g. 2,2")
    sp = sub.add_parser("server", help="one storage server")
    sp.add_argument("--ordering", required=True, help="the ordering process's address")
    sp.add_argument("--shape", type=parse_shape, required=True)
    sp.add_argument("--shard", type=int, required=True)
    sp.add_argument("--server", type=int, required=True)
    sp.add_argument("--interval-us", type=int, default=100, help="local cut report interval")
    sp.add_argument("--data", type=Path, required=True, help="the record file")
    args = ap.parse_args(argv)
    stop = StopFlag()
    if args.role == "ordering":
        run_ordering(args.shape, stop)
    else:
        run_server(args.ordering, args.shape, args.shard, args.server, args.interval_us, args.data, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
