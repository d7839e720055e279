"""The leader election the MMS and the failure handler share (``ziplog.io.election``),
against a real ZooKeeper: a leader that stops beating is deposed by the next in line
well before its session would expire, learns it at its next beat, and the heartbeat
rewrites a node of its own, never the lock node (rewriting that woke every waiting
contender's lock recipe on each beat); a leader whose process dies is deposed through
the follower's death watch, with no silence to wait out."""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from ziplog.io import election as election_module
from ziplog.io import zk as zkio
from ziplog.io.election import HEARTBEAT_NS, Election
from ziplog.tools.zk_ensemble import ZooKeeperEnsemble, ZooKeeperNotInstalled, find_zookeeper_classpath

PATH = "/test/election"


class _Loop:
    """A driver's runtime, reduced to what the election calls (the callbacks only queue
    an event for the test's thread)."""

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        fn()


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    try:
        find_zookeeper_classpath()
    except ZooKeeperNotInstalled as e:
        pytest.skip(str(e))
    ens = ZooKeeperEnsemble(tmp_path_factory.mktemp("zk"), size=1, force_sync=False)
    ens.start()
    try:
        yield ens.hosts
    finally:
        ens.stop()


class _Contender:
    def __init__(self, name: str, hosts: str, events: queue.Queue[tuple[str, str]]) -> None:
        self.name = name
        self.zk = zkio.connect(hosts)
        self.election = Election(self.zk, _Loop())
        self.beating = threading.Event()
        self._stop = threading.Event()
        self._events = events
        self._beater = threading.Thread(target=self._beat, daemon=True)

    def start(self) -> None:
        self.election.run_election(PATH, self.name, lambda: self._on("elected"), lambda: self._on("lost"))
        self._beater.start()

    def _on(self, what: str) -> None:
        if what == "elected":
            self.beating.set()
        self._events.put((self.name, what))

    def _beat(self) -> None:
        # the driver's loop, reduced to its heartbeat timer
        while not self._stop.wait(HEARTBEAT_NS / 1e9):
            if self.beating.is_set():
                self.election.heartbeat()

    def close(self) -> None:
        self._stop.set()
        self.election.close()
        self.zk.stop()
        self.zk.close()


def _next(events: queue.Queue[tuple[str, str]]) -> tuple[str, str]:
    return events.get(timeout=30)  # far beyond a second: only a broken election waits that long


def test_a_leader_that_stops_beating_is_deposed_and_learns_it(hosts: str) -> None:
    events: queue.Queue[tuple[str, str]] = queue.Queue()
    contenders: dict[str, _Contender] = {}
    try:
        for name in ("a", "b", "c"):
            contenders[name] = c = _Contender(name, hosts, events)
            c.start()
            if name == "a":
                assert _next(events) == ("a", "elected")
        a = contenders["a"]
        own = a.election._own
        assert own is not None
        lock_version = a.zk.exists(own).version
        beat = f"{PATH}-beat/{own.rsplit('/', 1)[1]}"
        seen: list[Any] = []
        changed = threading.Event()

        def on_beat(data: Any, stat: Any) -> None:
            seen.append(stat and stat.version)
            if len(seen) >= 3:
                changed.set()

        a.zk.DataWatch(beat, on_beat)
        assert changed.wait(30), "the leader's beat node never changed"
        assert a.zk.exists(own).version == lock_version, "a heartbeat rewrote the lock node"

        a.beating.clear()  # its loop is stuck: no more heartbeats
        who, what = _next(events)
        assert what == "elected" and who != "a", (who, what)
        assert a.zk.exists(own) is None and a.zk.exists(beat) is None, "deposing removes the lock and the beat"
        a.election.heartbeat()  # its loop runs again: the next beat tells it
        assert _next(events) == ("a", "lost")
    finally:
        for c in contenders.values():
            c.close()


#: a leader in a process of its own, beating from its loop, with a session that outlives
#: the test's wait (so only its death watch can move the leadership in time)
_LEADER = """
import sys, threading, time
from kazoo.client import KazooClient
from ziplog.io.election import HEARTBEAT_NS, Election

class Loop:
    def call_soon_threadsafe(self, fn):
        fn()

zk = KazooClient(hosts=sys.argv[1], timeout=60.0)
zk.start(30)
elected = threading.Event()
election = Election(zk, Loop())
election.run_election(sys.argv[2], "doomed", elected.set, lambda: None)
if elected.wait(30):
    print("elected", flush=True)
while True:
    election.heartbeat()
    time.sleep(HEARTBEAT_NS / 1e9)
"""


def test_a_leader_whose_process_dies_is_deposed_through_the_death_watch(
        hosts: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # No silence ends within the test's wait, and the dead leader's session (60 s)
    # outlives it: only the death watch can depose it in time.
    monkeypatch.setattr(election_module, "SILENCE_NS", 3600 * 1_000_000_000)
    caplog.set_level(logging.WARNING, logger="ziplog.election")
    path = PATH + "-death"
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    leader = subprocess.Popen([sys.executable, "-c", _LEADER, hosts, path], stdout=subprocess.PIPE, text=True, env=env)
    events: queue.Queue[tuple[str, str]] = queue.Queue()
    follower: _Contender | None = None
    try:
        assert leader.stdout is not None and leader.stdout.readline().strip() == "elected"
        follower = _Contender("b", hosts, events)
        follower.election.run_election(path, "b", lambda: events.put(("b", "elected")), lambda: None)
        assert follower.election.watching_leader.wait(30), "the follower never held a death watch on the leader"
        leader.send_signal(signal.SIGKILL)
        leader.wait(30)
        assert _next(events) == ("b", "elected")
        assert any("its process is gone" in r.getMessage() for r in caplog.records), \
            [r.getMessage() for r in caplog.records]
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait(30)
        if leader.stdout is not None:
            leader.stdout.close()
        if follower is not None:
            follower.close()
