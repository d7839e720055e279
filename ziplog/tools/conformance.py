"""A conformance check for clients in other languages: what a port recorded against a
live cluster (its inserts, reads and subscriptions, as JSON lines) is checked against
what the cluster holds, read through this package's client.

``ziplog conformance run -- COMMAND...`` starts a local cluster, runs the port's
command with ``ZIPLOG_ZK`` (ZooKeeper's connection string) and ``ZIPLOG_HISTORY`` (where
to write its history) in its environment, then checks the history; ``ziplog conformance
check HISTORY --zk HOSTS`` checks a history recorded against a running cluster. The
history's lines (docs/CLIENT.md, Conformance; an integer may be a JSON number or a
decimal string, data is hex):

* ``{"op": "insert", "after": G, "data": HEX, "gsn": G, "shard": S}``: an acknowledged
  insert (``after`` 0 for anywhere);
* ``{"op": "read", "gsn": G, "shard": S, "data": HEX}``: a read's answer;
* ``{"op": "subscribe", "from": G}``, then ``{"op": "deliver", "gsn": G, "shard": S,
  "data": HEX}`` for each record that subscription delivered, in its order.

What must hold: an insert's gsn is above its ``after``; no two inserts share a gsn; the
cluster holds each inserted and each read record at its gsn and shard, with its data;
a subscription delivers gsns in strictly increasing order, from its ``from`` on, and
exactly the records the cluster delivers over the same span (none missed, none extra,
same order); every insert in that span is among them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Protocol

#: a record as the history and the cluster give it
Rec = tuple[int, int, bytes]


class HistoryError(ValueError):
    """A history line that is not one of the documented shapes."""


class ClusterView(Protocol):
    """What the check asks the cluster."""

    def read(self, gsn: int, shard: int) -> bytes | None:
        """The record's data, or None where the cluster holds none."""

    def records(self, lo: int, hi: int) -> list[Rec]:
        """Every record with ``lo <= gsn <= hi``, in the order a subscriber delivers them."""


@dataclass
class Report:
    """Each check's count, and what failed (empty: the history conforms)."""

    checked: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def count(self, what: str, n: int = 1) -> None:
        self.checked[what] = self.checked.get(what, 0) + n

    def fail(self, text: str) -> None:
        if len(self.failures) < 100:  # enough to see what is wrong
            self.failures.append(text)

    @property
    def ok(self) -> bool:
        return not self.failures


def _uint(line: dict[str, Any], key: str) -> int:
    v = line.get(key)
    if type(v) is str and v.isdigit():
        return int(v)
    if type(v) is int and v >= 0:
        return v
    raise HistoryError(f"{key!r} must be a non-negative integer (a number or a decimal string): {line}")


def _data(line: dict[str, Any]) -> bytes:
    try:
        return bytes.fromhex(line["data"])
    except (KeyError, TypeError, ValueError):
        raise HistoryError(f"'data' must be hex: {line}") from None


def parse(lines: Iterable[str]) -> list[dict[str, Any]]:
    """A history's lines as dicts with their integers and data read; blank lines skipped."""
    out: list[dict[str, Any]] = []
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as e:
            raise HistoryError(f"line {n}: not JSON ({e})") from None
        if type(line) is not dict or line.get("op") not in ("insert", "read", "subscribe", "deliver"):
            raise HistoryError(f"line {n}: not an insert, read, subscribe or deliver line: {text.strip()[:200]}")
        op = line["op"]
        ev: dict[str, Any] = {"op": op, "line": n}
        if op == "subscribe":
            ev["from"] = _uint(line, "from")
        else:
            ev.update(gsn=_uint(line, "gsn"), shard=_uint(line, "shard"), data=_data(line))
            if op == "insert":
                ev["after"] = _uint(line, "after")
            if op == "deliver" and not any(e["op"] == "subscribe" for e in out):
                raise HistoryError(f"line {n}: a delivery before any subscribe line")
        out.append(ev)
    return out


def check(history: list[dict[str, Any]], cluster: ClusterView) -> Report:
    """The checks the module's docstring lists, of a parsed history."""
    rep = Report()
    inserts = [e for e in history if e["op"] == "insert"]
    seen: dict[int, int] = {}
    for e in inserts:
        rep.count("inserts")
        if e["gsn"] <= e["after"]:
            rep.fail(f"line {e['line']}: insert after {e['after']} got gsn {e['gsn']}, not above it")
        if e["gsn"] in seen:
            rep.fail(f"line {e['line']}: gsn {e['gsn']} was already given to the insert of line {seen[e['gsn']]}")
        seen[e["gsn"]] = e["line"]
    for e in (x for x in history if x["op"] in ("insert", "read")):
        rep.count("records read back")
        got = cluster.read(e["gsn"], e["shard"])
        if got != e["data"]:
            rep.fail(f"line {e['line']}: the cluster holds {got!r:.60} at {e['gsn']}:{e['shard']}, "
                     f"the history {e['data']!r:.60}")
    subs: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    for e in history:
        if e["op"] == "subscribe":
            subs.append((e, []))
        elif e["op"] == "deliver":
            subs[-1][1].append(e)
    for sub, delivered in subs:
        rep.count("subscriptions")
        rep.count("deliveries", len(delivered))
        if not delivered:
            continue
        gsns = [d["gsn"] for d in delivered]
        if any(b <= a for a, b in zip(gsns, gsns[1:])):
            rep.fail(f"subscription of line {sub['line']}: gsns not strictly increasing")
        start = max(sub["from"], 1)
        if gsns[0] < start:
            rep.fail(f"subscription of line {sub['line']}: delivered gsn {gsns[0]} below its start {start}")
        ours = [(d["gsn"], d["shard"], d["data"]) for d in delivered]
        theirs = cluster.records(start, max(gsns))
        if ours != theirs:
            rep.fail(f"subscription of line {sub['line']}: " + _first_difference(ours, theirs))
        inside = {(e["gsn"], e["shard"], e["data"]) for e in inserts if start <= e["gsn"] <= max(gsns)}
        missed = inside - set(ours)
        if missed:
            rep.fail(f"subscription of line {sub['line']}: {len(missed)} acknowledged inserts in its span "
                     f"not delivered, e.g. gsn {min(missed)[0]}")
    return rep


def _first_difference(ours: list[Rec], theirs: list[Rec]) -> str:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return f"delivery {i + 1} is {a[0]}:{a[1]} {a[2]!r:.40}, the cluster's {b[0]}:{b[1]} {b[2]!r:.40}"
    return f"{len(ours)} deliveries, the cluster has {len(theirs)} records in the same span"


class ClientView:
    """:class:`ClusterView` through this package's client."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def read(self, gsn: int, shard: int) -> bytes | None:
        from ziplog import RecordId
        from ziplog.protocol.errors import NotFoundError
        try:
            data: bytes = self.client.read_record(RecordId(gsn, shard))
            return data
        except NotFoundError:
            return None

    def records(self, lo: int, hi: int) -> list[Rec]:
        from ziplog import RecordId
        sub = self.client.subscribe(RecordId(lo, -1), end=hi)
        try:
            return [(r.rid.gsn, r.rid.shard, r.data) for r in sub]
        finally:
            sub.close()


def print_report(rep: Report, out: Any = sys.stdout) -> None:
    for what, n in rep.checked.items():
        print(f"  {what}: {n}", file=out)
    for f in rep.failures:
        print(f"  FAILED {f}", file=out)
    print("conformance: the history agrees with the cluster" if rep.ok else
          f"conformance: {len(rep.failures)} check(s) failed", file=out)


def check_file(path: Path, zk_hosts: str, **client_kw: Any) -> Report:
    """Check the history at ``path`` against the cluster whose ZooKeeper is ``zk_hosts``."""
    import ziplog
    with path.open() as f:
        history = parse(f)
    with ziplog.Client(zk_hosts, **client_kw) as client:
        return check(history, ClientView(client))


def run(command: list[str], shards: int = 2, timeout: float = 600.0) -> int:
    """Start a local cluster, run ``command`` against it, check the history it wrote."""
    import ziplog
    with ziplog.local_cluster(shards=shards, replicas=2) as cluster, tempfile.TemporaryDirectory() as tmp:
        history = Path(tmp) / "history.jsonl"
        env = {**os.environ, "ZIPLOG_ZK": cluster.zk_hosts, "ZIPLOG_HISTORY": str(history)}
        print(f"conformance: a local cluster of {shards} shards at ZIPLOG_ZK={cluster.zk_hosts}; running "
              f"{' '.join(command)}", flush=True)
        done = subprocess.run(command, env=env, timeout=timeout)
        if done.returncode != 0:
            print(f"conformance: the command exited with {done.returncode}")
            return 1
        if not history.exists():
            print("conformance: the command wrote no history to $ZIPLOG_HISTORY")
            return 1
        rep = check_file(history, cluster.zk_hosts)
    print_report(rep)
    return 0 if rep.ok else 1


def add_commands(sub: Any) -> None:
    """``ziplog conformance run|check``."""
    group = sub.add_parser("conformance", help="check another client's recorded history against a cluster",
                           description=__doc__.split("\n\n")[0])
    acts = group.add_subparsers(dest="conformance_command", metavar="ACTION", required=True)
    rn = acts.add_parser("run", help="start a local cluster, run COMMAND against it, check the history it wrote")
    rn.add_argument("--shards", type=int, default=2)
    rn.add_argument("--timeout", type=float, default=600.0, metavar="S", help="how long COMMAND may run")
    rn.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND...")
    rn.set_defaults(func=_cmd_run)
    ck = acts.add_parser("check", help="check a history recorded against a running cluster")
    ck.add_argument("history", type=Path, metavar="HISTORY")
    ck.add_argument("--zk", default=os.environ.get("ZIPLOG_ZK"), help="ZooKeeper hosts (default $ZIPLOG_ZK)")
    ck.set_defaults(func=_cmd_check)


def _cmd_run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("ziplog conformance run: no COMMAND given (ziplog conformance run -- COMMAND...)", file=sys.stderr)
        return 2
    try:
        return run(command, args.shards, args.timeout)
    except HistoryError as e:
        print(f"ziplog conformance run: {e}", file=sys.stderr)
        return 1


def _cmd_check(args: argparse.Namespace) -> int:
    if not args.zk:
        print("ziplog conformance check: --zk or $ZIPLOG_ZK is needed", file=sys.stderr)
        return 2
    try:
        rep = check_file(args.history, args.zk)
    except HistoryError as e:
        print(f"ziplog conformance check: {e}", file=sys.stderr)
        return 2
    print_report(rep)
    return 0 if rep.ok else 1
