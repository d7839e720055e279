"""The leader election the MMS and the failure handler share (``ziplog.io.election``),
against a real ZooKeeper: a leader that stops beating is deposed by the next in line
well before its session would expire, learns it at its next beat, and the heartbeat
rewrites a node of its own, never the lock node (rewriting that woke every waiting
contender's lock recipe on each beat)."""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator

import pytest

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
