"""LogDB's memory of decided transactions (no processes; the log's time is its epochs).

A transaction decided long ago (past the validator's window of ``WRITE_TTL_EPOCHS``) must
still be answered truthfully: its commit record resent (by the client's retry of a commit
whose outcome it did not learn) applies nothing twice and is not judged aborted, and
``Outcome`` answers the decision while the coordinator remembers it (its window, or at or
above LogDB's collection point, at most ``max_outcomes`` more) and ``FORGOTTEN`` (the
client raises ``OutcomeUnknownError``) once it does not, never ``UNKNOWN_TXN``. The
coordinator's and KV shards' memories survive a restart from their snapshots."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ziplog.cores.app_session import Insert
from ziplog.logdb.coordinator import SnapshotFile
from ziplog.logdb.core import frames as f
from ziplog.logdb.core.coordinator import CoordinatorCore
from ziplog.logdb.core.kvshard import KvShardCore, Stored, encode_snapshot
from ziplog.logdb.core.records import NO_RID, Commit, TransactionAborted, Write, encode
from ziplog.logdb.core import transaction as tx
from ziplog.logdb.core.transaction import Ask, Session, Transaction
from ziplog.logdb.core.validator import WRITE_TTL_EPOCHS, Validator
from ziplog.logdb.store import SqliteStore
from ziplog.protocol.errors import ZiplogError, ZiplogTimeoutError
from ziplog.protocol.gsna import EPOCH_SPAN

#: more than the validator's window, in gsns
PAST_THE_WINDOW = (WRITE_TTL_EPOCHS + 10) * EPOCH_SPAN


class Log:
    """A log being written (gsns go up by 1000 a record) and replayed by a coordinator
    and a KV shard (one shard: it owns every key)."""

    def __init__(self, coord: CoordinatorCore | None = None, kv: KvShardCore | None = None) -> None:
        self.coord = coord or CoordinatorCore()
        self.kv = kv or KvShardCore(0, 1, Stored(0, None))
        self.gsn = 0
        self.applied: list[tuple[int, int]] = []  # (gsn, txn) of every transaction the KV shard applied

    def put(self, data: bytes) -> tuple[int, int]:
        self.gsn += 1000
        self.coord.on_record(self.gsn, 0, data)
        before = len(self.kv._pending)
        self.kv.on_record(self.gsn, 0, data)
        self.applied += [(a.gsn, a.txn) for a in self.kv._pending[before:]]
        return (self.gsn, 0)

    def skip(self, gsns: int) -> None:
        """Time passes: the log moves on with nothing of LogDB's in it."""
        self.gsn += gsns
        self.coord.on_position(self.gsn)
        self.kv.on_position(self.gsn)


def outcome(coord: CoordinatorCore, txn: int, commit_gsn: int) -> f.Answer:
    (route, answer), = coord.on_request(b"client", f.encode(f.Outcome(req=1, txn=txn, commit_gsn=commit_gsn)))
    return answer


def committed_at(answer: f.Answer, gsn: int) -> bool:
    return type(answer) is f.OutcomeIs and answer.committed and answer.gsn == gsn


def test_a_decided_transaction_resent_and_asked_after_the_memory_window() -> None:
    """Decided, the window passes, then (a) the same commit record comes again (a resend)
    and (b) Outcome is asked: neither may be answered 'aborted' nor UNKNOWN_TXN, and the
    resend applies nothing."""
    log = Log()
    w = log.put(encode(Write(txn=7, key=b"k", value=b"v")))
    commit = encode(Commit(txn=7, reads={b"k": NO_RID}, writes={b"k": w}))
    g1, _ = log.put(commit)
    assert committed_at(outcome(log.coord, 7, g1), g1)
    log.skip(PAST_THE_WINDOW)
    # (b) asked after the window: the coordinator still knows (the collection point is behind)
    late = outcome(log.coord, 7, g1)
    assert committed_at(late, g1), f"asked after the window, Outcome answers {late}"
    # (a) the same commit record again
    g2, _ = log.put(commit)
    d = log.kv.validator.decided[7]
    assert d.committed or d.unknown, f"the resend is judged aborted: {d}"
    assert log.applied == [(g1, 7)], f"the KV shard applied {log.applied}"
    again = outcome(log.coord, 7, g2)
    assert committed_at(again, g1), f"Outcome of the resend answers {again}"
    # kept while its latest commit record is in the window, whatever the collection point;
    # once the coordinator forgot it too, it says it cannot know
    log.coord.on_collected(log.gsn + 1)
    assert committed_at(outcome(log.coord, 7, g2), g1)
    log.skip(PAST_THE_WINDOW)
    for at in (g1, g2):
        ans = outcome(log.coord, 7, at)
        assert type(ans) is f.Failed and ans.code == f.FORGOTTEN, ans


# -- the client's retry ---------------------------------------------------------------------------
class Client:
    """Runs a transaction's steps against the Log: inserts go into it, Outcome asks its
    coordinator. ``fail_inserts[n]``: the n-th insert (from 1) gets no answer, and was
    placed in the log anyway or not; ``fail_asks``: that many asks get no answer."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.fail_inserts: dict[int, bool] = {}
        self.fail_asks = 0
        self.inserts = 0  # inserts tried
        self.placed: list[tuple[int, int]] = []

    def run(self, steps: Any) -> Any:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                op = steps.send(value) if error is None else steps.throw(error)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            if type(op) is Insert:
                self.inserts += 1
                placed = self.fail_inserts.pop(self.inserts, None)
                if placed is not False:
                    value = self.log.put(op.data)
                    self.placed.append(value)
                if placed is not None:
                    value, error = None, ZiplogTimeoutError("no answer to the insert")
            else:
                assert type(op) is Ask and type(op.request) is f.Outcome
                if self.fail_asks:
                    self.fail_asks -= 1
                    error = ZiplogTimeoutError("no answer from any coordinator")
                else:
                    value = outcome(self.log.coord, op.request.txn, op.request.commit_gsn)


def _blind_write(log: Log) -> tuple[Transaction, Client]:
    t = Transaction(Session(1, random.Random(3)))
    t.put(b"x", b"1")
    return t, Client(log)


def test_a_commit_tried_again_after_the_window_commits_once() -> None:
    """A commit whose Outcome got no answer, called again after the window, asks again and
    inserts nothing: new write records and a new commit record would commit a second time."""
    log = Log()
    t, client = _blind_write(log)
    client.fail_asks = 1
    with pytest.raises(ZiplogTimeoutError):
        client.run(t.commit_steps())
    assert len(log.applied) == 1 and t.commit_rid is not None and not t.done
    g1 = log.applied[0][0]
    log.skip(PAST_THE_WINDOW)
    client.run(t.commit_steps())
    assert t.serialized_at == g1 and t.done
    assert log.applied == [(g1, t.txn)], f"the KV shard applied {log.applied}"
    assert client.inserts == 2, "the retry inserted records again"


@pytest.mark.parametrize("late", [False, True])
def test_a_commit_record_placed_without_an_answer_is_resent_the_same_and_applied_once(late: bool) -> None:
    log = Log()
    t, client = _blind_write(log)
    client.fail_inserts[2] = True  # the commit record (after the write record): placed, no answer
    with pytest.raises(ZiplogTimeoutError):
        client.run(t.commit_steps())
    (g1, _), = log.applied
    with pytest.raises(ZiplogError, match="committing"):
        t.put(b"x", b"2")  # the commit record is built: it is what a retry sends
    if late:
        log.skip(PAST_THE_WINDOW)
    client.run(t.commit_steps())  # the same commit record again, then Outcome of the new copy
    assert client.inserts == 3 and client.placed[2][0] > g1 and t.commit_rid == client.placed[2]
    assert t.serialized_at == g1, "told the first copy's decision"
    assert log.applied == [(g1, t.txn)], f"the KV shard applied {log.applied}"
    d = log.kv.validator.decided[t.txn]
    assert (d.committed and d.gsn == g1) if not late else d.unknown


def test_a_commit_record_never_placed_and_resent_past_the_window_cannot_be_known() -> None:
    """Its write expired, so the resend cannot commit, and no one can tell it from a resend
    of a forgotten decision: the client is told so, not 'aborted'."""
    log = Log()
    t, client = _blind_write(log)
    client.fail_inserts[2] = False
    with pytest.raises(ZiplogTimeoutError):
        client.run(t.commit_steps())
    log.skip(PAST_THE_WINDOW)
    with pytest.raises(tx.OutcomeUnknownError):
        client.run(t.commit_steps())
    assert log.applied == [] and t.done


def test_a_write_record_placed_without_an_answer_is_inserted_again_and_the_copy_stays_unused() -> None:
    log = Log()
    t, client = _blind_write(log)
    client.fail_inserts[1] = True
    with pytest.raises(ZiplogTimeoutError):
        client.run(t.commit_steps())
    client.run(t.commit_steps())
    assert client.inserts == 3 and t.serialized_at == client.placed[2][0]
    assert log.applied == [(client.placed[2][0], t.txn)]
    assert log.kv.validator.decided[t.txn].committed and client.placed[0] in log.kv.validator.writes


def test_a_forgotten_outcome_raises_outcome_unknown_not_aborted() -> None:
    log = Log()
    t, client = _blind_write(log)
    client.fail_asks = 1
    with pytest.raises(ZiplogTimeoutError):
        client.run(t.commit_steps())
    log.skip(PAST_THE_WINDOW)
    log.coord.on_collected(log.gsn + 1)
    with pytest.raises(tx.OutcomeUnknownError) as exc:
        client.run(t.commit_steps())
    assert not isinstance(exc.value, TransactionAborted) and "FORGOTTEN" in str(exc.value)
    assert t.done


# -- the validator's rule -------------------------------------------------------------------------
def test_a_commit_is_unknown_only_when_an_earlier_copy_could_be_forgotten() -> None:
    v = Validator(ttl_epochs=3)
    gsn = [0]

    def put(data: bytes, epochs: int = 0) -> Any:
        gsn[0] += epochs * EPOCH_SPAN + 1
        return (gsn[0], 0), v.on_record(gsn[0], 0, data)

    old, _ = put(encode(Write(txn=1, key=b"a", value=b"1")))
    new, _ = put(encode(Write(txn=1, key=b"b", value=b"1")), epochs=5)
    # the newest write is recent: any earlier copy of this record would be remembered, so
    # this is the first, and it aborts (its other write expired)
    _, d = put(encode(Commit(txn=1, reads={}, writes={b"a": old, b"b": new})))
    assert not d.committed and not d.unknown and not d.duplicate
    # every write older than the memory: an earlier copy may have been decided and forgotten
    w, _ = put(encode(Write(txn=2, key=b"c", value=b"1")))
    _, d = put(encode(Commit(txn=2, reads={}, writes={b"c": w})), epochs=5)
    assert not d.committed and d.unknown
    _, d2 = put(encode(Commit(txn=2, reads={}, writes={b"c": w})))
    assert d2.duplicate and d2.unknown and d2.gsn == d.gsn


# -- bounds ---------------------------------------------------------------------------------------
def test_the_outcome_memory_is_bounded_and_says_forgotten_at_the_bound() -> None:
    log = Log(CoordinatorCore(max_outcomes=5))
    gsns = []
    for txn in range(1, 11):
        w = log.put(encode(Write(txn=txn, key=b"k%d" % txn, value=b"v")))
        gsns.append(log.put(encode(Commit(txn=txn, reads={}, writes={b"k%d" % txn: w})))[0])
    # inside the validator's window everything is answered, whatever the bound
    assert len(log.coord.outcomes) == 10
    log.coord.on_collected(log.gsn + 1)
    assert all(committed_at(outcome(log.coord, txn, g), g) for txn, g in zip(range(1, 11), gsns))
    # past the window: the collection point is passed too, so all go
    log.skip(PAST_THE_WINDOW)
    assert log.coord.outcomes == {}
    assert outcome(log.coord, 3, gsns[2]).code == f.FORGOTTEN  # type: ignore[union-attr]
    # the collection point behind: at most max_outcomes stay, the oldest go first
    for txn in range(11, 21):
        w = log.put(encode(Write(txn=txn, key=b"k%d" % txn, value=b"v")))
        gsns.append(log.put(encode(Commit(txn=txn, reads={}, writes={b"k%d" % txn: w})))[0])
    log.skip(PAST_THE_WINDOW)
    assert sorted(log.coord.outcomes) == list(range(16, 21))
    assert outcome(log.coord, 15, gsns[14]).code == f.FORGOTTEN  # type: ignore[union-attr]
    assert committed_at(outcome(log.coord, 16, gsns[15]), gsns[15])
    # a gsn the coordinator remembers, holding no commit record of the transaction asked
    w = log.put(encode(Write(txn=30, key=b"q", value=b"v")))
    assert outcome(log.coord, 30, w[0]).code == f.UNKNOWN_TXN  # type: ignore[union-attr]
    # a resend of a forgotten one: unknown, and nothing applied
    log.put(encode(Commit(txn=3, reads={}, writes={b"k3": (gsns[2] - 1000, 0)})))
    assert outcome(log.coord, 3, log.gsn).code == f.FORGOTTEN  # type: ignore[union-attr]
    assert [txn for _, txn in log.applied].count(3) == 1


# -- restarts -------------------------------------------------------------------------------------
def _decided_then_forgotten_by_the_validator(log: Log) -> tuple[bytes, int, int]:
    w = log.put(encode(Write(txn=7, key=b"k", value=b"v")))
    commit = encode(Commit(txn=7, reads={}, writes={b"k": w}))
    g1, _ = log.put(commit)
    w8 = log.put(encode(Write(txn=8, key=b"k", value=b"w")))
    log.put(encode(Commit(txn=8, reads={b"k": NO_RID}, writes={b"k": w8})))  # aborts: k has w now
    log.skip(PAST_THE_WINDOW)
    g2, _ = log.put(commit)
    return commit, g1, g2


def test_decided_outcomes_survive_a_coordinator_restart_from_its_snapshot(tmp_path: Path) -> None:
    log = Log()
    commit, g1, g2 = _decided_then_forgotten_by_the_validator(log)
    SnapshotFile(tmp_path / "coordinator-0.snapshot").save(log.coord.snapshot_bytes())
    restarted = CoordinatorCore.from_snapshot(SnapshotFile(tmp_path / "coordinator-0.snapshot").load())
    assert restarted.position == log.coord.position and restarted.outcomes == log.coord.outcomes
    for core in (log.coord, restarted):
        assert committed_at(outcome(core, 7, g1), g1) and committed_at(outcome(core, 7, g2), g1)
        aborted = outcome(core, 8, g1 + 2000)
        assert type(aborted) is f.OutcomeIs and not aborted.committed and "read-write" in aborted.reason
        assert outcome(core, 9, g1 + 2000).code == f.UNKNOWN_TXN  # type: ignore[union-attr]
    # both go on alike: another resend, then the collection point and the window pass
    g3 = log.gsn + 1000
    for core in (log.coord, restarted):
        core.on_record(g3, 0, commit)
        core.on_collected(g3 + 1)
        assert committed_at(outcome(core, 7, g3), g1)
        core.on_position(g3 + PAST_THE_WINDOW)
        assert outcome(core, 7, g3).code == f.FORGOTTEN  # type: ignore[union-attr]
    assert restarted.outcomes == log.coord.outcomes == {}
    assert restarted.forgotten_below == log.coord.forgotten_below == g3 + 1


def test_a_kv_shard_restarted_from_its_sqlite_snapshot_decides_resends_alike(tmp_path: Path) -> None:
    log = Log(kv=KvShardCore(0, 1, Stored(0, None), snapshot_ns=0))
    commit, g1, g2 = _decided_then_forgotten_by_the_validator(log)
    store = SqliteStore(tmp_path / "kv-0-of-1.sqlite3", 0, 1)
    batch, = log.kv.due(1).persist
    assert batch.snapshot is not None
    store.apply(batch)
    log.kv.on_stored(batch, 1)
    store.close()
    store = SqliteStore(tmp_path / "kv-0-of-1.sqlite3", 0, 1)
    restarted = KvShardCore(0, 1, store.load())
    store.close()
    assert restarted.validator.decided == log.kv.validator.decided and restarted.validator.decided[7].unknown
    for d in (log.kv.on_record(log.gsn + 1000, 0, commit), restarted.on_record(log.gsn + 1000, 0, commit)):
        assert d is not None and d.duplicate and d.unknown and not d.committed
    assert not restarted._pending and [txn for _, txn in log.applied] == [7]
    assert encode_snapshot(restarted.validator) == encode_snapshot(log.kv.validator)


def test_snapshots_written_before_outcomes_were_kept_still_load() -> None:
    log = Log()
    w = log.put(encode(Write(txn=7, key=b"k", value=b"v")))
    g1, _ = log.put(encode(Commit(txn=7, reads={}, writes={b"k": w})))
    snap = log.coord.validator.snapshot()
    snap["decided"] = [e[:5] for e in snap["decided"]]  # no ``unknown`` field yet
    core = CoordinatorCore.from_snapshot(msgspec.msgpack.encode(snap))
    assert committed_at(outcome(core, 7, g1), g1)
    # what it never saw decided it cannot tell from a forgotten decision; what it replays, it can
    assert outcome(core, 9, g1).code == f.FORGOTTEN  # type: ignore[union-attr]
    core.on_record(log.gsn + 1000, 0, encode(Write(txn=9, key=b"k", value=b"v")))
    assert outcome(core, 9, log.gsn + 1000).code == f.UNKNOWN_TXN  # type: ignore[union-attr]
