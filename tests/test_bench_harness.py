"""The benchmark harness itself: its open-loop schedule, its summaries, and one small
end-to-end run of the latency experiment on the floor (real processes), checking the
results folder a reader gets: JSON rows with the promised fields, Markdown, plots."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from bench.loadgen import ClientPool, ClosedLoopClient, _uniform_schedule
from bench.report import histogram
from bench.systems import make
from bench.systems.base import ClientSpec, Unavailable
from bench.systems.floor import FloorSystem
from ziplog.tools.stats import summarize


def test_uniform_schedule_offers_the_rate_within_each_second() -> None:
    times = _uniform_schedule(random.Random(3), 2.5, 4.0)
    assert times == sorted(times)
    assert len(times) == 10  # 2.5 per second over 4 s, fractions carried over
    for sec in range(4):
        assert 2 <= sum(1 for t in times if sec <= t < sec + 1) <= 3
    assert all(0 <= t < 4.0 for t in times)


def test_histogram_counts_every_sample() -> None:
    samples = [1_000 * v for v in (5, 50, 120, 120, 900, 15_000)]
    h = histogram(samples)
    assert sum(h["counts"]) == len(samples)
    assert h["edges_us"][0] <= 5 and h["edges_us"][-1] >= 15_000
    assert summarize(samples)["p50_us"] == 120


def test_floor_clients_measure_what_they_were_asked() -> None:
    with make("floor") as floor:
        with ClosedLoopClient(floor.client_spec(), "floor") as c:
            samples, _ = c.measure(200, 4096, warmup=10)
        assert len(samples) == 200 and min(samples) > 0
        with ClientPool(floor.client_spec(), 3, "floor", max_workers=2) as pool:
            r = pool.open_loop(300, 1.0, 4096, warmup_s=0.2)
            assert r.errors == 0 and r.unfinished == 0
            assert 250 <= r.acked <= 350  # 300/s for 1 s, every one acknowledged
            assert len(r.lag_ns) == r.acked
            s = pool.saturate(4, 0.5, 4096, warmup_s=0.1)
            assert s.acked > 0 and s.errors == 0


def test_a_systems_server_processes_each_run_on_a_cpu_of_their_own() -> None:
    """The floor's echo processes are placed as the local ziplog cluster places a
    shard's replicas (``bench.systems.cpus.CpuSpread``): one CPU each, not the same one."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: nothing to spread the servers over")
    with make("floor") as floor:
        assert isinstance(floor, FloorSystem)
        placed = [os.sched_getaffinity(pid) for pid in floor.server_pids()]
    assert placed == [{cpus[0]}, {cpus[1]}]


def test_a_client_that_cannot_open_says_why() -> None:
    with pytest.raises(Unavailable, match="no-such-module|ModuleNotFoundError"):
        ClosedLoopClient(ClientSpec("bench.systems.no-such-module", {}), "nothing")


def test_latency_quick_writes_the_promised_results(tmp_path: Path, monkeypatch: Any) -> None:
    from bench.experiments import latency
    small = {**latency.params_for(True), "rounds": 2, "appends_per_round": 100, "warmup": 20,
             "loads": [200], "point_s": 0.5, "point_warmup_s": 0.1}
    monkeypatch.setattr(latency, "params_for", lambda quick: dict(small))
    latency.run(True, tmp_path, systems=["floor"])
    rows = json.loads((tmp_path / "latency.json").read_text())
    one = [r for r in rows if r["kind"] == "closed-loop"]
    assert [r["system"] for r in one] == ["floor"]
    for r in rows:
        for field in ("system", "p50_us", "p99_us", "clients", "offered_load"):
            assert field in r
    assert one[0]["count"] == 200 and one[0]["ratio_to_floor"] == 1.0
    assert any(r["kind"] == "open-loop" and r["offered_load"] == 200 for r in rows)
    assert (tmp_path / "latency.md").read_text().count("| floor") >= 2
    assert (tmp_path / "latency_one_client.png").stat().st_size > 0
    meta = json.loads((tmp_path / "latency_meta.json").read_text())
    assert meta["machine"]["cpu_count"] and meta["params"]["rounds"] == 2


def test_frames_per_append_sums_replicas_by_kind_and_divides_by_the_inserts() -> None:
    from bench.costs import frames_per_append, replica_frames
    before = replica_frames({0: [{"primary": True, "inserts": 10, "sent_ack": 10, "received_insert": 10, "epoch": 3},
                                 {"primary": False, "sent_prefix": 1}]})
    after = replica_frames({0: [{"primary": True, "inserts": 110, "sent_ack": 60, "sent_acks": 10,
                                 "received_insert": 110, "epoch": 9},
                                {"primary": False, "sent_prefix": 11}],
                            1: [{"primary": True, "inserts": 0, "sent_notice": 40}]})
    assert after["primary"] == {"inserts": 110, "sent_ack": 60, "sent_acks": 10, "received_insert": 110,
                                "sent_notice": 40}
    per = frames_per_append(before, after, 100)
    assert per["primary"] == {"received_insert": 1.0, "sent_ack": 0.5, "sent_acks": 0.1, "sent_notice": 0.4,
                              "sent": 1.0, "received": 1.0}
    assert per["backup"] == {"sent_prefix": 0.1, "sent": 0.1, "received": 0.0}


def test_throughput_raises_the_load_and_counts_what_each_append_costs(tmp_path: Path) -> None:
    """ziplog's series on a real cluster, one and two shards, two loads each and one total
    load open loop spread over the shards: every row
    has the servers' CPU and messages per append, the replicas' frames by kind (each
    INSERT reaches both replicas of its shard once), and one knee per shard count."""
    from bench.experiments import throughput
    from bench.report import Results
    p = {**throughput.params_for(True), "shard_counts": [1, 2], "ramp": [], "clients_per_shard": 1,
         "depth": 2, "seconds": 1.0, "warmup_s": 0.2, "workers_per_shard": 1, "equal_total_rate": 400}
    rows = throughput._ziplog_scaling(p, Results("throughput", tmp_path, p))
    assert [(r["shards"], r["clients_per_shard"], r["depth"]) for r in rows] == [
        (1, 1, 2), (1, 1, None), (2, 1, 2), (2, 1, None)]
    assert [r["system"] for r in rows] == ["ziplog", throughput.EQUAL] * 2
    equal = [r for r in rows if r["system"] == throughput.EQUAL]
    assert equal[0]["server_cpu_ratio"] == 1.0 and equal[1]["server_cpu_ratio"] > 0
    for r in rows:
        assert r["total_rate"] > 0 and r["server_cpu_us"] > 0 and r["server_msgs"] > 0, r
        frames = r["frames_per_append"]
        assert 0.8 <= frames["primary"]["received_insert"] <= 1.2, frames
        # The backups' INSERTs are divided by the primaries' inserts, and each replica reads
        # its counters when the STATUS reaches it: on two busy cores a half-second window
        # once gave 1.27 (a primary answering some 0.13 s after its backup). Once, not
        # twice, and not never, is what this checks.
        assert 0.7 <= frames["backup"]["received_insert"] <= 1.3, frames
    for n in (1, 2):
        assert sum(1 for r in rows if r["shards"] == n and r.get("knee")) == 1
    knee1 = next(r for r in rows if r["shards"] == 1 and r.get("knee"))
    assert knee1["server_cpu_ratio"] == 1.0


def test_the_knee_is_the_lightest_load_within_reach_of_the_best() -> None:
    from bench.experiments import throughput
    p = {"knee_within": 0.95}

    def row(system: str, shards: int, clients: int, depth: int, rate: float, cpu: float) -> dict[str, Any]:
        return {"system": system, "shards": shards, "clients_per_shard": clients, "depth": depth,
                "total_rate": rate, "server_cpu_us": cpu}
    rows = [row(throughput.RAMP, 1, 1, 4, 5000, 180), row("ziplog", 1, 4, 8, 9000, 100),
            row(throughput.RAMP, 1, 8, 16, 9200, 95), row(throughput.RAMP, 2, 1, 4, 4000, 270),
            row("ziplog", 2, 4, 8, 6000, 160), row(throughput.RAMP, 2, 8, 16, 7000, 130),
            row(throughput.EQUAL, 1, 4, 0, 2000, 300), row(throughput.EQUAL, 2, 4, 0, 2000, 450)]
    throughput._mark_knees(rows, p)
    assert [r["knee"] for r in rows[:6]] == [False, True, False, False, False, True]
    assert [r["server_cpu_ratio"] for r in rows[:6]] == [None, 1.0, None, None, None, 1.3]
    assert [r["server_cpu_ratio"] for r in rows[6:]] == [1.0, 1.5]


def test_the_next_epoch_is_heard_when_its_first_broadcast_was() -> None:
    """``sequential``'s release at a close: a record of epoch e released up to e's end
    waited for the close only if the release came once e + 1 was broadcast."""
    import numpy as np
    from bench.experiments.sequential_analyse import EpochLog
    from ziplog.protocol.gsna import epoch_base, epoch_end
    log = EpochLog([(300, 6, (0, 1), (200, 200)), (100, 5, (0, 1), (200, 200)), (250, 6, (0, 1), (200, 200))])
    got = log.next_heard(np.asarray([epoch_base(5), epoch_end(5), epoch_base(6), epoch_base(4)], dtype=np.int64))
    never = np.iinfo(np.int64).max
    assert got.tolist() == [250, 250, never, 100]


def test_shardcost_runs_the_control_beside_the_cluster(tmp_path: Path, shared_zookeeper: str) -> None:
    """``bench shardcost`` on real clusters, two shards, one short round: the cluster's
    replicas tell one another of their records (NOTICEs), with a process per replica or per
    CPU; the cluster started without them, the independent clusters and the one shard
    alone tell nobody; each configuration's costs are its own servers'."""
    from bench.experiments import shardcost
    from bench.report import Results
    p = {**shardcost.params_for(True), "shard_counts": [2], "rounds": 1, "seconds": 1.0, "warmup_s": 0.2,
         "workers_per_shard": 1, "loads": [("100/s open loop", 1, "open", 100.0)]}
    runs = shardcost._one_count(2, p, Results("shardcost", tmp_path / "out", p), shared_zookeeper, tmp_path)
    rows = {r["config"]: r for r in shardcost.summarize_runs(2, runs, shardcost.load_names(p))}
    assert set(rows) == set(shardcost.CONFIGS)
    assert rows[shardcost.CLUSTER]["notices"] > 0 and rows[shardcost.PER_CPU]["notices"] > 0, rows
    assert rows[shardcost.INDEPENDENT]["notices"] == 0 and rows[shardcost.ONE]["notices"] == 0, rows
    assert rows[shardcost.NO_NOTICES]["notices"] == 0, rows
    for r in rows.values():
        assert r["total_rate"] > 0 and r["server_cpu_us"] > 0 and r["server_msgs"] > 0, r
        assert r["runs"][0]["errors"] == 0, r


def test_shardcost_takes_each_ratio_within_its_round() -> None:
    from bench.experiments import shardcost

    def m(cpu: float) -> dict[str, Any]:
        return {"total_rate": 1000.0, "p50_us": 900.0, "server_cpu_us": cpu, "ctx_switches": 1.0,
                "server_msgs": 2.0, "notices": 0.0}
    runs = {"L|cluster": [m(110), m(220), m(300)], "L|independent": [m(100), m(200), m(200)],
            "L|one shard": [m(50), m(100), m(100)]}
    rows = {r["config"]: r for r in shardcost.summarize_runs(4, runs, ["L"])}
    cluster = rows[shardcost.CLUSTER]
    assert cluster["vs_independent_rounds"] == [1.1, 1.1, 1.5] and cluster["vs_independent"] == 1.1
    assert cluster["vs_one_shard"] == 2.2 and cluster["server_cpu_us"] == 220
    assert rows[shardcost.INDEPENDENT]["vs_independent"] is None
    assert rows[shardcost.INDEPENDENT]["vs_one_shard"] == 2.0
    assert (rows[shardcost.ONE]["shards"], rows[shardcost.ONE]["of"]) == (1, 4)


def test_shifted_one_shard_clusters_sit_where_the_shards_of_one_cluster_do(tmp_path: Path) -> None:
    """``LocalCluster(cpu_shift=i)``: its shard takes the CPUs shard i of an unshifted
    cluster has; ``zookeeper=``: a root in that ensemble, not an ensemble of its own."""
    import os

    from ziplog.tools.cluster import LocalCluster, ZooKeeperRoot
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: replicas are not spread")
    whole = LocalCluster(tmp_path / "whole", shards=4, zookeeper="127.0.0.1:1")
    for i in range(4):
        alone = LocalCluster(tmp_path / f"alone{i}", shards=1, cpu_shift=i, zookeeper="127.0.0.1:1")
        assert [alone._cpu(0, r) for r in range(2)] == [whole._cpu(i, r) for r in range(2)]
        assert isinstance(alone.zk, ZooKeeperRoot) and alone.zk_hosts.startswith("127.0.0.1:1/ziplog-local/")
    assert whole._cpu(0, 0) != whole._cpu(1, 0)  # the shards' primaries on different CPUs


def test_a_delivered_record_finds_its_acknowledgement_by_gsn() -> None:
    """``sequential``'s lead to the close: a delivered gsn's ack time, none for a gsn no
    writer acknowledged (its lead then counts as none)."""
    import numpy as np
    from bench.experiments.sequential_analyse import ack_times
    acks = np.asarray([[0, 1, 30, 7, 0], [0, 1, 10, 3, 1], [0, 1, 20, 5, 0]], dtype=np.int64)
    got = ack_times(acks, np.asarray([5, 3, 4, 7, 9], dtype=np.int64))
    never = np.iinfo(np.int64).max
    assert got.tolist() == [20, 10, never, 30, never]
    assert ack_times(acks[:0], np.asarray([3], dtype=np.int64)).tolist() == [never]


def test_epochstamp_runs_both_modes_on_both_layouts(tmp_path: Path, shared_zookeeper: str) -> None:
    """``bench epochstamp`` on real clusters, two shards, one short round: each layout
    runs with epochs taken at the leader's stamp and at each replica's arrival, and every
    run counts its inserts' fast path and the backups' guesses."""
    from bench.experiments import epochstamp, shardcost
    from bench.report import Results
    p = {**epochstamp.params_for(True), "shard_counts": [2], "rounds": 1, "seconds": 1.0, "warmup_s": 0.2,
         "workers_per_shard": 1, "loads": [("100/s open loop", 1, "open", 100.0)]}
    runs = epochstamp._count(2, p, Results("epochstamp", tmp_path / "out", p), shared_zookeeper, tmp_path)
    rows = epochstamp.summarize_runs(2, runs, shardcost.load_names(p))
    assert {(r["layout"], r["mode"]) for r in rows} == {(lay, m) for lay in epochstamp.LAYOUTS for m in epochstamp.MODES}
    for r in rows:
        assert r["total_rate"] > 0 and r["fast_path"] is not None and r["server_cpu_us"] > 0, r
        assert r["runs"][0]["errors"] == 0 and r["wrong_guesses_epoch"] >= 0, r
        assert (r["cpu_ratio"] is not None) == (r["mode"] == "sent"), r


def test_epochstamp_counts_guesses_per_insert_and_pairs_its_rounds() -> None:
    from bench.experiments import epochstamp
    before = {k: 0 for k in (*epochstamp.GUESS_COUNTERS, "inserts")}
    after = dict(before, inserts=200, wrong_guesses_epoch=10, reacks=12)
    assert epochstamp.per_insert(before, after)["wrong_guesses_epoch"] == 0.05

    def m(cpu: float, fast: float) -> dict[str, Any]:
        return {"total_rate": 1000.0, "fast_path": fast, "server_cpu_us": cpu, "wrong_guesses_epoch": 0.0,
                "wrong_guesses_ahead": 0.01, "wrong_guesses_behind": 0.0, "guesses_displaced": 0.02, "reacks": 0.03}
    layout = next(iter(epochstamp.LAYOUTS))
    runs = {f"{layout}|L|sent": [m(90, 0.95), m(100, 0.9)], f"{layout}|L|read": [m(100, 0.8), m(80, 0.7)]}
    rows = {r["mode"]: r for r in epochstamp.summarize_runs(4, runs, ["L"])}
    assert rows["sent"]["cpu_ratio_rounds"] == [0.9, 1.25] and rows["sent"]["cpu_ratio"] == 1.075
    assert rows["read"]["cpu_ratio"] is None and "cpu_ratio_rounds" not in rows["read"]
    assert rows["sent"]["fast_path"] == 0.925 and rows["sent"]["other_wrong_guesses"] == 0.03


def test_noticefanout_sends_fewer_notice_frames_per_process(tmp_path: Path, shared_zookeeper: str) -> None:
    """``bench noticefanout`` on real clusters, four shards on two processes, one short
    round: a NOTICE sent once per process takes fewer frames per append than one per
    replica (each round of it reaches three replicas of other shards in each process)."""
    from bench.experiments import epochstamp, noticefanout, shardcost
    from bench.report import Results
    p = {**noticefanout.params_for(True), "shard_counts": [4], "rounds": 1, "seconds": 1.0, "warmup_s": 0.2,
         "workers_per_shard": 1, "loads": [("100/s open loop", 1, "open", 100.0)]}
    runs = epochstamp._count(4, p, Results("noticefanout", tmp_path / "out", p), shared_zookeeper, tmp_path)
    rows = {r["mode"]: r for r in epochstamp.summarize_runs(4, runs, shardcost.load_names(p), list(noticefanout.MODES),
                                                            list(noticefanout.LAYOUTS))}
    assert set(rows) == set(noticefanout.MODES)
    per_process, per_replica = rows["per process"], rows["per replica"]
    assert 0 < per_process["notices"] < per_replica["notices"], (per_process, per_replica)
    assert per_process["cpu_ratio"] is not None and per_replica["cpu_ratio"] is None


def test_clockpass_busy_shards_send_one_another_fewer_notices_by_the_clock(tmp_path: Path,
                                                                           shared_zookeeper: str) -> None:
    """``bench clockpass`` on real clusters, two shards, one short pipelined round, with
    the clock from 300 records/s (a new cluster schedules every shard at 2,000/s, so both
    are busy from the start): busy shards passing by the clock send fewer NOTICE frames
    per append than the same load on NOTICEs alone."""
    from bench.experiments import clockpass, epochstamp, shardcost
    from bench.report import Results
    modes = {"by the clock": ["--clock-pass-rate", "300"], "on NOTICEs": ["--clock-pass-rate", "0"]}
    p = {**clockpass.params_for(True), "modes": modes, "layouts": {"a process per replica": False},
         "shard_counts": [2], "rounds": 1, "seconds": 1.0, "warmup_s": 0.2, "workers_per_shard": 1,
         "loads": [("pipelined 2 x 4", 2, "saturate", 4)]}
    runs = epochstamp._count(2, p, Results("clockpass", tmp_path / "out", p), shared_zookeeper, tmp_path)
    rows = {r["mode"]: r for r in epochstamp.summarize_runs(2, runs, shardcost.load_names(p), list(modes),
                                                            list(p["layouts"]))}
    clock, notices = rows["by the clock"], rows["on NOTICEs"]
    assert notices["notices"] > 0 and clock["notices"] < notices["notices"], (clock, notices)
    assert clock["cpu_ratio"] is not None
