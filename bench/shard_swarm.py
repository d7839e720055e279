"""Many simulated shards, in one process, as the membership service sees them.

    python -m bench.shard_swarm --zk HOSTS --first 0 --count 4000 --status FILE

The membership service (``mms.server``) knows a shard only through ZooKeeper and two
sockets, so that is all this process reproduces, for every shard in
``first .. first+count-1``:

* **registration**, as a storage server does it (``StorageDriver.start`` through
  ``ziplog.io.zk.StorageCoordination.register_replica``): the persistent
  ``/ziplog/shards/<s>`` = ``{"replicas": R}`` and one ephemeral
  ``/ziplog/shards/<s>/<r>`` = ``{"addr", "pid"}`` per replica, here all owned by this
  process's session (bulk transactions, so thousands of shards register in seconds; the
  shards disappear when this process does, like real servers);
* **the primary's side of the epoch protocol**: one SUB connected to every MMS replica's
  PUB, and one PUSH per MMS replica's PULL (a PUSH connected to several PULLs would
  round-robin). When EPOCH ``e+1`` arrives, every owned shard that was a member of ``e``
  closes it and reports its rate when a primary's rule says so
  (``ziplog.cores.replica.rate_report``): every shard here takes the same load, so one
  reporter's smoothed rate stands for all of them and decides when a change is reported
  (by every member), while the heartbeats and the reports owed to a new leader follow
  each shard's own phase (``heartbeat_due``, ``owed_due``), as real primaries' do. The
  epoch's reports leave in RATE frames of up to ``MAX_RATE_REPORTS`` to the leader the
  broadcast names (to every replica while none is named), as a storage process batches a
  turn's. A full PUSH queue drops the frame, as a storage server's does.

What it does not reproduce: one TCP connection per storage replica. Here one SUB and
one PUSH per MMS replica carry every shard's traffic, so the PUB's fan-out to N x (f+1)
subscribers is not exercised (the experiment reports the bandwidth it would need).

Counters go to ``--status`` (JSON, replaced atomically every 0.5 s and at exit) with a
``time.monotonic()`` stamp, so a harness can take differences over a window.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import zmq
from kazoo.client import KazooClient

from ziplog.cores.replica.rate_report import HEARTBEAT_EPOCHS, RateReporter, owed_due
from ziplog.io import zk as discovery
from ziplog.protocol import frames as wire
from ziplog.protocol.epoch_feed import BlockWanted, EpochFeed
from ziplog.protocol.frames import MAX_RATE_REPORTS
from ziplog.protocol.gsna import EpochConfig
from ziplog.protocol import layout
from ziplog.protocol.auth import ClusterKey
from ziplog.shell.process import add_cluster_key_argument, load_cluster_key

#: Shards per ZooKeeper transaction: (1 + replicas) creates each, far below the 1 MB
#: request limit, and few enough round trips that 8 000 shards register in seconds.
SHARDS_PER_TXN = 250
#: Each storage server queues up to 1000 frames per PUSH (``ZmqRuntime.pusher``),
#: so N servers can keep far more RATEs waiting for a slow leader than one socket with
#: that bound. Ours holds this many epochs of every owned shard's reports instead, so a
#: leader that reads slowly faces a backlog, as it would, rather than early drops.
PUSH_QUEUE_EPOCHS = 10
STATUS_EVERY_S = 0.5


@dataclass
class SwarmCounters:
    """Cumulative counts since start; the harness differences two snapshots."""

    registered: bool = False
    register_s: float = 0.0
    #: MMS replicas this process is connected to
    mms_connected: int = 0
    #: EPOCH frames received (an epoch may be broadcast more than once)
    epoch_frames: int = 0
    #: distinct new epochs taken
    epochs: int = 0
    last_epoch: int = -1
    #: epochs that arrived together with a later one in the same read: closed without
    #: a RATE (a real primary, behind by several epochs, closes the missed ones at once)
    epochs_skipped: int = 0
    #: epochs that did not list every owned shard
    epochs_missing_shards: int = 0
    #: EPOCH_SAME frames whose base was missed: block reads, and epochs not resolved
    block_reads: int = 0
    epochs_unresolved: int = 0
    #: RATE frames queued / dropped on a full PUSH queue, over every MMS replica
    rate_sent: int = 0
    rate_dropped: int = 0
    #: rate reports (one shard's each) in the frames queued
    reports_sent: int = 0
    #: RATE frames queued per MMS replica's PULL address: only the leader reads its
    #: PULL, so the followers' queues fill up and their counts stop growing
    sent_per_mms: dict[str, int] = field(default_factory=dict)
    t: float = 0.0


def rate_entry_head(shard: int) -> bytes:
    """The bytes of one report (a RateEntry) before its ``epoch`` field."""
    return b"\x94" + wire.encode(shard)


def rate_entry_tail(epoch: int, rate: int, busy: bool) -> bytes:
    return wire.encode(epoch) + wire.encode(rate) + wire.encode(busy)


def rate_frame(entries: list[bytes]) -> bytes:
    """A RATE frame of encoded reports: exactly ``wire.encode(wire.Rate(reports=...))``
    (checked at start-up); building it by concatenation keeps thousands of reports per
    epoch cheap."""
    n = len(entries)
    header = bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big")
    return b"\x93" + wire.encode(wire.PROTOCOL_VERSION) + wire.encode(wire.RATE) + header + b"".join(entries)


def register_shards(zk: KazooClient, shards: range, replicas: int, addr: str) -> None:
    """Create every shard's node and its replicas' ephemeral nodes, as storage servers
    do, in pipelined transactions."""
    zk.ensure_path(layout.SHARDS)
    meta = layout.enc({"replicas": replicas})
    replica_info = layout.enc({"addr": addr, "pid": os.getpid()})
    pending = []
    for lo in range(shards.start, shards.stop, SHARDS_PER_TXN):
        txn = zk.transaction()
        for s in range(lo, min(lo + SHARDS_PER_TXN, shards.stop)):
            txn.create(f"{layout.SHARDS}/{s}", meta)
            for r in range(replicas):
                txn.create(f"{layout.SHARDS}/{s}/{r}", replica_info, ephemeral=True)
        pending.append(txn.commit_async())
    for result in pending:
        outcome = result.get(timeout=60)
        failed = [r for r in outcome if isinstance(r, Exception)]
        if failed:
            raise RuntimeError(f"registration transaction failed: {failed[0]!r}")


class ShardSwarm:
    def __init__(self, zk_hosts: str, shards: range, replicas: int, records_per_s: int, send_rates: bool,
                 status_path: Path, key: ClusterKey) -> None:
        self.shards = shards
        #: the swarm stands in for storage replicas: it registers and reports as one
        self.key = key
        self.replicas = replicas
        self.records_per_s = records_per_s
        self.send_rates = send_rates
        self.status_path = status_path
        self.counters = SwarmCounters()
        self.running = True
        self.ctx = zmq.Context()
        # A real storage server's ROUTER address: nothing talks to it here, but the
        # registration carries a reachable endpoint like a real one.
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.addr = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.pushes: dict[str, zmq.Socket] = {}
        self.pubs: set[str] = set()
        self._mms_lock = threading.Lock()
        #: MMS replica id -> its registration
        self._mms_seen: dict[int, dict[str, str]] = {}
        self.pull_of: dict[int, str] = {}
        self.heads = [rate_entry_head(s) for s in shards]
        for n in (1, 20, MAX_RATE_REPORTS):
            probe = rate_frame([self.heads[0] + rate_entry_tail(7, 2000, True)] * n)
            assert probe == wire.encode(wire.Rate(reports=[wire.RateEntry(shard=shards.start, epoch=7, rate=2000,
                                                                          busy=True)] * n))
        #: one reporter stands for every shard (all take the same load): its smoothed
        #: rate and its change test; each shard's phase decides its heartbeats
        self.reporter = RateReporter(shards.start)
        #: shards owed a report by a new leader (they send it at their phase)
        self.owed: set[int] = set()
        self.leader = -1
        self.zk = discovery.connect(zk_hosts, key=key)
        # the epoch being served: (epoch, when it arrived, indexes into heads of the
        # owned shards that are members)
        self.cur_epoch = -1
        self.cur_start_ns = 0
        self.cur_members: list[int] = []
        self._last_shard_list: tuple[int, ...] | None = None
        self.feed = EpochFeed()
        self._cached_members: list[int] = []
        #: the member indexes by heartbeat phase (shard id mod HEARTBEAT_EPOCHS)
        self._by_phase: dict[int, list[int]] = {}

    # -- ZooKeeper ------------------------------------------------------------------------------
    def register(self) -> None:
        t0 = time.monotonic()
        register_shards(self.zk, self.shards, self.replicas, self.addr)
        self.counters.register_s = round(time.monotonic() - t0, 3)
        self.counters.registered = True
        self.zk.ensure_path(layout.MMS_REPLICAS)
        self.zk.ChildrenWatch(layout.MMS_REPLICAS, self._on_mms)
        self.write_status()

    def _on_mms(self, children: list[str]) -> None:
        """kazoo thread: note the MMS replicas' addresses; sockets stay on the main thread."""
        found = {}
        for c in children:
            try:
                data, _ = self.zk.get(f"{layout.MMS_REPLICAS}/{c}")
            except Exception:
                continue
            found[int(c)] = layout.dec(data) or {}
        with self._mms_lock:
            self._mms_seen = found

    def _connect_mms(self) -> None:
        with self._mms_lock:
            seen = dict(self._mms_seen)
        for rid, info in seen.items():
            pub, pull = info.get("pub"), info.get("pull")
            if pull:
                self.pull_of[rid] = pull
            if pub and pub not in self.pubs:
                self.sub.connect(pub)
                self.pubs.add(pub)
            if pull and pull not in self.pushes:
                sock = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, max(1000, PUSH_QUEUE_EPOCHS * len(self.shards)))
                sock.connect(pull)
                self.pushes[pull] = sock
                self.counters.sent_per_mms[pull] = 0
        self.counters.mms_connected = len(self.pushes)

    # -- epochs ----------------------------------------------------------------------------------
    def _owned_members(self, shard_list: tuple[int, ...]) -> list[int]:
        """Indexes (into ``heads``) of the owned shards in an epoch's shard list; cached
        while the list stays the same, which it does between membership changes (the
        epochs of a block share one tuple)."""
        if shard_list is not self._last_shard_list and shard_list != self._last_shard_list:
            lo, hi = self.shards.start, self.shards.stop
            self._cached_members = [s - lo for s in shard_list if lo <= s < hi]
            self._last_shard_list = shard_list
            self._by_phase = {}
            for i in self._cached_members:  # by shard id mod HEARTBEAT_EPOCHS: see heartbeat_due
                self._by_phase.setdefault((lo + i) % HEARTBEAT_EPOCHS, []).append(i)
        return self._cached_members

    def _read_block(self) -> Any:
        """The committed epoch block, as a storage replica reads it for a missed base."""
        self.counters.block_reads += 1
        try:
            return layout.dec(self.zk.get(layout.EPOCH_PATH)[0])
        except Exception:
            return None

    def _take_epochs(self, now_ns: int) -> None:
        latest: EpochConfig | None = None
        leader: int | None = None
        c = self.counters
        while True:
            try:
                frame = self.sub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            c.epoch_frames += 1
            try:
                msg = wire.decode_epoch(frame)
                got = self.feed.on_message(msg)
            except (wire.ProtocolError, ValueError):
                continue
            if isinstance(got, BlockWanted):
                got = self.feed.on_block(got, self._read_block())
            if got is None:
                c.epochs_unresolved += 1
                continue
            epoch = got.epoch
            if epoch <= self.cur_epoch or (latest is not None and epoch <= latest.epoch):
                continue  # an epoch we already have (it may be broadcast twice)
            if latest is not None:
                c.epochs_skipped += 1
            latest, leader = got, msg.leader
            c.epochs += 1
        if latest is None:
            return
        if self.cur_epoch >= 0 and self.send_rates and self.cur_members:
            self._send_rates(self.cur_epoch, now_ns - self.cur_start_ns)
        if leader is not None and leader != self.leader:
            self.leader = leader  # a new leader is owed every shard's report
            self.owed = set(range(len(self.shards)))
        members = self._owned_members(latest.shards)
        if len(members) != len(self.shards):
            c.epochs_missing_shards += 1
        self.cur_epoch, self.cur_start_ns, self.cur_members = latest.epoch, now_ns, members
        c.last_epoch = self.cur_epoch

    def _reporting(self, epoch: int, duration_ns: int) -> list[int]:
        """Indexes (into ``heads``) of the member shards that report as ``epoch`` closes
        after ``duration_ns``: all when the load changed what was reported, else those
        whose heartbeat or owed report falls on this epoch (shard ids spread both over
        the epochs)."""
        members = self.cur_members
        first = self.shards.start
        duration_ns = max(duration_ns, 1)
        if self.reporter.observe(self.records_per_s * duration_ns // 1_000_000_000, duration_ns):
            self.reporter.report(epoch)
            self.owed.clear()
            return members
        # heartbeat_due(shard, epoch) holds for the shards of the epoch's phase
        due = self._by_phase.get(epoch % HEARTBEAT_EPOCHS, [])
        if self.owed:
            owed = [i for i in self.owed if owed_due(first + i, epoch)]
            self.owed.difference_update(owed)
            due = sorted(set(due) | set(owed))
        return due

    def _send_rates(self, epoch: int, duration_ns: int) -> None:
        reporting = self._reporting(epoch, duration_ns)
        if not reporting:
            return
        rep = self.reporter.reported
        assert rep is not None
        tail = rate_entry_tail(epoch, rep.rate, rep.busy)
        heads = self.heads
        seal, key = wire.seal, self.key
        frames = [seal(key, rate_frame([heads[i] + tail for i in reporting[k:k + MAX_RATE_REPORTS]]))
                  for k in range(0, len(reporting), MAX_RATE_REPORTS)]
        leader = self.pull_of.get(self.leader)
        targets = [(leader, self.pushes[leader])] if leader in self.pushes else list(self.pushes.items())
        c = self.counters
        for addr, sock in targets:
            sent = 0
            for frame in frames:
                try:
                    sock.send(frame, zmq.NOBLOCK)
                except zmq.Again:
                    break  # queue full: the rest would drop too
                sent += 1
            c.rate_sent += sent
            c.rate_dropped += len(frames) - sent
            c.reports_sent += sum(min(MAX_RATE_REPORTS, len(reporting) - k * MAX_RATE_REPORTS) for k in range(sent))
            c.sent_per_mms[addr] += sent

    # -- loop ---------------------------------------------------------------------------------------
    def write_status(self) -> None:
        self.counters.t = time.monotonic()
        tmp = self.status_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self.counters)))
        os.replace(tmp, self.status_path)

    def serve(self) -> None:
        next_status = time.monotonic() + STATUS_EVERY_S
        while self.running:
            self._connect_mms()
            if self.sub.poll(50):
                self._take_epochs(time.monotonic_ns())
            if time.monotonic() >= next_status:
                self.write_status()
                next_status = time.monotonic() + STATUS_EVERY_S

    def close(self) -> None:
        try:
            self.write_status()
        except OSError:
            pass
        discovery.stop(self.zk)
        self.ctx.destroy(linger=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.shard_swarm", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--zk", required=True, help="ZooKeeper hosts (a chroot suffix is allowed)")
    ap.add_argument("--first", type=int, default=0, help="first shard id")
    ap.add_argument("--count", type=int, required=True, help="number of shards")
    ap.add_argument("--replicas", type=int, default=2, help="replicas registered per shard (f+1)")
    ap.add_argument("--records-per-s", type=int, default=2000,
                    help="load each shard reports in RATE (default: the planner's default rate)")
    ap.add_argument("--no-rates", action="store_true", help="never send RATE (to isolate its cost)")
    ap.add_argument("--status", type=Path, required=True, help="JSON counters file")
    add_cluster_key_argument(ap)
    args = ap.parse_args(argv)
    swarm = ShardSwarm(args.zk, range(args.first, args.first + args.count), args.replicas, args.records_per_s,
                       not args.no_rates, args.status, load_cluster_key(args.cluster_key_file))

    def stop(signum: int, frame: Any) -> None:
        swarm.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        swarm.register()
        swarm.serve()
    finally:
        swarm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
