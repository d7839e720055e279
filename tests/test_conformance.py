"""The conformance check a port in another language runs (``ziplog conformance``): its
checks on histories against a cluster that holds known records (each lie a port could
tell is caught), and the whole command against a real local cluster with a port that
speaks the wire protocol itself (tests/port_client.py: pyzmq, msgpack and kazoo, no
ziplog), written from docs/CLIENT.md."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ziplog.tools import conformance as cf

#: what the fake cluster holds: gsn -> (shard, data)
HELD = {5: (0, b"a"), 9: (1, b"b"), (1 << 32) + 2: (0, b"c")}


class FakeCluster:
    def read(self, gsn: int, shard: int) -> bytes | None:
        s, d = HELD.get(gsn, (None, None))
        return d if s == shard else None

    def records(self, lo: int, hi: int) -> list[cf.Rec]:
        return [(g, s, d) for g, (s, d) in sorted(HELD.items()) if lo <= g <= hi]


def _lines(*events: dict[str, Any]) -> list[str]:
    return [json.dumps(e) for e in events]


def _ins(after: int, gsn: int, shard: int, data: bytes) -> dict[str, Any]:
    return {"op": "insert", "after": after, "gsn": str(gsn), "shard": shard, "data": data.hex()}


def _dl(gsn: int, shard: int, data: bytes) -> dict[str, Any]:
    return {"op": "deliver", "gsn": gsn, "shard": shard, "data": data.hex()}


GOOD = [_ins(0, 5, 0, b"a"), _ins(5, 9, 1, b"b"), _ins(9, (1 << 32) + 2, 0, b"c"),
        {"op": "read", "gsn": 9, "shard": 1, "data": b"b".hex()},
        {"op": "subscribe", "from": 0}, _dl(5, 0, b"a"), _dl(9, 1, b"b"), _dl((1 << 32) + 2, 0, b"c")]


def _check(events: list[dict[str, Any]]) -> cf.Report:
    return cf.check(cf.parse(_lines(*events)), FakeCluster())


def test_a_true_history_conforms() -> None:
    rep = _check(GOOD)
    assert rep.ok, rep.failures
    assert rep.checked == {"inserts": 3, "records read back": 4, "subscriptions": 1, "deliveries": 3}


@pytest.mark.parametrize("lie, found", [
    ([_ins(9, 9, 1, b"b")], "not above"),  # a gsn not above its rid
    ([_ins(0, 5, 0, b"a"), _ins(0, 5, 0, b"a")], "already given"),
    ([_ins(0, 5, 1, b"a")], "the cluster holds None"),  # the wrong shard
    ([{"op": "read", "gsn": 5, "shard": 0, "data": b"x".hex()}], "the cluster holds b'a'"),
    ([{"op": "subscribe", "from": 0}, _dl(9, 1, b"b"), _dl(5, 0, b"a")], "not strictly increasing"),
    ([{"op": "subscribe", "from": 6}, _dl(5, 0, b"a"), _dl(9, 1, b"b")], "below its start"),
    ([{"op": "subscribe", "from": 0}, _dl(5, 0, b"a"), _dl((1 << 32) + 2, 0, b"c")], "delivery 2 is"),  # a gap
    ([{"op": "subscribe", "from": 0}, _dl(5, 0, b"a"), _dl(9, 1, b"b"), _dl(10, 1, b"z")], "3 deliveries"),
])
def test_each_lie_is_caught(lie: list[dict[str, Any]], found: str) -> None:
    rep = _check(lie)
    assert not rep.ok
    assert any(found in f for f in rep.failures), rep.failures


def test_an_insert_the_subscription_skipped_is_caught() -> None:
    class Forgetful(FakeCluster):  # a cluster whose subscription lost a record the port inserted
        def records(self, lo: int, hi: int) -> list[cf.Rec]:
            return [r for r in super().records(lo, hi) if r[0] != 9]
    events = [_ins(0, 9, 1, b"b"), {"op": "subscribe", "from": 0}, _dl(5, 0, b"a"), _dl((1 << 32) + 2, 0, b"c")]
    rep = cf.check(cf.parse(_lines(*events)), Forgetful())
    assert any("not delivered" in f for f in rep.failures), rep.failures


@pytest.mark.parametrize("line", ['{"op": "insert"}', "[1]", '{"op": "erase"}', "nope",
                                  '{"op": "deliver", "gsn": 1, "shard": 0, "data": ""}',
                                  '{"op": "read", "gsn": -1, "shard": 0, "data": ""}',
                                  '{"op": "read", "gsn": 1, "shard": 0, "data": "zz"}'])
def test_a_malformed_history_is_refused_with_its_line(line: str) -> None:
    with pytest.raises(cf.HistoryError, match="line 1|must be|'data'"):
        cf.parse([line])


PORT = Path(__file__).resolve().parent / "port_client.py"


def test_the_port_written_from_client_md_passes_the_command(shared_zookeeper: str, tmp_path: Path) -> None:
    # its cluster under a root of this worker's ensemble rather than three JVMs more
    env = {**os.environ, "ZIPLOG_LOCAL_ZOOKEEPER": shared_zookeeper}
    done = subprocess.run([sys.executable, "-m", "ziplog", "conformance", "run", "--", sys.executable, str(PORT)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout
    assert "conformance: the history agrees with the cluster" in done.stdout, done.stdout
    assert "inserts: " in done.stdout and "deliveries: " in done.stdout


def test_the_port_imports_nothing_of_ziplog() -> None:
    source = PORT.read_text()
    assert not re.search(r"^\s*(from|import)\s+ziplog", source, re.M)
    assert "docs/CLIENT.md" in source


def test_a_failing_port_fails_the_command(shared_zookeeper: str, tmp_path: Path) -> None:
    # a port that records a record the cluster does not hold at that place
    liar = tmp_path / "liar.py"
    liar.write_text("import json, os\n"
                    "open(os.environ['ZIPLOG_HISTORY'], 'w').write(json.dumps("
                    "{'op': 'read', 'gsn': 5, 'shard': 0, 'data': '00'}) + '\\n')\n")
    env = {**os.environ, "ZIPLOG_LOCAL_ZOOKEEPER": shared_zookeeper}
    done = subprocess.run([sys.executable, "-m", "ziplog", "conformance", "run", "--shards", "1", "--", sys.executable,
                           str(liar)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600, env=env)
    assert done.returncode == 1, done.stdout
    assert "FAILED line 1: the cluster holds None at 5:0" in done.stdout, done.stdout
