"""Admission of inserts and reads by a replica that has seen no epoch yet (a shard just
added, a replica just started): an InsertAfter naming a rid from the running log must
wait for the replica's first epoch, not be refused as "far beyond" an epoch it does not
know. Found under load by test_failures' add-a-shard test: a writer's next insert after
its last rid reached the new shard before the new shard's first EPOCH did."""

from __future__ import annotations

from tests.harness import request
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
    request(core, b"client", wire.Insert(req_id=7, client_id=99, seq=1, after=after, data=DATA), 10)
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
    request(core, b"client", wire.Insert(req_id=8, client_id=99, seq=2, after=far, data=DATA), 10)
    errors = [m for m in _replies(core) if isinstance(m, wire.Error)]
    assert errors and errors[0].code == wire.E_UNKNOWN_RID


def test_read_of_a_running_log_gsn_waits_for_the_first_epoch() -> None:
    core = _fresh_primary()
    core.on_request(b"client", wire.Read(req_id=9, gsn=epoch_base(RUNNING_EPOCH) + 5), 10)
    assert not [m for m in _replies(core) if isinstance(m, wire.Error)]


# -- per-connection bounds: one connection cannot take every slot ---------------------------------
def test_one_connection_parks_at_most_its_share() -> None:
    from ziplog.cores.replica import ReplicaSettings as S

    core = ReplicaCore(S(5, 0, 2, max_parked=10, max_parked_per_connection=3))
    core.on_request(b"backup", wire.Hello(shard=5, replica=1, frontier=0, guessed_top=0), 0)
    _replies(core)  # no epoch yet: every read of a gsn waits
    for i in range(4):
        core.on_request(b"greedy", wire.Read(req_id=i, gsn=100 + i), 1)
    errors = [m for m in _replies(core) if isinstance(m, wire.Error)]
    assert [(e.req_id, e.code) for e in errors] == [(3, wire.E_OVERLOADED)]
    for i in range(3):
        core.on_request(b"modest", wire.Read(req_id=10 + i, gsn=100), 1)
    assert not [m for m in _replies(core) if isinstance(m, wire.Error)], "another connection still parks"
    assert core.status()["parked"] == 6
    core.tick(1 + core.s.park_timeout_ns)  # every wait times out: the shares are free again
    _replies(core)
    core.on_request(b"greedy", wire.Read(req_id=20, gsn=100), core.s.park_timeout_ns + 2)
    assert not [m for m in _replies(core) if isinstance(m, wire.Error)]
    assert core.parking.by_route == {b"greedy": 1}


def test_one_connection_holds_at_most_its_share_of_subscriptions() -> None:
    from ziplog.cores.replica import ReplicaSettings as S

    core = ReplicaCore(S(5, 1, 2, max_subscriptions=10, max_subscriptions_per_connection=2))
    for sub_id in range(3):
        core.on_request(b"greedy", wire.Subscribe(sub_id=sub_id, from_gsn=0, credit=1 << 20), 0)
    errors = [m for m in _replies(core) if isinstance(m, wire.Error)]
    assert [(e.req_id, e.code) for e in errors] == [(2, wire.E_OVERLOADED)]
    core.on_request(b"greedy", wire.Subscribe(sub_id=0, from_gsn=0, credit=1 << 20), 0)  # a resubscribe is no new one
    core.on_request(b"other", wire.Subscribe(sub_id=0, from_gsn=0, credit=1 << 20), 0)
    assert not [m for m in _replies(core) if isinstance(m, wire.Error)]
    core.on_request(b"greedy", wire.Unsubscribe(sub_id=1), 0)
    core.on_request(b"greedy", wire.Subscribe(sub_id=2, from_gsn=0, credit=1 << 20), 0)
    assert not [m for m in _replies(core) if isinstance(m, wire.Error)]
    assert core.fanout.subs_by_route == {b"greedy": 2, b"other": 1}
