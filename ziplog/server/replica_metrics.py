"""A storage replica's Prometheus metrics: what its core and driver already count, read
at scrape time (``--metrics-port``; docs/ARCHITECTURE.md, Metrics)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ziplog.cores.replica import ReplicaCore, ReplicaSettings
from ziplog.cores.replica.primary import PrimarySequencer, PrimaryState
from ziplog.cores.replica.recovery import RecoveryPhase
from ziplog.io.ports import Disk
from ziplog.protocol.gsna import epoch_of
from ziplog.shell.metrics import Durations, counter, counters, directory_bytes, gauge, histogram, histograms, one_of

if TYPE_CHECKING:
    from prometheus_client.core import Metric


class MeteredReplica(Protocol):
    """What the metrics read of a replica's driver (a ``StorageDriver``)."""

    settings: ReplicaSettings
    core: ReplicaCore
    disk: Disk | None
    disk_fault: str | None
    refused_frames: dict[str, int]
    park_waits: dict[str, Durations]
    insert_turns: Durations

    @property
    def buffered_events(self) -> int: ...


def replica_metrics(driver: MeteredReplica) -> list[Metric]:
    """Prometheus families from the counters and state a replica's core and driver keep;
    called at scrape time from the metrics server's thread (plain reads: no lock)."""
    s = driver.settings
    lb = {"shard": str(s.shard), "replica": str(s.replica)}
    return _role_and_requests(driver, lb) + _log_and_state(driver, lb)


def _role_and_requests(driver: MeteredReplica, lb: dict[str, str]) -> list[Metric]:
    """The role, and what the replica did with the requests it took."""
    core, s = driver.core, driver.settings
    stats = dict(core.stats)
    role = core.role
    state = getattr(role, "state", None)
    return [
        gauge("ziplog_replica_primary", "1 on the shard's primary (replica 0), 0 on a backup", int(s.is_primary), lb),
        one_of("ziplog_replica_primary_state", "the primary's state (1 for the current one; a backup shows none)",
               "state", [st.value for st in PrimaryState], state.value if state is not None else None, lb),
        gauge("ziplog_replica_blocked", "1 while this primary refuses every insert until a recovery (it lost "
              "state a backup holds)", int(core.blocked is not None), lb),
        gauge("ziplog_replica_backups_connected", "backups whose HELLO this primary holds",
              len(role.fwd.backup_routes) if isinstance(role, PrimarySequencer) else 0, lb),
        counter("ziplog_replica_inserts", "new inserts this replica took (a duplicate or refused-before-the-role "
                "insert excluded; a parked insert resent counts again)", stats["inserts"], lb),
        counter("ziplog_replica_fast_acks", "backup: inserts answered with this replica's own guess (the fast "
                "path's ACK; a guess the primary decided otherwise is also counted in reacks)",
                stats["fast_acks"], lb),
        counter("ziplog_replica_reacks", "backup: inserts re-acknowledged with the primary's decided gsn because "
                "this replica's first answer (a guess or NO_GUESS) differed: each is a slow-path insert",
                stats["reacks"], lb),
        counter("ziplog_replica_confirmed_guesses", "backup: guesses the primary decided the same (each is a "
                "fast-path insert of a client that waited for this replica): confirmed_guesses + reacks counts "
                "the inserts this backup answered", stats["confirmed_guesses"], lb),
        counters("ziplog_replica_wrong_guesses", "backup: guesses the primary decided at another gsn, by why: "
                 "epoch (the replicas switched epochs at different moments), ahead or behind (a slot above or "
                 "below the primary's in the same epoch)", "kind",
                 {k: stats[f"wrong_guesses_{k}"] for k in ("epoch", "ahead", "behind")}, lb),
        counter("ziplog_replica_guesses_displaced", "backup: guesses dropped because the primary decided another "
                "record at their gsn", stats["guesses_displaced"], lb),
        counter("ziplog_replica_reads", "reads and ranges served", stats["reads"], lb),
        counter("ziplog_replica_errors", "error replies sent (every refusal, whatever its code)", stats["errors"], lb),
        counters("ziplog_replica_refused_frames", "requests refused by the driver before the core saw them, by "
                 "error code (undecodable, badly signed, an uncommitted recovery generation)", "code",
                 dict(driver.refused_frames), lb),
        counters("ziplog_replica_errors_by_code", "error replies the core sent, by code (NOT_READY, TIMEOUT, "
                 "DISK_FULL, TRIMMED, ...)", "code", dict(core.errors_by_code), lb),
        counter("ziplog_replica_inbound_failures", "inbound messages whose handling failed (contained; see the "
                "log)", core.driver_stats.get("inbound_failures", 0), lb),
        counter("ziplog_replica_passed_on_notice", "primary: times it passed its unused slots as no-ops on a NOTICE",
                stats.get("passed_on_notice", 0), lb),
        counter("ziplog_replica_passed_by_clock", "inserts placed (primary) or guessed (backup) past slots expected "
                "before their stamps", stats.get("passed_by_clock", 0), lb),
        counter("ziplog_replica_expired_by_clock", "primary: times a shard scheduled busy passed its slots while no "
                "insert came", stats.get("expired_by_clock", 0), lb),
        counter("ziplog_replica_notices_by_clock", "NOTICEs not sent to a shard: every replica of it passes its slots "
                "by the clock", core.driver_stats.get("notices_by_clock", 0), lb),
    ]


def _log_and_state(driver: MeteredReplica, lb: dict[str, str]) -> list[Metric]:
    """The decided log, subscriptions, waits, recovery and the disk."""
    core, log_ = driver.core, driver.core.log
    role = core.role
    stable, frontier = log_.stable, log_.frontier
    servable = log_.servable
    subs = list(core.fanout.subs.values())
    lag = max((max(servable - sub.progress_sent, 0) for sub in subs), default=0)
    out: list[Metric] = [
        gauge("ziplog_replica_records", "decided records held (not trimmed)", len(log_.gsns), lb),
        gauge("ziplog_replica_log_bytes", "the memory the records held take (data and what each costs beside it)",
              log_.held_bytes, lb),
        gauge("ziplog_replica_max_log_bytes", "the most the records may take (--max-log-memory-mb; 0: no bound): "
              "past it no new record is taken (LOG_FULL)", driver.settings.max_log_bytes, lb),
        gauge("ziplog_replica_frontier_gsn", "every slot of this shard up to this gsn is decided here", frontier, lb),
        gauge("ziplog_replica_stable_gsn", "every replica of the shard holds the log up to this gsn", stable, lb),
        gauge("ziplog_replica_stable_lag_gsns", "frontier minus stable, in gsns (an epoch spans 2^32 gsns: "
              "within one epoch, slots)", max(frontier - stable, 0), lb),
        gauge("ziplog_replica_stable_lag_epochs", "epochs between the stable point and the frontier",
              max(epoch_of(frontier) - epoch_of(stable), 0), lb),
        gauge("ziplog_replica_trim_gsn", "records below this gsn are trimmed", log_.trim_point, lb),
        gauge("ziplog_replica_epoch", "the last epoch of the decided stream", log_.last_epoch, lb),
        gauge("ziplog_replica_epoch_records", "primary: records assigned in the current epoch (the count its "
              "RATE report carries at the epoch's close)", getattr(role, "epoch_count", 0), lb),
        gauge("ziplog_replica_subscriptions", "subscriptions open", len(subs), lb),
        gauge("ziplog_replica_subscription_lag_gsns", "the largest gap between what subscribers may be shown and "
              "the position last reported to them, in gsns", lag, lb),
        gauge("ziplog_replica_parked", "requests waiting for an epoch or a position", len(core.parking), lb),
        histograms("ziplog_replica_parked_wait_seconds", "parked requests only: seconds from a request's arrival "
                   "to its release (an insert: its epoch began, and it is decided in that turn unless it must wait "
                   "again or is refused; a read: its gsn was decided, and it is answered). Requests answered at "
                   "once, and those that time out, are not in it", "kind", driver.park_waits, lb),
        histogram("ziplog_replica_insert_turn_seconds", "the server's share of an insert's latency: seconds from "
                  "the first INSERT a loop turn read to its ACKs leaving (one sample per turn with inserts; a "
                  "parked insert's ACK leaves later: ziplog_replica_parked_wait_seconds)", driver.insert_turns, lb),
        gauge("ziplog_replica_qualified", "1 once this replica is synchronised with the primary (a backup "
              "guesses only then)", int(core.qualified), lb),
        one_of("ziplog_replica_recovery_phase", "this replica's part in a failure recovery (1 for the current "
               "phase)", "phase", [ph.value for ph in RecoveryPhase], core.recovery.phase.value, lb),
        gauge("ziplog_replica_recovery_generation", "the highest recovery generation the failure handler named "
              "here (-1: none)", core.recovery.gen, lb),
        gauge("ziplog_replica_suspicions", "peers this replica reported to the failure handler as silent",
              core.liveness.suspicions, lb),
        gauge("ziplog_replica_disk_full", "1 while the segment files cannot be written (DISK_FULL: no new "
              "records taken)", int(driver.disk_fault is not None), lb),
        gauge("ziplog_replica_disk_buffered_events", "decided-stream events waiting to be written",
              driver.buffered_events, lb),
    ]
    directory = getattr(driver.disk, "dir", None)
    if isinstance(directory, Path):
        out.append(gauge("ziplog_replica_disk_bytes", "bytes of this replica's segment directory",
                         directory_bytes(directory), lb))
    return out
