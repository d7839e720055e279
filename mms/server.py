"""Membership service replica process.

    python -m mms.server --zk HOSTS --id N [--interval-ms 10]

Several replicas run; a kazoo Election picks the leader. The leader publishes one
epoch per interval on its PUB socket, and only epochs it has written to ZooKeeper
with a version check (a transaction over ``/ziplog/epoch`` for a block of epochs and,
when membership changes, ``/ziplog/membership``). The version check is what keeps
two leaders (a deposed one still running, say) from ever broadcasting different
configs for the same epoch: only one of them can commit epoch e, and a new leader
continues from what is committed.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any, NamedTuple

import zmq
from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError

from ziplog.io import zk as discovery
from ziplog.protocol import frames as wire
from ziplog.server.elected import ElectedReplica, serve
from ziplog.protocol.gsna import EpochConfig

from .planner import EpochPlanner, PlannerSettings

log = logging.getLogger("mms")

#: RATE frames read per ``_drain_rates`` call: the clock is looked at between calls, so
#: a backlog delays a broadcast by one call at most (about a millisecond on a busy
#: machine). What is not read by the deadline waits in the queue; when the queue is
#: full, primaries drop their reports, which the planner can do without.
RATE_CHUNK = 256
#: An EPOCH frame up to its ``epoch`` field: a 5-element msgpack array header, the
#: version and the op (``EpochSequencer.frame`` appends the rest).
EPOCH_HEAD = b"\x95" + wire.pack(wire.PROTOCOL_VERSION) + wire.pack(wire.EPOCH)


class Block(NamedTuple):
    """Epochs ``first..last``, committed to ZooKeeper with one config."""

    first: int
    last: int
    config: EpochConfig


class Commit(NamedTuple):
    """A block's transaction, sent to ZooKeeper and not yet answered."""

    reply: Any  # kazoo IAsyncResult: the list of per-operation results
    block: Block
    history: list[list[Any]] | None


class EpochSequencer:
    """The leader's epochs, without the clock: which epoch comes next, the committed
    block it belongs to, and when a new plan is needed.

    Blocks of ``epochs_per_commit`` epochs (one transaction, same members and rates) are
    committed before any of their epochs is broadcast. A block in ZooKeeper may have
    been partly broadcast by a previous leader, so a new leader honours it whole: it
    broadcasts the block's last epoch (shards that missed the ones between fill them
    from the membership history) and plans after it. Its own blocks it may cut short
    at any epoch it has not broadcast yet, which is how a membership change takes
    effect at the next epoch.

    Planning (the ready list over every shard, then ``EpochPlanner.plan``) costs
    O(shards), so it runs only when its result can differ from the block's config:

    * a block is due: rates are taken up at block commits only;
    * the topology changed (shards registered or gone, replicas up or down, a shard
      marked ``removed`` or ``recovering`` or no longer recovering): its generation
      differs from the one the last plan read;
    * a removed shard's drain ends (``EpochPlanner.drain_ends_at``): membership
      changes with no event;
    * the last plan changed membership but could not commit it (the epoch was the
      first of the current block), so it must be tried again.

    Between plans the planner's inputs that matter for membership are unchanged, and a
    plan of an unchanged input is the committed membership again (members = previous
    members | ready - gone - recovering is idempotent), so skipping it loses nothing.

    A block's transaction is sent by :meth:`prepare` and its answer taken by
    :meth:`settle`, so the leader reads RATE reports while ZooKeeper works; nothing of
    the block is used (not even for the next plan) until it is settled, and
    :meth:`frame` refuses an epoch whose block is not.
    """

    def __init__(self, zk: KazooClient, topology: discovery.Topology, settings: PlannerSettings,
                 epochs_per_commit: int) -> None:
        assert epochs_per_commit >= 1
        self.zk = zk
        self.topology = topology
        self.epochs_per_commit = epochs_per_commit
        zk.sync(discovery.EPOCH_PATH)
        data, stat = zk.get(discovery.EPOCH_PATH)
        hdata, hstat = zk.get(discovery.MEMBERSHIP_PATH)
        #: versions our transactions expect: a commit by anyone else refuses ours
        self.block_version: int = stat.version
        self.history_version: int = hstat.version
        self.planner = EpochPlanner(settings, None, discovery.dec(hdata) or [])
        #: the committed block ``next_epoch`` belongs to (None: nothing committed yet)
        self.block: Block | None = None
        self.next_epoch = 0
        #: the topology generation the last plan read (None: no plan yet)
        self.planned_generation: int | None = None
        #: the last plan changed membership and that change is not committed yet
        self.change_pending = False
        #: shards with every replica registered and not removed, as of planned_generation
        self._ready: list[int] = []
        #: the block commit sent and not yet settled
        self._commit: Commit | None = None
        self._frame_config: EpochConfig | None = None
        self._frame_tail = b""
        cur = discovery.dec(data)
        if cur:
            last = int(cur.get("last", cur["epoch"]))
            inherited = EpochConfig(last, tuple(cur["shards"]), tuple(cur["rates"]))
            self.planner.committed(inherited, None)
            self.next_epoch = last
            self.block = Block(last, last, inherited)

    # -- what to do -----------------------------------------------------------------------
    def block_due(self) -> bool:
        return self.block is None or self.next_epoch > self.block.last

    def topology_moved(self) -> bool:
        return self.topology.generation != self.planned_generation

    def needs_plan(self) -> bool:
        return (self.block_due() or self.topology_moved() or self.change_pending
                or self.planner.drain_ends_at(self.next_epoch))

    # -- the steps of an epoch ------------------------------------------------------------
    def prepare(self) -> bool:
        """Get ``next_epoch`` ready: plan if something can have changed, and send the
        commit of a new block from ``next_epoch`` if one is due or membership changed
        (:meth:`settle` takes its answer). May be called again for the same epoch
        (nothing broadcast in between): the topology may have changed meanwhile.
        Returns False if a commit was refused (see :meth:`settle`)."""
        if not self._take_commit():
            return False
        if self.needs_plan():
            cfg, history = self._plan()
            changed = history is not None
            block = self.block
            if block is None or self.next_epoch > block.last or (changed and self.next_epoch > block.first):
                self._send_commit(cfg, changed)
                self.change_pending = False
            else:
                # A change found at the first epoch of a block (one inherited, or one we
                # just committed for this epoch) cannot cut it: it waits for the next epoch.
                self.change_pending = changed
        return True

    def settle(self) -> bool:
        """Wait for the commit :meth:`prepare` sent, if any, and take it up. Returns False
        if ZooKeeper refused it: another leader committed, so this one must step down.
        Afterwards ``next_epoch`` is in a committed block."""
        if not self._take_commit():
            return False
        assert self.block is not None and self.block.first <= self.next_epoch <= self.block.last, \
            "the epoch to broadcast is in a committed block"
        return True

    def _take_commit(self) -> bool:
        """The answer to the commit in flight, if any (False: refused)."""
        commit, self._commit = self._commit, None
        if commit is not None:
            results = commit.reply.get()  # raises if the session failed, as a plain commit would
            if any(isinstance(r, Exception) for r in results):
                # Someone else committed: we are not (or no longer) the leader.
                log.warning("block from epoch %d refused (%s); stepping down", commit.block.first, results)
                return False
            self.block_version += 1
            if commit.history is not None:
                self.history_version += 1
                log.info("epoch %d: membership now %s", commit.block.first, list(commit.block.config.shards))
            self.planner.committed(commit.block.config, commit.history)
            self.block = commit.block
        return True

    def frame(self) -> bytes:
        """The EPOCH frame of ``next_epoch``: the committed block's config. Only the
        epoch differs from one epoch of a block to the next, so the rest is packed once
        per config."""
        assert self._commit is None, "settle() the block's commit before broadcasting"
        assert self.block is not None and self.block.first <= self.next_epoch <= self.block.last, \
            "an epoch is broadcast only once its block is committed"
        cfg = self.block.config
        if self._frame_config is not cfg:
            self._frame_tail = wire.pack(list(cfg.shards)) + wire.pack(list(cfg.rates))
            self._frame_config = cfg
            frame = EPOCH_HEAD + wire.pack(self.next_epoch) + self._frame_tail
            assert frame == wire.pack([wire.PROTOCOL_VERSION, wire.EPOCH, self.next_epoch, list(cfg.shards),
                                       list(cfg.rates)])
            return frame
        return EPOCH_HEAD + wire.pack(self.next_epoch) + self._frame_tail

    def advance(self) -> None:
        """``next_epoch`` was broadcast: it is the base of the next plan."""
        assert self._commit is None and self.block is not None
        self.planner.last = self.block.config.at(self.next_epoch)
        self.next_epoch += 1

    # -- internals ------------------------------------------------------------------------
    def _plan(self) -> tuple[EpochConfig, list[list[Any]] | None]:
        topo = self.topology
        # Read the generation first: a change racing with the reads below shows as a
        # different generation at the next epoch, and is planned then.
        generation = topo.generation
        removed, recovering = topo.removed, topo.recovering
        for s in removed:
            self.planner.remove(s)
        if generation != self.planned_generation:
            # The ready list is the topology's alone: a plan at a block commit with no
            # change since the last plan reuses it (it is the costlier half of a plan).
            self._ready = [s for s in topo.replica_counts if s not in removed and topo.shard_complete(s)]
        self.planned_generation = generation
        return self.planner.plan(self._ready, recovering)  # the planner leaves recovering shards out

    def _send_commit(self, planned: EpochConfig, changed: bool) -> None:
        """Send the commit of the block that starts at ``next_epoch``, the first epoch
        nobody broadcast, with the planned config (versions as last settled: one commit
        at a time)."""
        assert self._commit is None
        first = self.next_epoch
        assert planned.epoch == first, (planned.epoch, first)
        last = first + self.epochs_per_commit - 1
        history = self.planner.history + [[first, list(planned.shards)]] if changed else None
        txn = self.zk.transaction()
        txn.set_data(discovery.EPOCH_PATH, discovery.enc({"epoch": first, "last": last, "shards": list(planned.shards),
                                                          "rates": list(planned.rates)}), version=self.block_version)
        if history is not None:
            txn.set_data(discovery.MEMBERSHIP_PATH, discovery.enc(history), version=self.history_version)
        self._commit = Commit(txn.commit_async(), Block(first, last, planned), history)


class MembershipReplica(ElectedReplica):
    kind = "mms"

    def __init__(self, zk_hosts: str, replica_id: int, interval_ms: float = 10.0, host: str = "127.0.0.1",
                 settings: PlannerSettings | None = None, epochs_per_commit: int = 10) -> None:
        assert epochs_per_commit >= 1
        super().__init__(zk_hosts, replica_id, discovery.MMS_ELECTION)
        self.epochs_per_commit = epochs_per_commit
        self.interval_ns = int(interval_ms * 1_000_000)
        self.settings = settings or PlannerSettings()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 10_000)
        pub_port = self.pub.bind_to_random_port(f"tcp://{host}")
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        pull_port = self.pull.bind_to_random_port(f"tcp://{host}")
        self.addrs = {"pub": f"tcp://{host}:{pub_port}", "pull": f"tcp://{host}:{pull_port}"}

    def start(self) -> None:
        for path in (discovery.EPOCH_PATH, discovery.MEMBERSHIP_PATH):
            try:
                self.zk.create(path, b"", makepath=True)
            except NodeExistsError:
                pass
        self.zk.ensure_path(discovery.MMS_REPLICAS)
        node = f"{discovery.MMS_REPLICAS}/{self.id}"
        try:
            self.zk.delete(node)
        except Exception:
            pass
        self.zk.create(node, discovery.enc(self.addrs), ephemeral=True)
        self.topology = discovery.Topology(self.zk)
        log.info("mms replica %d up: %s", self.id, self.addrs)

    # -- leader ---------------------------------------------------------------------------
    def lead(self) -> None:
        """Broadcast one epoch per interval (``EpochSequencer`` decides what, and commits
        it to ZooKeeper first).

        Each epoch is prepared right after the previous broadcast (RATE reports, a plan
        if one is needed, the block commit sent if one is due); RATE reports are read
        while ZooKeeper answers and until the deadline, so at the deadline only the send
        is left and a block commit does not stretch the interval. If the topology
        changes while we wait, the epoch is prepared again at the deadline, so a change
        takes effect as soon as it did before."""
        seq = EpochSequencer(self.zk, self.topology, self.settings, self.epochs_per_commit)
        self._drop_queued_rates()
        next_t = time.monotonic_ns()
        while self.running and not self.lost.is_set():
            # Reports are read mostly while waiting for the deadline; one chunk here keeps
            # them moving when preparing takes the whole interval.
            self._drain_rates(seq.planner, RATE_CHUNK)
            if not seq.prepare():
                return
            self._wait_until(next_t, seq.planner)
            if seq.topology_moved() and not seq.prepare():
                return
            if not seq.settle():
                return
            if self.lost.is_set() or not self.running:
                return
            self.pub.send(seq.frame())
            seq.advance()
            # fell behind (slow commit): do not burst to catch up
            next_t = max(next_t + self.interval_ns, time.monotonic_ns())

    def _drop_queued_rates(self) -> None:
        """Rate reports queued while we were not leading are stale."""
        while True:
            try:
                self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _drain_rates(self, planner: EpochPlanner, limit: int | None = None) -> int:
        """Fold queued RATE reports into the planner: at most ``limit`` frames (None:
        until the queue is empty). Returns how many frames were read."""
        pull, on_rate, rate_op = self.pull, planner.on_rate, wire.RATE
        n = 0
        while limit is None or n < limit:
            try:
                frame = pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            try:
                msg = wire.unpack(frame)
                if msg[1] == rate_op:
                    on_rate(int(msg[2]), int(msg[3]), int(msg[4]), int(msg[5]))
            except Exception:
                log.warning("bad rate report dropped")
        return n

    def _wait_until(self, t_ns: int, planner: EpochPlanner) -> None:
        """Until ``t_ns``, reading RATE reports as they come, a chunk at a time."""
        while True:
            left = t_ns - time.monotonic_ns()
            if left <= 0:
                return
            if self.pull.poll(max(1, left // 1_000_000) if left > 1_000_000 else 0):
                self._drain_rates(planner, RATE_CHUNK)
            elif left < 1_000_000:
                time.sleep(left / 1e9)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mms.server", description="ziplog membership service replica")
    ap.add_argument("--zk", required=True)
    ap.add_argument("--id", type=int, required=True)
    ap.add_argument("--interval-ms", type=float, default=10.0)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--default-rate", type=int, default=PlannerSettings.default_rate)
    ap.add_argument("--min-rate", type=int, default=PlannerSettings.min_rate)
    ap.add_argument("--epochs-per-commit", type=int, default=10,
                    help="epochs committed to ZooKeeper per transaction (1: one commit per epoch)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    replica = MembershipReplica(args.zk, args.id, args.interval_ms, args.host,
                                PlannerSettings(default_rate=args.default_rate, min_rate=args.min_rate),
                                epochs_per_commit=args.epochs_per_commit)
    return serve(replica)


if __name__ == "__main__":
    sys.exit(main())
