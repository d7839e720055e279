"""Membership service replica process: a thin driver over :class:`EpochSequencer`.

    python -m mms.server --zk HOSTS --id N [--interval-ms 10]

Several replicas run; an election picks the leader. The leader publishes one epoch per
interval on its PUB, and only epochs it has written to ZooKeeper with a version check
(a transaction over ``/ziplog/epoch`` for a block of epochs and, when membership
changes, ``/ziplog/membership``) that also checks its own lock node (the election's
:meth:`~ziplog.shell.elected.ElectionPort.fence`). These checks are what keep two leaders
(a deposed one still running, say) from ever broadcasting different configs for the same
epoch: only one of them can commit epoch e; a deposed one cannot commit at all, whatever
versions it read before its stall; and a new leader broadcasts nothing before its own
first commit (it leaves the inherited block as it is: :mod:`mms.sequencer`).

Each epoch is prepared right after the previous broadcast (a plan if one is needed, the
block's commit sent if one is due); RATE reports are read while ZooKeeper answers and
until the deadline, so at the deadline only the send is left and a block commit does
not stretch the interval. If the topology changed meanwhile, the epoch is prepared again
at the deadline, so a change takes effect at the next epoch.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import TYPE_CHECKING, Callable, Protocol

from mms.planner import PlannerSettings
from mms.sequencer import EpochSequencer
from ziplog.shell.inbound import InboundGuard
from ziplog.shell.throttled_log import ThrottledLog
from ziplog.io.ports import Network, Runtime, Timer, wall_offset_ns
from ziplog.cores.effects import CommitBlock
from ziplog.protocol import frames as wire
from ziplog.protocol import layout
from ziplog.protocol.addresses import advertised
from ziplog.protocol.auth import ClusterKey
from ziplog.protocol.membership import EpochState
from ziplog.protocol.topology import TopologyView
from ziplog.shell.elected import (
    ElectedDriver,
    ElectionPort,
    elected_parser,
    open_member_report,
    parse_elected_args,
    run_elected,
)
from ziplog.shell.metrics import counter, counters, gauge

if TYPE_CHECKING:
    from prometheus_client.core import Metric

log = logging.getLogger("mms")

#: an idle cluster's epochs lengthen up to this (a subscription calls a replica silent for
#: a second: progress must come well before that)
IDLE_INTERVAL_NS = 200_000_000


class MembershipCoordination(Protocol):
    """What a membership service replica needs of ZooKeeper."""

    @property
    def topology(self) -> TopologyView: ...

    def register_mms(self, replica_id: int, addrs: dict[str, str]) -> None: ...

    def read_epoch_state(self) -> EpochState:
        """The committed block and history with their versions, read fresh (synced)."""

    def commit_block(self, commit: CommitBlock, on_done: Callable[[bool], None]) -> None:
        """Send the transaction; ``on_done(ok)`` later, on the driver's runtime (False:
        a version check failed, ``commit.fence`` is gone or None, or the session failed)."""


class MembershipDriver(ElectedDriver):
    kind = "mms"

    def __init__(self, rt: Runtime, net: Network, coord: MembershipCoordination, election: ElectionPort,
                 replica_id: int, key: ClusterKey, interval_ns: int = 10_000_000,
                 settings: PlannerSettings | None = None, epochs_per_commit: int = 10, host: str = "127.0.0.1",
                 idle_interval_ns: int = IDLE_INTERVAL_NS, advertise: str | None = None,
                 wall_offset_ns: int = 0) -> None:
        assert epochs_per_commit >= 1
        super().__init__(rt, election, layout.MMS_ELECTION, replica_id)
        self.net = net
        self.coord = coord
        self.interval_ns = interval_ns
        #: the longest an epoch lasts while the cluster is idle (``interval_ns``: never longer)
        self.idle_interval_ns = idle_interval_ns
        self.settings = settings or PlannerSettings()
        self.epochs_per_commit = epochs_per_commit
        self.pub = net.publisher(host)
        # Only the leader reads rate reports: a follower's queue fills and primaries then
        # drop theirs, at no cost to the follower.
        self.guard = InboundGuard(log, rt)
        self.pull = net.puller(self.guard.frames("the rate PULL", self.on_rate_frame), host, paused=True,
                               max_bytes=wire.CONTROL_FRAME_LIMIT)
        #: what this replica registers for primaries to dial
        self.addrs = {"pub": advertised(self.pub.addr, advertise), "pull": advertised(self.pull.addr, advertise)}
        self.encoder = wire.EpochEncoder(replica_id)  # each EPOCH names its leader
        #: the wall clock minus the runtime's (``ports.wall_offset_ns``): each broadcast is
        #: stamped with when it left, the place both replicas of a shard take it at
        self.wall_offset_ns = wall_offset_ns
        self.key = key
        self.bad_input = ThrottledLog(log, rt)
        self.seq: EpochSequencer | None = None
        #: counts terms of leadership: answers to an earlier term's commits are ignored
        self.term = 0
        self.next_t = 0
        self.timer: Timer | None = None
        #: the deadline passed while a commit was unanswered: broadcast once it is
        self.broadcast_due = False
        self.broadcasts = 0
        #: the epoch of the last broadcast (-1: none yet from this replica)
        self.last_epoch = -1
        #: block commits answered by ZooKeeper: "ok" and "refused"
        self.commits = {"ok": 0, "refused": 0}
        #: rate reports taken while leading
        self.rate_reports = 0

    def start(self) -> None:
        self.coord.register_mms(self.id, self.addrs)
        log.info("mms replica %d up: %s", self.id, self.addrs)
        self.contend()

    # -- leadership -------------------------------------------------------------------------------
    def lead_begin(self) -> None:
        self.term += 1
        self.seq = EpochSequencer(self.coord.read_epoch_state(), self.coord.topology, self.settings,
                                  self.epochs_per_commit)
        self.broadcast_due = False
        self.pull.resume(discard_queued=True)  # reports queued while we followed are stale
        self.next_t = self.rt.now()
        self._prepare()
        self._arm()

    def lead_end(self) -> None:
        self.term += 1
        self.seq = None
        self.pull.pause()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    # -- input ------------------------------------------------------------------------------------
    def on_rate_frame(self, frame: bytes) -> None:
        """A storage process's rate reports (followers drop them: a primary reports again
        to each new leader the broadcasts name)."""
        seq = self.seq
        if seq is None:
            return
        msg = open_member_report(self.key, frame, wire.decode_rate, self.bad_input, "rate report")
        if msg is None:
            return
        for r in msg.reports:
            if seq.on_rate(r.shard, r.rate, r.busy):
                self.rate_reports += 1
            else:
                self.bad_input("rate report of an unknown shard dropped", r.shard)

    # -- the epoch cycle --------------------------------------------------------------------------
    def _prepare(self) -> None:
        seq = self.seq
        assert seq is not None
        term = self.term
        for commit in seq.prepare().coordinate:
            assert type(commit) is CommitBlock
            self.coord.commit_block(dataclasses.replace(commit, fence=self.fence), lambda ok: self._committed(term, ok))

    def _committed(self, term: int, ok: bool) -> None:
        if term != self.term or self.seq is None:
            return  # an answer to a term that is over
        self.commits["ok" if ok else "refused"] += 1
        if not self.seq.on_commit_result(ok):
            self.step_down("a block commit was refused: another leader committed")
            return
        if self.broadcast_due:
            self._deadline()

    def _arm(self) -> None:
        self.timer = self.rt.call_at(self.next_t, self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        if self.seq is not None:
            self._deadline()

    def _deadline(self) -> None:
        seq = self.seq
        assert seq is not None
        if seq.committing:
            self.broadcast_due = True
            return
        if seq.topology_moved():
            self._prepare()
            if seq.committing:
                self.broadcast_due = True
                return
        self.broadcast_due = False
        cfg = seq.config()
        # named before it leaves: a scrape never shows an epoch older than one a replica began
        self.last_epoch = cfg.epoch
        base = seq.same_as()
        # stamped once every storage replica reads a stamp (a server of an earlier build
        # refuses the longer frame: wire.READS_STAMP)
        stamp = wire.wall_stamp(self.rt.now(), self.wall_offset_ns) \
            if self.coord.topology.every_replica_reads() >= wire.READS_STAMP else 0
        self.pub.send(self.encoder.encode(cfg.epoch, cfg.shards, cfg.rates, stamp) if base is None
                      else self.encoder.encode_same(cfg.epoch, base, stamp))
        self.broadcasts += 1
        seq.advance()
        # fell behind (slow commit): do not burst to catch up
        self.next_t = max(self.next_t + seq.interval_ns(self.interval_ns, self.idle_interval_ns), self.rt.now())
        self._prepare()
        self._arm()

    def metrics(self) -> list[Metric]:
        """Prometheus families (called at scrape time from the metrics server's thread)."""
        lb = {"id": str(self.id)}
        return [
            gauge("ziplog_mms_leader", "1 while this replica leads (broadcasts epochs)", int(self.leading), lb),
            counter("ziplog_mms_epochs_broadcast", "epochs this replica broadcast", self.broadcasts, lb),
            gauge("ziplog_mms_epoch", "the epoch this replica broadcast last (-1: none)", self.last_epoch, lb),
            counters("ziplog_mms_zk_commits", "block commits to ZooKeeper answered, by result (refused: a version "
                     "check or the session failed)", "result", dict(self.commits), lb),
            counter("ziplog_mms_rate_reports", "primaries' rate reports taken while leading", self.rate_reports, lb),
        ]

    def close(self) -> None:
        self.lead_end()
        self.pub.close()
        self.pull.close()


def main(argv: list[str] | None = None) -> int:
    from ziplog.io.zk_membership import KazooMembershipCoordination
    from ziplog.io.zmq_runtime import ZmqRuntime
    from ziplog.shell.process import member_credentials

    ap = elected_parser("mms.server", "ziplog membership service replica")
    ap.add_argument("--interval-ms", type=float, default=10.0)
    ap.add_argument("--idle-interval-ms", type=float, default=IDLE_INTERVAL_NS / 1e6,
                    help="an idle cluster's epochs lengthen up to this (well under a subscriber's 1 s silence rule)")
    ap.add_argument("--default-rate", type=int, default=PlannerSettings.default_rate)
    ap.add_argument("--min-rate", type=int, default=PlannerSettings.min_rate)
    ap.add_argument("--epochs-per-commit", type=int, default=10,
                    help="epochs committed to ZooKeeper per transaction (1: one commit per epoch)")
    args, key = parse_elected_args(ap, argv, "mms", "mms")
    # epochs go out on time, not up to a millisecond late
    rt = ZmqRuntime(precise_timers=True, credentials=member_credentials(args, key))
    coord = KazooMembershipCoordination(args.zk, key, rt, args.bind, args.advertise)
    driver = MembershipDriver(rt, rt, coord, coord.election, args.id, key, int(args.interval_ms * 1_000_000),
                              PlannerSettings(default_rate=args.default_rate, min_rate=args.min_rate),
                              args.epochs_per_commit, args.bind, int(args.idle_interval_ms * 1_000_000),
                              advertise=args.advertise, wall_offset_ns=wall_offset_ns())
    return run_elected(args, rt, driver, coord)


if __name__ == "__main__":
    sys.exit(main())
