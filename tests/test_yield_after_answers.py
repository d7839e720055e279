"""Every driver's answers leave before any driver's bookkeeping (a process may serve
replicas of several shards), and a storage server's loop told to
(``--yield-after-answers``) gives its CPU away once a turn's answers have left: once per
turn that answered anyone, never after one that did not, and not for a while after a
yield that ran another process for long; a cluster's replicas count their yields, and
none by default."""

from __future__ import annotations

import os
import subprocess
import sys

import ziplog
from ziplog.io.zmq_runtime import ZmqRuntime
from tests.test_metrics import metrics_url, scrape, value


def _one_turn(rt: ZmqRuntime) -> None:
    """Run one turn of ``rt`` that has input (a call handed over), whether or not the last
    yield took long (on a busy machine it may have: that pause is tested below)."""
    rt._yield_paused_until = 0
    rt.call_soon_threadsafe(lambda: None)
    rt.run_once(0)


def test_every_answer_hook_runs_before_any_turn_end_hook_and_the_loop_yields_once() -> None:
    rt = ZmqRuntime(native=True, yield_after_answers=True)
    order: list[str] = []
    answered = {"a": True, "b": True}

    def answers(name: str) -> bool:
        order.append(name)
        return answered[name]

    try:
        rt.at_turn_answers(lambda: answers("a"))
        rt.at_turn_end(lambda: order.append("end a"))
        rt.at_turn_answers(lambda: answers("b"))
        rt.at_turn_end(lambda: order.append("end b"))
        _one_turn(rt)
        assert order == ["a", "b", "end a", "end b"]
        assert rt.yields == 1  # once for the turn, not once per driver that answered

        answered.update(a=False, b=True)
        _one_turn(rt)
        assert rt.yields == 2

        answered.update(a=False, b=False)  # a turn that answered nobody (an epoch, a timer)
        order.clear()
        _one_turn(rt)
        assert order == ["a", "b", "end a", "end b"]
        assert rt.yields == 2
    finally:
        rt.close()


def test_a_yield_that_ran_another_process_long_pauses_the_yields(one_cpu: int) -> None:
    """A process that always wants the CPU shares it with the loop: a yield runs it for its
    time slice, far over YIELD_LONG_NS, and the turns after it do not yield (their
    FORWARDs would wait for it again) until 20 times that long has passed."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    rt = ZmqRuntime(native=True, yield_after_answers=True)
    try:
        os.sched_setaffinity(burner.pid, {one_cpu})
        rt.at_turn_answers(lambda: True)
        for _ in range(10_000):  # a yield may find the other process not yet due the CPU
            _one_turn(rt)
            if rt.yields_long:
                break
        assert rt.yields_long == 1
        yields = rt.yields
        assert rt._yield_paused_until > rt.now()
        rt.call_soon_threadsafe(lambda: None)
        rt.run_once(0)
        assert (rt.yields, rt.yields_long) == (yields, 1)  # paused: no yield
    finally:
        rt.close()
        burner.kill()
        burner.wait()


def test_a_loop_told_not_to_yield_never_does() -> None:
    rt = ZmqRuntime(native=True)  # the default (a storage server's too)
    try:
        rt.at_turn_answers(lambda: True)
        _one_turn(rt)
        assert rt.yields == 0
    finally:
        rt.close()


def test_replicas_yield_after_their_acks_when_told_to() -> None:
    """Both replicas answer every insert, so both yield with ``--yield-after-answers``;
    by default the same inserts are served and neither yields."""
    for args, yielding in ((["--yield-after-answers"], True), ([], False)):
        with ziplog.local_cluster(shards=1, replicas=2, server_args=[*args, "--metrics-port", "auto"]) as cl:
            urls = [metrics_url(cl.logs / f"shard0-replica{r}.log", cl.servers[(0, r)].pid) for r in (0, 1)]
            with cl.client() as c:
                prev = ziplog.RID_GENESIS
                rids = []
                for i in range(100):
                    prev = c.insert_after(b"y-%03d" % i, prev)
                    rids.append(prev)
                assert [c.read_record(r) for r in rids[::25]] == [b"y-%03d" % i for i in range(0, 100, 25)]
            for url in urls:
                yields = value(scrape(url), "ziplog_server_yields_total")
                assert (yields > 0) if yielding else (yields == 0), (args, url, yields)
