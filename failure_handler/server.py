"""Failure handler replica process: a thin driver over :class:`RecoveryCore`.

    python -m failure_handler.server --zk HOSTS --id N [--group G --groups K]

Several replicas run per group; an election per group picks the leader, which alone
acts, for the shards it owns (shard % K == G; one group owns all by default). Endpoints:

  * PULL (bound, address in ``/ziplog/fh/replicas/<group>-<id>``): SUSPECT reports,
    pushed by storage replicas to every handler replica
  * DEALER -> each storage replica's ROUTER: PROBE, ACQUIRED, FETCH, INSTALL, RESUME

Everything the handler decides is in ZooKeeper before it acts on it: of each batch of
the core's effects, the recovery records (``WriteRecovery``) are written first, one at a
time, and nothing after a write is performed until ZooKeeper took it
(``ziplog.io.zk_recovery``); the batch's messages follow. Each write checks, in its
transaction, that this replica still holds the lock of its term: a leader deposed while
its loop stalled cannot write after its successor read the record.
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Protocol

from failure_handler.recovery import ACQUIRED, DONE, PROBING, HandlerSettings, RecoveryCore
from ziplog.cores.effects import Message, Ready, ReplicaOf, WriteRecovery
from ziplog.shell.inbound import InboundGuard
from ziplog.shell.metrics import counter, counters, gauge
from ziplog.shell.throttled_log import ThrottledLog
from ziplog.io.ports import Endpoint, Network, Runtime, Timer
from ziplog.protocol import frames as wire
from ziplog.protocol import layout
from ziplog.protocol.addresses import advertised
from ziplog.protocol.auth import ClusterKey
from ziplog.protocol.topology import TopologyView
from ziplog.shell.elected import (
    ElectedDriver,
    ElectionPort,
    elected_parser,
    open_member_report,
    parse_elected_args,
    run_elected,
)

if TYPE_CHECKING:
    from prometheus_client.core import Metric

log = logging.getLogger("failure_handler")

#: While a recovery is under way the leader looks at it at least this often, even with
#: nothing due (with none, it sleeps until an event).
TICK_NS = 50_000_000
#: A suspicion's reason is logged up to this many characters.
REASON_CHARS = 200
#: a recovery without a source says so this often
STUCK_LOG_NS = 10_000_000_000


class HandlerCoordination(Protocol):
    """What a failure handler replica needs of ZooKeeper."""

    @property
    def topology(self) -> TopologyView: ...

    def on_change(self, fn: Callable[[], None]) -> None: ...

    def register_fh(self, group: int, replica_id: int, addr: str) -> None: ...

    def sync_records(self) -> None:
        """Make the next reads see every write committed so far."""

    def read_record(self, shard: int) -> tuple[dict[str, Any] | None, int]:
        """The shard's recovery record and its node's version (-1: none)."""

    def write_record(self, shard: int, record: dict[str, Any], recovering: bool, version: int,
                     on_done: Callable[[int | None], None], fence: str | None = None) -> None:
        """Write the record and set or clear the flag, in one transaction that also checks
        that the lock ``fence`` (the writer's term: ``ElectionPort.fence``) is still
        there; ``on_done`` with the new version, or None when another leader wrote since
        ``version``, the writer was deposed, or ``fence`` is None."""


class FailureHandlerDriver(ElectedDriver):
    kind = "failure_handler"

    def __init__(self, rt: Runtime, net: Network, coord: HandlerCoordination, election: ElectionPort,
                 replica_id: int, key: ClusterKey, settings: HandlerSettings | None = None, group: int = 0,
                 groups: int = 1, host: str = "127.0.0.1", advertise: str | None = None) -> None:
        assert 0 <= group < groups
        super().__init__(rt, election, layout.fh_election_path(group), replica_id)
        self.net = net
        self.key = key
        self.bad_input = ThrottledLog(log, rt)
        self.suspect_log = ThrottledLog(log, rt, logging.INFO)
        #: a recovery that found no replica to be its source says so, every 10 s
        self.stuck_log = ThrottledLog(log, rt, logging.ERROR, interval_ns=STUCK_LOG_NS)
        #: how many did at the last timer (read by the metrics thread: a plain int)
        self.without_source = 0
        self.coord = coord
        self.settings = settings or HandlerSettings()
        self.group, self.groups = group, groups
        # Only the leader reads suspicions (the replicas repeat theirs while they stay
        # suspicious); a follower's queue fills and senders drop theirs.
        self.guard = InboundGuard(log, rt)
        self.pull = net.puller(self.guard.frames("the suspicion PULL", self.on_suspect_frame), host, paused=True,
                               max_bytes=wire.CONTROL_FRAME_LIMIT)
        #: what this replica registers for storage replicas to dial
        self.addr = advertised(self.pull.addr, advertise)
        # -- one term of leadership -----------------------------------------------------------
        self.core: RecoveryCore | None = None
        self.term = 0
        self.versions: dict[int, int] = {}  # record versions this term wrote or read
        self.dealers: dict[tuple[int, int], tuple[str, Endpoint]] = {}
        #: effects taken from the core and not yet performed (they wait behind a write)
        self.queue: deque[WriteRecovery | Message] = deque()
        self.writing = False
        self.timer: Timer | None = None
        self.seen_generation = -1
        self.suspicions = 0
        #: recovery records written to ZooKeeper, by phase (probing: a recovery began;
        #: done: it finished)
        self.recovery_steps = {PROBING: 0, ACQUIRED: 0, DONE: 0}

    def start(self) -> None:
        self.coord.register_fh(self.group, self.id, self.addr)
        self.coord.on_change(lambda: self.rt.call_soon_threadsafe(self.on_topology))
        log.info("failure handler replica %d up: %s", self.id, self.addr)
        self.contend()

    # -- leadership -------------------------------------------------------------------------------
    def lead_begin(self) -> None:
        self.term += 1
        self.core = RecoveryCore(self.settings)
        self.versions = {}
        self.queue.clear()
        self.writing = False
        self.coord.sync_records()
        self.pull.resume(discard_queued=True)  # suspicions queued while we followed may be stale
        self.seen_generation = -1
        self.on_topology()
        self._arm()

    def lead_end(self) -> None:
        self.term += 1
        self.core = None
        self.without_source = 0
        self.pull.pause()
        self.queue.clear()
        self.writing = False
        for _, ep in self.dealers.values():
            ep.close()
        self.dealers.clear()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    # -- input ------------------------------------------------------------------------------------
    def on_suspect_frame(self, frame: bytes) -> None:
        """A replica's suspicion (followers drop them: the replicas repeat theirs while
        they stay suspicious)."""
        core = self.core
        if core is None:
            return
        msg = open_member_report(self.key, frame, wire.decode_suspect, self.bad_input, "suspicion report")
        if msg is None:
            return
        if not core.on_suspect(msg.shard, msg.replica, self.rt.now()):
            self.bad_input("suspicion from no replica of a shard this group owns dropped", (msg.shard, msg.replica))
            return
        self.suspicions += 1
        self.suspect_log(f"shard {msg.shard} replica {msg.replica} suspects", msg.reason[:REASON_CHARS])
        self._act()

    def _on_reply(self, shard: int, replica: int, frame: bytes) -> None:
        core = self.core
        if core is None:
            return
        try:
            msg = wire.decode_recovery_reply(frame)
        except wire.ProtocolError as exc:
            self.bad_input(f"bad reply from shard {shard} replica {replica}", exc)
            return
        core.on_reply(shard, replica, msg, self.rt.now())
        self._act()

    def on_topology(self) -> None:
        core = self.core
        if core is None:
            return
        topo = self.coord.topology
        if topo.generation == self.seen_generation:
            return
        self.seen_generation = topo.generation
        now = self.rt.now()
        # The history first: a record loaded below is advanced at once, and its end (the
        # last epoch that included the shard) read from this history; an older copy (a
        # leader that took over long ago, or whose loop stalled) may not show the shard
        # at all, and would install the wrong epochs.
        core.on_history(topo.history, now)
        for shard, n in topo.replica_counts.items():
            if shard % self.groups != self.group:
                continue  # another group's shard: its SUSPECTs are ignored here
            if shard not in core.replica_counts and n > 0:
                record, version = self.coord.read_record(shard)
                self.versions[shard] = version
                core.load(shard, n, record, now)
        for shard, addrs in topo.replicas.items():
            for replica, addr in addrs.items():
                cur = self.dealers.get((shard, replica))
                if cur is not None and cur[0] == addr:
                    continue
                if cur is not None:
                    cur[1].close()
                ep = self.net.dealer(addr, self._reply_handler(shard, replica), "handler",
                                     max_bytes=wire.RECOVERY_REPLY_LIMIT)
                self.dealers[(shard, replica)] = (addr, ep)
        self._act()

    def _reply_handler(self, shard: int, replica: int) -> Callable[[bytes], None]:
        return self.guard.frames("a replica's reply", lambda frame: self._on_reply(shard, replica, frame))

    def _arm(self) -> None:
        core = self.core
        if core is None:
            return
        now = self.rt.now()
        deadline = core.next_deadline()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if deadline is None and not core.active:
            return  # no recovery under way: nothing to look at until an event arrives
        t = now + TICK_NS if deadline is None else min(max(deadline, now), now + TICK_NS)
        self.timer = self.rt.call_at(t, self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        core = self.core
        if core is None:
            return
        core.tick(self.rt.now())
        stuck = core.waiting_for_a_source()
        for shard, why in stuck.items():
            self.stuck_log(f"shard {shard} cannot recover", why)
        self.without_source = len(stuck)
        self._act()
        self._arm()

    # -- effects ----------------------------------------------------------------------------------
    def _act(self) -> None:
        """Perform the core's effects: each batch's writes, then its messages; a write
        holds back everything after it until ZooKeeper took it."""
        core = self.core
        if core is None:
            return
        self._take(core.ready())
        while self.queue and not self.writing:
            a = self.queue.popleft()
            if isinstance(a, WriteRecovery):
                self.writing = True
                term, v = self.term, self.versions.get(a.shard, -1)
                self.coord.write_record(a.shard, a.record, a.recovering, v,
                                        lambda version, a=a: self._written(term, a, version),  # type: ignore[misc]
                                        fence=self.fence)
            else:
                dest, msg = a
                assert isinstance(dest, ReplicaOf), dest  # the handler's messages go to replicas
                d = self.dealers.get((dest.shard, dest.replica))
                if d is not None:  # not registered (down): the core retries
                    d[1].send(wire.seal(self.key, wire.encode(msg)))
            if not self.queue:
                self._take(core.ready())
        self._arm()

    def _take(self, ready: Ready) -> None:
        for w in ready.coordinate:
            assert type(w) is WriteRecovery
            self.queue.append(w)
        self.queue.extend(ready.messages)

    def _written(self, term: int, a: WriteRecovery, version: int | None) -> None:
        if term != self.term or self.core is None:
            return  # a write of a term that is over
        self.writing = False
        if version is None:
            self.step_down(f"the recovery record of shard {a.shard} changed under us")
            return
        self.versions[a.shard] = version
        phase = str(a.record["phase"])
        self.recovery_steps[phase] = self.recovery_steps.get(phase, 0) + 1
        log.info("shard %d recovery %d: %s", a.shard, a.record["gen"], a.record["phase"])
        self.core.on_persisted(a.shard, int(a.record["gen"]), self.rt.now())
        self._act()

    def metrics(self) -> list[Metric]:
        """Prometheus families (called at scrape time from the metrics server's thread)."""
        lb = {"id": str(self.id), "group": str(self.group)}
        core = self.core
        steps = dict(self.recovery_steps)
        return [
            gauge("ziplog_fh_leader", "1 while this replica leads its group (acts on suspicions)", int(self.leading), lb),
            counter("ziplog_fh_suspicions", "replicas' suspicions taken while leading", self.suspicions, lb),
            counter("ziplog_fh_recoveries_started", "recoveries this replica began (a probing record written)",
                    steps.get(PROBING, 0), lb),
            counter("ziplog_fh_recoveries_finished", "recoveries this replica finished (a done record written)",
                    steps.get(DONE, 0), lb),
            counters("ziplog_fh_recovery_records", "recovery records written to ZooKeeper, by phase", "phase", steps,
                     lb),
            gauge("ziplog_fh_recoveries_active", "recoveries under way (while leading)",
                  len(core.active) if core is not None else 0, lb),
            gauge("ziplog_fh_recoveries_without_source", "recoveries that found no replica holding every record it "
                  "acknowledged (more replicas failed than the shard tolerates): they wait, probing again",
                  self.without_source if core is not None else 0, lb),
        ]

    def close(self) -> None:
        self.lead_end()
        self.pull.close()


def main(argv: list[str] | None = None) -> int:
    from ziplog.io.zk_recovery import KazooHandlerCoordination
    from ziplog.io.zmq_runtime import ZmqRuntime
    from ziplog.shell.process import member_credentials

    ap = elected_parser("failure_handler.server", "ziplog failure handler replica")
    ap.add_argument("--retry-ms", type=float, default=HandlerSettings.retry_ns / 1e6)
    ap.add_argument("--group", type=int, default=0, help="this replica's group: it owns shards with shard %% groups == group")
    ap.add_argument("--groups", type=int, default=1)
    args, key = parse_elected_args(ap, argv, "failure_handler", "failure-handler")
    rt = ZmqRuntime(credentials=member_credentials(args, key))
    coord = KazooHandlerCoordination(args.zk, key, rt, args.bind, args.advertise)
    driver = FailureHandlerDriver(rt, rt, coord, coord.election, args.id, key,
                                  HandlerSettings(retry_ns=int(args.retry_ms * 1e6)), args.group, args.groups, args.bind,
                                  advertise=args.advertise)
    return run_elected(args, rt, driver, coord)


if __name__ == "__main__":
    sys.exit(main())
