"""Seeded simulation of one shard's replicas (sans-I/O cores over a simulated
network and clock).

The primary and backup :class:`ReplicaCore` objects run unchanged; the network
delays every message by a seeded random amount (so messages on different
channels overtake each other), can reorder and duplicate them, and can lose
client messages (clients retry with the same id). An MMS actor broadcasts a new
epoch every few ms with random rates, reaching the two replicas at different
times. Two subscribers (one on each replica) merge the shard's stream.

:func:`run` returns a :class:`Outcome` and raises ``AssertionError`` with a
replayable description when any invariant breaks.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Any, Callable

from ziplog.protocol import frames as wire
from ziplog.cores.client import InsertWait
from ziplog.protocol.gsna import EpochConfig, EpochSchedule, epoch_of
from ziplog.cores.merge import SubscriberMerge
from ziplog.cores.replica import TO_HANDLER, TO_MMS, TO_PRIMARY, ReplicaCore, ReplicaSettings
from ziplog.protocol.frames import PROTOCOL_VERSION as V
from ziplog.protocol.frames import pack, unpack

MS = 1_000_000
US = 1_000
SHARD = 0


@dataclass
class NetParams:
    min_delay: int = 20 * US
    max_delay: int = 200 * US
    reorder: float = 0.2  # chance a message gets an extra large delay
    duplicate: float = 0.02  # chance a message is delivered twice
    client_loss: float = 0.01  # chance a client<->replica message is lost
    peer_loss: float = 0.0  # chance a primary<->backup message is lost


@dataclass
class Outcome:
    fast: int = 0
    slow: int = 0
    acked: int = 0
    delivered: int = 0
    trace: list[str] = field(default_factory=list)


class SimClient:
    """A client as ``ziplog.Client`` behaves: send to both replicas; done when the backup's
    latest ack equals the primary's."""

    def __init__(self, cid: int, sim: "ShardSim", inserts: int) -> None:
        self.cid = cid
        self.sim = sim
        self.left = inserts
        self.seq = 0
        self.req = 0
        self.after = 0
        self.wait: InsertWait | None = None
        self.frame: bytes | None = None
        self.results: list[tuple[int, int, int, bytes]] = []  # (seq, gsn, after, data)
        self.data = b""
        self.retry_at = 0

    @property
    def route(self) -> bytes:
        return f"client{self.cid}".encode()

    def start_next(self, now: int) -> None:
        if self.left == 0:
            return
        self.left -= 1
        self.seq += 1
        self.req += 1
        rng = self.sim.rng
        # InsertAfter: usually after our own last record, sometimes after another
        # client's, sometimes a genesis insert.
        pick = rng.random()
        if pick < 0.6:
            pass
        elif pick < 0.9 and self.sim.acked_gsns:
            self.after = rng.choice(self.sim.acked_gsns)
        else:
            self.after = 0
        self.data = f"c{self.cid}s{self.seq}".encode() * rng.randint(1, 4)
        self.frame = pack([V, wire.INSERT, self.req, self.cid, self.seq, self.after, self.data])
        self.wait = InsertWait(self.req, 2)
        self._send(now)

    def _send(self, now: int) -> None:
        assert self.frame is not None
        self.sim.send(self.route, "P", self.frame, client=True)
        self.sim.send(self.route, "B", self.frame, client=True)
        self.retry_at = now + 30 * MS
        self.sim.at(self.retry_at, lambda t, r=self.req: self._maybe_retry(t, r))

    def _maybe_retry(self, now: int, req: int) -> None:
        if req == self.req and self.frame is not None and now >= self.retry_at:
            self._send(now)

    def on_frame(self, src: str, frame: bytes, now: int) -> None:
        msg = unpack(frame)
        if self.frame is None or msg[2] != self.req:
            return
        assert self.wait is not None
        if msg[1] == wire.ERROR and msg[3] == wire.E_TIMEOUT:
            return  # a parked insert timed out (e.g. waiting for an epoch): the retry resends
        assert not (msg[1] == wire.ERROR and msg[3] not in (wire.E_NO_GUESS,)), msg
        if not self.wait.feed(0 if src == "P" else 1, msg):
            return
        gsn = self.wait.decided
        assert gsn is not None
        fast = self.wait.fast
        self.sim.outcome.fast += fast
        self.sim.outcome.slow += not fast
        assert gsn > self.after, ("InsertAfter gsn not above rid", gsn, self.after)
        self.results.append((self.seq, gsn, self.after, self.data))
        self.sim.acked_gsns.append(gsn)
        self.after = gsn
        self.frame = None
        self.sim.at(now + self.sim.rng.randint(0, 300) * US, self.start_next)


class ShardSim:
    def __init__(self, seed: int, clients: int = 3, inserts: int = 30, net: NetParams | None = None,
                 epoch_ms: int = 5, rates: tuple[int, ...] = (200, 1000, 5000, 20000), noop_timeout_ns: int | None = None) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        if net is None:
            # Each seed draws its own network: from calm to hostile.
            r = self.rng
            net = NetParams(min_delay=r.choice([5, 20, 50]) * US, max_delay=r.choice([60, 200, 1000]) * US,
                            reorder=r.choice([0.0, 0.1, 0.3]), duplicate=r.choice([0.0, 0.02, 0.1]),
                            client_loss=r.choice([0.0, 0.01, 0.05]), peer_loss=r.choice([0.0, 0.0, 0.02]))
        self.net = net
        self.now = 0
        self._q: list[tuple[int, int, Callable[[int], None]]] = []
        self._n = 0
        self.outcome = Outcome()
        self.acked_gsns: list[int] = []
        self.rates = rates
        st = dict(noop_timeout_ns=noop_timeout_ns or self.rng.choice([200 * US, 1 * MS, 3 * MS]), park_timeout_ns=200 * MS,
                  stable_push_ns=1 * MS, lag_probe_ns=5 * MS)
        self.P = ReplicaCore(ReplicaSettings(SHARD, 0, 2, **st))
        self.B = ReplicaCore(ReplicaSettings(SHARD, 1, 2, **st))
        self.cores = {"P": self.P, "B": self.B}
        self.clients = {f"client{i}".encode(): SimClient(i, self, inserts) for i in range(1, clients + 1)}
        self.merges = {"P": SubscriberMerge(1), "B": SubscriberMerge(1)}
        self.delivered: dict[str, list[tuple[int, bytes]]] = {"P": [], "B": []}
        self.epoch = -1
        self.epoch_ms = epoch_ms
        self.fifo_peer_last: dict[tuple[str, str], int] = {}
        self.configs: dict[int, EpochConfig] = {}

    # -- scheduling -----------------------------------------------------------------------------
    def at(self, t: int, fn: Callable[[int], None]) -> None:
        self._n += 1
        heapq.heappush(self._q, (t, self._n, fn))

    def trace(self, text: str) -> None:
        self.outcome.trace.append(f"{self.now / MS:9.3f}ms {text}")

    def send(self, src: Any, dst: str | bytes, frame: bytes, client: bool = False) -> None:
        net, rng = self.net, self.rng
        if isinstance(dst, bytes) and dst.startswith(b"sub") or isinstance(src, bytes) and src.startswith(b"sub"):
            # A subscription is one TCP stream: in order, no loss, no duplicates.
            key = (repr(src), repr(dst))
            t = max(self.now + rng.randint(net.min_delay, net.max_delay), self.fifo_peer_last.get(key, 0) + 1)
            self.fifo_peer_last[key] = t
            self.at(t, lambda t, s=src, x=dst, f=frame: self.deliver(s, x, f, t))
            return
        loss = net.client_loss if client else net.peer_loss
        if rng.random() < loss:
            self.trace(f"lost {src!r}->{dst!r}")
            return
        copies = 2 if rng.random() < net.duplicate else 1
        for _ in range(copies):
            d = rng.randint(net.min_delay, net.max_delay)
            if rng.random() < net.reorder:
                d += rng.randint(net.max_delay, 5 * net.max_delay)
            self.at(self.now + d, lambda t, s=src, x=dst, f=frame: self.deliver(s, x, f, t))

    def deliver(self, src: Any, dst: str | bytes, frame: bytes, now: int) -> None:
        if isinstance(dst, bytes):
            if dst in self.clients:
                self.clients[dst].on_frame(src, frame, now)
            elif dst.startswith(b"sub"):
                name = dst.decode()[3:]
                msg = unpack(frame)
                if msg[1] == wire.SUB_BATCH:
                    m = self.merges[name]
                    m.on_batch(SHARD, msg[3], msg[4], msg[5])
                    self.send(dst, name, pack([V, wire.CREDIT, 1, wire.SUB_BATCH_COST]))
                    while (item := m.pop()) is not None:
                        self.delivered[name].append((item[0], item[2]))
                        # grant the credit back, as the real subscriber does
                        self.send(dst, name, pack([V, wire.CREDIT, 1, len(item[2])]))
            return
        core = self.cores[dst]
        if dst == "B" and src == "P":
            msg = unpack(frame)
            if msg[1] == wire.FORWARD:
                core.on_forward(msg, now)
        else:
            route = src if isinstance(src, bytes) else b"backup" if src == "B" else b"?"
            core.on_request(route, wire.decode_request(frame), now)
        self.pump(dst, now)

    def pump(self, name: str, now: int) -> None:
        core = self.cores[name]
        if core.replay_epoch is not None:
            # What the server shell does: the latest stashed epoch, after the ones missed.
            cfg, core.replay_epoch = core.replay_epoch, None
            gap = core.missed_before(cfg)
            for e in range(gap[0], gap[1] + 1) if gap else ():
                core.on_missed_epochs(e, e, self.configs[e].shards, now)
            core.on_epoch(cfg, now)
        core.flush(now)
        out, core.outbox = core.outbox, []
        for dest, frame in out:
            if dest == TO_PRIMARY:
                self.send(name, "P", frame)
            elif dest in (TO_MMS, TO_HANDLER):
                pass
            elif dest == b"backup":
                self.send("P", "B", frame)
            else:
                self.send(name, dest, frame)
        core.disk.clear()

    def tick(self, now: int) -> None:
        for name, core in self.cores.items():
            core.tick(now)
            self.pump(name, now)
        if not self.done() or now < self.quiet_until:
            self.at(now + 500 * US, self.tick)

    def broadcast_epoch(self, now: int) -> None:
        self.epoch += 1
        final = self.done() and now >= self.quiet_until - 100 * MS
        if final:
            # Last epoch leaves the shard out, so its frontier stops moving and the
            # replicas can be compared at rest.
            cfg = EpochConfig(self.epoch, (), ())
        else:
            cfg = EpochConfig(self.epoch, (SHARD,), (self.rng.choice(self.rates),))
        self.configs[cfg.epoch] = cfg
        for name in ("P", "B"):
            d = self.rng.randint(10 * US, 300 * US)
            self.at(now + d, lambda t, n=name, c=cfg: self._epoch_to(n, c, t))
        if not final:
            self.at(now + self.epoch_ms * MS, self.broadcast_epoch)

    def _epoch_to(self, name: str, cfg: EpochConfig, now: int) -> None:
        core = self.cores[name]
        core.on_epoch(cfg, now)
        self.pump(name, now)

    def done(self) -> bool:
        return all(c.left == 0 and c.frame is None for c in self.clients.values())

    # -- run --------------------------------------------------------------------------------------
    quiet_until = 1 << 62

    def run(self, limit_ms: int = 60_000) -> Outcome:
        # The backup says hello; both subscribers subscribe from the start of the log.
        self.B.connect_primary(0)
        self.pump("B", 0)
        self.send(b"subP", "P", pack([V, wire.SUBSCRIBE, 1, 0, 1 << 20]))
        self.send(b"subB", "B", pack([V, wire.SUBSCRIBE, 1, 0, 1 << 20]))
        self.at(0, self.broadcast_epoch)
        self.at(0, self.tick)
        for c in self.clients.values():
            self.at(self.rng.randint(1, 3) * MS, c.start_next)
        while self._q:
            t, _, fn = heapq.heappop(self._q)
            if t > limit_ms * MS:
                raise AssertionError(f"seed {self.seed}: did not finish in {limit_ms} ms of simulated time")
            self.now = t
            fn(t)
            if self.done() and self.quiet_until == 1 << 62:
                self.quiet_until = t + 200 * MS  # let stability and subscribers catch up
        self.check()
        return self.outcome

    # -- invariants ---------------------------------------------------------------------------------
    def check(self) -> None:
        P, B = self.P, self.B
        ctx = f"seed {self.seed}"
        assert P.frontier == B.frontier, (ctx, "replicas did not converge", P.frontier, B.frontier)
        assert P.gsns == B.gsns, (ctx, "replicas hold different positions")
        for g in P.gsns:
            a, b = P.records[g], B.records[g]
            assert (a.client_id, a.seq, a.data) == (b.client_id, b.seq, b.data), (ctx, "replicas disagree at", g)
            # the gsn must be one of this shard's slots in its epoch
            cfg = self.configs[epoch_of(g)]
            sched = EpochSchedule(cfg)
            k = sched.first_slot_after(SHARD, g - 1)
            assert sched.gsn(SHARD, k) == g, (ctx, "gsn is not a slot of the shard", g)
        seen: set[tuple[int, int]] = set()
        for g in P.gsns:
            key = (P.records[g].client_id, P.records[g].seq)
            assert key not in seen, (ctx, "record stored twice", key)
            seen.add(key)
        for c in self.clients.values():
            for seq, gsn, after, data in c.results:
                rec = P.records.get(gsn)
                assert rec is not None and (rec.client_id, rec.seq, rec.data) == (c.cid, seq, data), (
                    ctx, "acknowledged record lost or moved", c.cid, seq, gsn)
                self.outcome.acked += 1
        assert P.stable == P.frontier, (ctx, "stability did not catch up", P.stable, P.frontier)
        want = [(g, P.records[g].data) for g in P.gsns]
        for name, got in self.delivered.items():
            gs = [g for g, _ in got]
            assert all(a < b for a, b in zip(gs, gs[1:])), (ctx, name, "subscriber gsns not increasing")
            assert got == want, (ctx, name, "subscriber did not deliver exactly the log", len(got), len(want))
        self.outcome.delivered = len(want)


def run(seed: int, **kw: Any) -> Outcome:
    return ShardSim(seed, **kw).run()
