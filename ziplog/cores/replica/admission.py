"""Which inserts a primary may place now (dissertation 4.2.3): the refusals that are final
and the waits that are not.

A refusal is final: a client may then move the record to another shard, so a late
duplicate of the same INSERT must never place it here too; the refused records are
remembered (bounded in number and in time, :class:`~.memory.Memory`) and a resend hears
the first refusal's code again. A wait parks the insert (:class:`~.parking.Parking`) until
the epoch it needs begins here: its rid lies in an epoch not begun yet, or this shard is
joining, or it left and a rejoin may be on its way.
"""

from __future__ import annotations

from typing import Callable

from ziplog.cores.replica.log import DecidedLog
from ziplog.cores.replica.memory import Memory
from ziplog.cores.replica.parking import Parked, Parking
from ziplog.cores.replica.settings import ReplicaSettings
from ziplog.protocol import frames as f
from ziplog.protocol.gsna import EpochConfig, epoch_of

ErrorReply = Callable[[bytes, "int | None", str, str], None]
Key = tuple[int, int]


class Admission:
    def __init__(self, settings: ReplicaSettings, log: DecidedLog, parking: Parking, error: ErrorReply) -> None:
        self.s = settings
        self.shard = settings.shard
        self.log = log
        self.parking = parking
        self.error = error
        #: records refused for good -> the code they were refused with (None: NOT_MEMBER)
        self.refused: Memory[Key, str] = Memory(settings.refusal_memory_ns, settings.max_remembered,
                                                settings.prune_interval_ns)
        #: record -> the epoch it waited in, on a shard that is not a member (it waits one
        #: epoch before a refusal: clients see a rejoin in ZooKeeper before its epoch)
        self.member_wait: dict[Key, int] = {}

    def refuse(self, route: bytes, req_id: int, key: Key, now: int, code: str, message: str) -> None:
        """A final refusal: this primary will never decide this record."""
        self.refused.add(key, now, code)
        self.error(route, req_id, code, message)

    def refused_at_once(self, route: bytes, msg: f.Insert, now: int, blocked_reason: str | None) -> bool:
        """Refuse, for good, what no epoch could make placeable here (True when refused):
        a BLOCKED primary's inserts, a record refused before, one the disk cannot take."""
        key = (msg.client_id, msg.seq)
        if blocked_reason is not None:
            self.refuse(route, msg.req_id, key, now, f.E_NOT_READY, blocked_reason)
            return True
        if key in self.refused or key in self.log.refused:
            # (``log.refused``: what the last recovery's source said the shard will not
            # hold, as the disk holds it, past a restart and the memory's 20 s.)
            # Again with the first refusal's code: a client that asked again meanwhile
            # still learns why (DISK_FULL, TIMEOUT, ...) rather than a bare NOT_MEMBER.
            code = self.refused.get(key) or f.E_NOT_MEMBER
            self.refuse(route, msg.req_id, key, now, code, "this shard refused this record before")
            return True
        refusal = self.log.takes_no_new(len(msg.data), self.s.max_log_bytes)
        if refusal is not None:
            # A record it could not persist is one a restart could lose on every replica
            # at once, and one past its memory bound one for which both could run out of
            # memory at once (they fill together): refuse it, for good, so it goes elsewhere.
            self.refuse(route, msg.req_id, key, now, *refusal)
            return True
        return False

    def park(self, route: bytes, msg: f.Insert, now: int, need_epoch: int) -> None:
        if not self.parking.park(Parked(route, msg, now + self.s.park_timeout_ns, need_epoch=need_epoch, arrived_ns=now)):
            self.refuse(route, msg.req_id, (msg.client_id, msg.seq), now, f.E_OVERLOADED,
                        "too many requests are waiting on this replica")

    def admit(self, route: bytes, msg: f.Insert, now: int, config: EpochConfig | None, member: bool) -> bool:
        """Park when the rid or our epoch is ahead; refuse when this shard takes no
        inserts. True when the insert can be placed now."""
        need_epoch = epoch_of(msg.after + 1)
        have = config.epoch if config is not None else -1
        log = self.log
        if need_epoch > have:
            # "Far beyond" needs a current epoch to measure from: a replica that has seen
            # none yet (a shard just added, a replica just started) parks instead.
            known = config is not None or bool(log.membership)
            if known and need_epoch > max(have, log.last_epoch) + self.s.max_epochs_ahead:
                self.error(route, msg.req_id, f.E_UNKNOWN_RID,
                           f"rid gsn {msg.after} lies in epoch {need_epoch}, far beyond the current epoch {have}")
                return False
            self.park(route, msg, now, need_epoch)
            return False
        if not member:
            if not log.ever_member(self.shard):
                # Never a member yet: we are joining. Clients learn membership from
                # ZooKeeper, which the MMS writes before it broadcasts, so an insert can
                # reach us just before the epoch that admits us does: wait for it.
                self.park(route, msg, now, have + 1)
                return False
            key = (msg.client_id, msg.seq)
            waited = self.member_wait.pop(key, None)
            if waited is None or waited >= have:
                # It left, but clients see a rejoin in ZooKeeper before its epoch reaches
                # us (after a recovery, say): wait for one more epoch before refusing.
                if len(self.member_wait) >= self.s.max_remembered:
                    self.member_wait.clear()  # requests that timed out while waiting
                self.member_wait[key] = have
                self.park(route, msg, now, have + 1)
                return False
            self.refuse(route, msg.req_id, key, now, f.E_NOT_MEMBER, f"shard {self.shard} takes no inserts in epoch {have}")
            return False
        return True

    def parked_insert_expired(self, p: Parked, now: int) -> None:
        """A parked INSERT timed out: that refusal is final too, and a resend hears it
        again as TIMEOUT (a client counts only the answer to its latest resend)."""
        assert isinstance(p.msg, f.Insert)
        self.refused.add((p.msg.client_id, p.msg.seq), now, f.E_TIMEOUT)

    def refused_for_recovery(self, key: Key, now: int) -> None:
        """The recovery's source said the shard will not hold this record."""
        self.refused.add(key, now)
