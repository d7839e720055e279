"""Storage server process: the thin ZeroMQ shell around :class:`ReplicaCore`.

    python -m ziplog.server --zk HOSTS --shard S --replica R [--replicas N] [--data-dir D]

Sockets:
  * ROUTER (bound): clients, and backups' HELLO/PREFIX when this is the primary
  * DEALER -> primary's ROUTER (backups only): HELLO, PREFIX out; FORWARD in
  * SUB -> every MMS replica's PUB: epoch broadcasts
  * PUSH -> every MMS replica's PULL: rate reports (only the leader uses them)
  * PUSH -> every failure handler replica's PULL: suspicions (only the leader acts)
  * PAIR (inproc): wake-ups from ZooKeeper watch threads
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import zmq
from kazoo.exceptions import NodeExistsError

from ziplog.io import zk as discovery
from ziplog.protocol import frames as wire
from ziplog.protocol.gsna import EpochConfig
from ziplog.cores.replica import EV_STABLE, TO_HANDLER, TO_MMS, TO_PRIMARY, ReplicaCore, ReplicaSettings
from ziplog.io.segments import SegmentLog

log = logging.getLogger("ziplog.server")

# Plain ints: pyzmq's flag enums cost a Python-level enum operation per send.
POLLIN = int(zmq.POLLIN)
NOBLOCK = int(zmq.NOBLOCK)
SNDMORE = int(zmq.SNDMORE)
DISK_FLUSH_NS = 5_000_000
MIN_TICK_NS = 500_000


class StorageServer:
    def __init__(self, zk_hosts: str, settings: ReplicaSettings, data_dir: Path | None,
                 fsync: str = "interval", host: str = "127.0.0.1", port: int = 0, fsync_interval: float = 1.0) -> None:
        self.settings = settings
        self.core = ReplicaCore(settings)
        self.zk = discovery.connect(zk_hosts)
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.SNDHWM, 100_000)
        self.router.setsockopt(zmq.RCVHWM, 100_000)
        self.router.setsockopt(zmq.LINGER, 0)
        if port:
            self.router.bind(f"tcp://{host}:{port}")
        else:
            port = self.router.bind_to_random_port(f"tcp://{host}")
        self.addr = f"tcp://{host}:{port}"
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.dealer: zmq.Socket | None = None
        self.primary_addr: str | None = None
        self.pushes: dict[str, zmq.Socket] = {}
        self.fh_pushes: dict[str, zmq.Socket] = {}
        self.pubs: set[str] = set()
        # Watch threads only poke this PAIR; all socket work stays on the loop thread.
        self.wake_rx = self.ctx.socket(zmq.PAIR)
        self.wake_rx.bind(f"inproc://wake-{id(self)}")
        self.wake_tx = self.ctx.socket(zmq.PAIR)
        self.wake_tx.connect(f"inproc://wake-{id(self)}")
        self.running = True
        self.seglog: SegmentLog | None = None
        if data_dir is not None:
            self.seglog = SegmentLog(Path(data_dir) / f"shard{settings.shard}-replica{settings.replica}", fsync=fsync,
                                     fsync_interval=fsync_interval)
            self.core.replay(self.seglog.load())
            self.seglog.start(self.core.snapshot())
        self._disk_buf: list[tuple[Any, ...]] = []
        self._dropped_below = 0
        self._last_disk_ns = 0

    # -- start-up ---------------------------------------------------------------------------
    def start(self) -> None:
        s = self.settings
        shard_path = f"{discovery.SHARDS}/{s.shard}"
        try:
            self.zk.create(shard_path, discovery.enc({"replicas": s.replicas}), makepath=True)
        except NodeExistsError:
            pass
        self.topology = discovery.Topology(self.zk)
        self.topology.on_change(self._poke)
        self._refresh_peers()
        # Epochs arrive by broadcast; the first one we see is preceded by the ones we
        # missed, filled in from the membership history (see _on_epoch).
        node = f"{shard_path}/{s.replica}"
        try:
            self.zk.delete(node)  # a stale ephemeral of our previous life
        except Exception:
            pass
        self.zk.create(node, discovery.enc({"addr": self.addr, "pid": os.getpid()}), ephemeral=True)
        log.info("shard %d replica %d serving on %s", s.shard, s.replica, self.addr)

    def _poke(self) -> None:
        try:
            self.wake_tx.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _push_socket(self, addr: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.connect(addr)
        return sock

    def _refresh_peers(self) -> None:
        topo = self.topology
        for info in topo.mms.values():
            pub, pull = info.get("pub"), info.get("pull")
            if pub and pub not in self.pubs:
                self.sub.connect(pub)
                self.pubs.add(pub)
            if pull and pull not in self.pushes:
                self.pushes[pull] = self._push_socket(pull)
        for info in topo.fh.values():
            pull = info.get("pull")
            if pull and pull not in self.fh_pushes:
                self.fh_pushes[pull] = self._push_socket(pull)
        if not self.settings.is_primary:
            addr = topo.replicas.get(self.settings.shard, {}).get(0)
            if addr and addr != self.primary_addr:
                if self.dealer is not None:
                    self.poller.unregister(self.dealer)
                    self.dealer.close(0)
                self.dealer = self.ctx.socket(zmq.DEALER)
                self.dealer.setsockopt(zmq.LINGER, 0)
                self.dealer.setsockopt(zmq.SNDHWM, 100_000)
                self.dealer.setsockopt(zmq.RCVHWM, 100_000)
                self.dealer.connect(addr)
                self.primary_addr = addr
                if hasattr(self, "poller"):
                    self.poller.register(self.dealer, zmq.POLLIN)
                self.core.connect_primary(time.monotonic_ns())

    def _on_epoch(self, cfg: EpochConfig) -> None:
        core = self.core
        now = time.monotonic_ns()
        gap = core.missed_before(cfg)
        if gap is not None:
            # Missed broadcasts (start-up, restart, or a slow moment): the history in
            # ZooKeeper names the members of the epochs we never saw.
            self.zk.sync(discovery.MEMBERSHIP_PATH)
            data, _ = self.zk.get(discovery.MEMBERSHIP_PATH)
            history = discovery.dec(data) or []
            for first, last, members in discovery.history_ranges(history, *gap):
                core.on_missed_epochs(first, last, members, now)
        core.on_epoch(cfg, now)

    # -- loop -------------------------------------------------------------------------------
    def serve(self) -> None:
        core = self.core
        router, sub, wake = self.router, self.sub, self.wake_rx
        self.poller = poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(sub, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        if self.dealer is not None:
            poller.register(self.dealer, zmq.POLLIN)
        decode = wire.decode_request
        unpack = wire.unpack
        next_tick = 0
        while self.running:
            now = time.monotonic_ns()
            deadline = core.next_deadline(now)
            wait_ns = 100_000_000 if deadline is None else max(deadline, next_tick) - now
            if self.seglog is not None and self._disk_buf:
                wait_ns = min(wait_ns, self._last_disk_ns + DISK_FLUSH_NS - now)
            timeout_ms = 0 if wait_ns <= 0 else min(100, -(-wait_ns // 1_000_000))
            events = dict(poller.poll(timeout_ms))
            now = time.monotonic_ns()
            if router in events:
                # EVENTS before each recv instead of catching zmq.Again: an exception per
                # drained socket costs more than the request itself.
                for _ in range(256):
                    if not int(router.getsockopt(zmq.EVENTS)) & POLLIN:
                        break
                    route = router.recv()
                    frame = router.recv()
                    if router.getsockopt(zmq.RCVMORE):
                        extra = 1
                        while router.getsockopt(zmq.RCVMORE):
                            router.recv()
                            extra += 1
                        core.error(route, None, wire.E_MALFORMED, f"a request is one frame, got {extra + 1}")
                        continue
                    try:
                        msg = decode(frame)
                    except wire.ProtocolError as exc:
                        core.error(route, exc.req_id, exc.code, exc.message)
                        continue
                    core.on_request(route, msg, now)
                    if core.outbox:
                        # Acks leave now, before forwards and bookkeeping: that is the
                        # client's critical path.
                        self._send(core.outbox)
                        core.outbox = []
            dealer = self.dealer
            if dealer is not None and dealer in events:
                for _ in range(256):
                    if not int(dealer.getsockopt(zmq.EVENTS)) & POLLIN:
                        break
                    frame = dealer.recv()
                    try:
                        msg = unpack(frame)
                    except Exception:
                        continue
                    if type(msg) is list and len(msg) == 4 and msg[1] == wire.FORWARD:
                        core.on_forward(msg, now)
                    elif type(msg) is list and len(msg) >= 5 and msg[1] == wire.ERROR:
                        log.error("primary refused us: %s %s", msg[3], msg[4])
            if sub in events:
                while True:
                    try:
                        frame = sub.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        msg = unpack(frame)
                        if msg[1] == wire.EPOCH:
                            self._on_epoch(EpochConfig(msg[2], tuple(msg[3]), tuple(msg[4])))
                    except Exception:
                        log.exception("bad epoch broadcast")
            if wake in events:
                while True:
                    try:
                        wake.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                self._refresh_peers()
            if now >= next_tick:
                core.tick(now)
                next_tick = now + MIN_TICK_NS
            if core.replay_epoch is not None:
                cfg, core.replay_epoch = core.replay_epoch, None
                self._on_epoch(cfg)
            core.flush(now)
            if core.outbox:
                self._send(core.outbox)
                core.outbox = []
            if self.seglog is not None:
                if core.disk:
                    self._disk_buf.extend(core.disk)
                    core.disk.clear()
                if self._disk_buf and now - self._last_disk_ns >= DISK_FLUSH_NS:
                    self._flush_disk(now)
                if self.seglog.error is not None:
                    raise RuntimeError("segment fsync failed") from self.seglog.error
            else:
                core.disk.clear()

    def _send(self, outbox: list[tuple[Any, bytes]]) -> None:
        router = self.router
        for dest, frame in outbox:
            if type(dest) is bytes:
                try:
                    router.send(dest, SNDMORE | NOBLOCK)
                    router.send(frame, NOBLOCK)
                except zmq.Again:
                    log.warning("dropped a frame to a slow peer")
            elif dest == TO_PRIMARY:
                if self.dealer is not None:
                    self.dealer.send(frame, NOBLOCK)
            elif dest == TO_MMS or dest == TO_HANDLER:
                for sock in (self.pushes if dest == TO_MMS else self.fh_pushes).values():
                    try:
                        sock.send(frame, NOBLOCK)
                    except zmq.Again:
                        pass

    def _flush_disk(self, now: int) -> None:
        assert self.seglog is not None
        core = self.core
        self._disk_buf.append((wire.EV_FRONTIER, core.frontier, core.last_epoch, 0))
        self._disk_buf.append((EV_STABLE, core.stable))
        self.seglog.append(self._disk_buf, core.snapshot())
        self._disk_buf = []
        self._last_disk_ns = now
        # Whole segment files below that point can go (every segment opens with a
        # snapshot, so recovery never needs an older one).
        cut = core.deletable_below
        if cut > self._dropped_below:
            self.seglog.drop_below(cut)
            self._dropped_below = cut

    def close(self) -> None:
        if self.seglog is not None:
            if self.core.disk:
                self._disk_buf.extend(self.core.disk)
            self._flush_disk(time.monotonic_ns())
            self.seglog.close()
        try:
            self.zk.stop()
            self.zk.close()
        except Exception:
            pass
        self.ctx.destroy(linger=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ziplog.server", description="ziplog storage server (one replica of one shard)")
    ap.add_argument("--zk", required=True, help="ZooKeeper hosts, host:port[,host:port...]")
    ap.add_argument("--shard", type=int, required=True)
    ap.add_argument("--replica", type=int, required=True, help="0 is the primary")
    ap.add_argument("--replicas", type=int, default=2, help="replicas per shard (f+1)")
    ap.add_argument("--data-dir", type=Path, default=None, help="where segment files live (none: memory only)")
    ap.add_argument("--fsync", choices=["never", "interval", "always"], default="interval",
                    help="when segment writes are fsynced (interval: every --fsync-interval seconds)")
    ap.add_argument("--fsync-interval", type=float, default=1.0)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--noop-timeout-us", type=int, default=1000)
    ap.add_argument("--max-record-bytes", type=int, default=1 << 20)
    ap.add_argument("--forward-interval-us", type=int, default=0,
                    help="batch forwarded decisions for up to this long (fewer messages, later stability)")
    ap.add_argument("--prefix-interval-us", type=int, default=0)
    ap.add_argument("--heartbeat-ms", type=float, default=ReplicaSettings.heartbeat_ns / 1e6,
                    help="an idle replica tells its peers it is alive this often")
    ap.add_argument("--suspect-timeout-ms", type=float, default=ReplicaSettings.suspect_timeout_ns / 1e6,
                    help="a peer silent this long is suspected and failure recovery asked for (0: never)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = ReplicaSettings(shard=args.shard, replica=args.replica, replicas=args.replicas,
                               max_record_bytes=args.max_record_bytes, noop_timeout_ns=args.noop_timeout_us * 1000,
                               forward_interval_ns=args.forward_interval_us * 1000,
                               prefix_interval_ns=args.prefix_interval_us * 1000,
                               heartbeat_ns=int(args.heartbeat_ms * 1e6), suspect_timeout_ns=int(args.suspect_timeout_ms * 1e6))
    server = StorageServer(args.zk, settings, args.data_dir, fsync=args.fsync, host=args.host, port=args.port,
                           fsync_interval=args.fsync_interval)

    def stop(signum: int, frame: Any) -> None:
        server.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server.start()
        server.serve()
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
