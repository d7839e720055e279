"""The ``ziplog`` command line and the demo, against one real local cluster."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

import ziplog
from ziplog import RecordId
from ziplog.tools.cli import main, parse_rid
from tests.load import REPO_ROOT, cli_env, running_cluster_up, stop_cluster_up, storage_cmdlines, wait_status


@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=2, replicas=2) as c:
        yield c


@pytest.fixture
def zk(cluster: ziplog.LocalCluster) -> str:
    return cluster.zk_hosts


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def rids(out: str) -> list[RecordId]:
    return [parse_rid(line) for line in out.split()]


def test_insert_prints_record_ids_in_argument_order(zk: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "insert", "--zk", zk, "alpha", "beta", "gamma")
    assert rc == 0, err
    got = rids(out)
    assert len(got) == 3
    assert [r.gsn for r in got] == sorted(r.gsn for r in got) and len({r.gsn for r in got}) == 3
    with ziplog.Client(zk) as c:
        assert [c.read_record(r) for r in got] == [b"alpha", b"beta", b"gamma"]


def test_insert_after_and_fixed_shard(zk: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "insert", "--zk", zk, "--shard", "1", "first")
    assert rc == 0
    (first,) = rids(out)
    assert first.shard == 1
    rc, out, _ = run(capsys, "insert", "--zk", zk, "--shard", "0", "--after", f"{first.gsn}:{first.shard}", "second")
    assert rc == 0
    (second,) = rids(out)
    assert second.shard == 0 and second.gsn > first.gsn


def test_insert_from_stdin(zk: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"line one\nline two\n\xff\xfe\n")))
    monkeypatch.setenv("ZIPLOG_ZK", zk)  # no --zk: taken from the environment
    rc, out, err = run(capsys, "insert", "-")
    assert rc == 0, err
    got = rids(out)
    assert len(got) == 3
    with ziplog.Client(zk) as c:
        assert [c.read_record(r) for r in got] == [b"line one", b"line two", b"\xff\xfe"]


def test_read(zk: str, capsys: pytest.CaptureFixture[str]) -> None:
    with ziplog.Client(zk) as c:
        text = c.insert_after("héllo wörld".encode())
        binary = c.insert_after(b"\x00\x01bin\n")
    rc, out, _ = run(capsys, "read", "--zk", zk, f"{text.gsn}:{text.shard}")
    assert (rc, out) == (0, "héllo wörld\n")
    rc, out, _ = run(capsys, "read", "--zk", zk, f"{binary.gsn}:{binary.shard}")
    assert (rc, out) == (0, repr(b"\x00\x01bin\n") + "\n")


def test_read_missing_record_is_one_clear_error_line(zk: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "read", "--zk", zk, "5:99")
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("ziplog read: error:") and "shard 99" in err
    assert "Traceback" not in err


def test_tail_n_prints_records_in_gsn_order(zk: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Insert after every replica's frontier, so no earlier record has a gsn above ours.
    with ziplog.Client(zk) as c:
        top = max(r["frontier"] for reps in wait_status(c).values() for r in reps)
    rc, out, _ = run(capsys, "insert", "--zk", zk, "--after", f"{top}:0", "t1", "t2", "t3")
    assert rc == 0
    mine = rids(out)
    rc, out, _ = run(capsys, "tail", "--zk", zk, "--from", str(mine[0].gsn), "-n", "3")
    assert rc == 0
    lines = out.splitlines()
    assert len(lines) == 3
    parsed = [line.split(" ", 2) for line in lines]
    gsns = [int(g) for g, _, _ in parsed]
    assert gsns == sorted(gsns) and len(set(gsns)) == 3
    assert gsns[0] == mine[0].gsn
    assert [(int(g), int(s), d) for g, s, d in parsed] == [(r.gsn, r.shard, d) for r, d in zip(mine, ["t1", "t2", "t3"])]


def test_tail_from_genesis_sees_everything_in_order(zk: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Its own records, so that it does not depend on which tests ran before it.
    with ziplog.Client(zk) as c:
        mine = [c.insert_after(f"genesis-{i}".encode()) for i in range(10)]
    rc, out, _ = run(capsys, "tail", "--zk", zk, "--from", "genesis", "--idle-timeout", "1")
    assert rc == 0
    gsns = [int(line.split(" ", 1)[0]) for line in out.splitlines()]
    assert gsns == sorted(set(gsns))
    assert {r.gsn for r in mine} <= set(gsns)


def test_status_table(zk: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Records on both shards of its own, so that it does not depend on which tests ran before it.
    with ziplog.Client(zk) as c:
        shards: set[int] = set()
        for i in range(200):
            shards.add(c.insert_after(f"status-{i}".encode()).shard)
            if len(shards) == 2:
                break
    rc, out, err = run(capsys, "status", "--zk", zk)
    assert rc == 0, err
    lines = out.splitlines()
    header = lines[0].split()
    for col in ("shard", "replica", "role", "epoch", "frontier", "stable", "records", "subscriptions"):
        assert col in header
    rows = [dict(zip(header, line.split())) for line in lines[1:]]
    assert sorted((r["shard"], r["replica"]) for r in rows) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert sorted(r["role"] for r in rows) == ["backup", "backup", "primary", "primary"]
    for r in rows:
        assert int(r["epoch"]) >= 0 and int(r["records"]) > 0
        assert int(r["stable"]) <= int(r["frontier"])


def test_status_table_lists_replicas_that_did_not_answer() -> None:
    from ziplog.tools.cli import format_status, status_rows
    st: dict[int, list[dict[str, Any]]] = {0: [{"shard": 0, "replica": 0, "answer": "ok", "primary": True, "epoch": 3, "frontier": 9, "stable": 9,
               "records": 2},
              {"shard": 0, "replica": 1, "addr": None, "answer": "not registered"}],
          1: [{"shard": 1, "replica": 0, "addr": "tcp://h:1", "answer": "unreachable"},
              {"shard": 1, "replica": 1, "answer": "ok", "primary": False, "epoch": 3, "frontier": 9, "stable": 9,
               "records": 2}]}
    lines = format_status(status_rows(st)).splitlines()
    header = lines[0].split()
    rows = [dict(zip(header, line.split())) for line in lines[1:]]
    assert [(r["shard"], r["replica"], r["answer"], r["role"]) for r in rows] == [
        ("0", "0", "ok", "primary"), ("0", "1", "not-registered", "backup"),
        ("1", "0", "unreachable", "primary"), ("1", "1", "ok", "backup")]
    assert rows[1]["frontier"] == "-" and rows[3]["frontier"] == "9"
    assert rows[1]["addr"] == "-" and rows[2]["addr"] == "tcp://h:1"


@pytest.mark.parametrize("bad", ["abc", "12", "x:0", "0:0", "5:-1"])
def test_bad_after_is_a_usage_error(zk: str, capsys: pytest.CaptureFixture[str], bad: str) -> None:
    rc, out, err = run(capsys, "insert", "--zk", zk, "--after", bad, "data")
    assert rc == 2 and out == ""
    assert "argument --after" in err and ("GSN:SHARD" in err or "GSN >= 1" in err)
    assert "Traceback" not in err


def test_missing_zk_hosts(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZIPLOG_ZK", raising=False)
    rc, _, err = run(capsys, "status")
    assert rc == 2 and "ZIPLOG_ZK" in err and err.count("\n") == 1


def test_insert_on_unknown_shard_fails_cleanly(zk: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "insert", "--zk", zk, "--shard", "7", "x")
    assert rc == 1 and out == ""
    assert err.startswith("ziplog insert: error:") and "shard 7" in err and err.count("\n") == 1


def test_demo_core_against_the_cluster(zk: str) -> None:
    from ziplog.tools import demo

    lines: list[str] = []
    summary = demo.run_demo(zk, seconds=0.5, writers=2, reads=20, log=lines.append)
    assert summary["ok"], summary["failures"]
    assert summary["records_written"] > 0
    assert summary["records_seen"] == summary["records_written"]
    assert summary["order_ok"]
    assert summary["reads_ok"] == summary["reads"] > 0
    assert summary["insert_p50_us"] > 0 and summary["fast_path_ratio"] is not None
    assert "all checks passed" in demo.format_summary(summary)
    assert lines


def test_trim(zk: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Last: it deletes the older records the other tests wrote.
    rc, out, _ = run(capsys, "insert", "--zk", zk, "old", "new")
    old, new = rids(out)
    rc, out, err = run(capsys, "trim", "--zk", zk, str(new.gsn))
    assert rc == 0, err
    rc, out, err = run(capsys, "read", "--zk", zk, f"{old.gsn}:{old.shard}")
    assert rc == 1 and err.startswith("ziplog read: error:") and "trim" in err.lower()
    rc, out, _ = run(capsys, "read", "--zk", zk, f"{new.gsn}:{new.shard}")
    assert (rc, out) == (0, "new\n")
    rc, out, _ = run(capsys, "tail", "--zk", zk, "-n", "1")
    assert rc == 0 and out.split(" ", 2)[:2] == [str(new.gsn), str(new.shard)]


def test_demo_module_is_importable() -> None:
    import importlib

    mod = importlib.import_module("ziplog.tools.demo")
    assert callable(mod.main) and callable(mod.run_demo)


def test_python_dash_m_ziplog_is_the_command_line(zk: str) -> None:
    done = subprocess.run([sys.executable, "-m", "ziplog", "insert", "--zk", zk, "by -m"], cwd=REPO_ROOT,
                          env=cli_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    [rid] = rids(done.stdout)
    with ziplog.Client(zk) as c:
        assert c.read_record(rid) == b"by -m"


def test_the_local_helpers_share_one_naming() -> None:
    from ziplog import logbook
    from ziplog.tools import cluster, logbook_local, logdb_local

    assert ziplog.local_cluster is cluster.local_cluster
    assert ziplog.local_logdb is logdb_local.local_logdb
    assert ziplog.local_logbook is logbook_local.local_logbook is logbook.local_logbook  # the old name stays


def test_cluster_up_runs_until_sigterm(tmp_path) -> None:
    with running_cluster_up(tmp_path / "data", "--shards", "1") as (proc, text):
        assert "press Ctrl-C" in text, text
        m = re.search(r"ZooKeeper hosts:\s+(\S+)", text)
        assert m, text
        hosts = m.group(1)
        assert f"ziplog insert --zk {hosts} hello" in text and "import ziplog" in text
        with ziplog.Client(hosts) as c:
            rid = c.insert_after(b"via cluster up")
            assert c.read_record(rid) == b"via cluster up"
        assert "stopped" in stop_cluster_up(proc)


def test_cluster_up_curve_prints_a_key_that_works(tmp_path) -> None:
    """``cluster up --curve``: every process speaks CURVE; the key it prints (every right)
    inserts and reads, from Python and the CLI; a client without a key is refused, typed."""
    with running_cluster_up(tmp_path / "data", "--shards", "1", "--curve") as (proc, text):
        hosts = re.search(r"ZooKeeper hosts:\s+(\S+)", text).group(1)  # type: ignore[union-attr]
        key = re.search(r"client key:\s+(\S+)", text).group(1)  # type: ignore[union-attr]
        assert f"export ZIPLOG_CLIENT_KEY_FILE={key}" in text and f"key_file={key!r}" in text, text
        assert all("--curve" in cmd for cmd in storage_cmdlines(proc))
        with ziplog.Client(hosts, key_file=key) as c:
            rid = c.insert_after(b"via cluster up --curve")
            assert c.read_record(rid) == b"via cluster up --curve"
        cli_run = subprocess.run([sys.executable, "-m", "ziplog.tools.cli", "tail", "--zk", hosts, "--from", "genesis",
                                  "-n", "1", "--key-file", key], capture_output=True, text=True, env=cli_env(),
                                 cwd=REPO_ROOT, timeout=60)
        assert cli_run.returncode == 0 and "via cluster up --curve" in cli_run.stdout, cli_run.stderr
        with ziplog.Client(hosts, key_file=None, timeout=5) as bare:
            with pytest.raises(ziplog.UnauthenticatedError):
                bare.insert_after(b"no key")
        assert "stopped" in stop_cluster_up(proc)


def test_cluster_restart_rolling_restarts_every_process_of_a_running_cluster_up(tmp_path) -> None:
    """``ziplog cluster restart --rolling --data-dir D`` asks the ``cluster up`` on D to
    restart every process one at a time and follows it to the end; inserts go on during
    it, nothing acknowledged is lost, and the restarted processes are new ones."""
    import threading

    import psutil

    env = cli_env()
    data = tmp_path / "data"
    missing = subprocess.run([sys.executable, "-m", "ziplog.tools.cli", "cluster", "restart", "--rolling",
                              "--data-dir", str(data)], capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=60)
    assert missing.returncode == 2 and "no `ziplog cluster up` runs on" in missing.stderr
    # its own ZooKeeper: the rolling restart restarts those nodes too
    with running_cluster_up(data, "--shards", "1", own_zookeeper=True) as (proc, text):
        assert "cluster restart --rolling" in text, text
        hosts = re.search(r"ZooKeeper hosts:\s+(\S+)", text).group(1)  # type: ignore[union-attr]
        before = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        acked: list[ziplog.RecordId] = []
        failed: list[str] = []
        stop = threading.Event()

        def write() -> None:
            with ziplog.Client(hosts) as c:
                while not stop.is_set():
                    try:
                        acked.append(c.insert_after(b"r-%d" % len(acked)))
                    except ziplog.ZiplogError as exc:  # every insert must go through: none may fail
                        failed.append(repr(exc))
                        return

        writer = threading.Thread(target=write)
        writer.start()
        try:
            done = subprocess.run([sys.executable, "-m", "ziplog.tools.cli", "cluster", "restart", "--rolling",
                                   "--data-dir", str(data), "--timeout", "240"],
                                  capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300)
        finally:
            stop.set()
            writer.join()
        assert done.returncode == 0, done.stdout + done.stderr
        assert not failed, (failed, done.stdout)
        for name in ("zk0", "zk1", "zk2", "mms0", "mms1", "mms2", "failure_handler0", "shard0-replica0",
                     "shard0-replica1"):
            assert f"  {name}: back after" in done.stdout, done.stdout
        after = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        assert not (before & after) - {proc.pid}, "a process was not restarted"
        with ziplog.Client(hosts) as c, c.subscribe(ziplog.RID_GENESIS, end=max(r.gsn for r in acked)) as sub:
            got = [rec.data for rec in sub]
        assert sorted(got) == sorted(b"r-%d" % i for i in range(len(acked)))  # every acknowledged one, once
        assert len(acked) > 10, "the writer wrote during the restart"
        rest = stop_cluster_up(proc)
        assert "rolling restart 1 done" in rest and not (data / "cluster-up.pid").exists()
