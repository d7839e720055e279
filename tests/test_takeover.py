"""``ziplog.server --take-over PID``: the successor stops only the process ZooKeeper holds
registered as its replica, running ``ziplog.server``; a wrong pid is refused and never
signalled. The mechanics on plain processes, then the refusal through a real server."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ziplog
from ziplog.server.takeover import TakeOverRefused, looks_like_storage_server, take_over

# A stand-in whose command line names ziplog.server (as ``python -m ziplog.server`` does).
SLEEPER = [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)", "ziplog.server"]
# ... and one that ignores SIGTERM (from when it says it is ready).
STUBBORN = [sys.executable, "-c",
            "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)", "ziplog.server"]


def _start(argv: list[str]) -> subprocess.Popen[bytes]:
    """Once it runs its program: until then its command line is still its parent's."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    return p


def test_a_process_not_registered_or_not_a_server_is_never_signalled() -> None:
    plain = _start([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"])
    server = _start(SLEEPER)
    try:
        with pytest.raises(TakeOverRefused, match="not this replica's registered server"):
            take_over(server.pid, registered_pid=None)
        with pytest.raises(TakeOverRefused, match="not this replica's registered server"):
            take_over(server.pid, registered_pid=plain.pid)
        with pytest.raises(TakeOverRefused, match="does not run ziplog.server"):
            take_over(plain.pid, registered_pid=plain.pid)
        assert plain.poll() is None and server.poll() is None
        assert looks_like_storage_server(server.pid) and not looks_like_storage_server(plain.pid)
    finally:
        for p in (plain, server):
            p.kill()
            p.wait()


def test_the_registered_server_is_stopped_and_waited_for() -> None:
    server = _start(SLEEPER)
    try:
        take_over(server.pid, registered_pid=server.pid)
        # take_over returned: the process has exited (a zombie until its parent reaps it).
        assert server.wait(0) == -15
    finally:
        server.kill()
        server.wait()
    take_over(server.pid, registered_pid=server.pid)  # gone already: nothing to do


def test_one_that_does_not_stop_is_killed_after_the_timeout() -> None:
    server = _start(STUBBORN)
    try:
        take_over(server.pid, registered_pid=server.pid, timeout_s=0.2)
        assert server.wait(0) == -9
    finally:
        server.kill()
        server.wait()


def test_a_server_started_to_take_over_a_wrong_pid_exits_and_signals_nothing() -> None:
    bystander = _start(SLEEPER)
    try:
        with ziplog.local_cluster(shards=1, replicas=2) as cluster:
            with cluster.client() as c:
                before = c.status(wait=5.0)[0]
                out = subprocess.run(
                    [sys.executable, "-m", "ziplog.server", "--zk", cluster.zk_hosts, "--shard", "0", "--replica", "1",
                     "--cluster-key-file", str(cluster.key_file), "--take-over", str(bystander.pid)],
                    capture_output=True, text=True, timeout=60)
                assert out.returncode == 2, out.stderr
                assert "not taking over" in out.stderr and "not this replica's registered server" in out.stderr
                assert bystander.poll() is None
                # The registered replica never stopped: same process, still serving.
                assert cluster.servers[(0, 1)].poll() is None
                after = c.status(wait=5.0)[0]
                assert [e.get("answer") for e in after] == ["ok", "ok"], after
                assert after[1]["frontier"] >= before[1]["frontier"]
                c.insert_after(b"still serving")
    finally:
        bystander.kill()
        bystander.wait()
