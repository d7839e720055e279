"""LogDB's sans-I/O core: the record format (strict, other records skipped) and the commit
decision as a pure function of the log prefix: conflicts, commits naming writes the log
does not hold for them, duplicates from a resend, bounded memory, snapshots, and
serializability checked against a replay of the committed transactions."""

from __future__ import annotations

import random
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from ziplog.logdb.core.records import HEADER, NO_RID, Commit, Write, decode, encode
from ziplog.logdb.core.validator import Validator
from ziplog.protocol.gsna import EPOCH_SPAN


# -- records --------------------------------------------------------------------------------------
def test_records_round_trip_and_anything_else_is_not_logdbs() -> None:
    for rec in (Write(txn=1, key=b"k", value=b"v"), Write(txn=2, key=b"k", value=None),
                Commit(txn=3, reads={b"a": (5, 1), b"b": NO_RID}, writes={b"a": (9, 0)})):
        assert decode(encode(rec)) == rec
    for junk in (b"", b"hello", HEADER, HEADER + b"\xc1", b"ZLDB\x02" + encode(Write(txn=1, key=b"k", value=None))[5:],
                 HEADER + msgspec.msgpack.encode([1, 1, "a str key", None]),
                 HEADER + msgspec.msgpack.encode([2, 1, {b"a": [1, -1]}, {}]),
                 HEADER + msgspec.msgpack.encode([3, 1]),
                 HEADER + msgspec.msgpack.encode([1, 1, b"k" * 2000, None])):
        assert decode(junk) is None, junk


@given(st.binary(max_size=64))
def test_no_bytes_make_the_decoder_raise(data: bytes) -> None:
    decode(data)
    decode(HEADER + data)


# -- decisions ------------------------------------------------------------------------------------
class Log:
    """A log being written: gsns increase by ``step``; every record goes to the validators."""

    def __init__(self, *validators: Validator, step: int = 1) -> None:
        self.validators = validators
        self.gsn = 0
        self.step = step
        self.decisions: list[Any] = []

    def put(self, data: bytes, shard: int = 0) -> tuple[int, int]:
        self.gsn += self.step
        outs = [v.on_record(self.gsn, shard, data) for v in self.validators]
        assert all(o == outs[0] for o in outs), "two replayers decided differently"
        if outs[0] is not None:
            self.decisions.append(outs[0])
        return (self.gsn, shard)


def test_commit_then_conflicts() -> None:
    v = Validator()
    log = Log(v)
    w1 = log.put(encode(Write(txn=1, key=b"x", value=b"1")))
    log.put(encode(Commit(txn=1, reads={b"x": NO_RID}, writes={b"x": w1})))
    assert log.decisions[-1].committed and v.latest[b"x"] == w1
    # T2 and T3 both read x at w1 and write it: the first commit wins
    w2 = log.put(encode(Write(txn=2, key=b"x", value=b"2")))
    w3 = log.put(encode(Write(txn=3, key=b"x", value=b"3")))
    log.put(encode(Commit(txn=3, reads={b"x": w1}, writes={b"x": w3})))
    log.put(encode(Commit(txn=2, reads={b"x": w1}, writes={b"x": w2})))
    d3, d2 = log.decisions[-2:]
    assert d3.committed and d3.writes == ((b"x", w3, b"3"),)
    assert not d2.committed and "read-write" in d2.reason
    assert w2 not in v.writes, "an aborted transaction's writes are gone for good"
    # a blind write older than the committed one: write-write conflict
    w4 = log.put(encode(Write(txn=4, key=b"y", value=b"a")))
    w5 = log.put(encode(Write(txn=5, key=b"y", value=b"b")))
    log.put(encode(Commit(txn=5, reads={}, writes={b"y": w5})))
    log.put(encode(Commit(txn=4, reads={}, writes={b"y": w4})))
    assert log.decisions[-2].committed and not log.decisions[-1].committed
    assert "write-write" in log.decisions[-1].reason


def test_commits_naming_writes_the_log_does_not_hold_for_them_abort() -> None:
    v = Validator()
    log = Log(v)
    mine = log.put(encode(Write(txn=1, key=b"k", value=b"v")))
    theirs = log.put(encode(Write(txn=2, key=b"k", value=b"w")))
    for writes in ({b"k": (999, 0)}, {b"k": theirs}, {b"other": mine}, {b"k": (log.gsn + 5, 0)}):
        log.put(encode(Commit(txn=1, reads={}, writes=writes)))
        assert not log.decisions[-1].committed and "no unused write" in log.decisions[-1].reason
        v.decided.pop(1)  # let the same txn try again with another bad write set
    assert v.latest == {}


def test_a_resent_commit_is_a_duplicate_and_other_records_are_skipped() -> None:
    v = Validator()
    log = Log(v)
    w = log.put(encode(Write(txn=7, key=b"k", value=b"v")))
    log.put(b"another application's record")
    commit = encode(Commit(txn=7, reads={}, writes={b"k": w}))
    first = log.put(commit)
    log.put(commit)  # the application resent it under a new sequence number
    assert [d.committed for d in log.decisions] == [True, True]
    assert not log.decisions[0].duplicate and log.decisions[1].duplicate and log.decisions[1].writes == ()
    assert log.decisions[1].gsn == first[0]
    assert v.skipped == 1


def test_memory_is_bounded_by_the_ttl_in_epochs() -> None:
    v = Validator(ttl_epochs=3)
    log = Log(v, step=EPOCH_SPAN // 4)  # four records per epoch
    for n in range(200):
        w = log.put(encode(Write(txn=n, key=b"k%d" % (n % 5), value=b"v")))
        if n % 2:
            log.put(encode(Commit(txn=n, reads={}, writes={b"k%d" % (n % 5): w})))
    assert len(v.writes) <= 4 * 4 and len(v.decided) <= 4 * 4, (len(v.writes), len(v.decided))
    # a commit naming a write older than the ttl aborts (the same for every replayer)
    old = log.put(encode(Write(txn=10_000, key=b"z", value=b"v")))
    v.advance(log.gsn + 5 * EPOCH_SPAN)
    log.gsn += 5 * EPOCH_SPAN
    log.put(encode(Commit(txn=10_000, reads={}, writes={b"z": old})))
    assert not log.decisions[-1].committed


def test_a_restored_snapshot_decides_as_the_original() -> None:
    a = Validator()
    log = Log(a)
    rng = random.Random(5)
    script = _random_script(rng, 300)
    half = len(script) // 2
    for data in script[:half]:
        log.put(data)
    b = Validator.restore(msgspec.msgpack.decode(msgspec.msgpack.encode(a.snapshot())))
    log.validators = (a, b)
    for data in script[half:]:
        log.put(data)  # asserts both decide the same
    assert a.latest == b.latest


def _random_script(rng: random.Random, n: int) -> list[bytes]:
    out: list[bytes] = []
    rids: dict[int, list[tuple[int, int]]] = {}
    for i in range(n):
        txn = rng.randrange(20)
        if rng.random() < 0.6:
            out.append(encode(Write(txn=txn, key=b"k%d" % rng.randrange(4), value=b"%d" % i)))
            rids.setdefault(txn, []).append((len(out), 0))
        else:
            out.append(encode(Commit(txn=txn, reads={b"k%d" % rng.randrange(4): (rng.randrange(len(out) + 1), 0)},
                                     writes={b"k%d" % rng.randrange(4): rng.choice(rids.get(txn, [(1, 0)]))})))
    return out


# -- serializability --------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 6), st.integers(2, 8))
def test_committed_transactions_replay_to_what_they_read(seed: int, keys: int, clients: int) -> None:
    """Clients run read-modify-write transactions concurrently: each reads its keys'
    latest committed rids as the coordinator knew them when it began (so some are stale
    by the time it commits), writes value+1, and commits. Replaying the committed ones in
    commit order from an empty store, every read saw exactly the replay's value, and the
    coordinator's latest rids are the replay's last writers."""
    rng = random.Random(seed)
    coord, replica = Validator(), Validator()
    log = Log(coord, replica)
    values: dict[tuple[int, int], bytes | None] = {}  # write rid -> value
    open_txns: dict[int, dict[str, Any]] = {}
    txn_ids = iter(range(1, 10**9))
    record: list[dict[str, Any]] = []
    for _ in range(rng.randrange(20, 120)):
        c = rng.randrange(clients)
        t = open_txns.get(c)
        if t is None:
            ks = rng.sample(range(keys), rng.randint(1, min(3, keys)))
            reads = {b"k%d" % k: coord.latest.get(b"k%d" % k, NO_RID) for k in ks}
            open_txns[c] = {"txn": next(txn_ids), "reads": reads, "writes": {}}
            continue
        if not t["writes"] or rng.random() < 0.5 and len(t["writes"]) < len(t["reads"]):
            key = rng.choice([k for k in t["reads"] if k not in t["writes"]] or list(t["reads"]))
            if key in t["writes"]:
                continue
            seen = t["reads"][key]
            v = int(values.get(seen) or b"0") + 1 if seen != NO_RID else 1
            rid = log.put(encode(Write(txn=t["txn"], key=key, value=b"%d" % v)))
            values[rid] = b"%d" % v
            t["writes"][key] = rid
            continue
        log.put(encode(Commit(txn=t["txn"], reads=t["reads"], writes=t["writes"])))
        record.append(dict(t, decision=log.decisions[-1]))
        del open_txns[c]
    store: dict[bytes, tuple[int, int]] = {}
    for t in sorted((t for t in record if t["decision"].committed), key=lambda t: t["decision"].gsn):
        for key, rid in t["reads"].items():
            assert store.get(key, NO_RID) == rid, "a committed transaction read a value the replay did not have"
        for key, rid in t["writes"].items():
            store[key] = rid
    assert store == coord.latest
    for t in record:
        if not t["decision"].committed:
            assert not any(coord.latest.get(k) == rid for k, rid in t["writes"].items())
