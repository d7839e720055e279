"""Who may make a backup QUALIFIED, on the cores (``tests/harness.py``).

A QUALIFIED backup may be a failure recovery's source: its log is taken to hold every
record any replica acknowledged. Only a SERVING primary may say so, with a catch-up or
FORWARD ending at its frontier: one serves only once every backup's HELLO showed it is
not ahead. A primary still STARTING may have lost records another backup holds, and
before this rule its catch-up qualified the first backup to say HELLO: in a shard of
three replicas (f = 2) a record all three acknowledged was lost when only two failed."""

from __future__ import annotations

from tests.harness import MS, ShardHarness
from ziplog.cores.client.waits import InsertWait
from ziplog.cores.replica import ReplicaCore
from ziplog.cores.replica.primary import PrimaryState
from ziplog.protocol import frames as wire
from ziplog.protocol.events import DiskEvent, RecordEvent

ALL = (0, 1, 2)


def three_replicas() -> ShardHarness:
    """Shard 0 with three replicas in step, its recovery dropping it from the next epoch."""
    h = ShardHarness({"noop_timeout_ns": 1 * MS, "suspect_timeout_ns": 300 * MS}, [[0, [0, 1]]], replicas=3)
    h.handler.load(0, 3, None, 0)
    h.handler.on_history(h.history, 0)

    def drop(a: object) -> None:
        if getattr(a, "recovering", False):
            h.history = h.history + [[h.epoch + 1, [1]]]
            h.handler.on_history(h.history, h.now)

    h.on_persist = drop
    for i in (1, 2):
        up(h, i).connect_primary(0)
    h.pump()
    h.next_epoch()
    return h


def up(h: ShardHarness, i: int) -> ReplicaCore:
    core = h.cores[i]
    assert core is not None
    return core


def without(disk: list[DiskEvent], gsn: int) -> list[DiskEvent]:
    """A disk that lost the event of the record at ``gsn`` (its tail after the ACKs left)."""
    return [ev for ev in disk if not (isinstance(ev, RecordEvent) and ev.gsn == gsn)]


def test_a_record_all_three_replicas_acknowledged_survives_two_failures() -> None:
    h = three_replicas()
    h.insert(1, b"one", to=ALL)
    h.pump()
    h.insert(2, b"two", to=ALL)
    h.pump()
    wait = InsertWait(2, 3)
    assert any(wait.feed(i, m) for i, m in h.replies(2)), "record two was acknowledged"
    g = wait.decided
    assert g is not None
    assert all(up(h, i).log.records.get(g) is not None for i in ALL)
    # The primary and backup 1 crash (f = 2 failures); both disks lost record two.
    for i in (0, 1):
        h.cores[i] = h.new_core(i)
        up(h, i).replay(without(h.disk[i], g))
    # Backup 1's HELLO reaches the restarted primary first, then backup 2's (ahead).
    up(h, 1).connect_primary(h.now)
    h.pump()
    assert h.P.role.state is PrimaryState.STARTING  # type: ignore[union-attr]
    assert not up(h, 1).qualified, "a starting primary's catch-up qualified backup 1"
    up(h, 2).connect_primary(h.now)
    h.pump()
    assert h.P.blocked is not None
    # The blocked primary asks for a recovery; only backup 2 may be its source.
    h.handler.on_suspect(0, 0, h.now)
    h.pump()
    for _ in range(3):
        h.tick(10 * MS)
    assert (0, 0) in h.handler.completed
    acquired = [a.record for a in h.persisted if a.record.get("phase") == "acquired"]
    assert [a["source"] for a in acquired] == [2]
    for i in ALL:
        held = up(h, i).log.records.get(g)
        assert held is not None and held.data == b"two", f"replica {i} lost the acknowledged record"


def test_a_starting_primary_sends_no_forward_until_every_backup_said_hello() -> None:
    """Not a catch-up, not a heartbeat: nothing that could put a backup in step."""
    h = three_replicas()
    h.insert(1, b"one", to=ALL)
    h.pump()
    for i in (0, 1):  # both restart (with all they wrote): backup 1 is UNQUALIFIED again
        disk = h.disk[i] + up(h, i).flush_marks()
        h.cores[i] = h.new_core(i)
        up(h, i).replay(disk)
    sent_before = len(h.sent)
    up(h, 1).connect_primary(h.now)
    for _ in range(5):
        h.tick(50 * MS)  # heartbeats are due many times over
    forwards = [m for i, _, m in h.sent[sent_before:] if i == 0 and isinstance(m, wire.Forward)]
    assert not forwards and not up(h, 1).qualified
    up(h, 2).connect_primary(h.now)
    h.pump()
    assert h.P.role.state is PrimaryState.SERVING  # type: ignore[union-attr]
    assert up(h, 1).qualified and up(h, 2).qualified
