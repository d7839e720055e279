"""A storage replica's settings: its identity, its timers, and the limits that bound
every queue and map it keeps."""

from __future__ import annotations

from dataclasses import dataclass

#: how often at most a shard's only backup reports its prefix (see ``prefix_every_ns``)
LONE_BACKUP_PREFIX_NS = 1_000_000


@dataclass
class ReplicaSettings:
    shard: int
    replica: int
    replicas: int = 2
    max_record_bytes: int = 1 << 20
    #: The most a replica holds of its records in memory (``DecidedLog.held_bytes``:
    #: their data and what each costs beside it), or 0: no bound. Past it a primary refuses new
    #: records (LOG_FULL, final: the client moves them to other shards) and a backup
    #: guesses none, until a trim frees some; decided records are always taken. Both
    #: replicas of a shard hold the same records and would run out of memory together,
    #: and a restart replays every record: a refusal is a state, an OOM kill a crash loop.
    max_log_bytes: int = 0
    #: A slot of the primary whose expected arrival passed this long ago becomes a
    #: no-op (0, the default: never by time; slots pass when another shard's NOTICE
    #: names a gsn beyond them, and at the epoch's close).
    noop_timeout_ns: int = 0
    #: A primary that decided records tells the other member shards' primaries (NOTICE),
    #: so they pass its gsn at once. Off, only the clock and epochs' closes pass slots
    #: (how it worked before: the benchmarks run both).
    notices: bool = True
    #: ... at most once per this interval: the first record after a quiet spell is
    #: announced at the end of its turn, a burst's records together (each NOTICE costs
    #: every other shard a no-op range and its replication round).
    notice_interval_ns: int = 1_000_000
    #: ... one NOTICE per process that serves some of the replicas told, which hands it
    #: to each replica it serves (off: one per replica; the driver reads it).
    notice_per_process: bool = True
    #: The wall clock minus the monotonic clock the core is given (``now``), read by
    #: the driver at start: a NOTICE's stamp is its send time on the wall clock.
    wall_offset_ns: int = 0
    #: An epoch broadcast is taken, among the turn's inserts, at the moment its sender
    #: stamped on it, the same at both replicas of a shard (off: at the moment it was
    #: read here, as before; the benchmarks compare both).
    epoch_stamp_sent: bool = True
    #: An insert takes no slot expected before its stamp (:mod:`.clock_pass`); a shard
    #: the epoch schedules at this many records/s or more also passes its slots while no
    #: insert comes, and gets no NOTICE (0: no slot passes by the clock, as before). Its
    #: next insert comes within 0.4 ms on average, about what a NOTICE round takes;
    #: slower shards keep the NOTICEs, which reach them sooner than their own next
    #: insert would. Above the planner's default rate (2,000/s): a new cluster's shards
    #: start on NOTICEs.
    clock_pass_rate: int = 2500
    #: ... an insert's stamp ahead of the replica's own reckoning by more than this
    #: counts as that reckoning plus it (a client's clock ahead burns no more slots)
    clock_slack_ns: int = 1_000_000
    #: ... and while no insert comes, slots expected this long ago pass, at most once
    #: per this interval
    clock_idle_ns: int = 1_000_000
    #: How long an InsertAfter or read may wait for a future epoch/position.
    park_timeout_ns: int = 2_000_000_000
    #: InsertAfter/read naming an epoch this far beyond ours is an unknown rid.
    max_epochs_ahead: int = 200
    #: The primary pushes the stable watermark to backups at least this often.
    stable_push_ns: int = 2_000_000
    #: The primary sends at most one FORWARD with records per interval (0: every turn).
    forward_interval_ns: int = 0
    #: A backup reports its prefix at most once per interval (0: after every FORWARD;
    #: None: :attr:`prefix_every_ns` picks by the shard's size). The first FORWARD after a
    #: quiet spell is answered at once, a burst's together.
    prefix_interval_ns: int | None = None
    #: A backup that found a gap in the forwards asks again after this long.
    hello_retry_ns: int = 10_000_000
    #: How often the primary re-announces its state to a backup that lags.
    lag_probe_ns: int = 20_000_000
    #: Subscriptions with no word from their subscriber this long are dropped.
    subscription_lease_ns: int = 60_000_000_000
    #: Largest SUB_BATCH payload.
    sub_batch_bytes: int = 1 << 20
    #: A FORWARD carries at most this many bytes of events (or one record larger than
    #: that): a turn's decisions beyond it go in several, a catch-up in parts. Backups
    #: refuse larger messages (``frames.forward_limit``).
    forward_batch_bytes: int = 4 << 20
    #: A FORWARD names a record of at least ``reference_min_bytes`` by its key, size and
    #: digest instead of carrying its data (the client's INSERT brought the backup the
    #: same bytes): the primary sends each such record once instead of once per backup.
    #: Off by default: it saves the primary's link bytes, not CPU (two SHA-256 digests
    #: per record cost more than a 4 KiB copy on one machine: README).
    forward_by_reference: bool = False
    reference_min_bytes: int = 1024
    #: A backup holds the data of the inserts it received for this long at most, until
    #: the primary's decision names them ...
    reference_memory_ns: int = 2_000_000_000
    #: ... and at most this many bytes of it (the oldest go first).
    max_reference_bytes: int = 64 << 20
    #: A FORWARD naming bytes the backup does not hold waits this long for the INSERT
    #: (FORWARDs after it wait with it, at most ``max_waiting_forwards``), then the
    #: backup asks for a catch-up.
    reference_wait_ns: int = 2_000_000
    max_waiting_forwards: int = 256
    #: Replicas of a shard hear from each other at least this often: an idle primary
    #: sends an empty FORWARD, an idle backup a PREFIX (the heartbeats).
    heartbeat_ns: int = 100_000_000
    #: A peer silent this long is suspected to have failed and recovery is asked for
    #: (0: never suspect).
    suspect_timeout_ns: int = 500_000_000
    #: How long a primary remembers a record it refused for good, and a backup one it
    #: will never guess: a copy of the INSERT delayed longer could be placed (see
    #: ARCHITECTURE.md, Known limitations).
    refusal_memory_ns: int = 20_000_000_000
    #: How long a backup remembers who asked for a record the primary has not decided
    #: (the client's resend finds the decision anyway).
    route_memory_ns: int = 20_000_000_000
    #: Those memories are pruned at most this often.
    prune_interval_ns: int = 1_000_000_000
    # -- bounds ----------------------------------------------------------------------
    #: Requests waiting for an epoch or a position; more are refused (OVERLOADED).
    max_parked: int = 10_000
    #: ... of which one connection may hold this many (one client cannot take them all).
    max_parked_per_connection: int = 1_000
    #: Subscriptions served at once; more are refused (OVERLOADED).
    max_subscriptions: int = 10_000
    #: ... of which one connection may hold this many.
    max_subscriptions_per_connection: int = 1_000
    #: Records a backup has guessed and the primary not yet decided; beyond it the
    #: backup guesses nothing (NO_GUESS: the primary still decides).
    max_guesses: int = 100_000
    #: Entries in each refusal memory and in the backup's route memory; the oldest go
    #: first when one is full (each is also pruned by age).
    max_remembered: int = 200_000
    #: Inserts one turn brought, held until the driver's input for the turn ends so that
    #: they are taken in stamp order; a turn that brings more takes them in batches.
    max_turn_inserts: int = 4096

    @property
    def is_primary(self) -> bool:
        return self.replica == 0

    @property
    def prefix_every_ns(self) -> int:
        """How often a backup reports its prefix at most. Unset: once per millisecond when
        it is the shard's only backup, else after every FORWARD. A lone backup knows what
        is stable without its PREFIX (:attr:`backup_knows_stable`) and subscriptions read
        such a shard from it, so its PREFIX only moves the primary's own watermark
        (replies' ``stable``, STATUS): under load one per millisecond instead of one per
        FORWARD spares both replicas a message per insert, as the dissertation's
        "periodically" has it (4.2.4). With more backups the PREFIXes make stability for
        everyone: each one at once."""
        if self.prefix_interval_ns is not None:
            return self.prefix_interval_ns
        return LONE_BACKUP_PREFIX_NS if self.backup_knows_stable else 0

    @property
    def backup_knows_stable(self) -> bool:
        """A lone backup knows everything it applied is stable (the primary decided it and
        holds it); with more backups only the primary hears every PREFIX."""
        return self.replicas == 2
