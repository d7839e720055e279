"""What a storage driver checks of a cluster member's frame before its core sees it, and
the incarnation that fences the messages meant for this start of a replica
(docs/ARCHITECTURE.md, Fencing).

* A recovery step counts only under a generation the failure handler committed in
  ZooKeeper (it writes the record before it sends anything): a generation from nowhere
  would freeze the shard under an authority that does not exist.
* A HELLO that names no incarnation is taken as meant for this primary only from a backup
  whose registration says it is of a build before incarnations (it cannot say); from any
  other it stays unfenced and the core refuses it: a backup of this build names the
  incarnation in every HELLO to a primary that reads it, so an unfenced one from it was
  meant for a primary of the build before, this one's predecessor.
"""

from __future__ import annotations

import secrets

import msgspec

from ziplog.io.ports import CoordinationUnavailable, StorageCoordination
from ziplog.protocol import frames as f

#: Requests that carry a recovery generation.
RECOVERY_REQUESTS = frozenset((f.Probe, f.Acquired, f.Fetch, f.Install, f.Resume))


def new_incarnation() -> int:
    """A nonce for one start of a replica's process: its registration names it, and so
    does every message meant for this start (HELLO, FORWARD, PREFIX, ACK); never 0, which
    names none."""
    return secrets.randbits(63) + 1


class MemberGate:
    """A member's frames, once their MAC is checked, before the core takes them."""

    def __init__(self, shard: int, incarnation: int, coord: StorageCoordination) -> None:
        self.shard = shard
        self.incarnation = incarnation
        self.coord = coord
        #: the highest recovery generation seen committed in ZooKeeper for this shard
        self.committed_gen = -1

    def admit(self, msg: f.Request) -> f.Request:
        """``msg`` as the core is to take it; ProtocolError when it must not be."""
        t = type(msg)
        if t in RECOVERY_REQUESTS:
            self._check_generation(msg)  # type: ignore[arg-type]
        elif t is f.Hello and not msg.to_inc:  # type: ignore[union-attr]
            topo = self.coord.topology
            replica = msg.replica  # type: ignore[union-attr]
            if (replica in topo.replicas.get(self.shard, {})  # registered, and says it reads less (or nothing)
                    and topo.replica_reads.get(self.shard, {}).get(replica, 0) < f.READS_FENCE):
                return msgspec.structs.replace(msg, to_inc=self.incarnation)
        return msg

    def _check_generation(self, msg: f.Probe | f.Acquired | f.Fetch | f.Install | f.Resume) -> None:
        """Read once per new generation."""
        if msg.gen <= self.committed_gen:
            return
        try:
            committed = self.coord.recovery_generation(self.shard)
        except CoordinationUnavailable as exc:  # the handler asks again
            raise f.ProtocolError(f.E_UNCOMMITTED, f"cannot check generation {msg.gen} now: {exc}", msg.req_id) from None
        self.committed_gen = max(self.committed_gen, committed)
        if msg.gen > self.committed_gen:
            raise f.ProtocolError(f.E_UNCOMMITTED, f"recovery generation {msg.gen} is not committed "
                                  f"(ZooKeeper holds {self.committed_gen})", msg.req_id)


def to_backup(msg: f.Frame) -> bytes:
    """A frame to a route: a FORWARD to a backup that named no incarnation goes without
    the fields that name them (a backup of a build before refuses a longer frame)."""
    return f.encode(msg) if type(msg) is not f.Forward or msg.to_inc else f.encode_compact(msg)


def to_primary(msg: f.Frame, fences: bool) -> bytes:
    """A HELLO or PREFIX to the primary: as this build sends it to one that reads the
    incarnations (``fences``), else as the builds before sent it."""
    if fences:
        return f.encode(msg)
    bare = (msgspec.structs.replace(msg, to_inc=0, inc=0) if type(msg) is f.Hello  # type: ignore[type-var]
            else msgspec.structs.replace(msg, to_inc=0))  # type: ignore[type-var]
    return f.encode_compact(bare)
