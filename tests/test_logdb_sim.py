"""LogDB's apply path under crashes (seeded simulation, ``tests/sim/logdb.py``): a KV
shard killed before any SQLite statement of its run never holds data without its
position or a position without its data, and once restarted it ends exactly where a
shard that never crashed ends: every committed write of its keys applied once, in gsn
order. The coordinator's core, replaying the same log, decides the same transactions
the shards applied. And LogDB's production drivers (coordinators, KV shards, clients)
on the whole simulated system (``tests/sim/logdb_system.py``), with kills: serializable,
outcomes as told, every commit applied once; the checker's own tests tamper with a
settled run to show it notices."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sim import logdb_system
from tests.sim.logdb import CRASH_EXIT, crash_child, make_log, reference, run_shard
from ziplog.logdb.core import frames as f
from ziplog.logdb.core.coordinator import CoordinatorCore
from ziplog.logdb.core.kvshard import owner
from ziplog.logdb.core.validator import Validator
from ziplog.logdb.store import SqliteStore

SHARDS = 2


def _state(path: Path, index: int) -> tuple[int, dict, list]:
    store = SqliteStore(path, index, SHARDS)
    try:
        return store.applied(), store.items(), store.journal()
    finally:
        store.close()


@pytest.mark.parametrize("seed", [1])
def test_a_crash_before_any_statement_leaves_data_and_position_together(tmp_path: Path, seed: int) -> None:
    log = make_log(seed, turns=15)  # ~70 statements a shard, each a crash point (a forked child)
    end = log.turns[-1][1]
    for index in range(SHARDS):
        clean = tmp_path / f"clean-{index}.sqlite3"
        statements = run_shard(clean, log, index, SHARDS)
        want_kv, want_journal = reference(log, index, SHARDS, end)
        assert _state(clean, index) == (end, want_kv, want_journal)
        assert want_journal, "the script committed nothing on this shard: a vacuous run"
        for crash_at in range(1, statements + 1):
            path = tmp_path / f"s{index}-{crash_at}.sqlite3"
            assert crash_child(path, log, index, SHARDS, crash_at) == CRASH_EXIT
            applied, kv, journal = _state(path, index)
            # whatever it stored, it stored with its position: exactly the reference at it
            assert (kv, journal) == reference(log, index, SHARDS, applied), (crash_at, applied)
            run_shard(path, log, index, SHARDS)  # restarted: resumes from what it stored
            assert _state(path, index) == (end, want_kv, want_journal), crash_at
            for p in path.parent.glob(path.name + "*"):
                p.unlink()


@pytest.mark.parametrize("seed", [4, 5])
def test_the_coordinator_decides_what_the_shards_apply(tmp_path: Path, seed: int) -> None:
    log = make_log(seed, turns=60)
    core = CoordinatorCore()
    for recs, position in log.turns:
        for gsn, shard, data in recs:
            core.on_record(gsn, shard, data)
        core.on_position(position)
    committed = {d.txn: d for d in core.validator.decided.values() if d.committed}
    for index in range(SHARDS):
        path = tmp_path / f"kv{index}.sqlite3"
        run_shard(path, log, index, SHARDS)
        _, kv, journal = _state(path, index)
        for gsn, txn, keys in journal:
            assert committed[txn].gsn == gsn
            assert keys == sum(1 for w in committed[txn].writes if owner(w[0], SHARDS) == index)
        applied_txns = {t for _, t, _ in journal}
        assert applied_txns == {t for t, d in committed.items() if any(owner(w[0], SHARDS) == index for w in d.writes)}
    # what a client asks of the coordinator agrees with what it decided
    some = next(iter(committed.values()))
    (route, answer), = core.on_request(b"r", f.encode(f.Outcome(req=1, txn=some.txn, commit_gsn=some.gsn)))
    assert type(answer) is f.OutcomeIs and answer.committed and answer.gsn == some.gsn


# -- LogDB on the whole simulated system (tests/sim/logdb_system.py) ---------------------------------
def test_logdb_on_the_simulated_system_is_serializable_and_applies_each_commit_once() -> None:
    """Coordinators, KV shards and bank clients (the production drivers) over the
    simulated log, with kills of all of them and the log's own faults: every seed checks
    serializability, the outcomes clients were told, exactly-once application and the
    coordinators' agreement (``python -m tests.sim --logdb --seeds 2000`` runs more)."""
    totals: dict[str, int] = {}
    for seed in range(25):
        out = logdb_system.run(seed)
        for k, v in out.logdb.items():
            totals[k] = totals.get(k, 0) + v
    # not vacuous: commits of both kinds, aborts and kills happened
    assert totals["committed_writes"] > 50 and totals["committed_reads"] > 20, totals
    assert totals["aborted"] > 0 and totals["logdb_kills"] > 10, totals


def _settled_sim(seed: int) -> logdb_system.LogDbSim:
    sim = logdb_system.LogDbSim(seed)
    sim.run()
    assert any(writes for *_, writes in sim.committed), "the seed committed no transfer: pick another"
    return sim


def test_the_logdb_simulation_sees_a_shard_that_applied_a_write_twice_or_a_wrong_value() -> None:
    sim = _settled_sim(0)
    try:
        sim.check_logdb()  # as it ran: green
        kv = next(k for k in sim.kvs if k.store is not None and k.store.items())
        assert kv.store is not None
        key = next(iter(kv.store.items()))
        kv.store.db.execute("UPDATE kv SET value = ? WHERE key = ?", (b"12345", key))
        with pytest.raises(AssertionError, match="holds"):
            sim.check_logdb()
        kv.store.db.execute("UPDATE kv SET value = ? WHERE key = ?", (sim_value(sim, key), key))
        sim.check_logdb()
        gsn, txn, n = kv.store.journal()[-1]
        kv.store.db.execute("INSERT INTO journal (gsn, txn, keys, applied_at) VALUES (?, ?, ?, 0)",
                            (gsn + 1, (txn ^ 1).to_bytes(8, "big"), n))
        with pytest.raises(AssertionError, match="journal"):
            sim.check_logdb()
    finally:
        sim.close()


def sim_value(sim: logdb_system.LogDbSim, key: bytes) -> bytes | None:
    """The value the log's last committed write of ``key`` holds."""
    value: bytes | None = None
    v = Validator()
    for gsn, shard, data in sim.readers[0].delivered:
        d = v.on_record(gsn, shard, data)
        if d is not None and d.committed and not d.duplicate:
            value = next((val for k, _, val in d.writes if k == key), value)
    return value


def test_the_logdb_simulation_sees_a_read_no_serial_order_explains() -> None:
    sim = _settled_sim(0)
    try:
        i = next(i for i, c in enumerate(sim.committed) if c[5] and c[4])
        cid, txn, at, rid, reads, writes = sim.committed[i]
        key = next(iter(reads))
        sim.committed[i] = (cid, txn, at, rid, {**reads, key: b"-777"}, writes)
        with pytest.raises(AssertionError, match="not serializable"):
            sim.check_logdb()
    finally:
        sim.close()
