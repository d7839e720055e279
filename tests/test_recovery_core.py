"""Failure recovery between real ReplicaCores and the failure handler's RecoveryCore,
driven step by step (no network, no clock): the protocol of dissertation 4.2.5."""

from __future__ import annotations

from typing import Any

from failure_handler.recovery import DONE, Persist, RecoveryCore, Send
from ziplog.protocol import frames as wire
from ziplog.cores.client import InsertWait, Redirect
from ziplog.protocol.gsna import EpochConfig, epoch_end
from ziplog.cores.replica import TO_HANDLER, TO_PRIMARY, ReplicaCore, ReplicaSettings
from ziplog.protocol.frames import PROTOCOL_VERSION as V
from ziplog.protocol.frames import pack, unpack

MS = 1_000_000
SHARDS = (0, 1)


class Harness:
    """Shard 0's two replicas, a client route, and the failure handler, wired by hand."""

    def __init__(self) -> None:
        self.now = 0
        self.P = self.new_core(0)
        self.B = self.new_core(1)
        self.disk: dict[int, list[Any]] = {0: [], 1: []}
        self.client_inbox: list[tuple[int, list[Any]]] = []
        self.suspects: list[list[Any]] = []
        self.history: list[list[Any]] = [[0, list(SHARDS)]]
        self.handler = RecoveryCore()
        self.handler.load(0, 2, None, 0)
        self.handler.on_history(self.history, 0)
        self.B.connect_primary(0)
        self.epoch = -1
        self.auto_drop = True  # the MMS drops a recovering shard at once
        self.pump()

    def new_core(self, replica: int) -> ReplicaCore:
        return ReplicaCore(ReplicaSettings(0, replica, 2, noop_timeout_ns=1 * MS, suspect_timeout_ns=300 * MS))

    @property
    def cores(self) -> dict[int, ReplicaCore]:
        return {0: self.P, 1: self.B}

    def pump(self, drop_from: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        """Deliver every frame until quiet; frames from replicas in ``drop_from`` are lost."""
        for _ in range(100):
            moved = False
            for i, core in self.cores.items():
                core.flush(self.now)
                out, core.outbox = core.outbox, []
                self.disk[i].extend(core.disk)
                core.disk.clear()
                for dest, frame in out:
                    moved = True
                    if i in drop_from:
                        continue
                    msg = unpack(frame)
                    if dest == TO_PRIMARY:
                        self.P.on_request(b"backup", wire.decode_request(frame), self.now)
                    elif dest == TO_HANDLER:
                        self.suspects.append(msg)
                    elif dest == b"backup":
                        self.B.on_forward(msg, self.now)
                    elif dest == b"client":
                        self.client_inbox.append((i, msg))
                    elif dest == b"handler":
                        self.handler.on_reply(0, i, msg, self.now)
            moved = self.run_handler() or moved
            if not moved:
                return

    def run_handler(self) -> bool:
        acts, self.handler.actions = self.handler.actions, []
        for a in acts:
            if isinstance(a, Persist):
                self.handler.on_persisted(a.shard, a.record["gen"], self.now)
                if a.recovering and self.auto_drop:
                    self.drop()
            elif isinstance(a, Send):
                core = self.cores[a.replica]
                core.on_request(b"handler", wire.decode_request(a.frame), self.now)
        return bool(acts)

    def drop(self) -> None:
        """The MMS leaves shard 0 out of the next epoch."""
        self.history = self.history + [[self.epoch + 1, [1]]]
        self.handler.on_history(self.history, self.now)

    def next_epoch(self) -> None:
        self.epoch += 1
        members = tuple(self.history[-1][1])
        cfg = EpochConfig(self.epoch, members, tuple(1000 for _ in members))
        for core in self.cores.values():
            core.on_epoch(cfg, self.now)
        self.pump()

    def insert(self, seq: int, data: bytes, to: tuple[int, ...] = (0, 1)) -> None:
        frame = pack([V, wire.INSERT, seq, 7, seq, 0, data])
        for i in to:
            self.cores[i].on_request(b"client", wire.decode_request(frame), self.now)


def test_primary_crash_keeps_acknowledged_guesses_and_resumes() -> None:
    h = Harness()
    h.next_epoch()
    # Two records on the fast path, then one the backup guessed and acked while the
    # primary decided it but crashed before forwarding: acknowledged, held only as a guess.
    h.insert(1, b"one")
    h.insert(2, b"two")
    h.pump()
    assert h.B.frontier >= h.P.gsns[-1]
    h.insert(3, b"three")
    h.pump(drop_from={0})  # the primary's acks and forwards are lost: it "crashed"
    third_gsn = h.P.gsns[-1]
    guess = [m for i, m in h.client_inbox if i == 1 and m[1] == wire.ACK and m[2] == 3]
    assert guess and guess[-1][3] == third_gsn, "the backup guessed the primary's gsn (fast path)"
    # The primary restarts from a disk without its last writes.
    lost_disk = [ev for ev in h.disk[0] if not (ev[0] == wire.EV_RECORD and ev[1] == third_gsn)]
    h.P = h.new_core(0)
    h.P.replay(lost_disk)
    # The backup hears nothing for the suspicion timeout: it asks for recovery.
    h.now += 400 * MS
    h.B.tick(h.now)
    h.pump()
    assert h.suspects and h.suspects[-1][1] == wire.SUSPECT
    h.auto_drop = False
    h.handler.on_suspect(0, 1, h.now)
    h.pump()
    # Frozen backup, acquired as source: it answers the in-doubt record for good.
    assert h.B.authority and not h.P.qualified
    h.client_inbox.clear()
    h.insert(3, b"three", to=(1,))
    h.insert(4, b"four", to=(1,))
    h.pump()
    answers = {m[2]: m for _, m in h.client_inbox}
    assert answers[3][1] == wire.ACK and answers[3][3] == third_gsn and answers[3][7], answers[3]
    assert answers[4][1] == wire.ERROR and answers[4][3] == wire.E_NOT_HELD
    w = InsertWait(4, 2)
    try:
        w.feed(1, answers[4])
        raise AssertionError("NOT_HELD must redirect")
    except Redirect:
        pass
    assert not h.handler.completed, "recovery waits for the MMS to drop the shard"
    h.drop()
    h.pump()
    # Roll forward done: both replicas hold the same log up to the end of the last
    # epoch that included the shard, with the guessed record decided.
    assert h.handler.completed == [(0, 0)], h.handler.completed
    end = epoch_end(0)
    for core in (h.P, h.B):
        assert core.frontier == end and not core.frozen, (core.frontier, core.frozen)
        assert core.records[third_gsn].data == b"three"
    assert h.P.gsns == h.B.gsns
    assert h.P.stable == end
    assert 0 not in h.handler.active
    # The shard comes back: the MMS re-adds it and the primary decides again.
    h.history = h.history + [[h.epoch + 1, list(SHARDS)]]
    h.next_epoch()
    h.next_epoch()
    h.client_inbox.clear()
    h.insert(5, b"five")
    h.pump()
    acks = [(i, m[3]) for i, m in h.client_inbox if m[1] == wire.ACK]
    assert {i for i, _ in acks} == {0, 1} and len({g for _, g in acks}) == 1, acks
    assert h.P.gsns == h.B.gsns and h.P.stable == h.P.frontier


def test_backup_crash_primary_is_source() -> None:
    h = Harness()
    h.next_epoch()
    h.insert(1, b"one")
    h.pump()
    h.insert(2, b"two")
    h.pump(drop_from={1})  # the backup's acks and prefix are lost: it "crashed"
    decided = list(h.P.gsns)
    h.B = h.new_core(1)  # restarted with an empty disk
    h.now += 400 * MS
    h.P.tick(h.now)
    h.pump()
    assert h.suspects, "the primary suspects its silent backup"
    h.handler.on_suspect(0, 0, h.now)
    h.B.connect_primary(h.now)
    h.pump()
    assert h.handler.completed == [(0, 0)]
    assert h.P.gsns == h.B.gsns == decided
    assert h.B.frontier == h.P.frontier == epoch_end(0)
    assert not h.handler.active and not h.P.frozen and not h.B.frozen
    # A second suspicion right after is ignored (reports may still be in flight).
    h.handler.on_suspect(0, 1, h.now)
    assert not h.handler.active
    assert h.handler.actions == [] or all(not isinstance(a, Persist) for a in h.handler.actions)
    assert DONE == "done"
