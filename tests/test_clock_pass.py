"""Slots passed by the clock (real cores, the wire codec between them): an insert takes
no slot expected before its stamp, on the primary and in the backup's guess alike; a
client's clock ahead burns no more than the slack; in a shard the epoch schedules busy,
while no insert comes the primary passes what a late insert could not want, at most
once per interval, and other shards send it no NOTICE once every replica of it
registered that it passes by the clock at the rate it is scheduled at. Below the rate
only the inserts' floors apply; with the rate 0, none of this happens."""

from __future__ import annotations

import time
from typing import Any

import pytest

import ziplog
from tests.harness import ShardHarness, links_over
from tests.load import delivered_until, wait_status
from ziplog import RID_GENESIS, Policy
from ziplog.cores.client.waits import InsertWait
from ziplog.cores.effects import ShardReplicas
from ziplog.cores.replica.primary import PrimarySequencer
from ziplog.cores.replica.settings import ReplicaSettings
from ziplog.protocol import frames as wire
from ziplog.protocol.auth import ClusterKey
from ziplog.protocol.gsna import EpochConfig, EpochSchedule
from ziplog.protocol.topology import TopologyView
from ziplog.server.frame_counts import FrameCounts
from ziplog.server.notices import NoticeFanout

MS = 1_000_000
#: the harness schedules every member at 1,000 records/s: slot k is expected (k+1) ms in
BUSY = {"clock_pass_rate": 1000}
QUIET = {"clock_pass_rate": 1001}
OFF = {"clock_pass_rate": 0}


def _serving(settings: dict[str, Any]) -> ShardHarness:
    h = ShardHarness(settings)
    h.B.connect_primary(0)
    h.pump()
    h.next_epoch()  # taken at h.now (the harness's wall clock is its monotonic one)
    return h


def _primary(h: ShardHarness) -> PrimarySequencer:
    role = h.P.role
    assert isinstance(role, PrimarySequencer)
    return role


def _slot_gsn(h: ShardHarness, slot: int) -> int:
    return EpochSchedule(h.config(h.epoch, (0,))).gsn(0, slot)


def _insert_at(h: ShardHarness, stamp: int, seq: int = 1) -> InsertWait:
    h.insert(seq, b"r%d" % seq, stamp=stamp)
    h.pump()
    w = InsertWait(seq, 2)
    assert any(w.feed(i, m) for i, m in h.replies(seq)), "settled"
    return w


def _sent_half_a_millisecond_before(settings: dict[str, Any]) -> tuple[ShardHarness, InsertWait]:
    """An insert read 6 ms into the epoch, sent half a millisecond before."""
    h = _serving(settings)
    start = h.now
    h.now = start + 6 * MS
    return h, _insert_at(h, start + 5 * MS + 500_000)


def test_an_insert_takes_no_slot_expected_before_it_was_sent_and_the_backup_guesses_it() -> None:
    h, w = _sent_half_a_millisecond_before(BUSY)
    assert w.decided == _slot_gsn(h, 5), "slots 0-4 were expected before it was sent"
    assert w.fast and h.B.stats["confirmed_guesses"] == 1 and h.B.stats["reacks"] == 0
    assert h.P.stats["passed_by_clock"] == 1
    assert h.P.log.frontier == _slot_gsn(h, 6) - 1 and h.B.log.frontier == h.P.log.frontier


@pytest.mark.parametrize("settings, slot", [(QUIET, 5), (OFF, 0)], ids=["below the rate", "the clock off"])
def test_below_the_rate_too_and_not_with_the_clock_off(settings: dict[str, Any], slot: int) -> None:
    """Below the rate an insert skips the slots expected before it too; with the clock
    off it takes the next slot (the tests above would pass vacuously otherwise)."""
    h, w = _sent_half_a_millisecond_before(settings)
    assert w.decided == _slot_gsn(h, slot) and w.fast
    assert ("passed_by_clock" in h.P.stats) == (slot > 0)


def test_a_client_clock_ahead_burns_no_more_than_the_slack() -> None:
    h = _serving(BUSY)
    start = h.now
    h.now = start + 2 * MS
    w = _insert_at(h, start + 8 * MS)  # stamped 6 ms ahead of the replicas' clock
    slack = ReplicaSettings(0, 0).clock_slack_ns
    assert w.decided == _slot_gsn(h, (2 * MS + slack) // MS), "counted as the replica's clock plus the slack"
    assert w.fast


def test_an_unstamped_insert_takes_the_next_slot() -> None:
    h = _serving(BUSY)
    h.now += 6 * MS
    assert _insert_at(h, 0).decided == _slot_gsn(h, 0)


def test_a_quiet_busy_shard_passes_slots_a_late_insert_cannot_want_once_per_interval() -> None:
    h = _serving(BUSY)
    start, P = h.now, h.P
    idle = ReplicaSettings(0, 0).clock_idle_ns
    deadline = P.role.next_deadline(start)
    assert deadline is not None and deadline <= start + 1 * MS + idle, "the first slot's expiry is due"
    h.now = start + 5 * MS
    P.tick(h.now)
    assert _primary(h).next_slot == (5 * MS - idle) // MS, "the slots expected more than the interval ago"
    assert P.stats["expired_by_clock"] == 1
    h.now += idle // 2
    P.tick(h.now)
    assert P.stats["expired_by_clock"] == 1, "at most once per interval"
    h.pump()
    assert h.B.log.frontier == P.log.frontier == _slot_gsn(h, _primary(h).next_slot) - 1, "forwarded like any no-op"
    # an insert sent after the expired slots' time takes a slot past them, guessed alike
    w = _insert_at(h, h.now - 100_000)
    assert w.fast and w.decided is not None and w.decided > P.log.frontier - 1


def test_below_the_rate_nothing_expires() -> None:
    h = _serving(QUIET)
    h.now += 5 * MS
    h.P.tick(h.now)
    assert _primary(h).next_slot == 0 and "expired_by_clock" not in h.P.stats


def _notice_dests(rate_of_other: int) -> list[ShardReplicas]:
    """Shard 0 (scheduled 1,000/s) decides a record in an epoch with shard 1 at
    ``rate_of_other``: where its NOTICE went."""
    h = ShardHarness(BUSY, history=[[0, [0, 1]]])
    h.B.connect_primary(0)
    h.pump()
    cfg = EpochConfig(0, (0, 1), (1000, rate_of_other))
    for core in (h.P, h.B):
        core.on_epoch(cfg, h.now)
    h.epoch = 0
    h.pump()
    h.now += 6 * MS
    h.insert(1, b"r", stamp=h.now - 100_000)
    h.pump()
    return [dest for _, dest, msg in h.sent if isinstance(msg, wire.Notice) and isinstance(dest, ShardReplicas)]


def test_a_notice_names_the_rate_the_epoch_schedules_its_receiver_at() -> None:
    assert _notice_dests(500) == [ShardReplicas(1, 500)]
    assert _notice_dests(1000) == [ShardReplicas(1, 1000)]


def _topology(clock: dict[int, int]) -> TopologyView:
    """Shard 1's two replicas registered ``clock`` (replica -> rate; absent: a build
    that does not say), at two processes."""
    topo = TopologyView()
    topo.replicas = {1: {r: f"tcp://10.0.0.{1 + r}:5001" for r in range(2)}}
    topo.replica_counts = {1: 2}
    topo.replica_reads = {1: {0: wire.READS, 1: wire.READS}}
    topo.replica_pids = {1: {0: 100, 1: 101}}
    topo.replica_clock = {1: clock}
    topo.changed()
    return topo


def test_a_shard_passes_by_the_clock_only_where_every_replica_says_it_does_at_that_rate() -> None:
    assert _topology({0: 1000, 1: 1000}).passes_by_clock(1, 1000)
    assert not _topology({0: 1000, 1: 1000}).passes_by_clock(1, 999), "scheduled below the rate"
    assert not _topology({0: 1000}).passes_by_clock(1, 5000), "a replica of a build before"
    assert not _topology({0: 1000, 1: 0}).passes_by_clock(1, 5000), "a replica that passes by NOTICEs alone"
    assert not _topology({0: 1000, 1: 1000}).passes_by_clock(2, 5000), "a shard with no replica known"


def _told(clock: dict[int, int], rate: int) -> tuple[int, int]:
    """(frames sent, shards not told) for shard 0's NOTICE to shard 1 at ``rate``."""
    links, net = links_over(_topology(clock))
    stats = {"notices_by_clock": 0}
    fan = NoticeFanout(links, ClusterKey(b"a test secret of thirty-two bytes"), FrameCounts({}), stats)
    fan.add(ShardReplicas(1, rate), wire.Notice(shard=0, epoch=3, gsn=99, stamp=1))
    fan.flush()
    return sum(len(ep.sent) for ep in net.endpoints.values()), stats["notices_by_clock"]


def test_a_notice_goes_only_to_a_shard_that_does_not_pass_by_the_clock() -> None:
    assert _told({0: 1000, 1: 1000}, 1000) == (0, 1), "both replicas pass by their own inserts"
    assert _told({0: 1000, 1: 1000}, 999) == (2, 0), "scheduled below their rate: told"
    assert _told({0: 1000}, 5000) == (2, 0), "a replica of a build before: told"


def test_a_local_cluster_whose_shards_are_busy_passes_by_the_clock_and_delivers_everything() -> None:
    """Two shards whose servers pass by the clock from 300 records/s (the shipped rate is
    higher; a closed-loop client per shard is well above this one), one writer on each:
    once the planner schedules both past it, their primaries place inserts past the slots
    the clock passed and send each other no NOTICE, and a subscriber still gets every
    record once, in gsn order. Real processes, ZooKeeper and sockets."""
    with ziplog.local_cluster(shards=2, replicas=2, server_args=["--clock-pass-rate", "300"]) as cluster:
        with cluster.client() as c0, cluster.client() as c1, cluster.client() as reader:
            sub = reader.subscribe(RID_GENESIS)
            c0.set_policy(Policy.fixed(0))
            c1.set_policy(Policy.fixed(1))
            acked: list[ziplog.RecordId] = []
            deadline = time.monotonic() + 60.0
            while True:
                for _ in range(100):
                    acked += [c0.insert_after(b"a", RID_GENESIS), c1.insert_after(b"b", RID_GENESIS)]
                st = wait_status(c0, [0, 1])
                primaries = [r for s in (0, 1) for r in st[s] if r.get("primary")]
                if (all(r.get("notices_by_clock", 0) > 0 for r in primaries)
                        and any(r.get("passed_by_clock", 0) > 0 for r in primaries)):
                    break
                assert time.monotonic() < deadline, f"never scheduled past the clock's rate: {primaries}"
            delivered_until(sub, acked)
            sub.close()
