"""A storage server's loop polling before it sleeps (``--poll-us``): how long it polls
adapts as Linux's haltpoll governor does (longer while idle periods are short, shorter
when they are long), an idle loop never polls, a loop with input arriving back to back
finds it while polling, a poll ends as soon as a yield lets another task run on its CPU,
and a cluster whose servers poll serves as any other and counts what polling cost."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import ziplog
from ziplog.io.zmq_runtime import POLL_GROW_START_NS, ZmqRuntime, next_poll_limit
from ziplog.server.process import main
from tests.load import running_cluster_up, stop_cluster_up, storage_cmdlines
from tests.test_metrics import metrics_url, scrape

MAX_NS = 200_000


def test_the_poll_grows_while_idle_periods_are_short_and_shrinks_when_they_are_long() -> None:
    assert next_poll_limit(0, 0, MAX_NS) == 0  # input at once: nothing to cover
    assert next_poll_limit(0, 30_000, MAX_NS) == POLL_GROW_START_NS  # a short one not covered
    assert next_poll_limit(POLL_GROW_START_NS, 80_000, MAX_NS) == 2 * POLL_GROW_START_NS
    assert next_poll_limit(150_000, 180_000, MAX_NS) == MAX_NS  # doubled, capped
    assert next_poll_limit(100_000, 60_000, MAX_NS) == 100_000  # covered: unchanged
    assert next_poll_limit(MAX_NS, 10_000_000, MAX_NS) == MAX_NS // 2  # an epoch's idle period
    assert next_poll_limit(0, 10_000_000, MAX_NS) == 0


@given(st.integers(0, MAX_NS), st.integers(0, 10**10), st.integers(1, 10**6))
def test_the_poll_limit_stays_within_zero_and_the_maximum(limit: int, idle: int, max_ns: int) -> None:
    limit = min(limit, max_ns)
    got = next_poll_limit(limit, idle, max_ns)
    assert 0 <= got <= max_ns
    if idle <= limit:
        assert got == limit
    elif idle <= max_ns:
        assert got > limit or got == max_ns
    else:
        assert got < limit or limit == 0


def test_an_idle_loop_never_polls() -> None:
    """A timer every 10 ms and nothing else (an idle replica's epochs): every idle period
    is longer than the maximum, so the loop sleeps at once after every turn."""
    rt = ZmqRuntime(native=True, poll_max_ns=MAX_NS)
    fired: list[int] = []

    def tick() -> None:
        fired.append(1)
        if len(fired) == 20:
            rt.stop()
        else:
            rt.call_at(rt.now() + 10_000_000, tick)

    try:
        rt.call_at(rt.now() + 10_000_000, tick)
        rt.run_forever()
        assert len(fired) == 20
        assert (rt.poll_limit_ns, rt.polled_ns, rt.polls_found) == (0, 0, 0)
    finally:
        rt.close()


def test_input_arriving_back_to_back_is_found_while_polling() -> None:
    """Input is there at every turn's end (a byte read per turn of many queued): the idle
    periods are microseconds, the poll grows, and the polls find the next byte."""
    rx, tx = socket.socketpair()
    rx.setblocking(False)
    rt = ZmqRuntime(native=True, poll_max_ns=MAX_NS)
    reads: list[bytes] = []
    limits: list[int] = []

    def on_read() -> None:
        reads.append(rx.recv(1))
        limits.append(rt.poll_limit_ns)
        if len(reads) == 200:
            rt.stop()

    try:
        tx.sendall(b"x" * 200)
        rt.watch_fd(rx.fileno(), on_read, None)
        rt.run_forever()
        assert len(reads) == 200
        assert max(limits) > 0
        assert rt.polls_found > 0
        assert all(0 <= lim <= MAX_NS for lim in limits)
    finally:
        rt.close()
        rx.close()
        tx.close()


def test_a_poll_ends_when_its_yield_lets_another_task_run(one_cpu: int) -> None:
    """A task that always wants the CPU shares it with the polling loop: the first yield
    runs it, and the poll stops there rather than taking turns with it to its limit."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    rt = ZmqRuntime(native=True, poll_max_ns=MAX_NS)
    try:
        os.sched_setaffinity(burner.pid, {one_cpu})
        rt.poll_limit_ns = 10 * 1_000_000_000  # ten seconds: only a cut ends it soon
        rt._poll_before_sleeping()
        assert rt.polls_cut == 1
        assert rt.polls_found == 0
    finally:
        rt.close()
        burner.kill()
        burner.wait()


def test_a_server_refuses_a_negative_poll(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--zk", "127.0.0.1:1", "--shard", "0", "--replica", "0", "--poll-us", "-1"])
    assert exit_.value.code == 2
    assert "--poll-us must be 0 or more" in capsys.readouterr().err


def test_a_cluster_whose_servers_poll_serves_and_counts_its_polls() -> None:
    with ziplog.local_cluster(shards=1, replicas=2, server_args=["--poll-us", "200", "--metrics-port", "auto"]) as cl:
        urls = [metrics_url(cl.logs / f"shard0-replica{r}.log", cl.servers[(0, r)].pid) for r in (0, 1)]
        with cl.client() as c:
            rids: list[ziplog.RecordId] = []
            prev = ziplog.RID_GENESIS
            for i in range(300):
                prev = c.insert_after(b"p-%03d" % i, prev)
                rids.append(prev)
            assert [c.read_record(r) for r in rids[::50]] == [b"p-%03d" % i for i in range(0, 300, 50)]
        found = 0.0
        for url in urls:
            samples = scrape(url)
            names = {name for name, _ in samples}
            assert {"ziplog_server_poll_seconds_total", "ziplog_server_polls_cut_total",
                    "ziplog_server_poll_limit_seconds"} <= names
            found += sum(v for (name, _), v in samples.items() if name == "ziplog_server_polls_found_total")
        assert found > 0  # 300 inserts back to back: the replicas were polling when some arrived


def test_cluster_up_passes_the_poll_on_to_its_storage_servers(tmp_path: Path) -> None:
    with running_cluster_up(tmp_path / "data", "--shards", "1", "--poll-us", "150") as (proc, text):
        assert "press Ctrl-C" in text, text
        storage = storage_cmdlines(proc)
        assert len(storage) == 2
        assert all(cmd[cmd.index("--poll-us") + 1] == "150" for cmd in storage), storage
        stop_cluster_up(proc)
