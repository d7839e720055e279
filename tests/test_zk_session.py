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
