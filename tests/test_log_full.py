"""A bound on the records a replica holds in memory (``--max-log-memory-mb``,
``ReplicaSettings.max_log_bytes``): past it a primary refuses new records for good
(LOG_FULL) and a backup guesses none, so a client moves them to other shards, and both
replicas of a shard stop together instead of running out of memory together (and
replaying the same records into the same wall at every restart). Decided records are
always taken; a trim frees memory and the shard takes records again by itself. Real
cores over the wire codec, the client's core, and a real cluster."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

import ziplog
from tests.harness import ShardHarness
from tests.load import Load, trim_and_resume, wait_status
from ziplog.cores.client.calls import InsertCall
from ziplog.cores.client.state import ClientState
from ziplog.cores.client.waits import InsertWait, Redirect
from ziplog.cores.effects import Outbox
from ziplog.cores.replica.log import RECORD_OVERHEAD, DecidedLog, held
from ziplog.protocol import frames as wire
from ziplog.protocol.errors import LogFullError
from ziplog.protocol.events import RecordEvent, TruncateEvent
from ziplog.protocol.gsna import epoch_base
from ziplog.protocol.topology import TopologyView
from ziplog.protocol.types import Policy, RecordId
from ziplog.server.process import build_parser, max_log_bytes, usable_memory
from ziplog.tools.cli import status_rows, status_warnings

RECORD = b"x" * 1000
#: room for three such records and part of a fourth
BOUND = 3 * (len(RECORD) + RECORD_OVERHEAD) + 500


def _serving(bound: int = BOUND) -> ShardHarness:
    h = ShardHarness({"max_log_bytes": bound})
    h.B.connect_primary(0)
    h.pump()
    h.next_epoch()
    return h


def _insert(h: ShardHarness, seq: int, after: int = 0) -> InsertWait | None:
    """The client's view of one insert: settled, or None when it must go elsewhere."""
    h.insert(seq, RECORD + b"%d" % seq, after=after)
    h.pump()
    w = InsertWait(seq, 2)
    try:
        for i, m in h.replies(seq):
            w.feed(i, m)
    except Redirect:
        return None
    return w


def _codes(h: ShardHarness, seq: int) -> list[tuple[int, str]]:
    return sorted((i, m.code) for i, m in h.replies(seq) if isinstance(m, wire.Error))


def test_past_the_bound_the_primary_refuses_for_good_the_backup_takes_no_copy_and_a_trim_makes_room() -> None:
    h = _serving()
    waits = [_insert(h, seq) for seq in (1, 2, 3)]
    decided = [w.decided for w in waits if w is not None and w.decided is not None]
    assert len(decided) == 3 and h.P.log.held_bytes == h.B.log.held_bytes == 3 * (len(RECORD) + 1 + RECORD_OVERHEAD)
    assert _insert(h, 4) is None, "refused for good, no copy anywhere: the client moves it"
    assert _codes(h, 4) == [(0, wire.E_LOG_FULL), (1, wire.E_LOG_FULL)], "refused, and no copy anywhere"
    # the refusal is final: a resend hears it again, even once there is room
    h.turn(h.P, [wire.Insert(req_id=40, client_id=7, seq=4, after=0, data=RECORD + b"4", stamp=0)])
    h.pump()
    assert [m.code for _, m in h.replies(40) if isinstance(m, wire.Error)] == [wire.E_LOG_FULL]
    status = h.P.status()
    assert status["log_bytes"] == h.P.log.held_bytes and status["max_log_bytes"] == BOUND
    # the shard still serves what it holds
    assert [h.P.log.records[g].data for g in h.P.log.gsns] == [RECORD + b"%d" % s for s in (1, 2, 3)]
    # a trim of the first two (stable on both) frees their memory on both replicas
    for core in (h.P, h.B):
        core.on_request(b"client", wire.Trim(req_id=50, gsn=max(decided[:2]) + 1), h.now)
    h.pump()
    assert h.P.log.held_bytes == h.B.log.held_bytes == len(RECORD) + 1 + RECORD_OVERHEAD
    w = _insert(h, 5, after=max(decided))
    assert w is not None and w.decided is not None and w.fast, "the shard takes records again by itself"


def test_without_a_bound_nothing_is_refused() -> None:
    h = _serving(bound=0)
    assert all((w := _insert(h, seq)) is not None and w.decided for seq in range(1, 10))
    assert h.P.log.held_bytes == 9 * (len(RECORD) + 1 + RECORD_OVERHEAD)


def test_the_count_follows_every_way_records_come_and_go() -> None:
    log = DecidedLog(Outbox())
    log.apply_epochs(0, 0, [0])
    base = epoch_base(0)
    rng = random.Random(7)
    evs = [RecordEvent(base + 3 * i + 1, i, 9, i, rng.randbytes(rng.randrange(200))) for i in range(40)]
    for ev in evs:
        log.apply_record(ev)

    def count(kept: list[RecordEvent]) -> int:
        return sum(held(ev) for ev in kept)

    assert log.held_bytes == count(evs)
    log.truncate(evs[29].gsn)  # a recovery replaces what lies above a base
    assert log.held_bytes == count(evs[:30])
    log.advance_stable(log.frontier)
    log.raise_trim(evs[10].gsn)
    assert log.held_bytes == count(evs[10:30]), "trimmed records leave once stable"
    again = DecidedLog(Outbox())  # a restart replays the disk, a truncation included
    again.replay([*log.out.persist, TruncateEvent(evs[19].gsn)])
    assert again.held_bytes == count(evs[:20]) == sum(held(again.records[g]) for g in again.gsns)


def test_a_client_moves_a_refused_record_and_raises_log_full_when_pinned() -> None:
    topo = TopologyView()
    topo.replica_counts = {0: 2, 1: 2}
    topo.replicas = {s: {r: f"tcp://s{s}r{r}" for r in range(2)} for s in (0, 1)}
    topo.history = [[0, [0, 1]]]
    for policy, moved in ((Policy.random(), True), (Policy.fixed(0), False)):
        c = ClientState(7, policy, random.Random(1), 5 * 10**9)
        call = InsertCall(c, b"data", 0, None, 30 * 10**9)
        (_, first), = call.start(0, topo)
        assert isinstance(first, wire.Insert)
        primary, backup = call.targets
        shard = call.shard
        call.on_reply(primary, wire.Error(req_id=first.req_id, code=wire.E_LOG_FULL, message="full"), 1, topo)
        sends = call.on_reply(backup, wire.Error(req_id=first.req_id, code=wire.E_LOG_FULL, message="full"), 2, topo)
        if moved:
            assert not call.done and call.shard != shard and sends, "moved to the other shard"
        else:
            assert call.done
            with pytest.raises(LogFullError):
                call.result()


def test_the_flag_sets_each_replicas_bound() -> None:
    usable = usable_memory()
    assert max_log_bytes(None, 1) == usable // 4 and max_log_bytes(None, 4) == usable // 16
    assert max_log_bytes(0.5, 3) == 1 << 19 and max_log_bytes(0, 1) == 0
    assert build_parser().parse_args(["--zk", "z", "--shard", "0", "--replica", "0",
                                      "--max-log-memory-mb", "2"]).max_log_memory_mb == 2.0


@pytest.mark.parametrize("cgroup, files, limit", [
    ("0::/app\n", {"sys/fs/cgroup/app/memory.max": "2147483648\n"}, 1 << 31),
    ("0::/app\n", {"sys/fs/cgroup/app/memory.max": "max\n"}, None),
    ("7:cpu:/x\n4:memory:/docker/abc\n", {"sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": "536870912"}, 1 << 29),
    ("4:memory:/\n", {"sys/fs/cgroup/memory/memory.limit_in_bytes": str(1 << 62)}, None),  # v1's "no limit"
    ("", {}, None),
], ids=["v2 limit", "v2 max", "v1 limit", "v1 unlimited", "no cgroup"])
def test_the_default_bound_follows_a_containers_memory_limit(tmp_path: Path, cgroup: str, files: dict[str, str],
                                                             limit: int | None) -> None:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert usable_memory(tmp_path) == (machine if limit is None else limit)


def test_a_full_shard_refuses_loses_nothing_and_takes_records_again_after_a_trim() -> None:
    """Real processes: every replica bounded at 64 KiB of records in memory."""
    record = b"m" * (8 << 10)
    with ziplog.local_cluster(shards=2, replicas=2, server_args=["--max-log-memory-mb", "0.0625"]) as cluster:
        subs = Load(cluster, writers=0)
        pinned = cluster.client(timeout=20, policy=Policy.fixed(0))
        roaming = cluster.client(timeout=20)
        acked: dict[RecordId, bytes] = {}
        try:
            refused = None
            for n in range(20):
                data = record + b"-%d" % n
                try:
                    rid = pinned.insert_after(data)
                except ziplog.LogFullError as exc:
                    refused = exc
                    break
                acked[rid] = data
            assert refused is not None and len(acked) == 7, (len(acked), refused)  # 7 x (8 KiB + 322) <= 64 KiB
            status = wait_status(pinned, [0])[0]
            assert all(st["max_log_bytes"] == 1 << 16 and st["log_bytes"] <= 1 << 16 for st in status), status
            warnings = status_warnings(status_rows({0: status}))
            assert len(warnings) == 2 and all("bytes of records in memory" in w for w in warnings), warnings
            some = sorted(acked)[0]
            assert pinned.read_record(some) == acked[some]
            for n in range(3):  # as large: no room for one on shard 0
                data = record + b"-elsewhere-%d" % n
                rid = roaming.insert_after(data)
                assert rid.shard == 1, "a full shard took a new record"
                acked[rid] = data
            assert subs.wait_delivered(set(acked)), "acknowledged records not delivered while the shard was full"
            _, resumed = trim_and_resume(pinned, acked, ziplog.LogFullError, lambda: wait_status(pinned, [0]))
            assert resumed.shard == 0
            acked[resumed] = b"after the trim"
            assert subs.wait_delivered({resumed})
            assert not cluster.restarts, "a replica restarted"
        finally:
            pinned.close()
            roaming.close()
            subs.stop_reading()
        for got in subs.delivered:  # every acknowledged record once, at its rid
            datas = [d for _, d in got]
            assert len(datas) == len(set(datas)), "a record delivered twice"
            by_rid = dict(got)
            assert all(by_rid.get(rid) == data for rid, data in acked.items()), "an acknowledged record lost or moved"
