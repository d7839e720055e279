"""Admission of inserts and reads by a replica that has seen no epoch yet (a shard just
added, a replica just started): an InsertAfter naming a rid from the running log must
wait for the replica's first epoch, not be refused as "far beyond" an epoch it does not
know. Found under load by test_failures' add-a-shard test: a writer's next insert after
its last rid reached the new shard before the new shard's first EPOCH did."""

from __future__ import annotations

from ziplog.cores.replica import ReplicaCore, ReplicaSettings
from ziplog.protocol import frames as wire
from ziplog.protocol.gsna import EpochConfig, epoch_base

DATA = b"x" * 64
RUNNING_EPOCH = 2557  # the log has run for ~25 s: far more epochs than max_epochs_ahead


def _replies(core: ReplicaCore) -> list[wire.Frame]:
    return [msg for dest, msg in core.ready().messages if isinstance(dest, bytes)]


def _fresh_primary() -> ReplicaCore:
    core = ReplicaCore(ReplicaSettings(5, 0, 2))
    core.on_request(b"backup", wire.Hello(shard=5, replica=1, frontier=0, guessed_top=0), 0)  # the backup is not ahead
    _replies(core)
    return core


def test_insert_after_a_running_log_rid_waits_for_the_first_epoch() -> None:
    core = _fresh_primary()
    after = epoch_base(RUNNING_EPOCH) + 1000  # a rid another shard got a moment ago
    core.on_request(b"client", wire.Insert(req_id=7, client_id=99, seq=1, after=after, data=DATA), 10)
    assert not [m for m in _replies(core) if isinstance(m, wire.Error)], "refused before knowing any epoch"
    # The first epoch follows a gap: the core asks for the members of the epochs it missed.
    core.on_epoch(EpochConfig(RUNNING_EPOCH, (4, 5), (1000, 1000)), 20)
    core.on_history([(0, RUNNING_EPOCH - 1, (4,))], 20)
    core.flush(20)
    acks = [m for m in _replies(core) if isinstance(m, wire.Ack) and m.req_id == 7]
    assert acks and acks[0].gsn > after and acks[0].decided, acks


def test_a_replica_that_knows_the_epoch_still_refuses_far_beyond() -> None:
    core = _fresh_primary()
    core.on_epoch(EpochConfig(3, (5,), (1000,)), 0)
    core.on_history([(0, 2, (5,))], 0)  # the epochs before it, from the membership history
    _replies(core)
    far = epoch_base(3 + core.s.max_epochs_ahead + 1)
    core.on_request(b"client", wire.Insert(req_id=8, client_id=99, seq=2, after=far, data=DATA), 10)
    errors = [m for m in _replies(core) if isinstance(m, wire.Error)]
    assert errors and errors[0].code == wire.E_UNKNOWN_RID


def test_read_of_a_running_log_gsn_waits_for_the_first_epoch() -> None:
    core = _fresh_primary()
    core.on_request(b"client", wire.Read(req_id=9, gsn=epoch_base(RUNNING_EPOCH) + 5), 10)
    assert not [m for m in _replies(core) if isinstance(m, wire.Error)]
