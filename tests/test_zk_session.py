"""A ZooKeeper session is a process's resource: what happens when nobody stops it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ziplog.tools.zk_ensemble import ZooKeeperNotInstalled, find_zookeeper_classpath

ROOT = Path(__file__).resolve().parent.parent

# A watch callback asks ZooKeeper for data after the ensemble is gone (the request waits
# for a connection that never comes), and the program ends without stopping its session.
LEAKY_PROGRAM = """
import sys, tempfile, threading
from ziplog.io import zk as zkio
from ziplog.tools.zk_ensemble import ZooKeeperEnsemble
ens = ZooKeeperEnsemble(tempfile.mkdtemp(), size=1, force_sync=False)
ens.start()
zk = zkio.connect(ens.hosts)
zk.ensure_path("/x")
seen, gone, asking = threading.Event(), threading.Event(), threading.Event()
def watch(data, stat):
    if data == b"go":
        seen.set()
        gone.wait()
        asking.set()
        try:
            zk.get("/x")
        except Exception as e:
            print("the pending request failed:", type(e).__name__, flush=True)
zk.DataWatch("/x", watch)
zk.set("/x", b"go")
seen.wait()
ens.stop()
gone.set()
asking.wait()
print("leaving without stopping the session", flush=True)
"""


def test_a_session_nobody_stopped_does_not_hold_the_exit(tmp_path: Path) -> None:
    try:
        find_zookeeper_classpath()
    except ZooKeeperNotInstalled as e:
        pytest.skip(str(e))
    proc = subprocess.Popen([sys.executable, "-c", LEAKY_PROGRAM], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        # kazoo's exit hook alone would join its callback thread forever
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the process did not exit: {out}\n{err[-2000:]}")
    assert proc.returncode == 0, err[-2000:]
    assert "leaving without stopping the session" in out
    assert "the pending request failed: ConnectionLoss" in out, out
    assert "a ZooKeeper session was never stopped" in err


def test_a_topology_whose_watch_could_not_read_refreshes_on_reconnecting(tmp_path: Path) -> None:
    """A replica registers while ZooKeeper refuses the watch callback's read (on a loaded
    machine the ensemble drops connections): the view is marked stale, and once the
    session reconnects after the server comes back it holds the new address."""
    import threading

    from kazoo.exceptions import ConnectionLoss
    from kazoo.protocol.states import KazooState

    from ziplog.io import zk as zkio
    from ziplog.protocol import layout
    from ziplog.tools.zk_ensemble import ZooKeeperEnsemble
    try:
        find_zookeeper_classpath()
    except ZooKeeperNotInstalled as exc:
        pytest.skip(str(exc))
    with ZooKeeperEnsemble(tmp_path / "zk", size=1, force_sync=False) as ens:
        writer, reader = zkio.connect(ens.hosts), zkio.connect(ens.hosts)
        try:
            writer.create(f"{layout.SHARDS}/0", layout.enc({"replicas": 2}), makepath=True)
            writer.create(f"{layout.SHARDS}/0/0", layout.enc({"addr": "tcp://a:1"}), ephemeral=True)
            topo = zkio.Topology(reader)
            assert topo.wait(lambda: topo.replicas.get(0) == {0: "tcp://a:1"}, 30)
            # the next read in a watch callback fails as if the connection were lost
            real_retry, failed = reader.retry, threading.Event()

            def lost(fn, *args, **kw):  # type: ignore[no-untyped-def]
                if fn == reader.get:
                    failed.set()
                    raise ConnectionLoss()
                return real_retry(fn, *args, **kw)

            reader.retry = lost
            writer.create(f"{layout.SHARDS}/0/1", layout.enc({"addr": "tcp://b:2"}), ephemeral=True)
            assert failed.wait(30)
            reader.retry = real_retry
            assert topo.replicas.get(0) == {0: "tcp://a:1"} and topo._stale
            reconnected = threading.Event()
            reader.add_listener(lambda state: reconnected.set() if state == KazooState.CONNECTED else None)
            ens.stop_node(0)  # the server goes; the sessions survive its return within their timeout
            ens.start_node(0)
            assert reconnected.wait(60)
            assert topo.wait(lambda: topo.replicas.get(0) == {0: "tcp://a:1", 1: "tcp://b:2"}, 30), topo.replicas
        finally:
            zkio.stop(reader)
            zkio.stop(writer)
