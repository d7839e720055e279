"""Failure handler replica process: the thin shell around :class:`RecoveryCore`.

    python -m failure_handler.server --zk HOSTS --id N [--group G --groups K]

Several replicas run per group; a kazoo Election per group picks the leader, which
alone acts, for the shards it owns (shard % K == G; one group owns all by default).
Sockets:

  * PULL (bound, address in ``/ziplog/fh/replicas/<id>``): SUSPECT reports, pushed by
    storage replicas to every handler replica
  * DEALER -> each storage replica's ROUTER: PROBE, ACQUIRED, FETCH, INSTALL, RESUME

Everything the handler decides is in ZooKeeper before it acts on it: the recovery
record ``/ziplog/recovery/<shard>`` (chunked when large) and the shard's
``recovering`` flag, written in one version-checked transaction, so a deposed
leader cannot overwrite its successor and a new leader continues from the record.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

import zmq
from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NoNodeError, NodeExistsError

from ziplog.io import zk as discovery
from ziplog.protocol import frames as wire
from ziplog.server.elected import ElectedReplica, serve

from .recovery import HandlerSettings, Persist, RecoveryCore, Send

log = logging.getLogger("failure_handler")

#: ZooKeeper's default limit on a request is 1 MiB: larger records are split.
CHUNK_BYTES = 512 * 1024


# -- the durable record ------------------------------------------------------------------------
def read_record(zk: KazooClient, shard: int) -> tuple[dict[str, Any] | None, int]:
    """The shard's recovery record and the version of its node (-1: none yet)."""
    path = f"{discovery.RECOVERY}/{shard}"
    try:
        data, stat = zk.get(path)
    except NoNodeError:
        return None, -1
    head = discovery.dec(data)
    if not head:
        return None, stat.version
    if "chunks" in head:
        blob = b"".join(zk.get(f"{path}/{name}")[0] for name in head["chunks"])
        return discovery.dec(blob), stat.version
    return head, stat.version


def write_record(zk: KazooClient, shard: int, record: dict[str, Any], recovering: bool, version: int) -> int:
    """Write the record and set or clear the shard's recovering flag atomically; returns
    the record node's new version. Raises BadVersionError if another leader wrote since
    ``version``.

    ZooKeeper limits a whole request (a transaction included) to about 1 MiB, so a large
    record goes first into chunk nodes no reader looks at yet; one transaction then
    points the record node at them and sets the flag; chunks of earlier versions go last."""
    path = f"{discovery.RECOVERY}/{shard}"
    meta_path = f"{discovery.SHARDS}/{shard}"
    blob = discovery.enc(record)
    if version < 0:
        try:
            zk.create(path, b"")
        except NodeExistsError:
            raise BadVersionError(f"recovery record of shard {shard} created under us") from None
        version = 0
    names: list[str] = []
    head = blob
    if len(blob) > CHUNK_BYTES:
        tag = f"v{version + 1}"  # unique: only the writer of version+1 can commit it
        for i in range(0, len(blob), CHUNK_BYTES):
            name = f"{tag}-{i // CHUNK_BYTES}"
            try:
                zk.create(f"{path}/{name}", blob[i:i + CHUNK_BYTES])
            except NodeExistsError:  # left by a writer that failed before committing
                zk.set(f"{path}/{name}", blob[i:i + CHUNK_BYTES])
            names.append(name)
        head = discovery.enc({"gen": record["gen"], "phase": record["phase"], "chunks": names})
    for _attempt in range(10):
        meta_data, meta_stat = zk.get(meta_path)
        meta = discovery.dec(meta_data) or {}
        if recovering:
            meta["recovering"] = record["gen"]
        else:
            meta.pop("recovering", None)
        txn = zk.transaction()
        txn.set_data(path, head, version=version)
        txn.set_data(meta_path, discovery.enc(meta), version=meta_stat.version)
        results = txn.commit()
        if not any(isinstance(r, Exception) for r in results):
            for child in zk.get_children(path):
                if child not in names:
                    zk.delete(f"{path}/{child}")
            return results[0].version
        if isinstance(results[0], BadVersionError):
            raise BadVersionError(f"recovery record of shard {shard} changed under us")
        # The shard's metadata changed (a concurrent remove): read it again.
    raise RuntimeError(f"could not write the recovery record of shard {shard}")


class FailureHandlerReplica(ElectedReplica):
    kind = "failure_handler"

    def __init__(self, zk_hosts: str, replica_id: int, host: str = "127.0.0.1",
                 settings: HandlerSettings | None = None, group: int = 0, groups: int = 1) -> None:
        assert 0 <= group < groups
        super().__init__(zk_hosts, replica_id, discovery.fh_election_path(group))
        self.group, self.groups = group, groups
        self.settings = settings or HandlerSettings()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        port = self.pull.bind_to_random_port(f"tcp://{host}")
        self.addr = f"tcp://{host}:{port}"

    def start(self) -> None:
        self.zk.ensure_path(discovery.FH_REPLICAS)
        self.zk.ensure_path(discovery.RECOVERY)
        node = f"{discovery.FH_REPLICAS}/{self.group}-{self.id}"
        try:
            self.zk.delete(node)
        except NoNodeError:
            pass
        self.zk.create(node, discovery.enc({"pull": self.addr, "pid": os.getpid()}), ephemeral=True)
        self.topology = discovery.Topology(self.zk)
        log.info("failure handler replica %d up: %s", self.id, self.addr)

    # -- leader ---------------------------------------------------------------------------------
    def lead(self) -> None:
        try:
            _Leader(self).loop()
        except BadVersionError as e:
            log.warning("stepping down: %s", e)


class _Leader:
    """One term of leadership: the core, its sockets, and the record versions it wrote."""

    def __init__(self, owner: FailureHandlerReplica) -> None:
        self.o = owner
        self.core = RecoveryCore(owner.settings)
        self.versions: dict[int, int] = {}
        self.dealers: dict[tuple[int, int], tuple[str, zmq.Socket]] = {}
        self.by_sock: dict[zmq.Socket, tuple[int, int]] = {}
        self.poller = zmq.Poller()
        self.poller.register(owner.pull, zmq.POLLIN)
        self.seen_gen = -1

    def loop(self) -> None:
        o, core, topo = self.o, self.core, self.o.topology
        # Suspicions queued while we were not leading may be stale; the replicas repeat
        # theirs while they stay suspicious.
        while True:
            try:
                o.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        o.zk.sync(discovery.RECOVERY)
        while o.running and not o.lost.is_set():
            now = time.monotonic_ns()
            if topo._generation != self.seen_gen:
                self.seen_gen = topo._generation
                self._sync_topology(now)
            deadline = core.next_deadline()
            wait_ms = 50 if deadline is None else max(0, min(50, (deadline - now) // 1_000_000 + 1))
            for sock, _ in self.poller.poll(wait_ms):
                self._drain(sock, time.monotonic_ns())
            core.tick(time.monotonic_ns())
            self._act()

    def _sync_topology(self, now: int) -> None:
        topo, core = self.o.topology, self.core
        for shard, n in topo.replica_counts.items():
            if shard % self.o.groups != self.o.group:
                continue  # another group's shard: its SUSPECTs are ignored here
            if shard not in core.replica_counts and n > 0:
                record, version = read_record(self.o.zk, shard)
                self.versions[shard] = version
                core.load(shard, n, record, now)
        for shard, addrs in topo.replicas.items():
            for replica, addr in addrs.items():
                cur = self.dealers.get((shard, replica))
                if cur is not None and cur[0] == addr:
                    continue
                if cur is not None:
                    self.poller.unregister(cur[1])
                    del self.by_sock[cur[1]]
                    cur[1].close(0)
                sock = self.o.ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(addr)
                self.dealers[(shard, replica)] = (addr, sock)
                self.by_sock[sock] = (shard, replica)
                self.poller.register(sock, zmq.POLLIN)
        core.on_history(topo.history, now)
        self._act()

    def _drain(self, sock: zmq.Socket, now: int) -> None:
        core = self.core
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = wire.unpack(frame)
            except Exception:
                continue
            if sock is self.o.pull:
                if type(msg) is list and len(msg) >= 5 and msg[1] == wire.SUSPECT:
                    log.info("shard %s replica %s suspects: %s", msg[2], msg[3], msg[4])
                    core.on_suspect(int(msg[2]), int(msg[3]), now)
            else:
                shard, replica = self.by_sock[sock]
                core.on_reply(shard, replica, msg, now)

    def _act(self) -> None:
        core = self.core
        while core.actions:
            actions, core.actions = core.actions, []
            for a in actions:
                if isinstance(a, Send):
                    d = self.dealers.get((a.shard, a.replica))
                    if d is not None:  # not registered (down): the core retries
                        try:
                            d[1].send(a.frame, zmq.NOBLOCK)
                        except zmq.Again:
                            pass
                elif isinstance(a, Persist):
                    v = self.versions.get(a.shard, -1)
                    self.versions[a.shard] = write_record(self.o.zk, a.shard, a.record, a.recovering, v)
                    log.info("shard %d recovery %d: %s", a.shard, a.record["gen"], a.record["phase"])
                    core.on_persisted(a.shard, a.record["gen"], time.monotonic_ns())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="failure_handler.server", description="ziplog failure handler replica")
    ap.add_argument("--zk", required=True)
    ap.add_argument("--id", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--retry-ms", type=float, default=HandlerSettings.retry_ns / 1e6)
    ap.add_argument("--group", type=int, default=0, help="this replica's group: it owns shards with shard %% groups == group")
    ap.add_argument("--groups", type=int, default=1)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    replica = FailureHandlerReplica(args.zk, args.id, args.host, HandlerSettings(retry_ns=int(args.retry_ms * 1e6)),
                                    group=args.group, groups=args.groups)
    return serve(replica)


if __name__ == "__main__":
    sys.exit(main())
