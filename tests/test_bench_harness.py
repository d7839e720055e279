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
