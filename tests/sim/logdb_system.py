"""Seeded simulation of LogDB on the whole simulated ziplog system: the production LogDB
drivers over the production log drivers, on the simulated ports.

On top of :class:`~tests.sim.system.SystemSim` (storage replicas, the membership service
and the failure handler, with their faults) run:

* **coordinator replicas** (:class:`ziplog.logdb.coordinator.CoordinatorDriver` over
  :class:`CoordinatorCore`), elected through the simulated ZooKeeper, serving clients on
  a ROUTER bound by the production ``serve_requests``, replaying the log through a
  subscription of their own client driver, their validator snapshot kept in a "file"
  that survives a kill;
* **KV shards** (:class:`ziplog.logdb.kvshard.KvShardDriver` over :class:`KvShardCore`)
  storing into the production :class:`SqliteStore` in a directory of the seed's own,
  restarted from what SQLite holds after a kill;
* **LogDB clients** (:class:`ziplog.logdb.driver.TransactionDriver` over the transaction
  steps, their log calls on a :class:`ClientDriver` on the same process): bank transfers
  between a few accounts (read two, write both) and audits (read every account, commit
  read-only), each outcome recorded as the client saw it.

Faults add to the system's: coordinator replicas and KV shards killed and restarted.
Once everything settles, :meth:`LogDbSim.check_logdb` replays the log one subscriber
delivered through a reference :class:`Validator` and checks:

* **serializability**: every transaction a client saw commit read exactly the state the
  reference reaches at its serialization point (its commit record's gsn; a read-only
  one's position), so ordering the committed transactions by those points is a serial
  history that explains every value read; every audit that committed saw the bank's
  total unchanged; every outcome a client was told matches the reference decision;
* **exactly-once application**: each KV shard holds exactly its keys' reference values,
  and its journal names every committed transaction of its keys once, in gsn order;
* every coordinator replica's validator agrees with the reference on every key's latest
  committed write.
"""

from __future__ import annotations

import logging
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from tests.sim import system
from tests.sim.system import CLIENT_TIMEOUT_NS, Outcome, SystemSim
from tests.sim.world import MS, US, Session, SimElection, SimProcess, SimTopology
from ziplog.client.driver import ClientDriver, SubscriptionDriver
from ziplog.cores.client.state import ClientState
from ziplog.logdb.coordinator import CoordinatorDriver
from ziplog.logdb.core.coordinator import CoordinatorCore
from ziplog.logdb.core.kvshard import KvShardCore, owner
from ziplog.logdb.core.records import TransactionAborted
from ziplog.logdb.core.transaction import Session as LogDbSession
from ziplog.logdb.core.transaction import Steps, Transaction
from ziplog.logdb.core.validator import Validator
from ziplog.logdb.driver import ClientLog, TransactionDriver
from ziplog.logdb.kvshard import KvShardDriver
from ziplog.logdb.process import feed, serve_requests
from ziplog.logdb.store import SqliteStore
from ziplog.protocol.errors import ZiplogError
from ziplog.protocol.types import Policy, RecordId
from ziplog.shell.inbound import InboundGuard

log = logging.getLogger("tests.sim.logdb")

ELECTION = "/ziplog/logdb/sim/election"
#: the LogDB client's timeouts, shorter than a real one's: the simulation's faults heal
#: in tens of milliseconds
TXN_TIMEOUT_NS = 2_000 * MS
REQUEST_TIMEOUT_NS = 50 * MS
#: a coordinator's clock ticks (its waiting requests time out on them)
TICK_NS = 20 * MS


class Directory:
    """The LogDB's registrations in the simulated ZooKeeper: an address per coordinator
    replica and KV shard, gone with its process's session; coordinators ranked as their
    election ranks them (the leader first)."""

    def __init__(self, sim: "LogDbSim") -> None:
        self.sim = sim
        self.kv_shards = sim.kv_shards
        self.coord: dict[int, tuple[str, Session]] = {}
        self.kv: dict[int, tuple[str, Session]] = {}

    def coordinators(self) -> list[str]:
        ranked = [e.session for _, e in self.sim.zk.elections.get(ELECTION, [])]
        live = {s: a for a, s in self.coord.values() if s.alive}
        return [live[s] for s in ranked if s in live] + [a for s, a in live.items() if s not in ranked]

    def kv_addr(self, shard: int) -> str | None:
        entry = self.kv.get(shard)
        return entry[0] if entry is not None and entry[1].alive else None


class Replayer:
    """What the coordinator and KV shard processes do with their subscription
    (``ziplog.logdb.process.replay`` on asyncio): each batch the subscription hands over,
    fed with the same ``feed``."""

    def __init__(self, proc: SimProcess, client: ClientDriver, first_gsn: int, target: Any,
                 turn_end: Callable[[], object] = lambda: None) -> None:
        self.target = target
        self.turn_end = turn_end
        self.sub: SubscriptionDriver = client.subscribe(RecordId(first_gsn, -1), lambda shard, n: 0)
        self.sub.on_change = self.drain

    def drain(self) -> None:
        sub = self.sub
        sub.core.raise_error()
        feed(self.target, iter(sub.pop, None), sub.core.position, self.turn_end)


def _client_driver(sim: "LogDbSim", proc: SimProcess, cid: int) -> ClientDriver:
    topology = SimTopology(sim.zk, proc)
    state = ClientState(cid, Policy.random(), random.Random(sim.rng.getrandbits(64)), CLIENT_TIMEOUT_NS)
    driver = ClientDriver(proc, proc, topology, state)
    topology.on_change(lambda: proc.call_soon_threadsafe(driver.on_topology))
    return driver


class CoordinatorReplica:
    def __init__(self, sim: "LogDbSim", rid: int) -> None:
        self.sim = sim
        self.rid = rid
        self.inc = 0
        self.snapshot: bytes | None = None  # the snapshot file: survives kills
        self.proc: SimProcess | None = None
        self.session: Session | None = None
        self.driver: CoordinatorDriver | None = None
        self.core: CoordinatorCore | None = None

    def start(self) -> None:
        sim = self.sim
        self.inc += 1
        name = f"coord{self.rid}#{self.inc}"
        proc = self.proc = SimProcess(sim.world, name)
        session = self.session = sim.zk.session(name)
        core = self.core = CoordinatorCore.from_snapshot(self.snapshot)

        def save(position: int, data: bytes) -> None:
            self.snapshot = data

        def handle(route: bytes, frame: bytes) -> None:
            assert self.driver is not None
            self.driver.on_request(route, frame)

        router = serve_requests(proc, handle, InboundGuard(log, proc))
        self.driver = CoordinatorDriver(proc, SimElection(sim.zk, proc, session), ELECTION, self.rid, core,
                                        router.send_to, save, snapshot_ns=30 * MS)
        sim.directory.coord[self.rid] = (router.addr, session)
        client = _client_driver(sim, proc, 5000 + self.rid * 100 + self.inc)
        sim.tr(f"{name}: up, replaying from gsn {core.position + 1}")

        def begin() -> None:
            assert self.driver is not None
            self.driver.contend()
            Replayer(proc, client, core.position + 1, self.driver)
            self._tick()

        proc.run(begin)

    def _tick(self) -> None:
        assert self.driver is not None and self.proc is not None
        self.driver.on_tick()
        self.proc.call_at(self.proc.now() + TICK_NS, self._tick)

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.alive


class KvShard:
    def __init__(self, sim: "LogDbSim", index: int) -> None:
        self.sim = sim
        self.index = index
        self.path = sim.tmp / f"kv-{index}.sqlite3"
        self.inc = 0
        self.proc: SimProcess | None = None
        self.session: Session | None = None
        self.store: SqliteStore | None = None
        self.driver: KvShardDriver | None = None

    def start(self) -> None:
        sim = self.sim
        self.inc += 1
        name = f"kv{self.index}#{self.inc}"
        proc = self.proc = SimProcess(sim.world, name)
        session = self.session = sim.zk.session(name)
        store = self.store = SqliteStore(self.path, self.index, sim.kv_shards)
        core = KvShardCore(self.index, sim.kv_shards, store.load(), proc.now(), snapshot_ns=30 * MS,
                           idle_store_ns=10 * MS)
        driver = self.driver = KvShardDriver(core, store, proc.now)

        def answer(route: bytes, frame: bytes) -> None:
            router.send_to(route, driver.answer(frame))

        router = serve_requests(proc, answer, InboundGuard(log, proc))
        sim.directory.kv[self.index] = (router.addr, session)
        client = _client_driver(sim, proc, 6000 + self.index * 100 + self.inc)
        sim.tr(f"{name}: up, applied up to gsn {core.applied}, replaying from gsn {core.replay_from}")
        proc.run(lambda: Replayer(proc, client, core.replay_from, driver, lambda: driver.flush()))

    def kill(self) -> None:
        assert self.proc is not None and self.store is not None
        self.proc.kill()
        self.store.close()  # what SQLite committed stays; nothing else was written

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.alive


class BankClient:
    """A LogDB client: transfers and audits, one after another, each a fresh transaction."""

    def __init__(self, sim: "LogDbSim", cid: int, transactions: int) -> None:
        self.sim = sim
        self.cid = cid
        self.proc = SimProcess(sim.world, f"bank{cid}")
        self.log_driver = _client_driver(sim, self.proc, 7000 + cid)
        self.driver = TransactionDriver(self.proc, self.proc, sim.directory, ClientLog(self.log_driver),
                                        TXN_TIMEOUT_NS, REQUEST_TIMEOUT_NS)
        self.session = LogDbSession(sim.kv_shards, random.Random(sim.rng.getrandbits(64)))
        self.left = transactions
        self.done = transactions == 0
        self.t: Transaction | None = None

    def next(self) -> None:
        if self.left == 0:
            self.done = True
            return
        self.left -= 1
        sim = self.sim
        t = self.t = Transaction(self.session)
        if sim.rng.random() < 0.7:
            a, b = sim.rng.sample(sim.accounts, 2)
            steps = self._transfer(t, a, b, sim.rng.randint(1, 9))
        else:
            steps = self._audit(t)
        run = self.driver.run(steps, lambda: self.finished(t, run))

    @staticmethod
    def _transfer(t: Transaction, a: bytes, b: bytes, amount: int) -> Steps:
        va = yield from t.get_steps(a)
        vb = yield from t.get_steps(b)
        t.put(a, b"%d" % (int(va or b"0") - amount))
        t.put(b, b"%d" % (int(vb or b"0") + amount))
        yield from t.commit_steps()

    def _audit(self, t: Transaction) -> Steps:
        for key in self.sim.accounts:
            yield from t.get_steps(key)
        yield from t.commit_steps()

    def finished(self, t: Transaction, run: Any) -> None:
        sim = self.sim
        reads = {k: v for k, (_, v) in t.reads.items()}
        try:
            run.result()
        except TransactionAborted as exc:
            sim.stats["aborted"] += 1
            if t.commit_rid is not None:
                sim.told_aborted.append((self.cid, t.txn, t.commit_rid))
            sim.tr(f"bank {self.cid}: txn {t.txn} aborted ({exc})")
        except ZiplogError as exc:  # a timeout or no shard: the outcome is unknown to the client
            sim.stats["unknown"] += 1
            sim.tr(f"bank {self.cid}: txn {t.txn} outcome unknown ({exc!r})")
        else:
            assert t.serialized_at is not None
            sim.stats["committed_writes" if t.writes else "committed_reads"] += 1
            sim.committed.append((self.cid, t.txn, t.serialized_at, t.commit_rid, reads, dict(t.writes)))
            sim.tr(f"bank {self.cid}: txn {t.txn} committed at {t.serialized_at}")
        self.proc.call_at(sim.now + sim.rng.randint(0, 3000) * US, self.next)


class LogDbSim(SystemSim):
    def __init__(self, seed: int, trace: bool = False, **kw: Any) -> None:
        knobs = random.Random(seed * 104_729 + 7)
        kw.setdefault("clients", knobs.randint(0, 2))  # the log's own apps: other records in the log
        super().__init__(seed, trace, **kw)
        # SQLite files in memory-backed storage where there is one: thousands of seeds
        # each commit hundreds of small transactions
        shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
        self.tmp = Path(tempfile.mkdtemp(prefix=f"logdb-sim-{seed}-", dir=shm))
        self.kv_shards = knobs.choice([1, 2, 3])
        self.accounts = [b"acct%d" % i for i in range(knobs.randint(2, 5))]
        self.directory = Directory(self)
        self.coords = [CoordinatorReplica(self, i) for i in range(2)]
        self.kvs = [KvShard(self, i) for i in range(self.kv_shards)]
        self.banks = [BankClient(self, i, knobs.randint(3, 8)) for i in range(knobs.randint(1, 3))]
        self.other_writers = {b.log_driver.client.client_id for b in self.banks}
        self.stats = {"committed_writes": 0, "committed_reads": 0, "aborted": 0, "unknown": 0, "logdb_kills": 0}
        #: (client, txn, serialized at, commit rid, reads, writes) of every commit a client saw
        self.committed: list[tuple[int, int, int, Any, dict[bytes, bytes | None], dict[bytes, bytes | None]]] = []
        self.told_aborted: list[tuple[int, int, Any]] = []
        for _ in range(knobs.choice([0, 1, 2, 3])):
            self.fault_plan.append((knobs.randint(5 * MS, self.fault_end), knobs.choice(["coordinator", "kv"])))

    # -- the LogDB's processes ------------------------------------------------------------------
    def _run(self) -> Outcome:
        for c in self.coords:
            self.at(self.rng.randint(1, 3) * MS, c.start)
        for k in self.kvs:
            self.at(self.rng.randint(1, 3) * MS, k.start)
        for b in self.banks:
            self.at(self.rng.randint(4, 8) * MS, b.proc.run, b.next)
        return super()._run()

    def fault(self, kind: str) -> None:
        if kind == "coordinator":
            live = [c for c in self.coords if c.up]
            if len(live) < 2:
                return  # one replica answers meanwhile
            c = self.rng.choice(live)
            assert c.proc is not None and c.session is not None
            self.tr(f"CRASH {c.proc.name}")
            self.stats["logdb_kills"] += 1
            c.proc.kill()
            self.at(self.now + self.rng.randint(5, 40) * MS, self.expire, c.session)
            self.at(self.now + self.rng.randint(10, 60) * MS, c.start)
        elif kind == "kv":
            k = self.rng.choice(self.kvs)
            if not k.up:
                return
            assert k.proc is not None and k.session is not None
            self.tr(f"CRASH {k.proc.name} (applied up to gsn {k.driver.core.applied if k.driver else '?'})")
            self.stats["logdb_kills"] += 1
            k.kill()
            self.at(self.now + self.rng.randint(5, 40) * MS, self.expire, k.session)
            self.at(self.now + self.rng.randint(10, 60) * MS, k.start)
        else:
            super().fault(kind)

    def settled(self) -> str | None:
        why = super().settled()
        if why is not None:
            return why
        for b in self.banks:
            if not b.done:
                return f"bank client {b.cid} not done ({b.left} left)"
        end = max((g for g, _, _ in self.readers[0].delivered), default=0)
        for c in self.coords:
            if not c.up or c.core is None or c.core.position < end:
                return f"coordinator {c.rid} not caught up"
        for k in self.kvs:
            if not k.up or k.driver is None or k.driver.core.applied < end or k.driver.blocked:
                return f"KV shard {k.index} not caught up"
        return None

    def check(self) -> None:
        super().check()
        self.check_logdb()

    # -- the checks -----------------------------------------------------------------------------
    def check_logdb(self) -> None:
        records = self.readers[0].delivered
        v = Validator()
        decided: dict[int, Any] = {}
        #: (gsn, key, value) of every committed write, in gsn order
        applied: list[tuple[int, bytes, bytes | None, tuple[int, int]]] = []
        journal: dict[int, list[tuple[int, int, int]]] = {i: [] for i in range(self.kv_shards)}
        for gsn, shard, data in records:
            d = v.on_record(gsn, shard, data)
            if d is None or d.duplicate:
                continue
            decided[d.txn] = d
            if not d.committed:
                continue
            per_shard: dict[int, int] = {}
            for key, rid, value in d.writes:
                applied.append((gsn, key, value, rid))
                per_shard[owner(key, self.kv_shards)] = per_shard.get(owner(key, self.kv_shards), 0) + 1
            for i, n in sorted(per_shard.items()):
                journal[i].append((gsn, d.txn, n))
        # outcomes as told
        for cid, txn, at, commit_rid, reads, writes in self.committed:
            if writes:
                d = decided.get(txn)
                assert d is not None and d.committed and d.gsn == at, (
                    f"bank {cid}: txn {txn} was told committed at {at}, the log decides {d}")
        for cid, txn, rid in self.told_aborted:
            d = decided.get(txn)
            assert d is None or not d.committed, f"bank {cid}: txn {txn} was told aborted, the log commits it"
        # serializability: each committed transaction read the state at its point
        total0 = 0
        for cid, txn, at, commit_rid, reads, writes in sorted(self.committed, key=lambda c: c[2]):
            state: dict[bytes, bytes | None] = {}
            for gsn, key, value, _ in applied:
                # a write transaction serializes at its commit: it read what was there before
                if gsn < at or (gsn == at and not writes):
                    state[key] = value
            for key, value in reads.items():
                assert state.get(key) == value, (
                    f"bank {cid}: txn {txn} serialized at {at} read {key!r} = {value!r}, but the state there "
                    f"holds {state.get(key)!r}: not serializable")
            if not writes and len(reads) == len(self.accounts):
                total = sum(int(x or b"0") for x in reads.values())
                assert total == total0, f"bank {cid}: audit {txn} at {at} sees a total of {total}, not {total0}"
        # exactly once: each KV shard holds its keys' last values and applied each commit once
        final: dict[bytes, tuple[bytes | None, int, int]] = {}
        for gsn, key, value, rid in applied:
            final[key] = (value, rid[0], rid[1])
        for k in self.kvs:
            assert k.store is not None
            want = {key: val for key, val in final.items() if owner(key, self.kv_shards) == k.index}
            assert k.store.items() == want, f"KV shard {k.index} holds {k.store.items()}, the log says {want}"
            assert k.store.journal() == journal[k.index], (
                f"KV shard {k.index} journal {k.store.journal()} is not the log's {journal[k.index]}")
        for c in self.coords:
            assert c.core is not None
            assert c.core.validator.latest == v.latest, f"coordinator {c.rid} disagrees on the latest writes"
        self.outcome.logdb = dict(self.stats)

    def close(self) -> None:
        for k in self.kvs:
            if k.store is not None:
                k.store.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


REPLAY = "python -m tests.sim --logdb --seed {seed} --trace"


def run(seed: int, trace: bool = False, **kw: Any) -> Outcome:
    """One seed; a broken invariant raises AssertionError naming it and its replay."""
    return system.run(seed, trace, sim_class=LogDbSim, replay=REPLAY, **kw)
