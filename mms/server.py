"""Membership service replica process.

    python -m mms.server --zk HOSTS --id N [--interval-ms 10]

Several replicas run; a kazoo Election picks the leader. The leader, every
interval, plans the next epoch, writes it to ZooKeeper with a version check
(a transaction over ``/ziplog/epoch`` and, when membership changes,
``/ziplog/membership``), and only once that commit succeeds publishes it on its
PUB socket. The version check is what keeps two leaders (a deposed one still
running, say) from ever broadcasting different configs for the same epoch: only
one of them can commit epoch e, and a new leader continues from what is
committed.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import zmq
from kazoo.exceptions import NodeExistsError

from ziplog import discovery, wire
from ziplog.elected import ElectedReplica, serve
from ziplog.gsna import EpochConfig

from .planner import EpochPlanner, PlannerSettings

log = logging.getLogger("mms")


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
        """Commit epochs to ZooKeeper in blocks of ``epochs_per_commit`` (one transaction,
        same members and rates), broadcast them one per interval.

        A block in ZooKeeper may have been partly broadcast by a previous leader, so a new
        leader honours it whole: it broadcasts the block's last epoch (shards that missed
        the ones between fill them from the membership history) and plans after it. Its
        own blocks it may cut short at any epoch it has not broadcast yet, which is how a
        membership change takes effect at the next epoch."""
        zk = self.zk
        zk.sync(discovery.EPOCH_PATH)
        data, stat = zk.get(discovery.EPOCH_PATH)
        block_version = stat.version
        hdata, hstat = zk.get(discovery.MEMBERSHIP_PATH)
        history_version = hstat.version
        cur = discovery.dec(data)
        planner = EpochPlanner(self.settings, None, discovery.dec(hdata) or [])
        block: tuple[int, int, EpochConfig] | None = None  # (first, last, config) we may use
        next_epoch = 0
        if cur:
            first, last = int(cur["epoch"]), int(cur.get("last", cur["epoch"]))
            inherited = EpochConfig(last, tuple(cur["shards"]), tuple(cur["rates"]))
            planner.committed(inherited, None)
            next_epoch = last
            block = (last, last, inherited)
        # Drop rate reports queued while we were not leading: they are stale.
        while True:
            try:
                self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        next_t = time.monotonic_ns()
        while self.running and not self.lost.is_set():
            self._drain_rates(planner)
            for s in self.topology.removed:
                planner.remove(s)
            ready = [s for s in self.topology.replica_counts if self.topology.shard_complete(s) and s not in self.topology.removed]
            cfg, history = planner.plan(ready, self.topology.recovering)  # the planner leaves recovering shards out
            changed = history is not None
            if block is None or next_epoch > block[1] or (changed and next_epoch > block[0]):
                # Commit the next block: it starts at the first epoch nobody broadcast.
                first = next_epoch
                last = first + self.epochs_per_commit - 1
                cfg = EpochConfig(first, cfg.shards, cfg.rates)
                history = planner.history + [[first, list(cfg.shards)]] if changed else None
                txn = zk.transaction()
                txn.set_data(discovery.EPOCH_PATH, discovery.enc({"epoch": first, "last": last, "shards": list(cfg.shards), "rates": list(cfg.rates)}), version=block_version)
                if history is not None:
                    txn.set_data(discovery.MEMBERSHIP_PATH, discovery.enc(history), version=history_version)
                results = txn.commit()
                if any(isinstance(r, Exception) for r in results):
                    # Someone else committed: we are not (or no longer) the leader.
                    log.warning("block from epoch %d refused (%s); stepping down", first, results)
                    return
                block_version += 1
                if history is not None:
                    history_version += 1
                    log.info("epoch %d: membership now %s", first, list(cfg.shards))
                planner.committed(cfg, history)
                block = (first, last, cfg)
            bcfg = block[2]
            self.pub.send(wire.pack([wire.PROTOCOL_VERSION, wire.EPOCH, next_epoch, list(bcfg.shards), list(bcfg.rates)]))
            planner.last = EpochConfig(next_epoch, bcfg.shards, bcfg.rates)
            next_epoch += 1
            next_t += self.interval_ns
            now = time.monotonic_ns()
            if next_t < now:
                next_t = now  # fell behind (slow commit): do not burst to catch up
            self._wait_until(next_t, planner)

    def _drain_rates(self, planner: EpochPlanner) -> None:
        while True:
            try:
                frame = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = wire.unpack(frame)
                if msg[1] == wire.RATE:
                    planner.on_rate(int(msg[2]), int(msg[3]), int(msg[4]), int(msg[5]))
            except Exception:
                log.warning("bad rate report dropped")

    def _wait_until(self, t_ns: int, planner: EpochPlanner) -> None:
        while True:
            left = t_ns - time.monotonic_ns()
            if left <= 0:
                return
            if self.pull.poll(max(1, left // 1_000_000) if left > 1_000_000 else 0):
                self._drain_rates(planner)
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
