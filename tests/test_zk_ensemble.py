"""Real 3-node ZooKeeper quorum: survives one crashed node, restarts it, cleans up.

Runs the Debian package's ZooKeeper JVMs (see ziplog.tools.zk_ensemble); skipped
with the setup hint if the package is not installed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import pytest

kazoo_client = pytest.importorskip("kazoo.client")
from kazoo.exceptions import NodeExistsError  # noqa: E402
from kazoo.retry import KazooRetry  # noqa: E402

from ziplog.tools.zk_ensemble import (  # noqa: E402
    ZooKeeperEnsemble,
    ZooKeeperNotInstalled,
    find_java,
    find_zookeeper_classpath,
)

KazooClient = kazoo_client.KazooClient
T = TypeVar("T")

try:
    find_zookeeper_classpath()
    find_java()
except ZooKeeperNotInstalled as e:  # pragma: no cover - depends on the machine
    pytest.skip(str(e), allow_module_level=True)


def _wait_until(pred: Callable[[], T], timeout: float, what: str) -> T:
    """Poll ``pred`` until it returns something truthy or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def _create_idempotent(client: Any, path: str, value: bytes) -> None:
    """Create ``path``; if a retry finds it already created by a lost reply, check it."""
    try:
        client.create(path, value)
    except NodeExistsError:
        assert client.get(path)[0] == value


def _processes_mentioning(needle: str) -> list[int]:
    """PIDs of live (non-zombie) processes whose command line contains ``needle``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmdline and state != "Z":
            found.append(int(entry))
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", ["leader", "follower"])
def test_quorum_survives_one_node_crash_and_restart(tmp_path: Path, victim: str) -> None:
    retry = KazooRetry(max_tries=-1, deadline=30, delay=0.05, max_delay=0.5, ignore_expire=True)

    t0 = time.monotonic()
    with ZooKeeperEnsemble(tmp_path, size=3) as ens:
        startup_s = time.monotonic() - t0
        print(f"ensemble serving after {startup_s:.2f}s: {ens.hosts}")

        modes = [ens.node_mode(i) for i in range(3)]
        assert sorted(m or "" for m in modes) == ["follower", "follower", "leader"], modes
        assert len(ens.hosts.split(",")) == 3

        client = KazooClient(hosts=ens.hosts, timeout=10.0)
        client.start(timeout=15)
        try:
            client.create("/ziplog-test/before", b"v0", makepath=True)
            assert client.get("/ziplog-test/before")[0] == b"v0"

            # Crash one node with SIGKILL.
            k = modes.index("leader") if victim == "leader" else modes.index("follower")
            survivors = [i for i in range(3) if i != k]
            ens.kill_node(k)
            assert not ens.is_running(k)
            assert ens.node_mode(k) is None

            # Writes still succeed through the remaining two (a leader crash
            # means a re-election first; the client reconnects on its own).
            for n in range(20):
                retry(_create_idempotent, client, f"/ziplog-test/after-kill-{n}", str(n).encode())
            assert retry(client.get, "/ziplog-test/after-kill-19")[0] == b"19"
            _wait_until(
                lambda: sorted(str(ens.node_mode(i)) for i in survivors) == ["follower", "leader"],
                30,
                "the two survivors to report one leader and one follower",
            )

            # Restart the crashed node with the same config and data: it
            # rejoins the quorum and catches up on what it missed.
            ens.start_node(k)
            mode = ens.wait_for_mode(k, timeout=30)
            assert mode in ("leader", "follower")

            pinned = KazooClient(hosts=ens.node_hosts(k), timeout=10.0)
            pinned.start(timeout=15)
            try:
                pinned.sync("/ziplog-test")
                assert pinned.get("/ziplog-test/after-kill-19")[0] == b"19"
                assert len(pinned.get_children("/ziplog-test")) == 21
            finally:
                pinned.stop()
                pinned.close()
        finally:
            client.stop()
            client.close()

        pids = ens.started_pids
        assert len(pids) == 4  # three initial JVMs + the restarted one

    # Leaving the context stops everything it started: no JVM survives.
    for pid in pids:
        assert pid not in _processes_mentioning(str(tmp_path)), f"zookeeper pid {pid} still alive"
    assert _processes_mentioning(str(tmp_path)) == []
    assert all(ens.pid(i) is None for i in range(3))
