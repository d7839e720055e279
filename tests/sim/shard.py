"""Seeded simulation of one shard: its two storage replicas (the production
:class:`~ziplog.server.storage.StorageDriver` on the simulated ports of
``tests/sim/world.py``), clients and two subscribers (the production
:class:`~ziplog.client.driver.ClientDriver`), and a test actor in the membership
service's place that broadcasts an epoch every few ms with a seeded rate. The network
delays every message by a seeded amount (so messages on different connections overtake
each other), can reorder and duplicate them, and can lose client and peer messages
(clients resend with the same id). Epochs reach the two replicas at different times.
One subscriber reads the primary, the other the backup. No failure handler: nothing
crashes here (``tests/sim/system.py`` has the faults).

:func:`run` returns an :class:`Outcome` and raises ``AssertionError`` naming the seed
when an invariant breaks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ziplog.client.driver import ClientDriver, SubscriptionDriver
from ziplog.cores.client.calls import InsertCall
from ziplog.cores.client.state import ClientState
from ziplog.cores.replica import ReplicaCore, ReplicaSettings
from ziplog.protocol import frames as wire
from ziplog.protocol.errors import ZiplogError, ZiplogTimeoutError
from ziplog.protocol.gsna import EpochConfig, EpochSchedule, epoch_of
from ziplog.protocol.types import RID_GENESIS, Policy
from ziplog.server.storage import StorageDriver

from .world import (
    CLUSTER_KEY,
    MS,
    US,
    NetParams,
    SimDisk,
    SimProcess,
    SimStorageCoordination,
    SimTopology,
    World,
    ZooKeeper,
)

SHARD = 0
CLIENT_TIMEOUT_NS = 30_000_000_000

__all__ = ["NetParams", "Outcome", "ShardSim", "run"]


@dataclass
class Outcome:
    fast: int = 0
    slow: int = 0
    acked: int = 0
    delivered: int = 0
    trace: list[str] = field(default_factory=list)


class ShardApp:
    """An application thread inserting ``inserts`` records on shard 0, one at a time:
    after its own last record mostly, sometimes after another client's, sometimes at
    the start of the log."""

    def __init__(self, sim: "ShardSim", cid: int, inserts: int) -> None:
        self.sim = sim
        self.cid = cid
        self.proc = SimProcess(sim.world, f"client{cid}")
        self.topology = SimTopology(sim.zk, self.proc)
        # resends every 30 ms (the library's default is 250 ms): more of them, in less time
        self.state = ClientState(cid, Policy.fixed(SHARD), random.Random(sim.rng.getrandbits(64)), CLIENT_TIMEOUT_NS,
                                 retry_after_ns=30 * MS, retry_troubled_ns=10 * MS)
        self.driver = ClientDriver(self.proc, self.proc, self.topology, self.state)
        self.topology.on_change(lambda: self.proc.call_soon_threadsafe(self.driver.on_topology))
        self.left = inserts
        self.after = 0
        self.busy = False
        self.results: list[tuple[int, int, int, bytes]] = []  # (seq, gsn, after, data)

    def next_insert(self) -> None:
        if self.left == 0:
            return
        sim = self.sim
        rng = sim.rng
        pick = rng.random()
        if pick < 0.6:
            pass
        elif pick < 0.9 and sim.acked_gsns:
            self.after = rng.choice(sim.acked_gsns)
        else:
            self.after = 0
        data = f"c{self.cid}n{self.left}".encode() * rng.randint(1, 4)
        call = InsertCall(self.state, data, self.after, None, sim.world.now + CLIENT_TIMEOUT_NS)
        self.busy = True
        self.driver.start(call, lambda: self.finished(call))

    def finished(self, call: InsertCall) -> None:
        sim = self.sim
        self.busy = False
        try:
            rid = call.result()
        except ZiplogTimeoutError as exc:
            if sim.world.now >= call.deadline_ns:
                raise AssertionError(f"seed {sim.seed}: client {self.cid} seq {call.seq}: {exc!r}") from None
            # a parked insert timed out (its epoch did not come in time): insert it again
            self.proc.call_at(sim.world.now + MS, self.next_insert)
            return
        except ZiplogError as exc:
            raise AssertionError(f"seed {sim.seed}: client {self.cid} seq {call.seq}: {exc!r}") from None
        assert rid.gsn > call.after, ("InsertAfter gsn not above rid", rid, call.after)
        self.left -= 1
        self.results.append((call.seq, rid.gsn, call.after, call.data))
        sim.acked_gsns.append(rid.gsn)
        self.after = rid.gsn
        self.proc.call_at(sim.world.now + sim.rng.randint(0, 300) * US, self.next_insert)


class ShardReader:
    """A subscriber from the start of the log reading one replica of shard 0."""

    def __init__(self, sim: "ShardSim", replica: int) -> None:
        self.proc = SimProcess(sim.world, f"reader{replica}")
        self.topology = SimTopology(sim.zk, self.proc)
        state = ClientState(1000 + replica, None, random.Random(sim.rng.getrandbits(64)), CLIENT_TIMEOUT_NS)
        self.driver = ClientDriver(self.proc, self.proc, self.topology, state)
        self.topology.on_change(lambda: self.proc.call_soon_threadsafe(self.driver.on_topology))
        self.replica = replica
        self.delivered: list[tuple[int, bytes]] = []
        self.sub: SubscriptionDriver | None = None

    def start(self) -> None:
        self.sub = self.driver.subscribe(RID_GENESIS, lambda shard, n: self.replica)
        self.sub.on_change = self.drain

    def drain(self) -> None:
        assert self.sub is not None
        self.sub.core.raise_error()
        while (rec := self.sub.pop()) is not None:
            self.delivered.append((rec.rid.gsn, rec.data))


class ShardSim:
    def __init__(self, seed: int, clients: int = 3, inserts: int = 30, net: NetParams | None = None,
                 epoch_ms: int = 5, rates: tuple[int, ...] = (200, 1000, 5000, 20000),
                 noop_timeout_ns: int | None = None, overrides: dict[str, Any] | None = None) -> None:
        self.seed = seed
        self.rng = r = random.Random(seed)
        if net is None:
            # Each seed draws its own network: from calm to hostile.
            net = NetParams(min_delay=r.choice([5, 20, 50]) * US, max_delay=r.choice([60, 200, 1000]) * US,
                            reorder=r.choice([0.0, 0.1, 0.3]), duplicate=r.choice([0.0, 0.02, 0.1]),
                            client_loss=r.choice([0.0, 0.01, 0.05]), peer_loss=r.choice([0.0, 0.0, 0.02]),
                            epoch_loss=0.0, control_loss=0.0)
        self.world = World(r.getrandbits(64), net)
        self.zk = ZooKeeper(self.world)
        self.outcome = Outcome()
        self.acked_gsns: list[int] = []
        self.rates = rates
        self.epoch_ms = epoch_ms
        self.settings: dict[str, Any] = dict(noop_timeout_ns=noop_timeout_ns or r.choice([200 * US, 1 * MS, 3 * MS]),
                             park_timeout_ns=200 * MS, stable_push_ns=1 * MS, lag_probe_ns=5 * MS, suspect_timeout_ns=0,
                             # a third of the seeds forward in parts of a few records
                             forward_batch_bytes=random.Random(seed * 7919 + 1).choice([4 << 20, 4 << 20, 200]))
        self.settings.update(overrides or {})  # a test's own replica settings
        self.drivers: dict[int, StorageDriver] = {}
        self.procs: dict[int, SimProcess] = {}
        for i in range(2):
            proc = self.procs[i] = SimProcess(self.world, f"rep0.{i}")
            coord = SimStorageCoordination(self.zk, proc, self.zk.session(proc.name))
            self.drivers[i] = StorageDriver(ReplicaSettings(SHARD, i, 2, **self.settings), proc, proc, coord, SimDisk(),
                                          CLUSTER_KEY, incarnation=i + 1)
        # the membership service's place: a publisher the replicas subscribe to
        self.mms = SimProcess(self.world, "mms")
        self.pub = self.mms.publisher()
        self.epoch = -1
        self.configs: dict[int, EpochConfig] = {}
        self.apps = [ShardApp(self, i, inserts) for i in range(1, clients + 1)]
        self.readers = [ShardReader(self, 0), ShardReader(self, 1)]
        self.quiet_until: int | None = None
        self.final_epoch: int | None = None
        self.stop_at: int | None = None

    @property
    def P(self) -> ReplicaCore:
        return self.drivers[0].core

    @property
    def B(self) -> ReplicaCore:
        return self.drivers[1].core

    # -- the membership service's place ---------------------------------------------------------------
    def broadcast_epoch(self) -> None:
        now = self.world.now
        self.epoch += 1
        final = self.quiet_until is not None and now >= self.quiet_until
        if final:
            # The last epoch leaves the shard out, so its frontier stops moving and the
            # replicas can be compared at rest (written to the history first, as the MMS does).
            cfg = EpochConfig(self.epoch, (), ())
            self.zk.history = self.zk.history + [[self.epoch, []]]
            self.zk.history_version += 1
        else:
            cfg = EpochConfig(self.epoch, (SHARD,), (self.rng.choice(self.rates),))
        self.configs[cfg.epoch] = cfg
        self.pub.send(wire.EpochEncoder().encode(cfg.epoch, cfg.shards, cfg.rates))
        if final:
            self.final_epoch = cfg.epoch
            self.mms.call_at(now + 5 * MS, self.settle_check)
        else:
            self.mms.call_at(now + self.epoch_ms * MS, self.broadcast_epoch)

    def settled(self) -> bool:
        """Both replicas decided the final epoch, everything is stable, and both
        subscribers delivered every record."""
        P, B = self.P, self.B
        if self.final_epoch is None or P.last_epoch < self.final_epoch or B.last_epoch < self.final_epoch:
            return False
        if P.frontier != B.frontier or P.stable != P.frontier or B.stable != B.frontier:
            return False
        return all(len(rd.delivered) == len(P.log.gsns) for rd in self.readers)

    def settle_check(self) -> None:
        if self.settled():
            self.stop_at = self.world.now
        else:
            self.mms.call_at(self.world.now + 5 * MS, self.settle_check)

    def done(self) -> bool:
        return all(a.left == 0 and not a.busy for a in self.apps)

    def watch_done(self) -> None:
        if self.quiet_until is None and self.done():
            self.quiet_until = self.world.now + 20 * MS  # the last records on their way

    # -- run --------------------------------------------------------------------------------------
    def run(self, limit_ms: int = 60_000, until_ms: int | None = None) -> Outcome:
        """Until the clients are done and everything settled (or until ``until_ms``, if
        given, when the last epoch leaves the shard), then check."""
        world, zk = self.world, self.zk
        with world.logs_in_trace():
            zk.history = [[0, [SHARD]]]
            zk.mms["0"] = ({"pub": self.pub.addr}, zk.session("mms"))
            zk.changed("the membership service is up")
            for i, d in self.drivers.items():
                self.procs[i].run(d.start)
            self.mms.run(self.broadcast_epoch)
            for a in self.apps:
                a.proc.call_at(self.rng.randint(1, 3) * MS, a.next_insert)
                a.proc.at_turn_end(self.watch_done)
            for rd in self.readers:
                rd.proc.run(rd.start)
            if until_ms is not None:
                self.quiet_until = until_ms * MS
            while self.stop_at is None or world.now < self.stop_at:
                t = world.next_time()
                if t is None or t > limit_ms * MS:
                    raise AssertionError(f"seed {self.seed}: did not settle in {limit_ms} ms of simulated time")
                world.step()
        self.check()
        return self.outcome

    # -- invariants ---------------------------------------------------------------------------------
    def check(self) -> None:
        P, B = self.P, self.B
        ctx = f"seed {self.seed}"
        assert P.frontier == B.frontier, (ctx, "replicas did not converge", P.frontier, B.frontier)
        assert P.log.gsns == B.log.gsns, (ctx, "replicas hold different positions")
        records = P.log.records
        for g in P.log.gsns:
            mine, theirs = records[g], B.log.records[g]
            assert (mine.client_id, mine.seq, mine.data) == (theirs.client_id, theirs.seq, theirs.data), (
                ctx, "replicas disagree at", g)
            # the gsn must be one of this shard's slots in its epoch
            sched = EpochSchedule(self.configs[epoch_of(g)])
            k = sched.first_slot_after(SHARD, g - 1)
            assert sched.gsn(SHARD, k) == g, (ctx, "gsn is not a slot of the shard", g)
        seen: set[tuple[int, int]] = set()
        for g in P.log.gsns:
            key = (records[g].client_id, records[g].seq)
            assert key not in seen, (ctx, "record stored twice", key)
            seen.add(key)
        for a in self.apps:
            for seq, gsn, after, data in a.results:
                rec = records.get(gsn)
                assert rec is not None and (rec.client_id, rec.seq, rec.data) == (a.cid, seq, data), (
                    ctx, "acknowledged record lost or moved", a.cid, seq, gsn)
                self.outcome.acked += 1
            self.outcome.fast += a.state.stats["fast_path"]
            self.outcome.slow += a.state.stats["slow_path"]
        assert P.stable == P.frontier, (ctx, "stability did not catch up", P.stable, P.frontier)
        want = [(g, records[g].data) for g in P.log.gsns]
        for rd in self.readers:
            got = rd.delivered
            gs = [g for g, _ in got]
            assert all(x < y for x, y in zip(gs, gs[1:])), (ctx, rd.replica, "subscriber gsns not increasing")
            assert got == want, (ctx, rd.replica, "subscriber did not deliver exactly the log", len(got), len(want))
        self.outcome.delivered = len(want)


def corrupt(core: ReplicaCore, gsn: int, data: bytes) -> None:
    """For the checker's own test: replace a record's data in one replica's log."""
    core.log.records[gsn] = msgspec.structs.replace(core.log.records[gsn], data=data)


def run(seed: int, **kw: Any) -> Outcome:
    return ShardSim(seed, **kw).run()
