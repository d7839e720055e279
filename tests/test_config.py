"""Config files: every flag settable in TOML, flags override them, every error reported
at once with its key (``ziplog config check``), secrets only by path; a real storage
replica started from one; JSON log lines."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

import ziplog
from ziplog.shell.config import ConfigError, parse_args, settings_for
from ziplog.shell.logs import JsonLines, OneLine


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="demo")
    ap.add_argument("--zk", required=True)
    ap.add_argument("--shard", type=int, required=True)
    ap.add_argument("--fsync-interval", type=float, default=1.0)
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--fsync", choices=["never", "interval", "always"], default="interval")
    ap.add_argument("--no-notices", action="store_true")
    ap.add_argument("--no-gc", dest="gc", action="store_false")
    return ap


def test_a_file_sets_every_kind_of_flag_and_flags_override_it(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('zk = "h1:1,h2:2"\n[storage]\nshard = 3\nfsync-interval = 2\ndata_dir = "/d"\n'
                   'fsync = "always"\nno_notices = true\nno_gc = true\n')
    args = parse_args(_parser(), ["--config", str(cfg)], "storage")
    assert (args.zk, args.shard, args.fsync_interval, args.data_dir, args.fsync, args.no_notices, args.gc) == (
        "h1:1,h2:2", 3, 2.0, Path("/d"), "always", True, False)
    args = parse_args(_parser(), ["--config", str(cfg), "--shard", "5", "--fsync", "never"], "storage")
    assert (args.shard, args.fsync, args.zk) == (5, "never", "h1:1,h2:2"), "flags override the file"
    # another role's table does not apply
    args = parse_args(_parser(), ["--config", str(cfg), "--shard", "1"], "mms")
    assert args.fsync == "interval" and args.zk == "h1:1,h2:2"


def test_every_problem_is_reported_at_once_with_its_key(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('zk = 5\ncluster_key = "s3cret"\nzk_hosts = "x"\n[storage]\nshard = "one"\nfsync = "sometimes"\n'
                   'no_notices = 1\nfsync_interval = true\nnot_a_flag = 1\n[strage]\nshard = 1\n')
    with pytest.raises(ConfigError) as err:
        settings_for(_parser(), cfg, "storage")
    text = str(err.value)
    for key in ("zk: must be a string", "cluster_key: secrets go by file path", "zk_hosts: not a setting",
                "[storage] shard: must be an integer", "[storage] fsync: must be one of",
                "[storage] no_notices: must be true or false", "[storage] fsync_interval: must be a number",
                "[storage] not_a_flag: not a setting", "[strage]: not a role"):
        assert key in text, (key, text)
    assert len(err.value.problems) == 9
    (tmp_path / "broken.toml").write_text("zk = \n")
    with pytest.raises(ConfigError, match="not TOML"):
        settings_for(_parser(), tmp_path / "broken.toml", "storage")


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ziplog.tools.cli", *argv], capture_output=True, text=True,
                          timeout=300)


def test_ziplog_config_check_checks_each_roles_table_against_its_process(tmp_path: Path) -> None:
    good = tmp_path / "cluster.toml"
    good.write_text('zk = "10.0.0.1:2181,10.0.0.2:2181"\ncluster_key_file = "/etc/ziplog/cluster.key"\n'
                    '[storage]\ndata_dir = "/var/lib/ziplog"\nfsync = "always"\nbind = "0.0.0.0"\n'
                    'advertise = "10.0.0.7"\nheartbeat_ms = 50\n'
                    '[mms]\ninterval_ms = 10\n[failure_handler]\nretry_ms = 200\n'
                    '[kvshard]\nshards = 4\ndata_dir = "/var/lib/logdb"\n')
    done = _cli("config", "check", str(good))
    assert done.returncode == 0, done.stderr
    assert [line.split()[1] for line in done.stdout.splitlines()] == ["[storage]", "[mms]", "[failure_handler]",
                                                                      "[kvshard]"]
    bad = tmp_path / "bad.toml"
    bad.write_text('zk = "h:1"\n[storage]\nfsync = "sometimes"\nheartbeat_ms = "fast"\n[mms]\ndata_dir = "/x"\n')
    done = _cli("config", "check", str(bad))
    assert done.returncode == 2
    assert "[storage] fsync: must be one of" in done.stderr and "[storage] heartbeat_ms: must be a number" in done.stderr
    assert "[mms] data_dir: not a setting of mms" in done.stderr
    one = tmp_path / "one.toml"
    one.write_text('zk = "h:1"\nnode = 2\n')
    assert _cli("config", "check", str(one)).returncode == 2, "no role table: --role is needed"
    done = _cli("config", "check", str(one), "--role", "index_node")
    assert done.returncode == 0, done.stderr


def test_a_storage_replica_runs_from_a_config_file(tmp_path: Path) -> None:
    """The cluster's replicas get their record size limit from a file: a record above it
    is refused with the server's typed error."""
    cfg = tmp_path / "storage.toml"
    cfg.write_text("[storage]\nmax_record_bytes = 1000\nfsync = \"never\"\n")
    with ziplog.local_cluster(shards=1, replicas=2, server_args=["--config", str(cfg)], mms_replicas=1,
                              fh_replicas=1) as cluster, cluster.client() as c:
        c.insert_after(b"x" * 900)
        with pytest.raises(ziplog.ZiplogError, match="1000"):
            c.insert_after(b"x" * 2000)


def test_log_lines_are_one_per_event_as_text_or_json() -> None:
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        rec = logging.LogRecord("ziplog.server", logging.ERROR, __file__, 1, "failed %s", ("here",), sys.exc_info())
    line = JsonLines("storage shard 0 replica 1").format(rec)
    assert "\n" not in line
    obj = json.loads(line)
    assert (obj["level"], obj["process"], obj["logger"], obj["msg"]) == (
        "error", "storage shard 0 replica 1", "ziplog.server", "failed here")
    assert "ValueError: boom" in obj["exc"] and obj["ts"].endswith("Z")
    text = OneLine("mms 0").format(rec)
    assert "\n" not in text and "mms 0 ERROR ziplog.server failed here" in text and "Traceback" in text
