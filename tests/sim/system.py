"""Seeded simulation of the whole ziplog system over a simulated network and clock.

Every protocol core runs unchanged, driven the way its real shell drives it:

* storage replicas: :class:`ziplog.replica.ReplicaCore` (what ``ziplog/server.py`` does:
  outbox routing to ROUTER identities / ``TO_PRIMARY`` / ``TO_MMS`` / ``TO_HANDLER``,
  ``replay_epoch``, gap filling with ``missed_before`` + ``on_missed_epochs`` from the
  membership history, disk events written every 5 ms, ticks at ``next_deadline``);
* the membership service: :class:`mms.planner.EpochPlanner` inside a leader loop that
  mimics ``mms/server.py`` (blocks of epochs committed before they are broadcast, a new
  leader honouring the committed block, removed and recovering shards);
* the failure handler: :class:`failure_handler.recovery.RecoveryCore` performed as
  ``failure_handler/server.py`` does (``Send`` over a DEALER per registered replica,
  ``Persist`` as one blocking ZooKeeper write of record + ``recovering`` flag, history
  from ZooKeeper, a new leader ``load()``-ing every shard's durable record);
* clients: :class:`ziplog.client_core.InsertWait` used exactly as ``Client.insert_after``
  and ``Client._insert_on`` use it (redirects keep the (client id, seq), resends after
  ``RETRY_AFTER_S`` / ``RETRY_TROUBLED_S``, troubled shards avoided for ``AVOID_S``);
* subscribers: :class:`ziplog.merge.SubscriberMerge` fed by one replica per shard, like
  ``ziplog.client.Subscription``, re-subscribing from ``resume_point`` when the replica
  it reads from comes back with a new address.

ZooKeeper is a few dicts (committed epoch block, membership history, shard metadata,
recovery records, ephemeral replica registrations that outlive a SIGKILL for a session
timeout). Faults are seeded: SIGKILL of storage replicas (restarting from what their disk
held: the events written every 5 ms, minus a random suffix), of the failure handler
leader and of the MMS leader; a shard added and a shard removed mid-run. At most one
replica of a shard is down at a time, and a second one is killed only once the shard is
whole again (f = 1). Afterwards the faults stop, everything settles, and
:meth:`SystemSim.check` verifies the log.

``run(seed)`` returns an :class:`Outcome`; any broken invariant raises ``AssertionError``
naming the seed and the command that replays it with a trace. A failure whose cause the
simulation recognises as one of the protocol bugs in :data:`KNOWN_BUGS` (found here and
fixed since) raises :class:`KnownBug`, an ``AssertionError`` too, naming the bug: the
classifiers are narrow (the bug's precondition was observed in that run, and the failure
is the one it causes), so anything else fails plainly. Both fail the run unless
``--lenient`` is given.
"""

from __future__ import annotations

import heapq
import random
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from failure_handler.recovery import ACQUIRED, DONE, PROBING, HandlerSettings, Persist, RecoveryCore, Send
from mms.planner import EpochPlanner, PlannerSettings
from ziplog.io import zk as discovery
from ziplog.protocol import frames as wire
from ziplog.cores.client import AVOID_S, NO_COPY, RETRY_AFTER_S, RETRY_TROUBLED_S, InsertWait, Redirect
from ziplog.protocol.membership import history_ranges
from ziplog.protocol.errors import ZiplogError, ZiplogTimeoutError
from ziplog.protocol.gsna import EpochConfig, EpochSchedule, epoch_of
from ziplog.cores.merge import MergeError, SubscriberMerge
from ziplog.cores.replica import EV_STABLE, TO_HANDLER, TO_MMS, TO_PRIMARY, ReplicaCore, ReplicaSettings
from ziplog.protocol.frames import PROTOCOL_VERSION as V
from ziplog.protocol.frames import pack, unpack

MS = 1_000_000
US = 1_000
S = 1_000_000_000
#: ``ziplog.server``: the loop ticks the core at most this often ...
MIN_TICK_NS = 500_000
#: ... and writes buffered disk events this often.
DISK_FLUSH_NS = 5_000_000
#: ``ziplog.client``: credit a subscription grants (and returns after a quarter of it).
SUB_CREDIT_BYTES = 8 << 20
#: ``ziplog.Client`` default timeout of one insert_after.
CLIENT_TIMEOUT_NS = 30 * S
REPLICAS = 2
REPLAY = "python -m tests.sim --system --seed {seed} --trace"


@dataclass
class NetParams:
    min_delay: int = 20 * US
    max_delay: int = 200 * US
    reorder: float = 0.1  # chance a message gets an extra delay of up to 5 x max_delay
    duplicate: float = 0.02  # chance a message is delivered twice
    client_loss: float = 0.01  # client <-> replica
    peer_loss: float = 0.002  # primary <-> backup
    epoch_loss: float = 0.01  # an MMS broadcast missed by one replica
    control_loss: float = 0.0  # failure handler <-> replicas, suspicions, rate reports


@dataclass
class Outcome:
    seed: int = 0
    acked: int = 0
    delivered: int = 0
    records: int = 0
    fast: int = 0
    slow: int = 0
    final_acks: int = 0  # settled by the recovering shard's authority
    redirects: int = 0
    retries: int = 0
    no_shard: int = 0  # insert_after calls that found no live shard (the app tried again)
    no_shard_excluded: int = 0  # ... while some shard was live, but excluded by an earlier redirect of the call
    timeouts: int = 0  # parked-insert TIMEOUTs (the app tried again under a new seq)
    crashes_primary: int = 0
    crashes_backup: int = 0
    crashes_handler: int = 0
    crashes_mms: int = 0
    recoveries: int = 0  # recovery records that reached DONE in ZooKeeper
    acquired: int = 0  # ... that reached ACQUIRED
    suspicions: int = 0  # SUSPECT frames the handler leader received
    blocked: int = 0  # restarted primaries that found a backup ahead of them
    shards_added: int = 0
    shards_removed: int = 0
    resubscribes: int = 0
    epochs: int = 0
    sim_ms: float = 0.0
    events: int = 0
    guesses_dropped: int = 0  # unconfirmed backup guesses forgotten at an epoch switch (bug B1, fixed: 0)
    frozen_hellos: int = 0  # B4 precondition: a primary not frozen took a frozen backup's HELLO
    trace: list[str] = field(default_factory=list)

    COUNTS = ("acked", "delivered", "fast", "slow", "final_acks", "redirects", "retries", "no_shard",
              "no_shard_excluded", "timeouts", "guesses_dropped", "frozen_hellos",
              "crashes_primary", "crashes_backup", "crashes_handler", "crashes_mms", "recoveries", "acquired",
              "suspicions", "blocked", "shards_added", "shards_removed", "resubscribes", "epochs", "events")

    def counts(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.COUNTS}


#: Protocol bugs this simulation found, all fixed; a seed that breaks an invariant the way one
#: of them did raises :class:`KnownBug` naming it. Their reproductions are regression tests in
#: tests/test_system_sim.py, as are B1 (a backup forgot unconfirmed acknowledged guesses at
#: each epoch switch) and B2 (a new shard's primary blocked for good when the backup guessed
#: before its first HELLO arrived). Fixes: B3 installs later epochs' members from the source's
#: membership; B4 frozen replicas send no HELLO; B5 a displaced guess is never guessed again
#: and a shard that left waits one epoch before refusing.
KNOWN_BUGS = {
    "B3": "RecoveryCore._install builds the epochs it installs (up to the epoch of the recovery's end, which the "
          "acquired frontier may push past the last epoch that included the shard) from its own copy of the "
          "membership history; when that copy lags ZooKeeper (a watch not yet seen, e.g. while the handler's "
          "loop was blocked in a ZooKeeper write), history_ranges extends the previous members over a later "
          "membership change, and the replica's correct membership is overwritten with a wrong one: subscribers "
          "then see shards disagree on an epoch's members (MergeError)",
    "B4": "a backup frozen for a recovery (or already INSTALLed) still sends HELLO to its primary (connect_primary "
          "on a topology change, tick's hello retry), and a primary that is not part of that recovery yet (it was "
          "down when the PROBEs went out) takes it (ReplicaCore._on_hello): the backup's installed frontier becomes "
          "its prefix, so the primary marks stable positions where it holds records the recovery replaces with "
          "no-ops; its subscribers deliver them and the INSTALL then truncates them (a delivered record vanishes)",
    "B5": "liveness: a primary's refusal is final (ReplicaCore.refused: NOT_READY while blocked, NOT_MEMBER), but "
          "backups never learn of it, so a backup may guess and ack the same record: when the client's first copy "
          "to it was lost while the primary refused, or when a shard comes back after recovery and the backup "
          "already has the epoch that re-admits it while the primary, still in the epoch that left it out, "
          "refuses NOT_MEMBER (clients see ZooKeeper's membership first; the joining-shard exception of "
          "_check_epoch covers only shards that were never members). Every resend then gets NOT_MEMBER and a "
          "guess: InsertWait neither completes nor redirects (Redirect needs NO_GUESS from every backup), and "
          "the insert hangs until the client's 30 s timeout",
}


class KnownBug(AssertionError):
    """An invariant broken by a known protocol bug (``bug``: a key of :data:`KNOWN_BUGS`)."""

    def __init__(self, bug: str, text: str) -> None:
        super().__init__(f"known bug {bug}: {text}")
        self.bug = bug


class Rep:
    """One storage server process slot (shard, replica): its core while up, its disk always."""

    __slots__ = ("shard", "idx", "settings", "core", "inc", "up", "written", "buf", "disk_at", "last_disk",
                 "tick_at", "last_tick", "pinc", "down_since", "blocked_seen")

    def __init__(self, shard: int, idx: int, settings: ReplicaSettings) -> None:
        self.shard = shard
        self.idx = idx
        self.settings = settings
        self.core: ReplicaCore | None = None
        self.inc = 0
        self.up = False
        self.written: list[tuple[Any, ...]] = []  # events on disk (survive a SIGKILL)
        self.buf: list[tuple[Any, ...]] = []  # events not yet written (lost on SIGKILL)
        self.disk_at: int | None = None
        self.last_disk = -(1 << 62)
        self.tick_at: int | None = None
        self.last_tick = -(1 << 62)
        self.pinc: int | None = None  # the primary incarnation this backup's DEALER talks to
        self.down_since = 0
        self.blocked_seen = False


@dataclass
class Op:
    """One insert_after call in progress (one seq; several shards when redirected)."""

    seq: int
    data: bytes
    after: int
    deadline: int
    excluded: set[int] = field(default_factory=set)
    shard: int = -1
    req: int = 0
    wait: InsertWait | None = None
    targets: tuple[int, ...] = ()
    frame: bytes = b""
    retry_at: int = 0


class SimClient:
    """An application thread with one ``ziplog.Client``: a sequence of InsertAfter calls.
    NoShardAvailable and a parked insert's TIMEOUT make it call insert_after again (a new
    seq); any other error fails the run."""

    def __init__(self, sim: "SystemSim", cid: int, inserts: int) -> None:
        self.sim = sim
        self.cid = cid
        self.route = f"c{cid}".encode()
        sim.routes[self.route] = ("client", cid)
        self.left = inserts
        self.seq = 0
        self.req = 0
        self.avoided: dict[int, int] = {}
        self.op: Op | None = None
        self.after = 0
        self.pending_after: int | None = None  # the rid of the record being inserted
        self.last_gsn = 0
        self.acked: list[tuple[int, int, int, int, bytes]] = []  # (seq, gsn, shard, after, data)
        self.issued: dict[int, bytes] = {}
        self.abandoned: set[int] = set()  # seqs given up before any shard could hold them
        self.ambiguous: set[int] = set()  # seqs given up on a TIMEOUT (may or may not be in the log)
        self.done = inserts == 0

    # -- the application loop ----------------------------------------------------------------
    def next_record(self, now: int) -> None:
        if self.left == 0:
            self.done = True
            return
        rng = self.sim.rng
        pick = rng.random()
        if pick < 0.55:
            after = self.last_gsn
        elif pick < 0.85 and self.sim.acked_gsns:
            after = rng.choice(self.sim.acked_gsns)
        else:
            after = 0
        self.pending_after = after
        self.call(now)

    def call(self, now: int) -> None:
        """``Client.insert_after(data, after)``: a new seq, excluded = {}."""
        assert self.pending_after is not None
        self.seq += 1
        data = f"c{self.cid}s{self.seq}|".encode() * self.sim.rng.randint(1, 3)
        self.issued[self.seq] = data
        self.op = Op(self.seq, data, self.pending_after, now + CLIENT_TIMEOUT_NS)
        self.choose(now)

    def choose(self, now: int) -> None:
        """The loop of ``insert_after``: pick a live shard not excluded, preferring ones not
        avoided; ``_insert_on`` it."""
        op = self.op
        assert op is not None
        sim = self.sim
        live = [s for s in sim.live_shards() if s not in op.excluded]
        if self.avoided:
            healthy = [s for s in live if self.avoided.get(s, 0) <= now]
            if healthy:
                live = healthy
        if not live:
            # NoShardAvailableError: nothing holds this seq (every shard tried said so).
            sim.outcome.no_shard += 1
            if sim.live_shards():
                sim.outcome.no_shard_excluded += 1  # a live shard exists, but this call excluded it earlier
            sim.tr(f"client {self.cid} seq {op.seq}: no live shard (excluded {sorted(op.excluded)})")
            self.abandoned.add(op.seq)
            self.op = None
            sim.at(now + sim.rng.randint(2, 20) * MS, self.call)
            return
        shard = live[sim.rng.randrange(len(live))]
        targets = sim.replica_incs(shard)
        assert targets is not None, "a live shard has every replica registered"
        self.req += 1
        op.shard, op.req, op.targets = shard, self.req, targets
        op.wait = InsertWait(op.req, len(targets))
        op.frame = pack([V, wire.INSERT, op.req, self.cid, op.seq, op.after, op.data])
        sim.tr(f"client {self.cid} seq {op.seq} req {op.req}: insert after {op.after} on shard {shard} {targets}")
        self.send(now)
        op.retry_at = now + int(RETRY_AFTER_S * S)
        sim.at(op.retry_at, self.on_timer, op.req, op.retry_at)

    def send(self, now: int) -> None:
        op = self.op
        assert op is not None
        sim = self.sim
        for i, inc in enumerate(op.targets):
            sim.net(sim.p.client_loss, sim.rep_request, op.shard, i, inc, self.route, op.frame)

    def on_timer(self, now: int, req: int, at: int) -> None:
        op = self.op
        if op is None or op.req != req or op.retry_at != at:
            return
        sim = self.sim
        if now >= op.deadline:
            raise AssertionError(f"client {self.cid} seq {op.seq}: insert not acknowledged within the client timeout")
        # Unanswered: resend the same frame; a replica that restarted has a new address.
        sim.outcome.retries += 1
        self.avoided[op.shard] = now + int(AVOID_S * S)
        new = sim.replica_incs(op.shard)
        if new is not None and new != op.targets:
            op.wait = InsertWait(op.req, len(new))
            op.targets = new
        assert op.wait is not None
        sim.tr(f"client {self.cid} seq {op.seq} req {op.req}: resend to shard {op.shard} {op.targets}"
               f"{' (troubled)' if op.wait.troubled else ''}")
        self.send(now)
        op.retry_at = now + int((RETRY_TROUBLED_S if op.wait.troubled else RETRY_AFTER_S) * S)
        sim.at(op.retry_at, self.on_timer, op.req, op.retry_at)

    def on_reply(self, now: int, shard: int, idx: int, inc: int, frame: bytes) -> None:
        op = self.op
        if op is None or op.shard != shard or op.targets[idx] != inc:
            return  # an answer on a socket we no longer wait on
        assert op.wait is not None
        sim = self.sim
        msg = unpack(frame)
        try:
            settled = op.wait.feed(idx, msg)
        except Redirect:
            sim.outcome.redirects += 1
            sim.tr(f"client {self.cid} seq {op.seq}: redirect away from shard {shard} ({msg[3] if msg[1] == wire.ERROR else msg})")
            op.excluded.add(shard)
            self.avoided[shard] = now + int(AVOID_S * S)
            self.choose(now)
            return
        except ZiplogTimeoutError:
            # A parked insert timed out: the app does not know whether it is in; it
            # inserts the record again under a new seq.
            sim.outcome.timeouts += 1
            sim.tr(f"client {self.cid} seq {op.seq}: TIMEOUT from shard {shard} replica {idx}")
            self.ambiguous.add(op.seq)
            self.op = None
            sim.at(now + sim.rng.randint(1, 5) * MS, self.call)
            return
        except ZiplogError as exc:
            raise AssertionError(f"client {self.cid} seq {op.seq}: unexpected error from shard {shard} replica {idx}: {exc!r}")
        if not settled:
            return
        w = op.wait
        gsn = w.decided
        assert gsn is not None
        assert gsn > op.after, ("InsertAfter returned a gsn not above the rid", self.cid, op.seq, gsn, op.after)
        if w.final:
            sim.outcome.final_acks += 1
        elif w.fast:
            sim.outcome.fast += 1
        else:
            sim.outcome.slow += 1
        sim.tr(f"client {self.cid} seq {op.seq}: acked gsn {gsn} shard {shard} ({'final' if w.final else 'fast' if w.fast else 'slow'})")
        self.acked.append((op.seq, gsn, shard, op.after, op.data))
        sim.acked_gsns.append(gsn)
        self.last_gsn = gsn
        self.op = None
        self.pending_after = None
        self.left -= 1
        sim.at(now + sim.rng.randint(0, sim.think_us) * US, self.next_record)


class SimSub:
    """``ziplog.client.Subscription`` from the start of the log: one connection per shard
    to one replica (a fixed choice per shard), resubscribing from ``resume_point`` when that
    replica's registration changes."""

    SUB_ID = 1

    def __init__(self, sim: "SystemSim", sid: int) -> None:
        self.sim = sim
        self.sid = sid
        self.merge = SubscriberMerge(1)
        self.conns: dict[int, tuple[int, int, bytes, int]] = {}  # shard -> (replica, inc, route, conn no)
        self.pref: dict[int, int] = {}
        self.nconn = 0
        self.consumed: dict[int, int] = {}
        self.delivered: list[tuple[int, int, bytes]] = []

    def connect_known(self, now: int) -> None:
        sim = self.sim
        wanted = set(sim.meta) | self.merge.known_shards()
        for shard in sorted(wanted):
            incs = sim.replica_incs(shard)
            if incs is None:
                continue
            idx = self.pref.get(shard)
            if idx is None:
                # The real Subscription reads replica 0; the second subscriber reads a
                # seeded choice, so backups' streams are checked too.
                idx = self.pref[shard] = 0 if self.sid == 0 else sim.rng.randrange(REPLICAS)
            inc = incs[idx]
            old = self.conns.get(shard)
            if old is not None and old[1] == inc:
                continue
            start = 0 if old is None else self.merge.resume_point(shard)
            if old is not None:
                sim.outcome.resubscribes += 1
            self.nconn += 1
            route = f"s{self.sid}.{self.nconn}".encode()
            sim.routes[route] = ("sub", self.sid, shard, self.nconn)
            self.conns[shard] = (idx, inc, route, self.nconn)
            self.consumed[shard] = 0
            sim.tr(f"sub {self.sid}: subscribe shard {shard} replica {idx} inc {inc} from {start}")
            sim.fifo((route, 0), sim.rep_request, shard, idx, inc, route,
                     pack([V, wire.SUBSCRIBE, self.SUB_ID, start, SUB_CREDIT_BYTES]))

    def on_frame(self, now: int, shard: int, nconn: int, frame: bytes) -> None:
        conn = self.conns.get(shard)
        if conn is None or conn[3] != nconn:
            return  # that socket was closed when we resubscribed
        msg = unpack(frame)
        if msg[1] == wire.ERROR:
            raise AssertionError(f"subscriber {self.sid}: error from shard {shard}: {msg}")
        if msg[1] != wire.SUB_BATCH or msg[2] != self.SUB_ID:
            return
        m = self.merge
        m.on_batch(shard, msg[3], msg[4], msg[5])
        self.credit(shard, wire.SUB_BATCH_COST)
        while (item := m.pop()) is not None:
            self.delivered.append(item)
            self.credit(item[1], len(item[2]))
        if m.known_shards() - set(self.conns):
            self.connect_known(now)

    def credit(self, shard: int, nbytes: int) -> None:
        c = self.consumed.get(shard, 0) + nbytes
        if c >= SUB_CREDIT_BYTES // 4:
            conn = self.conns.get(shard)
            if conn is not None:
                self.sim.fifo((conn[2], 0), self.sim.rep_request, shard, conn[0], conn[1], conn[2],
                              pack([V, wire.CREDIT, self.SUB_ID, c]))
            c = 0
        self.consumed[shard] = c


class SystemSim:
    def __init__(self, seed: int, trace: bool = False, shards: int | None = None, clients: int | None = None,
                 inserts: int | None = None, faults: int | None = None, net: NetParams | None = None,
                 add_shard: bool | None = None, remove_shard: bool | None = None, limit_ms: int = 10_000) -> None:
        self.seed = seed
        self.tracing = trace
        self.rng = rng = random.Random(seed)
        self.now = 0
        self._q: list[tuple[int, int, Callable[..., None], tuple[Any, ...]]] = []
        self._n = 0
        self.limit_ns = limit_ms * MS
        self.outcome = Outcome(seed=seed)
        self.finished = False
        # -- the seed's world ------------------------------------------------------------------
        if net is None:
            net = NetParams(min_delay=rng.choice([5, 20, 50]) * US, max_delay=rng.choice([60, 200, 500]) * US,
                            reorder=rng.choice([0.0, 0.05, 0.2]), duplicate=rng.choice([0.0, 0.01, 0.05]),
                            client_loss=rng.choice([0.0, 0.005, 0.02]), peer_loss=rng.choice([0.0, 0.0, 0.005]),
                            epoch_loss=rng.choice([0.0, 0.01, 0.05]), control_loss=rng.choice([0.0, 0.0, 0.01]))
        self.p = net
        self.epoch_ns = rng.choice([2, 4, 5, 7, 10]) * MS
        self.epochs_per_commit = rng.choice([1, 3, 10])
        suspect = rng.choice([30, 50, 80]) * MS
        self.settings = dict(noop_timeout_ns=rng.choice([500 * US, 1 * MS, 2 * MS]), heartbeat_ns=rng.choice([5, 7, 10]) * MS,
                             suspect_timeout_ns=suspect, park_timeout_ns=2 * S, lag_probe_ns=rng.choice([10, 20]) * MS)
        self.handler_settings = HandlerSettings(retry_ns=rng.choice([5, 10, 20]) * MS, quiet_ns=rng.choice([1, 2]) * suspect)
        self.planner_settings = PlannerSettings(default_rate=rng.choice([500, 2000]))
        self.think_us = rng.choice([500, 3000, 10_000])
        nshards = shards if shards is not None else rng.choice([2, 2, 3])
        nclients = clients if clients is not None else rng.randint(2, 4)
        ninserts = inserts if inserts is not None else rng.randint(4, 12)
        self.fault_end = rng.randint(60, 250) * MS
        # -- ZooKeeper --------------------------------------------------------------------------
        self.zk_epoch: dict[str, Any] | None = None
        self.zk_history: list[list[Any]] = []
        self.meta: dict[int, dict[str, Any]] = {}  # /ziplog/shards/<s>
        self.zk_records: dict[int, dict[str, Any]] = {}  # /ziplog/recovery/<s>
        self.zk_reg: dict[tuple[int, int], int] = {}  # ephemeral registrations: (shard, replica) -> incarnation
        self._topo_pending = False
        # -- processes --------------------------------------------------------------------------
        self.routes: dict[bytes, tuple[Any, ...]] = {}
        self.fifo_last: dict[Any, int] = {}
        self.incs = 0
        self.reps: dict[tuple[int, int], Rep] = {}
        self.configs: dict[int, EpochConfig] = {}
        # -- what the checker and the known-bug classifier watch --------------------------------
        self.acked_gsns: list[int] = []
        #: (client, seq) -> (shard, gsn, when) of guesses a backup forgot at an epoch switch
        #: before the primary's decision arrived (what bug B1 did; for the trace and the counts)
        self.dropped_guesses: dict[tuple[int, int], tuple[int, int, int]] = {}
        #: INSTALLs whose epochs contradict ZooKeeper's history (B3)
        self.bad_installs: list[tuple[Any, ...]] = []
        #: HELLOs from frozen backups that reached a primary not frozen (B4)
        self.frozen_hellos: list[tuple[int, int, int, int]] = []
        for s in range(nshards):
            self.create_shard(s)
        self.mms_alive = False
        self.mms_inc = 0
        self.planner: EpochPlanner | None = None
        self.mms_block: tuple[int, int, EpochConfig] | None = None
        self.mms_next = 0
        self.fh_alive = False
        self.fh_inc = 0
        self.fh: RecoveryCore | None = None
        self.fh_route = b""
        self.fh_busy_until = 0
        self.clients = [SimClient(self, i + 1, ninserts) for i in range(nclients)]
        self.subs = [SimSub(self, i) for i in range(2)]
        # -- the fault plan -------------------------------------------------------------------------
        nfaults = faults if faults is not None else rng.choice([0, 1, 2, 3, 3, 4, 5, 6])
        self.fault_plan: list[tuple[int, str]] = []
        for _ in range(nfaults):
            kind = rng.choices(["replica", "handler", "mms"], weights=[6, 2, 2])[0]
            self.fault_plan.append((rng.randint(5 * MS, self.fault_end), kind))
        if add_shard if add_shard is not None else rng.random() < 0.3:
            self.fault_plan.append((rng.randint(5 * MS, self.fault_end), "add"))
        if remove_shard if remove_shard is not None else rng.random() < 0.25:
            self.fault_plan.append((rng.randint(5 * MS, self.fault_end), "remove"))

    # ==========================================================================================
    # scheduling, network, trace
    def at(self, t: int, fn: Callable[..., None], *args: Any) -> None:
        self._n += 1
        heapq.heappush(self._q, (t, self._n, fn, args))

    def tr(self, text: str) -> None:
        if self.tracing:
            self.outcome.trace.append(f"{self.now / MS:10.3f} {text}")

    def net(self, loss: float, fn: Callable[..., None], *args: Any) -> None:
        """A datagram-like message: seeded delay, maybe reordered, duplicated or lost."""
        p = self.p
        rand = self.rng.random
        if loss and rand() < loss:
            if self.tracing:
                self.tr(f"lost {fn.__name__}{args[:4]}")
            return
        copies = 2 if p.duplicate and rand() < p.duplicate else 1
        lo, span = p.min_delay, p.max_delay - p.min_delay + 1
        for _ in range(copies):
            d = lo + int(rand() * span)
            if p.reorder and rand() < p.reorder:
                d += p.max_delay + int(rand() * (4 * p.max_delay + 1))
            self._n += 1
            heapq.heappush(self._q, (self.now + d, self._n, fn, args))

    def fifo(self, key: Any, fn: Callable[..., None], *args: Any) -> None:
        """One TCP stream (a subscription): in order, no loss, no duplicates."""
        p = self.p
        t = max(self.now + p.min_delay + int(self.rng.random() * (p.max_delay - p.min_delay + 1)), self.fifo_last.get(key, 0) + 1)
        self.fifo_last[key] = t
        self._n += 1
        heapq.heappush(self._q, (t, self._n, fn, args))

    # ==========================================================================================
    # ZooKeeper views (``ziplog.discovery.Topology``)
    def shard_complete(self, shard: int) -> bool:
        n = self.meta.get(shard, {}).get("replicas", 0)
        return n > 0 and all((shard, i) in self.zk_reg for i in range(n))

    def replica_incs(self, shard: int) -> tuple[int, ...] | None:
        n = self.meta.get(shard, {}).get("replicas", 0)
        if n == 0:
            return None
        reg = self.zk_reg
        out = []
        for i in range(n):
            inc = reg.get((shard, i))
            if inc is None:
                return None
            out.append(inc)
        return tuple(out)

    def live_shards(self) -> list[int]:
        members = self.zk_history[-1][1] if self.zk_history else []
        meta = self.meta
        return [s for s in members if not meta[s].get("removed") and meta[s].get("recovering") is None
                and self.shard_complete(s)]

    def topology_changed(self) -> None:
        """ZooKeeper watches fire: servers' ``_refresh_peers``, subscriptions'
        ``_connect_known``, the failure handler's ``_sync_topology``."""
        if not self._topo_pending:
            self._topo_pending = True
            self.at(self.now + self.rng.randint(100, 1000) * US, self._on_topology)

    def _on_topology(self, now: int) -> None:
        self._topo_pending = False
        for r in self.reps.values():
            if r.up and r.idx > 0:
                p = self.zk_reg.get((r.shard, 0))
                if p is not None and p != r.pinc:
                    r.pinc = p
                    assert r.core is not None
                    self.tr(f"rep {r.shard}.{r.idx}: connects to primary inc {p}")
                    r.core.connect_primary(now)
                    self.pump(r)
        for sub in self.subs:
            sub.connect_known(now)
        if self.fh_alive:
            self.fh_sync(now)

    # ==========================================================================================
    # storage replicas (``ziplog.server.StorageServer``)
    def create_shard(self, shard: int) -> None:
        self.meta[shard] = {"replicas": REPLICAS}
        for i in range(REPLICAS):
            r = Rep(shard, i, ReplicaSettings(shard, i, REPLICAS, **self.settings))
            self.reps[(shard, i)] = r
            self.start_rep(r, [])

    def start_rep(self, r: Rep, disk: list[tuple[Any, ...]]) -> None:
        self.incs += 1
        r.inc = self.incs
        r.up = True
        core = ReplicaCore(r.settings)
        core.replay(disk)
        r.core = core
        r.written = disk
        r.buf = []
        r.disk_at = None
        r.last_disk = self.now
        r.tick_at = None
        r.last_tick = -(1 << 62)
        r.pinc = None
        r.blocked_seen = False
        self.zk_reg[(r.shard, r.idx)] = r.inc
        self.topology_changed()
        self.tr(f"rep {r.shard}.{r.idx}: up as inc {r.inc} (replayed {len(disk)} events: frontier {core.frontier} "
                f"records {len(core.gsns)} last epoch {core.last_epoch})")
        if r.idx > 0:
            p = self.zk_reg.get((r.shard, 0))
            if p is not None:
                r.pinc = p
                core.connect_primary(self.now)
        self.pump(r)

    def backup_route(self, r: Rep) -> bytes:
        route = f"b{r.shard}.{r.idx}.{r.inc}.{r.pinc}".encode()
        if route not in self.routes:
            self.routes[route] = ("backup", r.shard, r.idx, r.inc, r.pinc)
        return route

    def pump(self, r: Rep) -> None:
        """The rest of one loop turn after an input: replay a stashed epoch, flush, send,
        buffer disk events, and arrange the next tick."""
        core = r.core
        assert core is not None
        now = self.now
        if core.replay_epoch is not None:
            cfg, core.replay_epoch = core.replay_epoch, None
            self.shell_epoch(r, cfg)
        core.flush(now)
        if core.outbox:
            out, core.outbox = core.outbox, []
            for dest, frame in out:
                self.route_out(r, dest, frame)
        if core.disk:
            r.buf.extend(core.disk)
            core.disk.clear()
            if r.disk_at is None:
                r.disk_at = max(now, r.last_disk + DISK_FLUSH_NS)
                self.at(r.disk_at, self.rep_disk, r.shard, r.idx, r.inc)
        if core.blocked is not None and not r.blocked_seen:
            r.blocked_seen = True
            self.outcome.blocked += 1
            self.tr(f"rep {r.shard}.{r.idx}: BLOCKED: {core.blocked}")
        d = core.next_deadline(now)
        if d is not None:
            t = max(d, r.last_tick + MIN_TICK_NS, now)
            if r.tick_at is None or t < r.tick_at:
                r.tick_at = t
                self.at(t, self.rep_tick, r.shard, r.idx, r.inc, t)

    def route_out(self, r: Rep, dest: Any, frame: bytes) -> None:
        p = self.p
        if type(dest) is bytes:
            info = self.routes[dest]
            kind = info[0]
            if kind == "client":
                self.net(p.client_loss, self.clients[info[1] - 1].on_reply, r.shard, r.idx, r.inc, frame)
            elif kind == "backup":
                self.net(p.peer_loss, self.rep_dealer, info[1], info[2], info[3], info[4], frame)
            elif kind == "sub":
                self.fifo((dest, 1), self.subs[info[1]].on_frame, info[2], info[3], frame)
            elif kind == "fh":
                self.net(p.control_loss, self.fh_reply, info[1], r.shard, r.idx, frame)
            else:
                raise AssertionError(f"unknown route {dest!r}")
        elif dest == TO_PRIMARY:
            if r.pinc is not None:
                self.net(p.peer_loss, self.rep_request, r.shard, 0, r.pinc, self.backup_route(r), frame)
        elif dest == TO_MMS:
            self.net(p.control_loss, self.mms_rate, self.mms_inc, frame)
        elif dest == TO_HANDLER:
            self.net(p.control_loss, self.fh_suspect, self.fh_inc, frame)
        else:
            raise AssertionError(f"unknown destination {dest!r}")

    def _live_rep(self, shard: int, idx: int, inc: int) -> Rep | None:
        r = self.reps.get((shard, idx))
        if r is None or not r.up or r.inc != inc:
            return None  # that process is gone: the frame is lost
        return r

    def rep_request(self, now: int, shard: int, idx: int, inc: int, route: bytes, frame: bytes) -> None:
        """A frame on the replica's ROUTER."""
        r = self._live_rep(shard, idx, inc)
        if r is None:
            return
        core = r.core
        assert core is not None
        msg = wire.decode_request(frame)  # the sim sends only well-formed frames
        if self.tracing:
            self.tr(f"rep {shard}.{idx} <- {route.decode()}: {_show(msg)}")
        if msg[1] == wire.HELLO and not core.frozen:
            info = self.routes.get(route)
            b = self.reps.get((shard, info[2])) if info is not None and info[0] == "backup" else None
            if b is not None and b.up and b.inc == info[3] and b.core is not None and b.core.frozen:  # type: ignore[index]
                # Known bug B4: a backup frozen for recovery introduces itself to a primary
                # that is not (yet) part of that recovery.
                self.frozen_hellos.append((shard, now, b.core.frontier, core.frontier))
                self.outcome.frozen_hellos += 1
                self.tr(f"rep {shard}.{idx}: HELLO from frozen backup {shard}.{b.idx} (its frontier {b.core.frontier}, "
                        f"recovery gen {b.core.recovery_gen}; ours {core.recovery_gen}) (known bug B4)")
        core.on_request(route, msg, now)
        self.pump(r)

    def rep_dealer(self, now: int, shard: int, idx: int, inc: int, pinc: int, frame: bytes) -> None:
        """A frame on a backup's DEALER to its primary."""
        r = self._live_rep(shard, idx, inc)
        if r is None or r.pinc != pinc:
            return
        msg = unpack(frame)
        if self.tracing:
            self.tr(f"rep {shard}.{idx} <- primary: {_show(msg)}")
        if type(msg) is list and len(msg) == 4 and msg[1] == wire.FORWARD:
            assert r.core is not None
            r.core.on_forward(msg, now)
            self.pump(r)

    def rep_epoch(self, now: int, shard: int, idx: int, inc: int, cfg: EpochConfig) -> None:
        r = self._live_rep(shard, idx, inc)
        if r is None:
            return
        core = r.core
        assert core is not None
        spec = core.spec
        held = [(g, q.key) for g, q in spec.by_gsn.items() if g > core.frontier] if spec is not None and r.idx > 0 else None
        self.shell_epoch(r, cfg)
        if held:
            # What bug B1 did: the new Speculation forgot guesses the primary had not confirmed.
            kept = core.spec.by_gsn if core.spec is not None else {}
            for g, key in held:
                if g not in kept and key not in core.dedup:
                    self.dropped_guesses[key] = (shard, g, now)
                    self.outcome.guesses_dropped += 1
                    self.tr(f"rep {shard}.{idx}: epoch {cfg.epoch} drops its guess {key} at gsn {g} (what bug B1 did)")
        self.pump(r)

    def shell_epoch(self, r: Rep, cfg: EpochConfig) -> None:
        """``StorageServer._on_epoch``: fill missed epochs from the membership history."""
        core = r.core
        assert core is not None
        gap = core.missed_before(cfg)
        if gap is not None:
            self.tr(f"rep {r.shard}.{r.idx}: fills epochs {gap[0]}..{gap[1]} from the history")
            for first, last, members in history_ranges(self.zk_history, *gap):
                core.on_missed_epochs(first, last, members, self.now)
        core.on_epoch(cfg, self.now)

    def rep_tick(self, now: int, shard: int, idx: int, inc: int, t: int) -> None:
        r = self._live_rep(shard, idx, inc)
        if r is None or r.tick_at != t:
            return
        r.tick_at = None
        r.last_tick = now
        assert r.core is not None
        r.core.tick(now)
        self.pump(r)

    def rep_disk(self, now: int, shard: int, idx: int, inc: int) -> None:
        r = self._live_rep(shard, idx, inc)
        if r is None:
            return
        r.disk_at = None
        if r.buf:
            core = r.core
            assert core is not None
            r.written.extend(r.buf)
            r.written.append((wire.EV_FRONTIER, core.frontier, core.last_epoch, 0))
            r.written.append((EV_STABLE, core.stable))
            r.buf = []
            r.last_disk = now

    def crash_rep(self, r: Rep) -> None:
        """SIGKILL: memory is gone; the disk keeps what was written, minus a random suffix
        (a torn tail, or what the OS had not written out)."""
        rng = self.rng
        kept = r.written + r.buf
        n = len(kept)
        drop = len(r.buf) if rng.random() < 0.5 else rng.randint(0, len(r.buf) + rng.choice([0, 5, 50]))
        drop = min(drop, n)
        disk = kept[:n - drop]
        core = r.core
        assert core is not None
        self.tr(f"CRASH rep {r.shard}.{r.idx} inc {r.inc} (frontier {core.frontier} stable {core.stable} "
                f"records {len(core.gsns)}; disk keeps {len(disk)} of {n} events)")
        if r.idx == 0:
            self.outcome.crashes_primary += 1
        else:
            self.outcome.crashes_backup += 1
        r.up = False
        r.core = None
        r.down_since = self.now
        inc = r.inc
        self.at(self.now + rng.choice([20, 60, 150]) * MS, self.session_expired, r.shard, r.idx, inc)
        self.at(self.now + rng.randint(10, 120) * MS, self.restart_rep, r.shard, r.idx, disk)

    def session_expired(self, now: int, shard: int, idx: int, inc: int) -> None:
        if self.zk_reg.get((shard, idx)) == inc and not self.reps[(shard, idx)].up:
            del self.zk_reg[(shard, idx)]
            self.tr(f"zk: ephemeral node of rep {shard}.{idx} inc {inc} expired")
            self.topology_changed()

    def restart_rep(self, now: int, shard: int, idx: int, disk: list[tuple[Any, ...]]) -> None:
        self.start_rep(self.reps[(shard, idx)], disk)

    # ==========================================================================================
    # membership service (``mms.server.MembershipReplica._lead_loop``)
    def mms_start(self, now: int) -> None:
        self.mms_inc += 1
        self.mms_alive = True
        planner = EpochPlanner(self.planner_settings, None, [[f, list(m)] for f, m in self.zk_history])
        self.mms_block = None
        self.mms_next = 0
        cur = self.zk_epoch
        if cur:
            last = int(cur["last"])
            inherited = EpochConfig(last, tuple(cur["shards"]), tuple(cur["rates"]))
            planner.committed(inherited, None)
            self.mms_next = last
            self.mms_block = (last, last, inherited)
        self.planner = planner
        self.tr(f"MMS leader {self.mms_inc} starts at epoch {self.mms_next}")
        self.mms_loop(now, self.mms_inc)

    def mms_loop(self, now: int, inc: int) -> None:
        if not self.mms_alive or inc != self.mms_inc:
            return
        self.mms_commit()
        self.mms_broadcast()
        self.at(now + self.epoch_ns, self.mms_loop, inc)

    def mms_commit(self) -> None:
        pl = self.planner
        assert pl is not None
        meta = self.meta
        for s in sorted(meta):
            if meta[s].get("removed"):
                pl.remove(s)
        recovering = [s for s in sorted(meta) if meta[s].get("recovering") is not None]
        ready = [s for s in sorted(meta) if self.shard_complete(s) and not meta[s].get("removed") and s not in recovering]
        cfg, history = pl.plan(ready, recovering)
        changed = history is not None
        ne, block = self.mms_next, self.mms_block
        if block is None or ne > block[1] or (changed and ne > block[0]):
            first = ne
            last = first + self.epochs_per_commit - 1
            cfg = EpochConfig(first, cfg.shards, cfg.rates)
            history = pl.history + [[first, list(cfg.shards)]] if changed else None
            self.zk_epoch = {"epoch": first, "last": last, "shards": list(cfg.shards), "rates": list(cfg.rates)}
            pl.committed(cfg, history)
            self.mms_block = (first, last, cfg)
            if history is not None:
                self.zk_history = history
                self.tr(f"zk: membership from epoch {first}: {list(cfg.shards)}")
                self.topology_changed()

    def mms_broadcast(self) -> None:
        pl, block = self.planner, self.mms_block
        assert pl is not None and block is not None
        e = self.mms_next
        cfg = EpochConfig(e, block[2].shards, block[2].rates)
        old = self.configs.get(e)
        assert old is None or old == cfg, ("two configs broadcast for one epoch", e, old, cfg)
        if old is None:
            self.outcome.epochs += 1
        self.configs[e] = cfg
        if self.tracing:
            self.tr(f"MMS broadcasts epoch {e}: {list(cfg.shards)} {list(cfg.rates)}")
        p, rng = self.p, self.rng
        for r in self.reps.values():
            if r.up:
                if p.epoch_loss and rng.random() < p.epoch_loss:
                    continue
                self.at(self.now + rng.randint(p.min_delay, p.max_delay), self.rep_epoch, r.shard, r.idx, r.inc, cfg)
        pl.last = cfg
        self.mms_next = e + 1

    def mms_rate(self, now: int, inc: int, frame: bytes) -> None:
        if not self.mms_alive or inc != self.mms_inc:
            return  # a report queued for another replica, or while nobody led: dropped
        msg = unpack(frame)
        assert self.planner is not None
        if msg[1] == wire.RATE:
            self.planner.on_rate(int(msg[2]), int(msg[3]), int(msg[4]), int(msg[5]))

    def crash_mms(self) -> None:
        if not self.mms_alive:
            return
        self.outcome.crashes_mms += 1
        if self.rng.random() < 0.3:
            # It died right after committing a block it never broadcast.
            self.mms_commit()
        self.tr(f"CRASH MMS leader {self.mms_inc} (next epoch {self.mms_next}, block {self.mms_block and self.mms_block[:2]})")
        self.mms_alive = False
        self.planner = None
        self.at(self.now + self.rng.randint(5, 40) * MS, self.mms_start)

    # ==========================================================================================
    # failure handler (``failure_handler.server._Leader``)
    def fh_start(self, now: int) -> None:
        self.fh_inc += 1
        self.fh_alive = True
        self.fh = RecoveryCore(self.handler_settings)
        self.fh_route = f"h{self.fh_inc}".encode()
        self.routes[self.fh_route] = ("fh", self.fh_inc)
        self.fh_busy_until = now
        self.tr(f"failure handler leader {self.fh_inc} starts")
        self.fh_sync(now)
        self.at(now + self.handler_settings.retry_ns // 2, self.fh_tick, self.fh_inc)

    def _fh_busy(self, fn: Callable[..., None], *args: Any) -> bool:
        """The real leader performs a Persist with a blocking ZooKeeper write: whatever
        arrives meanwhile waits in its sockets."""
        if self.now < self.fh_busy_until:
            self.at(self.fh_busy_until, fn, *args)
            return True
        return False

    def fh_sync(self, now: int) -> None:
        if not self.fh_alive or self._fh_busy(self.fh_sync_at, self.fh_inc):
            return
        core = self.fh
        assert core is not None
        for shard in sorted(self.meta):
            n = self.meta[shard].get("replicas", 0)
            if shard not in core.replica_counts and n > 0:
                rec = self.zk_records.get(shard)
                core.load(shard, n, discovery.dec(discovery.enc(rec)) if rec else None, now)
        core.on_history(self.zk_history, now)
        self.fh_act(now)

    def fh_sync_at(self, now: int, inc: int) -> None:
        if self.fh_alive and inc == self.fh_inc:
            self.fh_sync(now)

    def fh_tick(self, now: int, inc: int) -> None:
        if not self.fh_alive or inc != self.fh_inc:
            return
        if not self._fh_busy(self.fh_tick, inc):
            assert self.fh is not None
            self.fh.tick(now)
            self.fh_act(now)
            self.at(now + self.handler_settings.retry_ns // 2, self.fh_tick, inc)

    def fh_suspect(self, now: int, inc: int, frame: bytes) -> None:
        if not self.fh_alive or inc != self.fh_inc:
            return  # pushed to replicas that were not leading: dropped when they take over
        if self._fh_busy(self.fh_suspect, inc, frame):
            return
        msg = unpack(frame)
        self.outcome.suspicions += 1
        self.tr(f"handler: shard {msg[2]} replica {msg[3]} suspects: {msg[4]}")
        assert self.fh is not None
        self.fh.on_suspect(int(msg[2]), int(msg[3]), now)
        self.fh_act(now)

    def fh_reply(self, now: int, inc: int, shard: int, idx: int, frame: bytes) -> None:
        if not self.fh_alive or inc != self.fh_inc:
            return  # a reply to a previous leader's socket
        if self._fh_busy(self.fh_reply, inc, shard, idx, frame):
            return
        msg = unpack(frame)
        if self.tracing:
            self.tr(f"handler <- rep {shard}.{idx}: {_show(msg)}")
        assert self.fh is not None
        self.fh.on_reply(shard, idx, msg, now)
        self.fh_act(now)

    def fh_act(self, now: int) -> None:
        core = self.fh
        assert core is not None
        while core.actions:
            acts, core.actions = core.actions, []
            for i, a in enumerate(acts):
                if isinstance(a, Send):
                    inc = self.zk_reg.get((a.shard, a.replica))
                    if inc is not None:  # not registered (down): the core retries
                        msg = unpack(a.frame)
                        if self.tracing:
                            self.tr(f"handler -> rep {a.shard}.{a.replica}: {_show(msg)}")
                        if msg[1] == wire.INSTALL:
                            self.check_install(a.shard, a.replica, msg[6])
                        self.net(self.p.control_loss, self.rep_request, a.shard, a.replica, inc, self.fh_route, a.frame)
                else:
                    assert isinstance(a, Persist)
                    d = self.rng.randint(200, 2000) * US
                    self.fh_busy_until = now + d
                    self.at(now + d, self.fh_persisted, self.fh_inc, a, acts[i + 1:])
                    return

    def check_install(self, shard: int, replica: int, events: list[Any]) -> None:
        """Known bug B3: an INSTALL naming members of an epoch that ZooKeeper's history
        contradicts (the handler's copy of the history lagged)."""
        for ev in events:
            if ev[0] == wire.EV_EPOCH:
                _, first, last, members = ev
                for f, la, m in history_ranges(self.zk_history, first, last):
                    if list(m) != list(members):
                        self.bad_installs.append((shard, replica, f, la, list(members), list(m), self.now))
                        self.tr(f"handler: INSTALL to rep {shard}.{replica} says epochs {f}..{la} had members "
                                f"{list(members)}, ZooKeeper says {list(m)} (known bug B3)")
                        return

    def fh_persisted(self, now: int, inc: int, a: Persist, rest: list[Any]) -> None:
        if not self.fh_alive or inc != self.fh_inc:
            # The leader died while its transaction was in flight: it may or may not commit.
            if self.rng.random() < 0.5:
                self.zk_write_record(a)
            return
        self.zk_write_record(a)
        core = self.fh
        assert core is not None
        core.on_persisted(a.shard, int(a.record["gen"]), now)
        core.actions = rest + core.actions
        self.fh_busy_until = now
        self.fh_act(now)

    def zk_write_record(self, a: Persist) -> None:
        self.zk_records[a.shard] = discovery.dec(discovery.enc(a.record))
        meta = self.meta[a.shard]
        if a.recovering:
            meta["recovering"] = a.record["gen"]
        else:
            meta.pop("recovering", None)
        phase = a.record["phase"]
        if phase == DONE:
            self.outcome.recoveries += 1
        elif phase == ACQUIRED:
            self.outcome.acquired += 1
        self.tr(f"zk: recovery record of shard {a.shard}: gen {a.record['gen']} {phase}"
                f"{' source ' + str(a.record.get('source')) + ' stable ' + str(a.record.get('stable')) + ' frontier ' + str(a.record.get('frontier')) + ' records ' + str(len(a.record.get('records', []))) + ' guesses ' + str(len(a.record.get('guesses', []))) if phase == ACQUIRED else ''}"
                f" recovering={a.recovering}")
        self.topology_changed()

    def crash_handler(self) -> None:
        if not self.fh_alive:
            return
        self.outcome.crashes_handler += 1
        self.tr(f"CRASH failure handler leader {self.fh_inc} (active: {sorted(self.fh.active) if self.fh else []})")
        self.fh_alive = False
        self.fh = None
        self.at(self.now + self.rng.randint(5, 40) * MS, self.fh_start)

    # ==========================================================================================
    # faults
    def shard_whole(self, shard: int) -> bool:
        """Both replicas up, each holding everything it acknowledged, no recovery under
        way or pending: a replica of this shard may fail (f = 1)."""
        if self.meta[shard].get("recovering") is not None:
            return False
        rec = self.zk_records.get(shard)
        if rec is not None and rec["phase"] in (PROBING, ACQUIRED):
            return False
        if self.fh_alive and self.fh is not None and shard in self.fh.active:
            return False
        for i in range(REPLICAS):
            r = self.reps[(shard, i)]
            core = r.core
            if not r.up or core is None or not core.qualified or core.frozen or core.blocked is not None:
                return False
            if core.is_primary and core.awaiting_backups:
                return False
        return True

    def fault(self, now: int, kind: str) -> None:
        rng = self.rng
        if kind == "replica":
            cands = [r for r in self.reps.values() if self.shard_whole(r.shard)]
            if cands:
                self.crash_rep(cands[rng.randrange(len(cands))])
        elif kind == "handler":
            self.crash_handler()
        elif kind == "mms":
            self.crash_mms()
        elif kind == "add":
            shard = max(self.meta) + 1
            self.outcome.shards_added += 1
            self.tr(f"ADD shard {shard}")
            self.create_shard(shard)
        elif kind == "remove":
            keep = [s for s in sorted(self.meta) if not self.meta[s].get("removed")]
            if len(keep) >= 2:
                shard = keep[rng.randrange(len(keep))]
                self.outcome.shards_removed += 1
                self.tr(f"REMOVE shard {shard}")
                self.meta[shard]["removed"] = True
                self.topology_changed()

    # ==========================================================================================
    # run
    def settled(self) -> str | None:
        """None once everything is at rest and every subscriber has caught up; else why not."""
        if self.now < self.fault_end:
            return "faults still scheduled"
        for c in self.clients:
            if not c.done:
                op = c.op
                return f"client {c.cid} not done ({c.left} left; op {op and (op.seq, op.shard, op.targets, op.wait and (op.wait.decided, op.wait.latest, op.wait.refused, op.wait.frozen))})"
        if not self.mms_alive or not self.fh_alive:
            return "MMS or failure handler leader down"
        for (s, i), r in self.reps.items():
            if not r.up:
                return f"rep {s}.{i} down"
            core = r.core
            assert core is not None
            if core.frozen or core.blocked is not None or (core.is_primary and core.awaiting_backups):
                return f"rep {s}.{i} frozen={core.frozen} blocked={core.blocked} awaiting={core.awaiting_backups}"
        for s, m in self.meta.items():
            if m.get("recovering") is not None:
                return f"shard {s} recovering"
        assert self.fh is not None
        if self.fh.active:
            return f"recovery active for shards {sorted(self.fh.active)}"
        total = 0
        for s in self.meta:
            P, B = self.reps[(s, 0)].core, self.reps[(s, 1)].core
            assert P is not None and B is not None
            if P.gsns != B.gsns:
                return f"shard {s}: replicas hold different positions ({len(P.gsns)} vs {len(B.gsns)} records)"
            if P.gsns and (P.stable < P.gsns[-1] or B.stable < B.gsns[-1]):
                return f"shard {s}: records not yet stable (last {P.gsns[-1]}, stable {P.stable}/{B.stable})"
            total += len(P.gsns)
        for sub in self.subs:
            if len(sub.delivered) < total:
                return f"subscriber {sub.sid} delivered {len(sub.delivered)} of {total}"
        return None

    def settle_check(self, now: int) -> None:
        if self.settled() is None:
            self.finished = True
        else:
            self.at(now + 5 * MS, self.settle_check)

    def run(self) -> Outcome:
        try:
            return self._run()
        except KnownBug:
            raise
        except AssertionError as exc:
            if self.bad_installs and ("members" in str(exc) or isinstance(exc, MergeError)):
                shard, replica, f, la, wrong, right, t = self.bad_installs[0]
                raise KnownBug("B3", f"{exc} -- after the failure handler's INSTALL to rep {shard}.{replica} at "
                                     f"{t / MS:.3f} ms said epochs {f}..{la} had members {wrong}, ZooKeeper says {right}") from exc
            if self.frozen_hellos and any(w in str(exc) for w in ("delivered", "lost or moved", "disagree", "different")):
                shard, t, bf, pf = self.frozen_hellos[0]
                raise KnownBug("B4", f"{exc} -- after shard {shard}'s primary (frontier {pf}) took a HELLO from its "
                                     f"frozen backup (frontier {bf}) at {t / MS:.3f} ms") from exc
            raise

    def _run(self) -> Outcome:
        self.at(0, self.mms_start)
        self.at(0, self.fh_start)
        for c in self.clients:
            self.at(self.rng.randint(1, 5) * MS, c.next_record)
        for t, kind in self.fault_plan:
            self.at(t, self.fault, kind)
        self.at(self.fault_end, self.settle_check)
        for sub in self.subs:
            sub.connect_known(0)
        q = self._q
        pop = heapq.heappop
        n = 0
        limit = self.limit_ns
        while q:
            t, _, fn, args = pop(q)
            if t > limit:
                for c in self.clients:
                    op = c.op
                    w = op.wait if op is not None else None
                    p = self.reps[(op.shard, 0)].core if op is not None else None
                    if (op is not None and w is not None and w.refused and p is not None and (c.cid, op.seq) in p.refused
                            and any(g is not None and g != NO_COPY for g in w.latest[1:])):
                        raise KnownBug("B5", f"client {c.cid} seq {op.seq} stuck on shard {op.shard}: its primary refused "
                                             f"the record for good, a backup keeps answering a guess ({w.latest}); "
                                             f"not settled: {self.settled()}")
                raise AssertionError(f"did not settle within {limit // MS} ms of simulated time: {self.settled()}")
            self.now = t
            fn(t, *args)
            n += 1
            if self.finished:
                break
        self.outcome.events = n
        self.outcome.sim_ms = self.now / MS
        self.check()
        return self.outcome

    # ==========================================================================================
    # invariants
    def check(self) -> None:
        out = self.outcome
        why = self.settled()
        assert why is None, f"not settled: {why}"
        log: dict[int, tuple[int, int, int, bytes]] = {}  # gsn -> (shard, client, seq, data)
        keys: dict[tuple[int, int], int] = {}
        history = self.zk_history
        for s in sorted(self.meta):
            P, B = self.reps[(s, 0)].core, self.reps[(s, 1)].core
            assert P is not None and B is not None
            assert P.gsns == B.gsns, (f"shard {s}: replicas hold different positions", P.gsns, B.gsns)
            for core in (P, B):
                # one membership per epoch everywhere: the replica's history is ZooKeeper's
                for first, last, members in core.membership:
                    for f2, l2, m2 in history_ranges(history, first, last):
                        assert tuple(m2) == tuple(members), (f"rep {s}.{core.s.replica}: epochs {f2}..{l2} had members "
                                                              f"{list(members)}, the history says {list(m2)}")
            for g in P.gsns:
                a, b = P.records[g], B.records[g]
                assert (a.client_id, a.seq, a.data) == (b.client_id, b.seq, b.data), (f"shard {s}: replicas disagree at gsn {g}")
                cfg = self.configs.get(epoch_of(g))
                assert cfg is not None, (f"shard {s}: record at gsn {g} in epoch {epoch_of(g)}, which was never broadcast")
                assert s in cfg.shards, (f"shard {s}: record at gsn {g} in epoch {epoch_of(g)} without being a member", cfg)
                sched = EpochSchedule(cfg)
                k = sched.first_slot_after(s, g - 1)
                assert sched.gsn(s, k) == g, (f"shard {s}: gsn {g} is not one of its slots in epoch {epoch_of(g)}")
                assert g not in log, (f"gsn {g} held by shards {log[g][0]} and {s}")
                key = (a.client_id, a.seq)
                assert key not in keys, (f"record {key} stored twice: gsn {keys[key]} and gsn {g}")
                keys[key] = g
                log[g] = (s, a.client_id, a.seq, a.data)
        by_cid = {c.cid: c for c in self.clients}
        for g, (s, cid, seq, data) in log.items():
            c = by_cid.get(cid)
            assert c is not None and c.issued.get(seq) == data, (f"gsn {g}: record {cid}/{seq} was never issued with that data")
            assert seq not in c.abandoned, (f"gsn {g}: record {cid}/{seq} is in the log, but every shard said it held no copy")
        acked = 0
        for c in self.clients:
            assert c.done and c.left == 0, f"client {c.cid} did not finish"
            for seq, gsn, shard, after, data in c.acked:
                got = log.get(gsn)
                dropped = self.dropped_guesses.get((c.cid, seq))
                assert got == (shard, c.cid, seq, data), (f"acknowledged record {c.cid}/{seq} (gsn {gsn} shard {shard}) "
                                                           f"lost or moved: the log holds {got and got[:3]} there"
                                                           f"{'' if (c.cid, seq) not in keys else f', the record sits at gsn {keys[(c.cid, seq)]}'}"
                                                           f"{'' if dropped is None else f'; backup {dropped[0]}.1 forgot its guess of it at gsn {dropped[1]} when an epoch arrived at {dropped[2] / MS:.3f} ms'}")
                assert gsn > after, ("InsertAfter order broken", c.cid, seq, gsn, after)
                acked += 1
        want = [(g, log[g][0], log[g][3]) for g in sorted(log)]
        for sub in self.subs:
            seen = sub.delivered
            gs = [g for g, _, _ in seen]
            assert all(x < y for x, y in zip(gs, gs[1:])), f"subscriber {sub.sid}: gsns not increasing"
            if seen != want:
                for i, (x, y) in enumerate(zip(seen, want)):
                    if x != y:
                        raise AssertionError(f"subscriber {sub.sid} delivered {x[:2]} at position {i}, the log holds {y[:2]}")
                raise AssertionError(f"subscriber {sub.sid} delivered {len(seen)} records, the log holds {len(want)}")
        out.acked = acked
        out.records = len(log)
        out.delivered = len(self.subs[0].delivered)


def _show(msg: Any) -> str:
    """A frame for the trace, with long payloads cut."""
    text = repr(msg)
    return text if len(text) <= 300 else text[:300] + "..."


def run(seed: int, trace: bool = False, **kw: Any) -> Outcome:
    """One seed. Raises AssertionError naming the seed and the replay command on any
    broken invariant (also on an exception inside a protocol core)."""
    sim = SystemSim(seed, trace=trace, **kw)
    try:
        return sim.run()
    except KnownBug as exc:
        known = KnownBug(exc.bug, f"seed {seed}: {str(exc).split(': ', 1)[1]}\n  replay: {REPLAY.format(seed=seed)}")
        known.sim = sim  # type: ignore[attr-defined]
        raise known from exc
    except Exception as exc:
        # A broken invariant, or an exception inside a protocol core: name the seed, where
        # it was raised, and how to replay it.
        where = traceback.extract_tb(exc.__traceback__)[-1]
        what = str(exc) if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {exc}"
        err = AssertionError(f"seed {seed}: {what} [at {where.filename.rsplit('/', 1)[-1]}:{where.lineno}, "
                             f"{sim.now / MS:.3f} ms]\n  replay: {REPLAY.format(seed=seed)}")
        err.sim = sim  # type: ignore[attr-defined]
        raise err from exc
