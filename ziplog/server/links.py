"""A storage replica's connections to the rest of the cluster, kept to what ZooKeeper
holds (docs/ARCHITECTURE.md, Processes):

* SUB -> every MMS replica's PUB: epoch broadcasts
* PUSH -> every MMS replica's PULL: rate reports (only the leader uses them)
* PUSH -> every failure handler replica's PULL: suspicions (only the leader acts)
* DEALER -> the primary's ROUTER (a backup): HELLO, PREFIX out; FORWARD in
* DEALER -> each replica of a shard it sends NOTICEs to (a primary), made on the first
  notice; one NOTICE goes to one replica of each process that serves several of those it
  tells, which hands it to the others (``NoticeFanout.hand_on``)
"""

from __future__ import annotations

from typing import Callable

from ziplog.cores.effects import Peer
from ziplog.cores.replica import ReplicaSettings
from ziplog.io.ports import Endpoint, Network, StorageCoordination
from ziplog.protocol import frames as f
from ziplog.protocol.auth import ClusterKey
from ziplog.shell.inbound import InboundGuard
from ziplog.shell.throttled_log import ThrottledLog

FrameHandler = Callable[[bytes], None]


def host_of(addr: str) -> str:
    """The host part of a ``tcp://host:port`` address (the address itself if it has none)."""
    rest = addr.split("://", 1)[-1]
    return rest.rsplit(":", 1)[0]


#: what :meth:`ReplicaLinks.follow_topology` saw of the primary
NEW_PRIMARY_LINK = "new primary link"
PRIMARY_GONE = "primary gone"


class ReplicaLinks:
    def __init__(self, settings: ReplicaSettings, net: Network, coord: StorageCoordination, guard: InboundGuard,
                 trouble_log: ThrottledLog, on_epoch_frame: FrameHandler, on_primary_frame: FrameHandler) -> None:
        self.settings = settings
        self.net = net
        self.coord = coord
        self.guard = guard
        self.trouble_log = trouble_log
        self.on_epoch_frame = on_epoch_frame
        self.on_primary_frame = on_primary_frame
        self.primary: Endpoint | None = None
        self.primary_addr: str | None = None
        #: the ZooKeeper session that registered the primary we are linked to
        self.primary_owner: int | None = None
        #: the incarnation the primary's registration names (0: it names none): what our
        #: HELLOs and PREFIXes are meant for, and the only sender whose FORWARDs we take
        self.primary_inc = 0
        #: the primary reads the incarnations HELLO and PREFIX name (``frames.READS_FENCE``):
        #: else they go as the builds before it sent them
        self.primary_fences = False
        #: the primary's registration was seen gone (and the core told), until it is back
        self.primary_gone = False
        self.epochs: Endpoint | None = None  # one SUB on every MMS replica's PUB
        self.epoch_pubs: set[str] = set()
        self.mms_pushes: dict[str, Endpoint] = {}
        self.fh_pushes: dict[str, Endpoint] = {}
        #: a primary's connections to the other shards' replicas (its NOTICEs): (shard,
        #: replica) -> (address, endpoint); made on the first notice to the shard
        self.peer_replicas: dict[tuple[int, int], tuple[str, Endpoint]] = {}

    def report_rates(self, reports: list[f.RateEntry], leader: int, key: ClusterKey) -> int:
        """A turn's rate reports in one RATE frame (or more, past MAX_RATE_REPORTS), sealed,
        to membership service replica ``leader``, as the last epoch broadcast named it; to
        every replica while none is named or its PULL is unknown (a follower drops them
        at no cost). Returns how many messages left."""
        pull = self.coord.topology.mms_pull_of(leader) if leader >= 0 else None
        push = None if pull is None else self.mms_pushes.get(pull)
        pushes = [push] if push is not None else list(self.mms_pushes.values())
        sent = 0
        for i in range(0, len(reports), f.MAX_RATE_REPORTS):
            frame = f.seal(key, f.encode(f.Rate(reports=reports[i:i + f.MAX_RATE_REPORTS])))
            for ep in pushes:
                ep.send(frame)
            sent += len(pushes)
        return sent

    def follow_topology(self) -> str:
        """Connect to new control-plane replicas, and (a backup) to the primary's new
        address: :data:`NEW_PRIMARY_LINK` when a new link to the primary was made (the
        core introduces itself on it), :data:`PRIMARY_GONE` when the primary's
        registration has just left ZooKeeper, else ""."""
        topo = self.coord.topology
        net = self.net
        for pub in topo.mms_pubs():
            if pub not in self.epoch_pubs:
                self.epoch_pubs.add(pub)
                if self.epochs is None:
                    self.epochs = net.subscriber(pub, self.guard.frames("the epoch broadcast", self.on_epoch_frame),
                                                 max_bytes=f.EPOCH_FRAME_LIMIT)
                else:
                    self.epochs.connect(pub)
        for pull in topo.mms_pulls():
            if pull not in self.mms_pushes:
                self.mms_pushes[pull] = net.pusher(pull)
        for pull in topo.fh_pulls():
            if pull not in self.fh_pushes:
                self.fh_pushes[pull] = net.pusher(pull)
        if self.settings.is_primary:
            return ""
        shard = self.settings.shard
        addr = topo.replicas.get(shard, {}).get(0)
        owner = topo.replica_owners.get(shard, {}).get(0)
        inc = topo.replica_incs.get(shard, {}).get(0, 0)
        if not addr:
            if self.primary_addr is not None and not self.primary_gone:
                self.primary_gone = True
                return PRIMARY_GONE
            return ""
        self.primary_gone = False
        # A new address, or another incarnation at the same one (a primary restarted on a
        # fixed port: our old connection would carry on to it, and the restarted primary,
        # waiting for every backup's HELLO, would never hear ours). Every HELLO and PREFIX
        # the old connection still queues was meant for the incarnation before: closing it
        # drops them, and the new incarnation refuses any that reach it all the same.
        if addr == self.primary_addr and owner == self.primary_owner and inc == self.primary_inc:
            return ""
        if self.primary is not None:
            self.primary.close()
        self.primary = net.dealer(addr, self.guard.frames("the primary's link", self.on_primary_frame),
                                  "primary", max_bytes=f.forward_limit(self.settings.forward_batch_bytes,
                                                                       self.settings.max_record_bytes))
        self.primary_addr = addr
        self.primary_owner = owner
        self.primary_inc = inc
        self.primary_fences = topo.replica_reads.get(shard, {}).get(0, 0) >= f.READS_FENCE and inc != 0
        return NEW_PRIMARY_LINK

    def endpoints_for(self, dest: object) -> list[Endpoint]:
        """Where a sealed message to ``dest`` goes: the primary's link (none while it is
        down) or every failure handler replica (a NOTICE to other shards' replicas:
        :meth:`notice_endpoints`)."""
        if dest is Peer.PRIMARY:
            return [] if self.primary is None else [self.primary]
        assert dest is Peer.HANDLER, dest
        return list(self.fh_pushes.values())

    def replicas_of(self, shard: int) -> list[Endpoint]:
        """The connections to ``shard``'s replicas at the addresses ZooKeeper holds now
        (a replica it has none for is skipped: its notice is dropped, and the epoch's
        close is the backstop)."""
        return [ep for _, _, ep in self._replica_links(shard)]

    def notice_endpoints(self, shards: list[int]) -> tuple[list[Endpoint], bool]:
        """Where one NOTICE to every replica of ``shards`` goes, and whether it goes as
        ``hosted`` (for every replica the receiving process serves). With
        ``notice_per_process``, one connection per process: replicas registered at one
        host with one pid share a process (``ziplog.server --serve``), which hands the
        NOTICE to each replica it serves. A NOTICE then costs a message per process, not
        per replica. Unless every replica told registered its pid and reads ``hosted``
        (``frames.READS_STAMP``: a server of an earlier build refuses it), one per replica, not
        hosted."""
        topo = self.coord.topology
        if not self.settings.notice_per_process or any(
                topo.replica_reads.get(s, {}).get(r, 0) < f.READS_STAMP or r not in topo.replica_pids.get(s, {})
                for s in shards for r in topo.replicas.get(s, {})):
            return [ep for s in shards for ep in self.replicas_of(s)], False
        pids = topo.replica_pids
        seen: set[tuple[str, int]] = set()
        out: list[Endpoint] = []
        for shard in shards:
            of_shard = pids.get(shard, {})
            for replica, addr, ep in self._replica_links(shard):
                process = (host_of(addr), of_shard[replica])  # every replica told has one (checked above)
                if process not in seen:
                    seen.add(process)
                    out.append(ep)
        return out, True

    def _replica_links(self, shard: int) -> list[tuple[int, str, Endpoint]]:
        """(replica, address, connection) of every replica of ``shard`` ZooKeeper has an
        address for now; a connection is made on the first notice, and made again when
        the address moved."""
        addrs = self.coord.topology.replicas.get(shard, {})
        peers = self.peer_replicas
        out: list[tuple[int, str, Endpoint]] = []
        for replica in range(self.coord.topology.replica_counts.get(shard, len(addrs))):
            addr = addrs.get(replica)
            cur = peers.get((shard, replica))
            if cur is not None and cur[0] == addr:
                out.append((replica, addr, cur[1]))
                continue
            if cur is not None:
                cur[1].close()
                del peers[(shard, replica)]
            if addr is None:
                continue
            ep = self.net.dealer(addr, self.guard.frames("a peer replica's link", self._on_peer_replica_frame),
                                 "notice", max_bytes=f.CONTROL_FRAME_LIMIT)
            peers[(shard, replica)] = (addr, ep)
            out.append((replica, addr, ep))
        return out

    def _on_peer_replica_frame(self, frame: bytes) -> None:
        """Nothing is answered to a NOTICE but a refusal: worth a line, not an action."""
        try:
            msg = f.decode_reply(frame)
        except f.ProtocolError as exc:
            msg = exc  # type: ignore[assignment]
        self.trouble_log("a peer replica answered a notice", msg)

    def close(self) -> None:
        for ep in [self.primary, self.epochs, *self.mms_pushes.values(), *self.fh_pushes.values(),
                   *(ep for _, ep in self.peer_replicas.values())]:
            if ep is not None:
                ep.close()
