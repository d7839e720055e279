"""A replica's restart (sans-I/O): the decided log rebuilt from its disk, and what a
graceful stop may vouch for so that the next start need not hear the others out (the
clean-close marker: docs/ARCHITECTURE.md, Persistence)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from ziplog.cores.replica.backup import BackupFollower
from ziplog.cores.replica.primary import PrimarySequencer
from ziplog.cores.replica.recovery import RecoveryPhase
from ziplog.protocol.events import DiskEvent

if TYPE_CHECKING:
    from ziplog.cores.replica.core import ReplicaCore


def replay(core: ReplicaCore, events: Iterable[DiskEvent], clean_frontier: int | None) -> None:
    """Rebuild ``core``'s decided log from persisted events. ``clean_frontier``: what the
    last incarnation vouched for at a graceful stop (:func:`clean_close_frontier`); a
    replica whose replayed log ends exactly there restarts clean."""
    log, role = core.log, core.role
    log.replay(events)
    core.recovery.restore(log.recovery_mark)
    if isinstance(role, PrimarySequencer):
        role.fwd.mark_point()
    if clean_frontier is not None and clean_frontier == log.frontier:
        role.restart_clean()


def clean_close_frontier(core: ReplicaCore) -> int | None:
    """What a graceful stop may vouch for, once every event decided is written, in no
    recovery and with no disk fault: the frontier of a primary that holds every record
    any replica acknowledged (serving, or restarted clean and not deciding yet), or of a
    backup that holds every record it acknowledged in its log alone (in step, or
    restarted clean, with no guess outstanding: guesses live in memory only). None
    otherwise: a replica that cannot know, whose next incarnation must hear the others
    out."""
    role = core.role
    if (not role.holds_everything_acked or core.recovery.phase is not RecoveryPhase.NORMAL
            or core.log.disk_fault is not None):
        return None
    if isinstance(role, BackupFollower) and role.guessing:
        return None
    return core.log.frontier
