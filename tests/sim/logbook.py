"""Seeded simulation of the LogBook index tier: the production drivers of the feeder
(:class:`ziplog.logbook.feeder.FeederDriver`), the index nodes
(:class:`ziplog.logbook.index_node.IndexNodeDriver`) and an aggregator
(:class:`ziplog.logbook.tier.AskDriver`) over their cores, on the simulated ports: a
network that delays, reorders, duplicates and loses frames, and processes that are
killed and started again.

The log is scripted: records (entries of a few books and tags, trims near the end of a
book, other applications' records) appended in gsn order across epochs, made stable a
while later, which is what a subscription would deliver. Faults: an index node killed and
started again empty (under a new address), the feeder killed and started again, a node
added through the wanted count. Lookups at session positions run all along.

Checked on every answer: it is computed at one cut ``C`` at or above the asking
session's position and at or below the stable position, and equals what a full replay
of the log up to ``C`` answers (an oracle over the script). At the end, with the faults
over, every lookup has been answered. A lookup that asks for its hit's record (some
do; nodes keep few bytes in some seeds, and some seeds' feeders send no records) must
get the record the log holds at the hit, or none.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from tests.sim.world import MS, NetParams, SimProcess, World
from ziplog.logbook.core import frames as tf
from ziplog.logbook.core import records as r
from ziplog.logbook.core.aggregator import AggregatorCore, Result
from ziplog.logbook.core.feeder import FeederCore
from ziplog.logbook.core.index import ALL, Hit
from ziplog.logbook.core.node import NodeCore
from ziplog.logbook.feeder import FeederDriver
from ziplog.logbook.index_node import IndexNodeDriver
from ziplog.logbook.tier import AskDriver
from ziplog.protocol.auth import ClusterKey
from ziplog.protocol.gsna import epoch_base

KEY = ClusterKey(b"the simulated cluster's secret")
BOOKS = 2
TAGS = 3
#: the simulated epoch length (records get gsns of the epoch they are appended in)
EPOCH_NS = 10 * MS


class Oracle:
    """What a full replay of the script up to a cut answers."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, int, int, tuple[int, ...]]] = []
        self.trims: list[tuple[int, int, int]] = []

    def _visible(self, book: int, tag: int | None, cut: int) -> list[Hit]:
        point = max((s for g, b, s in self.trims if b == book and g <= cut), default=0)
        return [Hit(g, sh) for g, sh, b, tags in self.entries
                if b == book and point <= g <= cut and (tag is ALL or tag in tags)]

    def answer(self, how: int, book: int, tag: int | None, seqnum: int, cut: int) -> Hit | None:
        hits = self._visible(book, tag, cut)
        if how == tf.NEXT:
            return next((h for h in hits if h.gsn >= seqnum), None)
        below = [h for h in hits if h.gsn <= seqnum]
        return below[-1] if below else None


@dataclass
class Stats:
    answered: int = 0
    found: int = 0
    #: answers that came with their hit's record
    records: int = 0
    errors: int = 0
    node_restarts: int = 0
    feeder_restarts: int = 0
    rewinds: int = 0
    failures: list[str] = field(default_factory=list)


class TierSim:
    def __init__(self, seed: int, nodes: int = 2, duration_ns: int = 3_000 * MS, faults: bool = True) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.world = World(seed, NetParams())
        self.duration_ns = duration_ns
        self.faults = faults
        self.oracle = Oracle()
        self.log: list[tuple[int, int, bytes]] = []
        self.stable = 0  # the stable position: every record at or below it is in self.log
        self.epoch = 0
        self.k = 0
        #: the simulated ZooKeeper: the history the feeder wrote, wanted count, registrations
        self.history: list[tuple[int, int]] = [(0, nodes)]
        self.history_version = 0
        self.wanted = nodes
        self.registered: dict[int, str] = {}
        self.node_procs: dict[int, SimProcess] = {}
        self.node_drivers: dict[int, IndexNodeDriver] = {}
        self.feeder: FeederDriver | None = None
        self.feeder_proc: SimProcess | None = None
        self.read_from = 0  # the feeder's reader: read past this gsn
        self.incarnation = 0
        #: how much later than the feeder the aggregator hears of a change
        self.directory_delay_ms = 0
        self.stats = Stats()
        self.sessions = [0] * 4  # session positions
        self.pending: dict[int, tuple[int, int, int, int | None, int, int]] = {}
        #: the bytes an index node keeps, and the largest record the feeder sends with its entry
        #: (its own draws, so the seeds' faults and lookups are those drawn without records)
        self.records_rng = random.Random(seed ^ 0x5EED)
        self.keep_bytes = self.records_rng.choice([0, 400, 4_000, 1 << 20])
        self.record_max = self.records_rng.choice([0, 40, tf.RECORD_IN_ANSWER_MAX])
        self._key = 0
        self.agg_proc = SimProcess(self.world, "aggregator")
        self.ask = AskDriver(self.agg_proc, self.agg_proc, AggregatorCore(60_000 * MS, retry_ns=50 * MS),
                             self.on_result)
        for i in range(nodes):
            self.start_node(i)
        self.start_feeder()

    # -- processes --------------------------------------------------------------------------------
    def start_node(self, i: int) -> None:
        self.incarnation += 1
        proc = SimProcess(self.world, f"node{i}-{self.incarnation}")
        driver = IndexNodeDriver(NodeCore(i, park_ns=200 * MS, keep_bytes=self.keep_bytes), KEY, lambda route, frame: router.send_to(route, frame),
                                 proc.now)
        router = proc.router(driver.on_frame, driver.on_multipart, max_bytes=tf.REQUEST_LIMIT)
        self.node_procs[i], self.node_drivers[i] = proc, driver
        self.registered[i] = router.addr
        self._tick_node(proc, driver)
        self.directory_changed()

    def _tick_node(self, proc: SimProcess, driver: IndexNodeDriver) -> None:
        if proc.alive:
            driver.tick()
            proc.call_at(proc.now() + 20 * MS, lambda: self._tick_node(proc, driver))

    def kill_node(self, i: int) -> None:
        self.node_procs[i].kill()
        self.stats.node_restarts += 1
        # its registration goes when its session expires; a new incarnation replaces it
        self.world.at(self.world.now + self.rng.randrange(1, 300) * MS, self.start_node, i)

    def start_feeder(self) -> None:
        self.incarnation += 1
        proc = SimProcess(self.world, f"feeder-{self.incarnation}")
        self.feeder_proc = proc
        self.feeder = FeederDriver(FeederCore(list(self.history), self.history_version, record_max=self.record_max),
                                   KEY, proc, proc.now)
        self.directory_changed()
        proc.call_at(proc.now() + MS, lambda: self.feeder_turn(proc))

    def kill_feeder(self) -> None:
        assert self.feeder_proc is not None and self.feeder is not None
        self.stats.rewinds += self.feeder.core.rewinds
        self.feeder_proc.kill()
        self.stats.feeder_restarts += 1
        self.world.at(self.world.now + self.rng.randrange(1, 200) * MS, self.start_feeder)

    def directory_changed(self) -> None:
        """What ZooKeeper's watches tell the feeder and the aggregator (after a delay)."""
        def tell_feeder() -> None:
            feeder, proc = self.feeder, self.feeder_proc
            if feeder is None or proc is None or not proc.alive:
                return
            feeder.on_directory(dict(self.registered), self.wanted)

        def tell_aggregator() -> None:
            n = self.history[-1][1]
            self.ask.set_sources([self.registered.get(i) for i in range(n)])

        delay = self.rng.randrange(1, 20) * MS
        if self.feeder_proc is not None:
            self.feeder_proc.call_at(self.world.now + delay, tell_feeder)
        self.agg_proc.call_at(self.world.now + delay + self.directory_delay_ms * MS, tell_aggregator)

    def feeder_turn(self, proc: SimProcess) -> None:
        """The feeder's reader: what the process's loop does with its subscription."""
        feeder = self.feeder
        if not proc.alive or feeder is None:
            return
        what, frm = feeder.next_action()
        if what == "assign":  # ZooKeeper's compare-and-set
            if frm.version == self.history_version:
                self.history, self.history_version = list(frm.history), self.history_version + 1
                self.directory_changed()
            feeder.core.on_assignment_written(list(self.history), self.history_version)
        elif what == "open":
            self.read_from = frm
        if what in ("open", "read"):
            batch = [rec for rec in self.log if self.read_from < rec[0] <= self.stable][:self.rng.randrange(1, 50)]
            position = batch[-1][0] if batch and batch[-1][0] < self.stable else self.stable
            if batch and len([rec for rec in self.log if self.read_from < rec[0] <= self.stable]) > len(batch):
                position = batch[-1][0]
            self.read_from = max(self.read_from, position)
            feeder.on_read(batch, position)
        proc.call_at(proc.now() + self.rng.randrange(1, 4) * MS, lambda: self.feeder_turn(proc))

    # -- the log ----------------------------------------------------------------------------------
    def append(self) -> None:
        epoch = self.world.now // EPOCH_NS + 1
        if epoch != self.epoch:
            self.epoch, self.k = epoch, 0
        self.k += 1
        gsn = epoch_base(self.epoch) + self.k
        roll = self.rng.random()
        book = self.rng.randrange(BOOKS)
        if roll < 0.85:
            tags = tuple(sorted(set(self.rng.sample(range(TAGS), self.rng.randrange(0, 3)))))
            shard = self.rng.randrange(2)
            data = r.encode(r.entry(book, b"x" * self.records_rng.randrange(1, 30) + str(gsn).encode(), tags))
            self.oracle.entries.append((gsn, shard, book, tags))
        elif roll < 0.95:
            mine = [g for g, _, b, _ in self.oracle.entries if b == book]
            point = mine[-self.rng.randrange(1, 6)] if len(mine) >= 6 else 0
            shard = 0
            data = r.encode(r.Trim(book=book, seqnum=point))
            self.oracle.trims.append((gsn, book, point))
        else:
            shard, data = 1, b"another application's record"
        self.log.append((gsn, shard, data))
        # stable a little later (the log's stable-prefix watermark trails the appends)
        self.world.at(self.world.now + self.rng.randrange(1, 15) * MS, self._stabilize, gsn)

    def _stabilize(self, gsn: int) -> None:
        self.stable = max(self.stable, gsn)

    # -- lookups ----------------------------------------------------------------------------------
    def lookup(self) -> None:
        s = self.rng.randrange(len(self.sessions))
        how = self.rng.choice([tf.NEXT, tf.PREV])
        book = self.rng.randrange(BOOKS)
        tag = self.rng.choice([None, *range(TAGS)])
        gsns = [g for g, _, _ in self.log[-20:]] or [0]
        seqnum = self.rng.choice([0, (1 << 64) - 1, *gsns, self.rng.choice(gsns) + 1])
        self._key += 1
        self.pending[self._key] = (s, how, book, tag, seqnum, self.sessions[s])
        key = self._key
        record = self.records_rng.random() < 0.5
        self.agg_proc.run(lambda: self.ask.lookup(key, how, book, tag, seqnum, self.sessions[s], record=record))

    def on_result(self, res: Result) -> None:
        s, how, book, tag, seqnum, min_cut = self.pending.pop(res.key)  # type: ignore[call-overload]
        if res.error is not None:
            self.stats.errors += 1
            self.stats.failures.append(f"lookup failed: {res.error} {res.message}")
            return
        want = self.oracle.answer(how, book, tag, seqnum, res.cut)
        if not min_cut <= res.cut <= self.stable:
            self.stats.failures.append(f"cut {res.cut} outside [{min_cut}, {self.stable}]")
        if res.hit != want:
            self.stats.failures.append(f"{'next' if how == tf.NEXT else 'prev'}(book {book}, tag {tag}, {seqnum}) at "
                                       f"cut {res.cut}: got {res.hit}, a replay says {want}")
        if res.record is not None:
            held = [data for gsn, _, data in self.log if res.hit is not None and gsn == res.hit.gsn]
            if held != [res.record]:
                self.stats.failures.append(f"the answer at gsn {res.hit} came with {res.record!r}, the log holds {held}")
            self.stats.records += 1
        self.stats.answered += 1
        self.stats.found += res.hit is not None
        self.sessions[s] = max(self.sessions[s], res.cut)

    # -- the run ----------------------------------------------------------------------------------
    def run(self) -> Stats:
        w = self.world
        end = self.duration_ns
        t = 0
        while t < end:
            w.at(t, self.append)
            if self.rng.random() < 0.3:
                w.at(t, self.lookup)
            t += self.rng.randrange(200, 2_000) * 1_000
        if self.faults:
            for _ in range(self.rng.randrange(1, 4)):
                w.at(self.rng.randrange(end // 2), self.kill_node, self.rng.randrange(len(self.registered)))
            for _ in range(self.rng.randrange(0, 3)):
                w.at(self.rng.randrange(end // 2), self.kill_feeder)
            if self.rng.random() < 0.5:
                w.at(self.rng.randrange(end // 2), self.add_node)
        while w.step():
            if w.now > end + 30_000 * MS:
                self.stats.failures.append(f"still running 30 s after the end: {len(self.pending)} lookups pending")
                break
            if w.now > end and not self.pending:
                break
        if self.pending:
            self.stats.failures.append(f"{len(self.pending)} lookups never answered")
        if self.feeder is not None:
            self.stats.rewinds += self.feeder.core.rewinds
        return self.stats

    def add_node(self) -> None:
        self._grow_now()

    def _grow_now(self) -> None:
        self.wanted += 1
        self.start_node(self.wanted - 1)


def run_seed(seed: int, **kw: Any) -> Stats:
    return TierSim(seed, **kw).run()
