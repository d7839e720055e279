"""Seeded simulation of the whole ziplog system: the production drivers on simulated
ports (``tests/sim/world.py``).

Every process is the real driver over its real core: storage replicas
(:class:`ziplog.server.storage.StorageDriver`), membership service replicas
(:class:`mms.server.MembershipDriver`), failure handler replicas
(:class:`failure_handler.server.FailureHandlerDriver`), and clients and subscribers
(:class:`ziplog.client.driver.ClientDriver`). What is simulated is only what they run on:
the network (seeded delays, reordering, duplication and loss), the clock, the disks and
ZooKeeper (versioned nodes, sessions that expire a while after their process dies,
elections, watches that reach each process after a delay).

Each seed draws its world: shards of 2 or 3 replicas (f = 1 or 2), 2 or 3 replicas of
the membership service and of the failure handler, an fsync policy, a segment size, loss
rates per kind of connection. Storage replicas write with the production segment log
(``ziplog.io.segments``) on simulated files (``tests/sim/files.py``) that keep, at a
power loss, only what POSIX promises: what was synced, and a seeded part of the rest.

Faults are seeded: storage replicas killed (SIGKILL: the files keep what was written) or
their machine losing power (the files keep what was synced and a seeded part of the
rest), also two replicas of a three-replica shard at once, and power lost right after a
graceful stop; restarts at the same address (a server with a fixed ``--port``: what its
peers queued meanwhile may reach the new incarnation) or at a new one; PROBEs to a
primary held back while later epochs reach it; the failure handler leader and the MMS
leader killed (another replica takes over once the dead one's session expires; the dead
one comes back as a follower); a shard added and a shard removed mid-run. A replica of a
shard fails only while fewer than f of its replicas are failed (down, restarting, not yet
in step, frozen); afterwards the faults stop, everything settles, and
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

import random
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from failure_handler.recovery import ACQUIRED, DONE, PROBING, HandlerSettings
from failure_handler.server import FailureHandlerDriver
from mms.planner import PlannerSettings
from mms.server import MembershipDriver
from ziplog.client.driver import ClientDriver, SubscriptionDriver
from ziplog.cores.client.calls import InsertCall
from ziplog.cores.client.state import ClientState
from ziplog.cores.client.waits import NO_COPY
from ziplog.cores.merge import MergeError
from ziplog.cores.replica import ReplicaCore, ReplicaSettings
from ziplog.protocol import frames as wire
from ziplog.protocol import layout
from ziplog.protocol.errors import (
    DiskFullError,
    LogFullError,
    NoShardAvailableError,
    ZiplogError,
    ZiplogTimeoutError,
)
from ziplog.protocol.events import EpochEvent, FrontierEvent, RecordEvent, RecordRefEvent
from ziplog.protocol.gsna import EpochConfig, EpochSchedule, epoch_of
from ziplog.protocol.membership import history_ranges
from ziplog.protocol.types import RID_GENESIS, Policy
from ziplog.io.segments import SegmentLog
from ziplog.server.storage import StorageDriver

from .files import SimFiles
from .world import (
    CLUSTER_KEY,
    MS,
    US,
    NetParams,
    Session,
    SimElection,
    SimHandlerCoordination,
    SimMembershipCoordination,
    SimProcess,
    SimStorageCoordination,
    SimTopology,
    World,
    ZooKeeper,
)

__all__ = ["KNOWN_BUGS", "KnownBug", "NetParams", "Outcome", "SystemSim", "run"]

#: ``ziplog.Client`` default timeout of one insert_after.
CLIENT_TIMEOUT_NS = 30_000_000_000
REPLAY = "python -m tests.sim --system --seed {seed} --trace"
#: A seed that needs more events than this is looping, not settling.
MAX_EVENTS = 2_000_000


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
    timeouts: int = 0  # inserts every shard refused on a parked-insert TIMEOUT (the app tried again)
    crashes_primary: int = 0
    crashes_backup: int = 0
    crashes_handler: int = 0
    crashes_mms: int = 0
    recoveries: int = 0  # recovery records that reached DONE in ZooKeeper
    acquired: int = 0  # ... that reached ACQUIRED
    suspicions: int = 0  # SUSPECT frames a handler leader took
    rate_reports: int = 0  # rate reports MMS leaders took (per change, to the leader EPOCH names)
    epochs_same: int = 0  # EPOCH_SAME broadcasts (an epoch named "as epoch b" of its block)
    block_reads: int = 0  # epoch block reads by replicas that missed an EPOCH_SAME's base
    #: inserts a primary placed past slots the clock passed, and its expiries of slots
    #: while no insert came (shards scheduled busy; live cores at the end)
    passed_by_clock: int = 0
    expired_by_clock: int = 0
    blocked: int = 0  # restarted primaries that found a backup ahead of them
    shards_added: int = 0
    shards_removed: int = 0
    resubscribes: int = 0
    epochs: int = 0
    sim_ms: float = 0.0
    events: int = 0
    guesses_dropped: int = 0  # unconfirmed backup guesses forgotten at an epoch switch (bug B1, fixed: 0)
    frozen_hellos: int = 0  # B4 precondition: a primary not frozen took a frozen backup's HELLO
    disks_filled: int = 0  # shards whose replicas' disks both filled (and later had space again)
    disk_refusals: int = 0  # appends a full disk refused (the batch stayed buffered)
    disk_full_errors: int = 0  # inserts every shard tried refused with DISK_FULL (the app tried again)
    logs_filled: int = 0  # shards whose replicas were both held at their bound of records in memory, for a while
    log_full_errors: int = 0  # inserts every shard tried refused with LOG_FULL (the app tried again)
    forward_parts: int = 0  # catch-up FORWARDs that were one part of several (no frontier at their end)
    install_parts: int = 0  # INSTALLs that were one part of several (ending at their last record)
    notices: int = 0  # NOTICEs a primary received from another shard's primary
    killed_after_notice: int = 0  # primaries killed after a notice moved them, before they forwarded it
    stops: int = 0  # replicas stopped gracefully (SIGTERM) and started again
    clean_restarts: int = 0  # primaries that restarted on a clean-close marker matching their disk
    # -- the world's draws and the widened fault model ---------------------------------------------
    replicas3: int = 0  # seeds whose shards have three replicas (f = 2)
    control3: int = 0  # seeds with three MMS and three failure handler replicas
    fsync_never: int = 0  # seeds per fsync policy
    fsync_interval: int = 0
    fsync_always: int = 0
    power_losses: int = 0  # crashes that took the machine's power (what was not synced may be gone)
    power_lost_bytes: int = 0  # written but not synced bytes such crashes could take
    stop_power_losses: int = 0  # power lost right after a graceful stop
    double_crashes: int = 0  # two replicas of a three-replica shard crashed at once
    same_address_restarts: int = 0  # replicas that came back at the address they had
    requeued: int = 0  # frames a DEALER held while its peer was down and sent to the next incarnation
    probes_held: int = 0  # PROBEs to a primary held back while later epochs reached it
    starting_hellos: int = 0  # (A's window) a STARTING primary of a 3-replica shard took one HELLO, then blocked
    installed_power_losses: int = 0  # (B's window) power lost by a replica installed by a recovery (resumed or not)
    frozen_restarts: int = 0  # replicas that came back frozen for a recovery that had not resumed them
    cuts: int = 0  # replicas cut from their peers (alive, serving clients) past the suspicion timeout
    references: int = 0  # records FORWARDs named by reference (forward by reference)
    reference_misses: int = 0  # FORWARDs a live backup could not resolve at the end (a catch-up brought the data)
    # -- fencing: stale messages across restarts and freezes, stalled leaders --------------------
    links_held: int = 0  # backups' HELLOs and PREFIXes kept a while in their DEALERs' queues
    forwards_held: int = 0  # FORWARDs held back on a backup's link
    inserts_held: int = 0  # clients' INSERTs to a backup kept a while in their DEALERs' queues
    killed_on_hello: int = 0  # primaries killed as a backup's HELLO left (the HELLO kept past the restart)
    stalls: int = 0  # storage processes stopped whole (SIGSTOP), and leaders' loops stalled
    deposed: int = 0  # leaders deposed while their loop stalled
    stale_links: int = 0  # HELLOs, PREFIXes and FORWARDs a live replica refused as meant for another incarnation
    stale_leader_writes: int = 0  # ZooKeeper writes refused because their leader's lock was gone
    trace: list[str] = field(default_factory=list)
    #: what a simulation on top of the log counts (``tests/sim/logdb_system.py``)
    logdb: dict[str, int] = field(default_factory=dict)

    COUNTS = ("acked", "delivered", "fast", "slow", "final_acks", "redirects", "retries", "no_shard",
              "no_shard_excluded", "timeouts", "guesses_dropped", "frozen_hellos",
              "crashes_primary", "crashes_backup", "crashes_handler", "crashes_mms", "recoveries", "acquired",
              "suspicions", "blocked", "shards_added", "shards_removed", "resubscribes", "epochs", "events",
              "disks_filled", "disk_refusals", "disk_full_errors", "forward_parts", "install_parts", "notices",
              "killed_after_notice", "stops", "clean_restarts", "replicas3", "control3", "fsync_never",
              "fsync_interval", "fsync_always", "power_losses", "power_lost_bytes", "stop_power_losses",
              "double_crashes", "same_address_restarts", "requeued", "probes_held", "starting_hellos",
              "installed_power_losses", "frozen_restarts", "cuts", "references", "reference_misses", "rate_reports",
              "epochs_same", "block_reads", "passed_by_clock", "expired_by_clock", "logs_filled", "log_full_errors",
              "links_held", "forwards_held", "inserts_held", "killed_on_hello", "stalls", "deposed", "stale_links",
              "stale_leader_writes")

    def counts(self) -> dict[str, int]:
        return {**{k: getattr(self, k) for k in self.COUNTS}, **self.logdb}


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


# ==============================================================================================
# processes
class Rep:
    """One storage server slot (shard, replica): its process while up, its machine's
    files always."""

    def __init__(self, shard: int, idx: int, settings: ReplicaSettings) -> None:
        self.shard = shard
        self.idx = idx
        self.settings = settings
        self.files = SimFiles()
        self.dir = f"/data/shard{shard}-replica{idx}"
        self.disk: SegmentLog | None = None
        self.proc: SimProcess | None = None
        self.driver: StorageDriver | None = None
        self.session: Session | None = None
        self.inc = 0
        self.blocked_seen = False
        #: a graceful stop, or a kill, was decided and waits for the end of this replica's
        #: next turn (later still if it is stalled): its shard is no longer whole (no other
        #: fault may take its peer meanwhile)
        self.stopping = False
        #: a STARTING primary took one backup's HELLO (A's window, while it lasts)
        self.took_hello_starting = False
        #: its next start is at the address it had (a primary killed as a HELLO left)
        self.same_address = False

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.alive

    @property
    def core(self) -> ReplicaCore | None:
        return self.driver.core if self.driver is not None and self.up else None


class Control:
    """One control-plane replica slot (MMS or failure handler)."""

    def __init__(self, kind: str, rid: int) -> None:
        self.kind = kind
        self.rid = rid
        self.proc: SimProcess | None = None
        self.driver: Any = None
        self.session: Session | None = None
        self.inc = 0

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.alive


class App:
    """An application thread with one client: a sequence of InsertAfter calls. NoShardAvailable
    and a parked insert's TIMEOUT make it call insert_after again (a new seq); any other
    error fails the run."""

    def __init__(self, sim: "SystemSim", cid: int, inserts: int) -> None:
        self.sim = sim
        self.cid = cid
        self.proc = SimProcess(sim.world, f"client{cid}")
        self.topology = SimTopology(sim.zk, self.proc)
        self.state = ClientState(cid, Policy.random(), random.Random(sim.rng.getrandbits(64)), CLIENT_TIMEOUT_NS)
        self.driver = ClientDriver(self.proc, self.proc, self.topology, self.state)
        self.topology.on_change(lambda: self.proc.call_soon_threadsafe(self.driver.on_topology))
        self.left = inserts
        self.calls = 0
        self.call: InsertCall | None = None
        self.after = 0
        self.last_gsn = 0
        self.acked: list[tuple[int, int, int, int, bytes]] = []  # (seq, gsn, shard, after, data)
        self.issued: dict[int, bytes] = {}
        self.abandoned: set[int] = set()  # seqs given up before any shard could hold them
        self.done = inserts == 0

    def next_record(self) -> None:
        if self.left == 0:
            self.done = True
            return
        rng = self.sim.rng
        pick = rng.random()
        if pick < 0.55:
            self.after = self.last_gsn
        elif pick < 0.85 and self.sim.acked_gsns:
            self.after = rng.choice(self.sim.acked_gsns)
        else:
            self.after = 0
        self.insert()

    def insert(self) -> None:
        """``Client.insert_after(data, after)``: a new call, a new seq."""
        sim = self.sim
        self.calls += 1
        data = f"c{self.cid}n{self.calls}|".encode() * sim.rng.randint(1, 3)
        call = InsertCall(self.state, data, self.after, None, sim.world.now + CLIENT_TIMEOUT_NS)
        self.issued[call.seq] = data
        self.call = call
        sim.tr(f"client {self.cid} seq {call.seq}: insert after {self.after}")
        self.driver.start(call, lambda: self.finished(call))

    def finished(self, call: InsertCall) -> None:
        sim = self.sim
        out = sim.outcome
        now = sim.world.now
        self.call = None
        for seq in call.given_up:  # ids the call gave up and went on under a new one: nowhere
            self.issued[seq] = call.data
            self.abandoned.add(seq)
        self.issued[call.seq] = call.data
        try:
            rid = call.result()
        except NoShardAvailableError:
            # nothing holds this seq: every shard tried said so, or none was live
            out.no_shard += 1
            if self.topology.live_shards():
                out.no_shard_excluded += 1  # a live shard exists, but this call excluded it earlier
            sim.tr(f"client {self.cid} seq {call.seq}: no live shard (excluded {sorted(call.excluded)})")
            self.abandoned.add(call.seq)
            self.proc.call_at(now + sim.rng.randint(2, 20) * MS, self.insert)
            return
        except (DiskFullError, LogFullError) as exc:
            # Every shard it tried could not write its disk, or held its bound of records
            # in memory, and held no copy: it is nowhere. The app inserts the record again
            # under a new seq.
            if isinstance(exc, DiskFullError):
                out.disk_full_errors += 1
            else:
                out.log_full_errors += 1
            sim.tr(f"client {self.cid} seq {call.seq}: {type(exc).__name__} from shard {call.shard}")
            self.abandoned.add(call.seq)
            self.proc.call_at(now + sim.rng.randint(2, 20) * MS, self.insert)
            return
        except ZiplogTimeoutError:
            if now >= call.deadline_ns:
                raise AssertionError(f"client {self.cid} seq {call.seq}: insert not acknowledged within the client "
                                     f"timeout") from None
            # Every shard it tried refused it for good (a parked insert timed out) and held
            # no copy: it is nowhere. The app inserts the record again under a new seq.
            out.timeouts += 1
            sim.tr(f"client {self.cid} seq {call.seq}: TIMEOUT from shard {call.shard}")
            self.abandoned.add(call.seq)
            self.proc.call_at(now + sim.rng.randint(1, 5) * MS, self.insert)
            return
        except ZiplogError as exc:
            raise AssertionError(f"client {self.cid} seq {call.seq}: unexpected error from shard {call.shard}: {exc!r}")
        w = call.wait
        assert w is not None
        if w.final:
            out.final_acks += 1
        elif w.fast:
            out.fast += 1
        else:
            out.slow += 1
        sim.tr(f"client {self.cid} seq {call.seq}: acked gsn {rid.gsn} shard {rid.shard} "
               f"({'final' if w.final else 'fast' if w.fast else 'slow'})")
        self.acked.append((call.seq, rid.gsn, rid.shard, call.after, call.data))
        sim.acked_gsns.append(rid.gsn)
        self.last_gsn = rid.gsn
        self.left -= 1
        self.proc.call_at(now + sim.rng.randint(0, sim.think_us) * US, self.next_record)


class Reader:
    """A subscriber from the start of the log. Reader 0 reads every shard's replica 0, as
    ``ziplog.Client.subscribe`` does; reader 1 a seeded replica per shard, so backups'
    streams are checked too."""

    def __init__(self, sim: "SystemSim", sid: int) -> None:
        self.sim = sim
        self.sid = sid
        self.proc = SimProcess(sim.world, f"reader{sid}")
        self.topology = SimTopology(sim.zk, self.proc)
        state = ClientState(1000 + sid, None, random.Random(sim.rng.getrandbits(64)), CLIENT_TIMEOUT_NS)
        self.driver = ClientDriver(self.proc, self.proc, self.topology, state)
        self.topology.on_change(lambda: self.proc.call_soon_threadsafe(self.driver.on_topology))
        self.pref: dict[int, int] = {}
        self.delivered: list[tuple[int, int, bytes]] = []
        self.sub: SubscriptionDriver | None = None

    def start(self) -> None:
        self.sub = self.driver.subscribe(RID_GENESIS, self.pick)
        self.sub.on_change = self.drain

    def pick(self, shard: int, n: int) -> int:
        if self.sid == 0:
            return 0
        if shard not in self.pref:
            self.pref[shard] = self.sim.rng.randrange(n)
        return self.pref[shard]

    def drain(self) -> None:
        sub = self.sub
        assert sub is not None
        sub.core.raise_error()
        while (rec := sub.pop()) is not None:
            self.delivered.append((rec.rid.gsn, rec.rid.shard, rec.data))


# ==============================================================================================
class SystemSim:
    def __init__(self, seed: int, trace: bool = False, shards: int | None = None, clients: int | None = None,
                 inserts: int | None = None, faults: int | None = None, net: NetParams | None = None,
                 add_shard: bool | None = None, remove_shard: bool | None = None, limit_ms: int = 10_000,
                 stops: int | None = None, stop_guards_peer: bool = True) -> None:
        self.seed = seed
        #: a graceful stop under way keeps other faults off its peer (False: a crash may
        #: take the peer while the stop waits for its turn, as an operator restarting a
        #: replica of a shard whose other replica just failed would)
        self.stop_guards_peer = stop_guards_peer
        rng = random.Random(seed)
        if net is None:
            net = NetParams(min_delay=rng.choice([5, 20, 50]) * US, max_delay=rng.choice([60, 200, 500]) * US,
                            reorder=rng.choice([0.0, 0.05, 0.2]), duplicate=rng.choice([0.0, 0.01, 0.05]),
                            client_loss=rng.choice([0.0, 0.005, 0.02]), peer_loss=rng.choice([0.0, 0.0, 0.005]),
                            epoch_loss=rng.choice([0.0, 0.01, 0.05]), control_loss=rng.choice([0.0, 0.0, 0.01]))
        # The widened world, drawn apart so that the draws before it stay as they were.
        widen = random.Random(seed * 7919 + 3)
        self.widen = widen
        self.replicas = widen.choice([2, 3])
        self.control_replicas = widen.choice([2, 3])
        self.fsync = widen.choice(["never", "interval", "always"])
        self.fsync_interval = widen.choice([0.001, 0.005, 0.02])
        self.segment_bytes = widen.choice([2 << 10, 16 << 10, 64 << 20])
        #: chance a crash takes the machine's power, and a stop is followed by a power loss
        self.power_loss = widen.choice([0.0, 0.5, 0.5, 1.0])
        #: chance a replica restarts at the address it had
        self.same_address = widen.choice([0.0, 0.5, 1.0])
        #: chance a PROBE to a primary is held back for a while (while later epochs reach it)
        self.hold_probes = widen.choice([0.0, 0.3, 1.0])
        #: chance a replica loses power a moment after an INSTALL, or a RESUME, reached it
        #: (B's window: installed and answered, resumed, what the install wrote not synced
        #: but for the answer's sake)
        self.power_after_install = widen.choice([0.0, 0.0, 0.3, 0.6])
        if net.notice_loss == NetParams.notice_loss:
            net.notice_loss = widen.choice([0.0, 0.02, 0.1])
        self.world = World(rng.getrandbits(64), net, trace)
        self.world.requeue_unbound = widen.choice([0.0, 0.5]) if self.same_address else 0.0
        self.world.holds.append(self._hold)
        #: (shard, generation) of every PROBE to a primary the hold-back considered
        self.held_probes: set[tuple[int, int]] = set()
        self.rng = rng
        self.limit_ns = limit_ms * MS
        self.outcome = Outcome(seed=seed)
        self.finished = False
        # -- the seed's world ------------------------------------------------------------------
        self.epoch_ns = rng.choice([2, 4, 5, 7, 10]) * MS
        self.epochs_per_commit = rng.choice([1, 3, 10])
        suspect = rng.choice([30, 50, 80]) * MS
        self.settings: dict[str, Any] = dict(noop_timeout_ns=rng.choice([500 * US, 1 * MS, 2 * MS]), heartbeat_ns=rng.choice([5, 7, 10]) * MS,
                             suspect_timeout_ns=suspect, park_timeout_ns=2_000_000_000,
                             lag_probe_ns=rng.choice([10, 20]) * MS)
        # Batch bounds, drawn apart so that the draws above (and every older seed's world)
        # stay as they were: a third of the seeds forward and install in parts of a few
        # records (catch-ups and roll-forwards in many parts).
        knobs = random.Random(seed * 7919 + 1)
        self.settings["forward_batch_bytes"] = knobs.choice([4 << 20, 4 << 20, 200])
        # Half the seeds pass slots only on notices and at the epoch's close (the default);
        # the others also by time, as before notices existed.
        self.settings["noop_timeout_ns"] = knobs.choice([0, self.settings["noop_timeout_ns"]])
        self.handler_settings = HandlerSettings(retry_ns=rng.choice([5, 10, 20]) * MS, quiet_ns=rng.choice([1, 2]) * suspect,
                                                install_bytes=knobs.choice([1 << 20, 1 << 20, 100]))
        self.settings["notice_interval_ns"] = knobs.choice([0, 1 * MS, 5 * MS])
        # Forward by reference, drawn apart again: off in half the seeds; on, every record
        # (or those of 16 bytes and more) goes by reference, and in some seeds a backup
        # keeps so few bytes of inserts that references miss and catch-ups carry the data.
        refs = random.Random(seed * 104729 + 3)
        self.settings["forward_by_reference"] = refs.random() < 0.5
        self.settings["reference_min_bytes"] = refs.choice([0, 16])
        self.settings["max_reference_bytes"] = refs.choice([64 << 20, 64 << 20, 100])
        # Where a turn takes an epoch among its inserts, drawn apart again: at the stamp
        # the membership service sent it with (the default, in three seeds of four) or at
        # its arrival; and the service's clock off the replicas' and clients' by up to
        # 3 ms either way (its stamps then sort a broadcast before or after every insert
        # of the turn that reads it, and two leaders' stamps may run backwards).
        order = random.Random(seed * 15485863 + 5)
        self.settings["epoch_stamp_sent"] = order.random() < 0.75
        self.mms_wall_offset_ns = order.choice([0, 0, 3 * MS, -3 * MS])
        # Which shards pass their slots by the clock (each insert's stamp, and expiry
        # while none comes) instead of NOTICEs: those scheduled at the shipped 2,500/s
        # (none at the planner's default rates here), every shard (400: the default
        # rates are 500 and 2,000), some, or none (0: NOTICEs alone, as before).
        self.settings["clock_pass_rate"] = order.choice([2500, 400, 1500, 0])
        self.planner_settings = PlannerSettings(default_rate=rng.choice([500, 2000]))
        self.think_us = rng.choice([500, 3000, 10_000])
        nshards = shards if shards is not None else rng.choice([2, 2, 3])
        nclients = clients if clients is not None else rng.randint(2, 4)
        ninserts = inserts if inserts is not None else rng.randint(4, 12)
        self.fault_end = rng.randint(60, 250) * MS
        self.zk = ZooKeeper(self.world)
        self.zk.watchers.append(self._zk_write)
        self.world.taps.append(self._tap)
        # -- processes --------------------------------------------------------------------------
        self.reps: dict[tuple[int, int], Rep] = {}
        self.by_proc: dict[SimProcess, Rep] = {}
        self.mms = [Control("mms", i) for i in range(self.control_replicas)]
        self.fh = [Control("fh", i) for i in range(self.control_replicas)]
        self.fh_drivers: list[FailureHandlerDriver] = []
        self.mms_drivers: list[MembershipDriver] = []
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
        self.initial_shards = nshards
        #: client ids of writers a simulation on top of the log runs (their records are its to check)
        self.other_writers: set[int] = set()
        self.clients = [App(self, i + 1, ninserts) for i in range(nclients)]
        self.readers = [Reader(self, i) for i in range(2)]
        # -- the fault plan -------------------------------------------------------------------------
        nfaults = faults if faults is not None else rng.choice([0, 1, 2, 3, 3, 4, 5, 6])
        #: kills timed by the protocol itself (a primary right after a notice moved it)
        self.faults_left = 1 if nfaults else 0
        #: power losses timed by an INSTALL's arrival
        self.faults_left_install = 2
        self.fault_plan: list[tuple[int, str]] = []
        for _ in range(nfaults):
            kind = rng.choices(["replica", "handler", "mms", "disk"], weights=[6, 2, 2, 2])[0]
            if kind == "replica" and self.replicas == 3 and widen.random() < 0.3:
                kind = "replica2"  # two replicas of one shard at once
            elif kind == "replica" and widen.random() < 0.25:
                kind = "cut"  # alive, but cut from its peers
            self.fault_plan.append((rng.randint(5 * MS, self.fault_end), kind))
        # its own stream, so that every other draw of a seed stays what it was
        memory = random.Random(seed * 104729 + 11)
        if nfaults and memory.random() < 0.2:
            self.fault_plan.append((memory.randint(5 * MS, self.fault_end), "memory"))
        self.memory_rng = memory
        #: each replica start's incarnation (its own stream: the other draws stay as they were)
        self.incarnations = random.Random(seed * 104729 + 17)
        if add_shard if add_shard is not None else rng.random() < 0.3:
            self.fault_plan.append((rng.randint(5 * MS, self.fault_end), "add"))
        if remove_shard if remove_shard is not None else rng.random() < 0.25:
            self.fault_plan.append((rng.randint(5 * MS, self.fault_end), "remove"))
        # Graceful stops (a rolling restart's SIGTERM), drawn apart so that a seed without
        # any keeps the world it had before they existed.
        self.stopper = random.Random(seed * 7919 + 2)
        nstops = stops if stops is not None else self.stopper.choice([0, 0, 1, 2])
        for _ in range(nstops):
            self.fault_plan.append((self.stopper.randint(5 * MS, self.fault_end), "stop"))
        #: also stop some primaries while they are blocked (one must not vouch for a log
        #: it knows lacks records a backup holds)
        self.stop_blocked = nstops > 0
        # Fencing draws, from their own stream (every other draw of a seed stays what it
        # was): a backup's HELLO or PREFIX kept in its DEALER's queue a while (it reaches
        # whoever is bound at the primary's address by then: a next incarnation), a FORWARD
        # held back on a backup's link (past a freeze, an install, a resume), a client's
        # INSERT to a backup kept past its primary's restart, a primary killed as a backup's
        # HELLO leaves (the HELLO kept until after the restart, at the same address), and
        # stalls: a storage process stopped whole a while (SIGSTOP), the membership
        # service's or the failure handler's leader's loop stalled while the next in line
        # deposes it (it resumes, runs what was due, and learns it lost at its next beat).
        # Only in a seed with faults (a held FORWARD is a silence the backup suspects).
        fence = random.Random(seed * 104729 + 19)
        self.fence_rng = fence
        faulty = 1 if nfaults else 0
        self.hold_links = faulty * fence.choice([0.0, 0.0, 0.05, 0.3])
        self.hold_forwards = faulty * fence.choice([0.0, 0.0, 0.05, 0.3])
        self.hold_inserts = faulty * fence.choice([0.0, 0.0, 0.03, 0.2])
        self.kills_on_hello = faulty * fence.choice([0, 0, 1, 2])
        for _ in range(faulty * fence.choice([0, 0, 1, 2, 3])):
            self.fault_plan.append((fence.randint(5 * MS, self.fault_end), fence.choice(["stall", "stall_mms", "stall_fh"])))
        if self.hold_links or self.hold_inserts or self.kills_on_hello:
            self.world.queue_holds.append(self._queue_hold)
        if self.hold_forwards:
            self.world.dealer_holds.append(self._forward_hold)
        out = self.outcome
        out.replicas3 = int(self.replicas == 3)
        out.control3 = int(self.control_replicas == 3)
        setattr(out, f"fsync_{self.fsync}", 1)

    @property
    def now(self) -> int:
        return self.world.now

    def tr(self, text: str) -> None:
        self.world.tr(text)

    def at(self, t: int, fn: Callable[..., None], *args: Any) -> None:
        self.world.at(t, fn, *args)

    # ==========================================================================================
    # storage replicas
    def create_shard(self, shard: int) -> None:
        for i in range(self.replicas):
            r = Rep(shard, i, ReplicaSettings(shard, i, self.replicas, **self.settings))
            self.reps[(shard, i)] = r
            self.start_rep(r)

    def shard_reps(self, shard: int) -> list[Rep]:
        return [self.reps[(shard, i)] for i in range(self.replicas)]

    def start_rep(self, r: Rep) -> None:
        r.inc += 1
        r.stopping = False  # a stop decided for the last incarnation died with it
        r.took_hello_starting = False
        name = f"rep{r.shard}.{r.idx}#{r.inc}"
        same = r.inc > 1 and (self.widen.random() < self.same_address or r.same_address)
        r.same_address = False
        if same:
            self.outcome.same_address_restarts += 1
        proc = SimProcess(self.world, name, host=f"rep{r.shard}.{r.idx}" if same or r.inc == 1 else None)
        r.session = self.zk.session(name)
        coord = SimStorageCoordination(self.zk, proc, r.session)
        r.proc = proc
        r.blocked_seen = False
        # A process opens its data directory afresh, as ziplog.server does.
        r.disk = SegmentLog(r.dir, fsync=self.fsync, fsync_interval=self.fsync_interval,
                            segment_bytes=self.segment_bytes, files=r.files, clock=lambda: self.world.now / 1e9,
                            background=False)
        r.driver = StorageDriver(r.settings, proc, proc, coord, r.disk, CLUSTER_KEY,
                                 incarnation=self.incarnations.getrandbits(63) + 1)
        self._watch_epochs(r, r.driver)
        self.by_proc[proc] = r
        proc.at_turn_end(lambda: self._rep_turn(r))
        core = r.driver.core
        if core.restarted_clean:
            self.outcome.clean_restarts += 1
        if core.frozen:
            self.outcome.frozen_restarts += 1
        self.tr(f"rep {r.shard}.{r.idx}: up as {name} at {r.driver.addr} (clean: {core.restarted_clean}; frozen: "
                f"{core.frozen}; replayed frontier {core.frontier} records {len(core.log.gsns)} last epoch "
                f"{core.last_epoch})")
        proc.run(r.driver.start)

    def _watch_epochs(self, r: Rep, driver: StorageDriver) -> None:
        """One configuration per epoch at every subscriber: what each storage replica
        takes for an epoch (a broadcast in full, one named "as epoch b", or read from
        ZooKeeper's block) is the configuration first broadcast for it, and ZooKeeper's
        history names its members."""
        take = driver.epochs.take

        def checked(frame: bytes) -> Any:
            got = take(frame)
            if got is not None:
                cfg = got[0]
                first = self.configs.get(cfg.epoch)
                assert first is None or first == cfg, (f"rep {r.shard}.{r.idx} took epoch {cfg.epoch} as {cfg}, "
                                                       f"broadcast first as {first}")
                for f, la, m in history_ranges(self.zk.history, cfg.epoch, cfg.epoch):
                    assert tuple(m) == tuple(cfg.shards), (f"rep {r.shard}.{r.idx} took epoch {cfg.epoch} with members "
                                                           f"{cfg.shards}, ZooKeeper's history says {m}")
            return got
        driver.epochs.take = checked  # type: ignore[method-assign]

    def _rep_turn(self, r: Rep) -> None:
        core = r.core
        if core is not None and core.blocked is not None and not r.blocked_seen:
            r.blocked_seen = True
            self.outcome.blocked += 1
            if r.took_hello_starting:
                self.outcome.starting_hellos += 1
            self.tr(f"rep {r.shard}.{r.idx}: BLOCKED: {core.blocked}")
            if self.stop_blocked and self.stopper.random() < 0.5:
                self.at(self.now + self.stopper.randint(0, 5) * MS, self._stop_if_up, r, r.proc)

    def crash_rep(self, r: Rep, power: bool | None = None, same_address: bool = False) -> None:
        """SIGKILL (memory is gone; the files keep what was written), or the machine's
        power lost (the files keep what was synced, and a seeded part of the rest); it
        starts again at the address it had when ``same_address`` (else as drawn)."""
        rng = self.rng
        core = r.core
        assert core is not None and r.proc is not None
        if power is None:
            power = self.widen.random() < self.power_loss
        unsynced = r.files.unsynced_bytes()
        self.tr(f"CRASH rep {r.shard}.{r.idx} (frontier {core.frontier} stable {core.stable} "
                f"records {len(core.log.gsns)}; {'POWER LOST: ' if power else ''}{unsynced} bytes written, not synced)")
        if r.idx == 0:
            self.outcome.crashes_primary += 1
        else:
            self.outcome.crashes_backup += 1
        if power:
            self.outcome.power_losses += 1
            self.outcome.power_lost_bytes += unsynced
            if core.recovery.installed_gen >= 0:
                self.outcome.installed_power_losses += 1
        r.proc.kill()
        if power:
            r.files.power_loss(self.widen)
        session = r.session
        self.at(self.now + rng.choice([20, 60, 150]) * MS, self.expire, session)
        r.same_address = same_address
        self.at(self.now + rng.randint(10, 120) * MS, self.start_rep, r)

    def stop_rep(self, r: Rep) -> None:
        """SIGTERM: the driver writes everything it holds (a primary that may vouches for
        it with the clean-close marker), the process ends and its ZooKeeper session closes
        at once; it starts again a while later on the same disk."""
        driver, proc, session = r.driver, r.proc, r.session
        assert driver is not None and proc is not None and session is not None
        self.outcome.stops += 1
        driver.stop_requested()
        driver.close()
        marker = r.files.size(f"{r.dir}/clean-close") is not None
        self.tr(f"STOP rep {r.shard}.{r.idx} (frontier {driver.core.frontier}; clean-close marker: {marker})")
        proc.kill()
        if self.widen.random() < self.power_loss / 2:
            # the machine loses power right after the stop: what the stop synced stays
            self.outcome.stop_power_losses += 1
            r.files.power_loss(self.widen)
        self.zk.expire(session)
        self.at(self.now + self.rng.randint(10, 120) * MS, self.start_rep, r)

    def _power_off_if_up(self, r: Rep, proc: SimProcess) -> None:
        if r.proc is proc and r.up and self.may_fail(r.shard):
            self.crash_rep(r, power=True)

    def _stop_if_up(self, r: Rep, proc: SimProcess) -> None:
        if r.proc is proc and r.up:
            self.stop_rep(r)

    def expire(self, session: Session) -> None:
        self.tr(f"zk: session {session.name} expired")
        self.zk.expire(session)

    # ==========================================================================================
    # the control plane
    def start_control(self, c: Control) -> None:
        c.inc += 1
        name = f"{c.kind}{c.rid}#{c.inc}"
        proc = SimProcess(self.world, name)
        c.session = self.zk.session(name)
        election = SimElection(self.zk, proc, c.session)
        if c.kind == "mms":
            mcoord = SimMembershipCoordination(self.zk, proc, c.session)
            c.driver = MembershipDriver(proc, proc, mcoord, election, c.rid, CLUSTER_KEY, self.epoch_ns, self.planner_settings,
                                        self.epochs_per_commit, wall_offset_ns=self.mms_wall_offset_ns * (1 + c.rid % 2))
            self.mms_drivers.append(c.driver)
        else:
            hcoord = SimHandlerCoordination(self.zk, proc, c.session)
            c.driver = FailureHandlerDriver(proc, proc, hcoord, election, c.rid, CLUSTER_KEY, self.handler_settings)
            self.fh_drivers.append(c.driver)
        c.proc = proc
        self.tr(f"{c.kind} replica {c.rid} starts as {name}")
        proc.run(c.driver.start)

    def leader(self, kind: str) -> Control | None:
        path = layout.MMS_ELECTION if kind == "mms" else layout.fh_election_path(0)
        e = self.zk.leaders.get(path)
        if e is None:
            return None
        for c in (self.mms if kind == "mms" else self.fh):
            if c.proc is e.proc and c.up and c.driver.leading:
                return c
        return None

    def stall_leader(self, kind: str) -> None:
        """The leader's loop stalls (its ZooKeeper session and view live on); the next in
        line deposes it during the stall (its beats stopped), and it learns that only at
        its next beat after it resumes: meanwhile it runs the timers that came due."""
        c = self.leader(kind)
        if c is None:
            return
        assert c.proc is not None
        rng = self.fence_rng
        length = rng.randint(20, 500) * MS
        until = self.now + length
        self.outcome.stalls += 1
        self.tr(f"STALL {kind} leader {c.proc.name}'s loop until {until / MS:.3f} ms")
        c.proc.stall(until, threads=False)
        path = layout.MMS_ELECTION if kind == "mms" else layout.fh_election_path(0)
        self.at(self.now + int(length * rng.uniform(0.2, 0.9)), self._depose, path, c.driver.election)

    def _depose(self, path: str, election: SimElection) -> None:
        if self.zk.leaders.get(path) is election and len(self.zk.elections.get(path, [])) > 1:
            self.outcome.deposed += 1
            self.tr(f"zk: the next in line deposes {election.proc.name} (silent beat)")
            self.zk.depose(path)

    def _queue_hold(self, dealer: Any, frame: bytes) -> int:
        """How long a frame waits in its DEALER's queue (see the fencing draws)."""
        rng = self.fence_rng
        r = self.by_proc.get(dealer.proc)
        if r is not None and dealer.label == "primary" and (r.shard, self.replicas - 1) in self.reps:
            # (a backup's link to its primary, once its shard is created whole)
            try:
                msg = wire.open_signed(CLUSTER_KEY, frame, wire.decode_member_request)
            except wire.ProtocolError:
                return 0
            if type(msg) is wire.Hello and self.kills_on_hello > 0 and self.now < self.fault_end:
                p = self.reps[(r.shard, 0)]
                if p.up and p.core is not None and self.may_fail(r.shard) and rng.random() < 0.3:
                    self.kills_on_hello -= 1
                    self.outcome.killed_on_hello += 1
                    self.tr(f"KILL rep {r.shard}.0 while rep {r.shard}.{r.idx}'s HELLO is on its way; the HELLO waits "
                            f"in the DEALER's queue past the restart")
                    self.crash_rep(p, same_address=True)
                    return rng.randint(130, 300) * MS  # the restart takes 10-120 ms
            # (a link held past the suspicion timeout is a partition: only where the shard
            # tolerates one more failure, as every fault of the plan)
            if (type(msg) in (wire.Hello, wire.Prefix) and self.hold_links and rng.random() < self.hold_links
                    and self.now < self.fault_end and self.may_fail(r.shard)):
                self.outcome.links_held += 1
                return rng.randint(5, 250) * MS
            return 0
        if dealer.label == "replica" and self.hold_inserts:  # a client's link to a replica
            target = self.world.bound.get(dealer.addr)
            rep = self.by_proc.get(target.proc) if target is not None else None
            if rep is not None and rep.idx > 0 and rng.random() < self.hold_inserts:
                try:
                    msg = wire.decode_request(frame)
                except wire.ProtocolError:
                    return 0
                if type(msg) is wire.Insert:
                    self.outcome.inserts_held += 1
                    return rng.randint(5, 250) * MS
        return 0

    def _forward_hold(self, dealer: Any, frame: bytes) -> int:
        """How long a FORWARD to a backup is held back on its link (where the shard
        tolerates one more failure: a silence past the suspicion timeout is a partition)."""
        r = self.by_proc.get(dealer.proc)
        if dealer.label != "primary" or r is None or (r.shard, self.replicas - 1) not in self.reps:
            return 0
        rng = self.fence_rng
        if rng.random() >= self.hold_forwards or self.now >= self.fault_end or not self.may_fail(r.shard):
            return 0
        self.outcome.forwards_held += 1
        return rng.randint(5, 250) * MS

    def crash_control(self, kind: str) -> None:
        c = self.leader(kind)
        if c is None:
            return
        assert c.proc is not None and c.session is not None
        if kind == "mms":
            self.outcome.crashes_mms += 1
        else:
            self.outcome.crashes_handler += 1
        self.tr(f"CRASH {kind} leader {c.proc.name}")
        c.proc.kill()
        session = c.session
        self.at(self.now + self.rng.randint(5, 40) * MS, self.expire, session)
        self.at(self.now + self.rng.randint(5, 60) * MS, self.start_control, c)

    # ==========================================================================================
    # what the world shows
    def _zk_write(self, what: str, data: Any) -> None:
        if what == "recovery record":
            shard, record = data
            phase = record["phase"]
            if phase == DONE:
                self.outcome.recoveries += 1
            elif phase == ACQUIRED:
                self.outcome.acquired += 1
            self.tr(f"zk: recovery record of shard {shard}: gen {record['gen']} {phase}")
        elif what == "membership":
            self.tr(f"zk: membership from epoch {data[0]}: {data[1]}")
        elif self.world.tracing:
            self.tr(f"zk: {what}")

    def _tap(self, kind: str, endpoint: Any, frame: bytes, route: bytes | None) -> Callable[[], None] | None:
        if kind == "publish":
            msg = wire.decode_epoch(frame)
            if type(msg) is wire.EpochSame:
                # the base is an epoch broadcast in full, of the same block: its config
                self.outcome.epochs_same += 1
                assert msg.base in self.configs, ("EPOCH_SAME names an epoch never broadcast", msg)
                cfg = self.configs[msg.base].at(msg.epoch)
            else:
                cfg = EpochConfig(msg.epoch, tuple(msg.shards), tuple(msg.rates))
            old = self.configs.get(cfg.epoch)
            assert old is None or old == cfg, ("two configs broadcast for one epoch", cfg.epoch, old, cfg)
            if old is None:
                self.outcome.epochs += 1
                self.configs[cfg.epoch] = cfg
            return None
        r = self.by_proc.get(endpoint.proc)
        if r is None:
            return None
        if kind == "epoch" and r.idx > 0:
            return self._watch_guesses(r, frame)
        if kind == "router":
            self._watch_request(r, frame, route)
            return None
        if kind == "dealer" and r.idx > 0 and getattr(endpoint, "label", "") == "primary":
            try:
                fwd = wire.decode_from_primary(frame)
            except wire.ProtocolError:
                return None
            if isinstance(fwd, wire.Forward) and fwd.body.events and not isinstance(fwd.body.events[-1], FrontierEvent):
                self.outcome.forward_parts += 1
            if isinstance(fwd, wire.Forward):
                self.outcome.references += sum(type(ev) is RecordRefEvent for ev in fwd.body.events)
        return None

    def _hold(self, endpoint: Any, frame: bytes, route: bytes) -> int:
        """B's window: a recovery's first PROBE to a primary held back a while (its other
        replicas are frozen, installed, maybe resumed meanwhile, and later epochs reach it
        first); the handler's resends go as usual."""
        if not self.hold_probes:
            return 0
        r = self.by_proc.get(endpoint.proc)
        if r is None or r.idx != 0:
            return 0
        try:
            msg = wire.open_signed(CLUSTER_KEY, frame, wire.decode_member_request)
        except wire.ProtocolError:
            return 0
        if type(msg) is not wire.Probe or (r.shard, msg.gen) in self.held_probes:
            return 0
        self.held_probes.add((r.shard, msg.gen))  # the first of a generation only: its resends go
        if self.widen.random() >= self.hold_probes:
            return 0
        self.outcome.probes_held += 1
        delay = self.widen.randint(5, 60) * MS
        self.tr(f"HOLD a PROBE to rep {r.shard}.0 for {delay / MS:.0f} ms")
        return delay

    def _watch_guesses(self, r: Rep, frame: bytes) -> Callable[[], None] | None:
        """What bug B1 did: a new epoch's speculation forgot guesses the primary had not
        confirmed."""
        core = r.core
        spec = getattr(core.role, "spec", None) if core is not None else None
        if core is None or spec is None:
            return None
        held = [(g, q.key) for g, q in spec.by_gsn.items() if g > core.frontier]
        if not held:
            return None

        def after() -> None:
            kept = core.role.spec.by_gsn if core.role.spec is not None else {}  # type: ignore[union-attr]
            for g, key in held:
                if g not in kept and key not in core.log.dedup:
                    self.dropped_guesses[key] = (r.shard, g, self.now)
                    self.outcome.guesses_dropped += 1
                    self.tr(f"rep {r.shard}.{r.idx}: an epoch drops its guess {key} at gsn {g} (what bug B1 did)")
        return after

    def _watch_request(self, r: Rep, frame: bytes, route: bytes | None) -> None:
        try:
            msg = wire.decode_request(frame)
            if isinstance(msg, wire.Signed):
                msg = wire.open_envelope(CLUSTER_KEY, msg, wire.decode_member_request)
        except wire.ProtocolError:
            return None
        core = r.core
        if self.world.tracing:
            self.tr(f"rep {r.shard}.{r.idx} <- {_show(msg)}")
        if isinstance(msg, wire.Notice):
            self.outcome.notices += 1
            if (self.faults_left > 0 and core is not None and core.role.deciding and r.proc is not None
                    and self.rng.random() < 0.01 and self.shard_whole(r.shard)):
                # killed once the notice made it pass slots, before it forwarded or wrote them
                self.faults_left -= 1
                self.outcome.killed_after_notice += 1
                r.stopping = True  # its turn may wait out a stall: its peer is spared till then
                r.proc.doomed = lambda: self.crash_rep(r)
        if (isinstance(msg, (wire.Install, wire.Resume)) and self.power_after_install and self.faults_left_install > 0
                and self.now < self.fault_end and self.widen.random() < self.power_after_install
                and self.may_fail(r.shard)):
            self.faults_left_install -= 1
            self.at(self.now + self.widen.randint(0, 5_000) * US, self._power_off_if_up, r, r.proc)
        if isinstance(msg, wire.Install):
            self._check_install(r, msg)
            records = [ev for ev in msg.events if isinstance(ev, RecordEvent)]
            if records and records[-1].gsn == msg.end:
                self.outcome.install_parts += 1
        elif isinstance(msg, wire.Hello) and core is not None and not core.frozen and route is not None:
            if self.replicas > 2 and core.is_primary and core.status().get("state") == "starting":
                r.took_hello_starting = True
            d = self.world.routes.get(route)
            b = self.by_proc.get(d.proc) if d is not None else None
            bcore = b.core if b is not None else None
            if bcore is not None and bcore.frozen:
                # Known bug B4: a backup frozen for recovery introduces itself to a primary
                # that is not (yet) part of that recovery.
                self.frozen_hellos.append((r.shard, self.now, bcore.frontier, core.frontier))
                self.outcome.frozen_hellos += 1
                self.tr(f"rep {r.shard}.0: HELLO from frozen backup (known bug B4)")
        return None

    def _check_install(self, r: Rep, msg: wire.Install) -> None:
        """Known bug B3: an INSTALL naming members of an epoch that ZooKeeper's history
        contradicts (the handler's copy of the history lagged)."""
        for ev in msg.events:
            if isinstance(ev, EpochEvent):
                for f, la, m in history_ranges(self.zk.history, ev.first, ev.last):
                    if ev.members is not None and list(m) != list(ev.members):
                        self.bad_installs.append((r.shard, r.idx, f, la, list(ev.members), list(m), self.now))
                        return

    # ==========================================================================================
    # faults
    def failed_replicas(self, shard: int) -> int:
        """Replicas of ``shard`` that count as failed: down, stopping, or not (yet)
        holding every record any replica acknowledged (a restarted backup not in step
        again, a primary not serving or blocked). A replica frozen by a recovery, or cut
        from its peers, is not failed for that: it holds what it held (a false suspicion
        starts a recovery too)."""
        failed = 0
        for r in self.shard_reps(shard):
            core = r.core
            if (r.stopping or core is None or not core.qualified or core.blocked is not None
                    or (core.is_primary and not core.role.deciding)):
                failed += 1
        return failed

    def shard_whole(self, shard: int) -> bool:
        """No replica of this shard is failed, and no recovery is under way or pending."""
        if (self.zk.meta.get(shard, {}).get("recovering") is not None
                or (self.zk.records.get(shard) or {}).get("phase") in (PROBING, ACQUIRED)):
            return False
        lead = self.leader("fh")
        if lead is not None and lead.driver.core is not None and shard in lead.driver.core.active:
            return False
        return self.failed_replicas(shard) == 0

    def may_fail(self, shard: int, more: int = 1) -> bool:
        """``more`` replicas of ``shard`` may fail now: the shard tolerates f = replicas - 1."""
        return self.failed_replicas(shard) + more <= self.replicas - 1

    def fault(self, kind: str) -> None:
        rng = self.rng
        if kind == "replica":
            cands = [r for r in self.reps.values() if r.up and self.may_fail(r.shard)]
            if cands:
                self.crash_rep(cands[rng.randrange(len(cands))])
        elif kind == "cut":
            cands = [r for r in self.reps.values() if r.up and self.may_fail(r.shard)]
            if cands:
                r = cands[rng.randrange(len(cands))]
                assert r.proc is not None
                until = self.now + self.widen.randint(2, 4) * r.settings.suspect_timeout_ns
                self.outcome.cuts += 1
                self.tr(f"CUT rep {r.shard}.{r.idx} from its peers until {until / MS:.3f} ms")
                self.world.cut_from_peers[r.proc] = until
        elif kind == "replica2":
            shards = sorted({r.shard for r in self.reps.values() if self.may_fail(r.shard, 2)})
            if shards:
                shard = shards[rng.randrange(len(shards))]
                pair = self.widen.sample(self.shard_reps(shard), 2)
                self.outcome.double_crashes += 1
                for r in pair:
                    self.crash_rep(r)
        elif kind == "disk":
            # Both replicas of a shard fill at once (they write the same bytes): the
            # common case, not a double failure. Space comes back a while later.
            shard = rng.choice(sorted({s for s, _ in self.reps}))
            self.outcome.disks_filled += 1
            self.tr(f"DISK FULL on both replicas of shard {shard}")
            for r in self.shard_reps(shard):
                r.files.full = True
            self.at(self.now + rng.choice([20, 80, 250]) * MS, self.free_disk, shard)
        elif kind == "memory":
            # Both replicas of a shard hold the same records, so they reach their bound
            # together: from now on every new record is past it, until it is lifted.
            shard = self.memory_rng.choice(sorted({s for s, _ in self.reps}))
            self.outcome.logs_filled += 1
            self.tr(f"LOG FULL on the replicas of shard {shard}")
            for r in self.shard_reps(shard):
                r.settings.max_log_bytes = max(1, r.core.log.held_bytes if r.core is not None else 1)
            self.at(self.now + self.memory_rng.choice([20, 80, 250]) * MS, self.lift_log_bound, shard)
        elif kind == "stop":
            cands = [r for r in self.reps.values() if r.up and self.may_fail(r.shard)]
            primaries = [r for r in cands if r.idx == 0]
            pick = primaries if primaries and rng.random() < 0.7 else cands
            if pick:
                r = pick[rng.randrange(len(pick))]
                if r.proc is not None and self.stopper.random() < 0.5:
                    # Mid-turn: after its input was handled, before anything of it was sent
                    # (decisions whose ACKs never left are written and vouched for). The
                    # stop is under way from now on: until that turn ends no other fault
                    # may take its peer (f = 1; an operator stops one replica of a whole
                    # shard at a time).
                    r.stopping = self.stop_guards_peer
                    r.proc.doomed = lambda: self.stop_rep(r)
                else:
                    self.stop_rep(r)
        elif kind == "handler":
            self.crash_control("fh")
        elif kind == "mms":
            self.crash_control("mms")
        elif kind == "stall":
            cands = [r for r in self.reps.values() if r.up]
            if cands:
                r = cands[self.fence_rng.randrange(len(cands))]
                assert r.proc is not None
                until = self.now + self.fence_rng.randint(5, 250) * MS
                self.outcome.stalls += 1
                self.tr(f"STALL rep {r.shard}.{r.idx} (SIGSTOP) until {until / MS:.3f} ms")
                r.proc.stall(until, threads=True)
        elif kind in ("stall_mms", "stall_fh"):
            self.stall_leader(kind[6:])
        elif kind == "add":
            shard = max(s for s, _ in self.reps) + 1
            self.outcome.shards_added += 1
            self.tr(f"ADD shard {shard}")
            self.create_shard(shard)
        elif kind == "remove":
            keep = [s for s in sorted(self.zk.meta) if not self.zk.meta[s].get("removed")]
            if len(keep) >= 2:
                shard = keep[rng.randrange(len(keep))]
                self.outcome.shards_removed += 1
                self.tr(f"REMOVE shard {shard}")
                self.zk.meta[shard]["removed"] = True
                self.zk.changed(f"shard {shard} removed")

    def lift_log_bound(self, shard: int) -> None:
        self.tr(f"LOG BOUND lifted on shard {shard}")
        for r in self.shard_reps(shard):
            r.settings.max_log_bytes = 0

    def free_disk(self, shard: int) -> None:
        self.tr(f"DISK SPACE back on shard {shard}")
        for r in self.shard_reps(shard):
            r.files.full = False
            self.outcome.disk_refusals += r.files.refused_writes
            r.files.refused_writes = 0

    # ==========================================================================================
    # run
    def settled(self) -> str | None:
        """None once everything is at rest and every subscriber has caught up; else why not."""
        if self.now < self.fault_end:
            return "faults still scheduled"
        for c in self.clients:
            if not c.done:
                call = c.call
                return (f"client {c.cid} not done ({c.left} left; call "
                        f"{call and (call.seq, call.state.value, call.shard, call.targets, call.wait and (call.wait.decided, call.wait.latest, call.wait.refused, call.wait.frozen))})")
        if self.leader("mms") is None or self.leader("fh") is None:
            return "MMS or failure handler leader down"
        for (s, i), r in self.reps.items():
            core = r.core
            if core is None:
                return f"rep {s}.{i} down"
            if r.files.full or (r.driver is not None and r.driver.disk_fault is not None):
                return f"rep {s}.{i} cannot write its disk yet"
            if core.frozen or core.blocked is not None or (core.is_primary and not core.role.deciding):
                return f"rep {s}.{i} frozen={core.frozen} blocked={core.blocked} state={core.status().get('state')}"
        for s, m in self.zk.meta.items():
            if m.get("recovering") is not None:
                return f"shard {s} recovering"
        lead = self.leader("fh")
        assert lead is not None
        if lead.driver.core is not None and lead.driver.core.active:
            return f"recovery active for shards {sorted(lead.driver.core.active)}"
        total = 0
        for s in {s for s, _ in self.reps}:
            cores = [r.core for r in self.shard_reps(s)]
            P = cores[0]
            assert P is not None
            for B in cores[1:]:
                assert B is not None
                if P.log.gsns != B.log.gsns:
                    return f"shard {s}: replicas hold different positions ({len(P.log.gsns)} vs {len(B.log.gsns)} records)"
                if P.log.gsns and (P.stable < P.log.gsns[-1] or B.stable < B.log.gsns[-1]):
                    return f"shard {s}: records not yet stable (last {P.log.gsns[-1]}, stable {P.stable}/{B.stable})"
            total += len(P.log.gsns)
        for rd in self.readers:
            if len(rd.delivered) < total:
                return f"subscriber {rd.sid} delivered {len(rd.delivered)} of {total}"
        return None

    def close(self) -> None:
        """Let go of what the run holds outside memory (nothing here; files on top)."""

    def settle_check(self) -> None:
        if self.settled() is None:
            self.finished = True
        else:
            self.at(self.now + 5 * MS, self.settle_check)

    def run(self) -> Outcome:
        try:
            with self.world.logs_in_trace():
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
        world = self.world
        for c in self.mms + self.fh:
            self.start_control(c)
        for s in range(self.initial_shards):
            self.create_shard(s)
        for app in self.clients:
            self.at(self.rng.randint(1, 5) * MS, app.proc.run, app.next_record)
        for fault_at, kind in self.fault_plan:
            self.at(fault_at, self.fault, kind)
        self.at(self.fault_end, self.settle_check)
        for rd in self.readers:
            rd.proc.run(rd.start)
        limit = self.limit_ns
        while True:
            t = world.next_time()
            if t is None or t > limit:
                self._stuck()
            world.step()
            if self.finished:
                break
            if world.events > MAX_EVENTS:
                raise AssertionError(f"more than {MAX_EVENTS} events by {world.now / MS:.3f} ms of simulated time "
                                     f"(a livelock?): {self.settled()}")
        self.outcome.events = world.events
        self.outcome.requeued = world.requeued
        self.outcome.sim_ms = world.now / MS
        self.check()
        return self.outcome

    def _stuck(self) -> None:
        for c in self.clients:
            call = c.call
            w = call.wait if call is not None else None
            p = self.reps[(call.shard, 0)].core if call is not None and (call.shard, 0) in self.reps else None
            if (call is not None and w is not None and w.refused and p is not None
                    and (c.cid, call.seq) in p.role.refused  # type: ignore[union-attr]
                    and any(g is not None and g != NO_COPY for g in w.latest[1:])):
                raise KnownBug("B5", f"client {c.cid} seq {call.seq} stuck on shard {call.shard}: its primary refused "
                                     f"the record for good, a backup keeps answering a guess ({w.latest}); "
                                     f"not settled: {self.settled()}")
        raise AssertionError(f"did not settle within {self.limit_ns // MS} ms of simulated time: {self.settled()}")

    # ==========================================================================================
    # invariants
    def check(self) -> None:
        out = self.outcome
        why = self.settled()
        assert why is None, f"not settled: {why}"
        log: dict[int, tuple[int, int, int, bytes]] = {}  # gsn -> (shard, client, seq, data)
        keys: dict[tuple[int, int], int] = {}
        history = self.zk.history
        for s in sorted({s for s, _ in self.reps}):
            cores = [r.core for r in self.shard_reps(s)]
            P = cores[0]
            assert P is not None and all(c is not None for c in cores)
            for B in cores[1:]:
                assert B is not None
                assert P.log.gsns == B.log.gsns, (f"shard {s}: replicas hold different positions", P.log.gsns, B.log.gsns)
            for core in cores:
                assert core is not None
                # one membership per epoch everywhere: the replica's history is ZooKeeper's
                for first, last, members in core.log.membership:
                    for f2, l2, m2 in history_ranges(history, first, last):
                        assert tuple(m2) == tuple(members), (f"rep {s}.{core.s.replica}: epochs {f2}..{l2} had members "
                                                              f"{list(members)}, the history says {list(m2)}")
            for g in P.log.gsns:
                a = P.log.records[g]
                for B in cores[1:]:
                    assert B is not None
                    b = B.log.records[g]
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
            if cid in self.other_writers:
                continue  # a simulation on top of the log checks its own records
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
        for rd in self.readers:
            seen = rd.delivered
            gs = [g for g, _, _ in seen]
            assert all(x < y for x, y in zip(gs, gs[1:])), f"subscriber {rd.sid}: gsns not increasing"
            if seen != want:
                for i, (x, y) in enumerate(zip(seen, want)):
                    if x != y:
                        raise AssertionError(f"subscriber {rd.sid} delivered {x[:2]} at position {i}, the log holds {y[:2]}")
                raise AssertionError(f"subscriber {rd.sid} delivered {len(seen)} records, the log holds {len(want)}")
        out.acked = acked
        out.records = len(log)
        out.delivered = len(self.readers[0].delivered)
        out.redirects = sum(c.state.stats["redirects"] for c in self.clients)
        out.retries = sum(c.state.stats["retries"] for c in self.clients)
        out.resubscribes = sum(rd.sub.core.resubscribes for rd in self.readers if rd.sub is not None)
        out.suspicions = sum(d.suspicions for d in self.fh_drivers)
        out.rate_reports = sum(d.rate_reports for d in self.mms_drivers)
        out.reference_misses = sum(r.driver.core.stats["reference_misses"] for r in self.reps.values()
                                   if r.up and r.driver is not None)
        out.block_reads = self.zk.block_reads
        live = [r.driver.core.stats for r in self.reps.values() if r.up and r.driver is not None]
        out.passed_by_clock = sum(stats.get("passed_by_clock", 0) for stats in live)
        out.stale_links = sum(stats.get("stale_links", 0) for stats in live)
        out.stale_leader_writes = self.zk.stale_leader_writes
        out.expired_by_clock = sum(stats.get("expired_by_clock", 0) for stats in live)
        out.trace = self.world.trace


def corrupt(core: ReplicaCore, gsn: int, data: bytes) -> None:
    """For the checker's own tests: replace a record's data in a replica's log."""
    core.log.records[gsn] = msgspec.structs.replace(core.log.records[gsn], data=data)


def _show(msg: Any) -> str:
    """A frame for the trace, with long payloads cut."""
    text = repr(msg)
    return text if len(text) <= 300 else text[:300] + "..."


def run(seed: int, trace: bool = False, sim_class: type["SystemSim"] | None = None, replay: str = REPLAY,
        **kw: Any) -> Outcome:
    """One seed (of ``sim_class``, default :class:`SystemSim`). Raises AssertionError naming
    the seed and the replay command on any broken invariant (also on an exception inside
    a protocol core or driver)."""
    sim = (sim_class or SystemSim)(seed, trace=trace, **kw)
    try:
        return sim.run()
    except KnownBug as exc:
        known = KnownBug(exc.bug, f"seed {seed}: {str(exc).split(': ', 1)[1]}\n  replay: {replay.format(seed=seed)}")
        known.sim = sim  # type: ignore[attr-defined]
        raise known from exc
    except Exception as exc:
        # A broken invariant, or an exception inside a core or driver: name the seed, where
        # it was raised, and how to replay it.
        sim.outcome.trace = sim.world.trace
        where = traceback.extract_tb(exc.__traceback__)[-1]
        what = str(exc) if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {exc}"
        err = AssertionError(f"seed {seed}: {what} [at {where.filename.rsplit('/', 1)[-1]}:{where.lineno}, "
                             f"{sim.now / MS:.3f} ms]\n  replay: {replay.format(seed=seed)}")
        err.sim = sim  # type: ignore[attr-defined]
        raise err from exc
    finally:
        sim.close()
