"""Prometheus metrics of every server process, scraped over HTTP from real processes: a
local cluster (one shard, two replicas, three MMS and three failure handler replicas)
and a local LogDB (one coordinator, one KV shard). Every process runs with
``--metrics-port auto`` and writes the port it took to its log; the test finds it there
(by the process's pid), scrapes ``/metrics`` and checks the counters against what it
did: inserts, the fast and slow paths, one MMS leader and epochs that move, a killed
replica recovered by the failure handler and serving metrics again, LogDB commits and
an abort."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

import ziplog
from ziplog import RecordId
from ziplog.protocol.errors import NotFoundError, ZiplogError
from ziplog.protocol.gsna import EPOCH_BITS
from ziplog.logdb import LogDB, TransactionAborted
from ziplog.tools import procs
from ziplog.tools.logdb_local import LocalLogDB, local_logdb

ARGS = ["--metrics-port", "auto"]
#: how long any awaited change may take on a busy machine
DEADLINE_S = 90.0
INSERTS = 60

T = TypeVar("T")
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

_SERVED = re.compile(r"metrics served on (http://\S+/metrics) \(pid (\d+)\)")


def wait_for(what: str, fn: Callable[[], T | None], timeout: float = DEADLINE_S) -> T:
    """Poll ``fn`` until it returns something other than None (or False)."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while True:
        try:
            got = fn()
            if got is not None and got is not False:
                return got
        except OSError as exc:  # not listening yet, or restarting
            last_exc = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}" + (f" (last error: {last_exc!r})" if last_exc else ""))
        time.sleep(0.05)


def metrics_url(log_path: Path, pid: int) -> str:
    """The endpoint the process ``pid`` wrote to its log (a restarted process appends to
    the same file: its own line is the one with its pid)."""
    def find() -> str | None:
        if not log_path.exists():
            return None
        for m in _SERVED.finditer(log_path.read_text(errors="replace")):
            if int(m.group(2)) == pid:
                return m.group(1)
        return None
    return wait_for(f"the metrics endpoint of pid {pid} in {log_path.name}", find)


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def scrape_until(what: str, url: str, ok: Callable[[Samples], bool]) -> Samples:
    """Scrape ``url`` until ``ok`` holds of what it serves; that scrape."""
    def once() -> Samples | None:
        got = scrape(url)
        return got if ok(got) else None
    return wait_for(what, once)


def value(samples: Samples, name: str, **labels: str) -> float:
    """The one sample called ``name`` whose labels include ``labels``."""
    found = [v for (n, lb), v in samples.items() if n == name and set(labels.items()) <= lb]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_cluster_processes_serve_metrics() -> None:
    with ziplog.local_cluster(shards=1, replicas=2, server_args=ARGS, mms_args=ARGS, fh_args=ARGS) as cluster:
        logs = cluster.logs
        primary = metrics_url(logs / "shard0-replica0.log", cluster.servers[(0, 0)].pid)
        backup = metrics_url(logs / "shard0-replica1.log", cluster.servers[(0, 1)].pid)
        mms = [metrics_url(logs / f"mms{i}.log", p.pid) for i, p in sorted(cluster.mms.items())]
        fh = [metrics_url(logs / f"fh{i}.log", p.pid) for i, p in sorted(cluster.fh.items())]

        with cluster.client() as c:
            for i in range(INSERTS):
                c.insert_after(b"x%d" % i)
            paths = dict(c.stats)
        assert paths["fast_path"] + paths["slow_path"] == INSERTS, paths

        # The backup holds every record once the primary's forwards reached it.
        b = scrape_until("the backup to hold every record", backup,
                         lambda s: value(s, "ziplog_replica_records") == INSERTS)
        p = scrape_until("the primary's stable point to move", primary,
                         lambda s: value(s, "ziplog_replica_stable_gsn") > 0)
        assert value(p, "ziplog_replica_primary", shard="0", replica="0") == 1
        assert value(b, "ziplog_replica_primary", shard="0", replica="1") == 0
        assert value(p, "ziplog_replica_primary_state", state="serving") == 1
        assert value(p, "ziplog_replica_blocked") == 0
        assert value(p, "ziplog_replica_backups_connected") == 1
        # every insert was decided by the primary, once (a resend is answered from its record)
        assert value(p, "ziplog_replica_inserts_total") >= INSERTS
        assert value(p, "ziplog_replica_records") == INSERTS
        # each slow-path insert is one re-ACK of the backup; the rest took the fast path
        assert value(b, "ziplog_replica_reacks_total") == paths["slow_path"], paths
        # each guess the primary confirmed is a fast-path insert (a client may also take the
        # fast path on a backup's answer from a decision it already held: not a guess)
        confirmed = value(b, "ziplog_replica_confirmed_guesses_total")
        assert confirmed <= paths["fast_path"], paths
        warm = 0
        if confirmed == 0:
            # A cold start on a busy machine can have every insert reach the backup after
            # the primary's decision did (a re-ACK each, or a fast answer from the decision
            # the backup held): on the warm cluster the backup's guesses are confirmed.
            with cluster.client() as c:
                for i in range(INSERTS):
                    c.insert_after(b"warm %d" % i)
            warm = INSERTS
            scrape_until("a guess of the backup's confirmed", backup,
                         lambda s: value(s, "ziplog_replica_confirmed_guesses_total") > 0)
        # every guess that missed is one of the slow paths (the re-ACK tells the client)
        wrong = sum(value(b, "ziplog_replica_wrong_guesses_total", kind=k) for k in ("epoch", "ahead", "behind"))
        assert wrong <= value(b, "ziplog_replica_reacks_total")
        assert value(p, "ziplog_replica_frontier_gsn") >= value(p, "ziplog_replica_stable_gsn") > 0
        assert value(p, "ziplog_replica_stable_lag_gsns") == (value(p, "ziplog_replica_frontier_gsn")
                                                              - value(p, "ziplog_replica_stable_gsn"))
        assert value(p, "ziplog_replica_epoch") > 0  # epoch 0 is over long before the inserts end
        assert value(p, "ziplog_replica_disk_full") == 0
        assert value(p, "ziplog_replica_disk_bytes") > 0
        assert value(p, "ziplog_replica_recovery_phase", phase="normal") == 1
        assert value(p, "ziplog_replica_subscriptions") == 0
        # The server's share of the inserts: a sample for each turn that read an INSERT, on
        # both replicas (each gets every insert from the client), in consistent buckets.
        for s in (p, b):
            turns = value(s, "ziplog_replica_insert_turn_seconds_count")
            assert turns > 0
            assert value(s, "ziplog_replica_insert_turn_seconds_bucket", le="+Inf") == turns
            assert 0 < value(s, "ziplog_replica_insert_turn_seconds_sum") < turns  # under a second each

        # Exactly one MMS replica leads, and its epochs move between two scrapes.
        def one_leader(urls: list[str], name: str) -> int | None:
            leading = [i for i, u in enumerate(urls) if value(scrape(u), name) == 1]
            return leading[0] if len(leading) == 1 else None
        # Followers broadcast nothing while the leader's epochs move on.
        leader = wait_for("one MMS leader", lambda: one_leader(mms, "ziplog_mms_leader"))
        followers = [u for i, u in enumerate(mms) if i != leader]
        followers_first = [value(scrape(u), "ziplog_mms_epochs_broadcast_total") for u in followers]
        first = scrape(mms[leader])
        later = scrape_until("the MMS leader's next epoch", mms[leader],
                             lambda s: value(s, "ziplog_mms_epoch") > value(first, "ziplog_mms_epoch"))
        assert value(later, "ziplog_mms_epochs_broadcast_total") > value(first, "ziplog_mms_epochs_broadcast_total")
        assert value(later, "ziplog_mms_zk_commits_total", result="ok") >= 1
        assert [value(scrape(u), "ziplog_mms_epochs_broadcast_total") for u in followers] == followers_first
        # A backup's epoch is one the leader has begun (scraped before the leader's).
        backup_epoch = value(scrape(backup), "ziplog_replica_epoch")
        assert 0 < backup_epoch <= value(scrape(mms[leader]), "ziplog_mms_epoch")

        # An insert after a rid a few epochs ahead parks on the primary until its epoch
        # begins: the wait histogram counts it (a lead the epochs overtook before the
        # insert arrived is tried again, longer).
        inserted = INSERTS + warm
        parked_before = value(scrape(primary), "ziplog_replica_parked_wait_seconds_count", kind="insert")
        with cluster.client() as c:
            for lead in (3, 6, 12, 24):
                epoch = value(scrape(mms[leader]), "ziplog_mms_epoch")
                try:
                    c.insert_after(b"parked", RecordId(int(epoch + lead) << EPOCH_BITS, 0))
                    inserted += 1
                except ZiplogError:  # waited past the park timeout: nothing was stored
                    continue
                if value(scrape(primary), "ziplog_replica_parked_wait_seconds_count", kind="insert") > parked_before:
                    break
        p = scrape(primary)
        assert value(p, "ziplog_replica_parked_wait_seconds_count", kind="insert") > parked_before
        assert value(p, "ziplog_replica_parked_wait_seconds_sum", kind="insert") > 0
        assert value(p, "ziplog_replica_parked_wait_seconds_bucket", kind="insert", le="+Inf") == value(
            p, "ziplog_replica_parked_wait_seconds_count", kind="insert")

        # A killed backup, restarted only after the suspicion timeout: the failure
        # handler's leader recovers the shard, and the new process serves metrics.
        fh_leader = wait_for("one failure handler leader", lambda: one_leader(fh, "ziplog_fh_leader"))
        before = scrape(fh[fh_leader])
        started = value(before, "ziplog_fh_recoveries_started_total")
        finished = value(before, "ziplog_fh_recoveries_finished_total")
        old_pid = cluster.servers[(0, 1)].pid
        cluster.restart_delay_s = 1.0
        cluster.kill_replica(0, 1)
        after = scrape_until("the failure handler to finish a recovery", fh[fh_leader],
                             lambda s: value(s, "ziplog_fh_recoveries_finished_total") > finished)
        assert value(after, "ziplog_fh_recoveries_started_total") > started
        assert value(after, "ziplog_fh_suspicions_total") >= 1
        assert value(after, "ziplog_fh_recovery_records_total", phase="done") > finished
        new_pid = wait_for("the supervisor to restart the backup",
                           lambda: pid if (pid := cluster.servers[(0, 1)].pid) != old_pid else None)
        restarted = metrics_url(logs / "shard0-replica1.log", new_pid)
        cluster.wait_ready([0])
        with cluster.client() as c:
            c.insert_after(b"after")
        r = scrape_until("the restarted backup to hold every record", restarted,
                         lambda s: value(s, "ziplog_replica_records") == inserted + 1)
        assert value(r, "ziplog_replica_primary") == 0
        assert value(r, "ziplog_replica_recovery_generation") >= 0
        assert value(r, "ziplog_replica_recovery_phase", phase="normal") == 1


@pytest.fixture(scope="module")
def logdb_stack() -> Iterator[tuple[ziplog.LocalCluster, LocalLogDB]]:
    """A cluster and a LogDB on it, every process serving metrics (shared by the LogDB
    test and the Prometheus test)."""
    with ziplog.local_cluster(shards=1, replicas=2, server_args=ARGS, mms_args=ARGS, fh_args=ARGS) as cluster, \
            local_logdb(cluster, coordinators=1, kv_shards=1, coordinator_args=ARGS, kv_args=ARGS) as ldb:
        yield cluster, ldb


def test_logdb_processes_count_commits(logdb_stack: tuple[ziplog.LocalCluster, LocalLogDB]) -> None:
    cluster, ldb = logdb_stack
    coordinator = metrics_url(cluster.logs / "logdb-coordinator0.log", ldb.coordinators[0].pid)
    kv = metrics_url(cluster.logs / "logdb-kv0.log", ldb.kv[0].pid)
    commits = 5
    with LogDB(ldb.zk_hosts) as db:
        for i in range(commits):
            db.run(lambda t, i=i: t.put(b"k%d" % i, b"v"))  # type: ignore[misc]
        # Two transactions read the same key and write it: the second to commit aborts.
        t1, t2 = db.transaction(), db.transaction()
        t1.get(b"k0")
        t2.get(b"k0")
        t1.put(b"k0", b"one")
        t2.put(b"k0", b"two")
        t1.commit()
        last = t1.commit_rid
        assert last is not None
        try:
            t2.commit()
            raise AssertionError("a transaction whose read was overwritten committed")
        except TransactionAborted:
            pass
    for url in (coordinator, kv):
        s = scrape_until("every decision counted", url,
                         lambda s: value(s, "ziplog_logdb_commits_total") == commits + 1
                         and value(s, "ziplog_logdb_aborts_total") == 1)
        assert value(s, "ziplog_logdb_position_gsn") > 0
    assert value(scrape(coordinator), "ziplog_logdb_coordinator_leader") == 1
    wait_for("the KV shard to apply every commit",
             lambda: value(scrape(kv), "ziplog_logdb_applied_gsn") >= last.gsn or None)


# -- the real tools: Prometheus scrapes every process, evaluates the alert rules ---------------
DEPLOY = Path(__file__).resolve().parent.parent / "docs" / "deploy"
RULES = DEPLOY / "prometheus" / "ziplog-alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "ziplog.json"
README = Path(__file__).resolve().parent.parent / "README.md"
#: Grafana's variables, as a query would run them
GRAFANA_VARIABLES = {"$shard": ".*", "$__rate_interval": "1m", "$__range": "1h"}
NAME = re.compile(r"\b(ziplog_[a-z0-9_]+)")
NO_PROMETHEUS = "Debian's prometheus package is not installed (make setup installs it)"


def readme_metric_names() -> set[str]:
    """The names README's Metrics section lists: whole ``ziplog_...`` names, and the
    storage replica's ``_...`` suffixes (each begins ``ziplog_replica``)."""
    text = README.read_text().split("### Metrics", 1)[1].split("\n#", 1)[0]
    out = set()
    for token in re.findall(r"`([^`]+)`", text):
        name = token.split("{")[0]
        if re.fullmatch(r"ziplog_[a-z0-9_]+", name) and name != "ziplog_replica":  # "each name begins ..."
            out.add(name)
        elif re.fullmatch(r"_[a-z0-9_]+", name) and name != "_total":
            out.add("ziplog_replica" + name)
    assert len(out) > 40, out  # the section was found and read
    return out


def served(name: str, names: set[str]) -> bool:
    """``name`` is served as itself, or as a histogram's series."""
    return name in names or name + "_bucket" in names


def test_alert_rules_and_the_example_config_pass_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(NO_PROMETHEUS)
    for what, path in (("rules", RULES), ("config", RULES.parent / "prometheus.yml")):
        done = subprocess.run([promtool, "check", what, str(path)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


def _api(base: str, path: str, **params: str) -> Any:
    url = f"{base}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.load(resp)
    except urllib.error.HTTPError as e:
        if e.code not in (400, 422):  # 503 while it starts: wait_for tries again (an OSError)
            raise
        body = json.load(e)  # a refused query: its reason
    assert body["status"] == "success", (url, body)
    return body["data"]


def test_a_real_prometheus_scrapes_every_process_and_evaluates_every_alert(
        logdb_stack: tuple[ziplog.LocalCluster, LocalLogDB], tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(NO_PROMETHEUS)
    cluster, ldb = logdb_stack
    logs = cluster.logs
    jobs = {
        "ziplog-storage": [metrics_url(logs / f"shard0-replica{r}.log", cluster.servers[(0, r)].pid) for r in (0, 1)],
        "ziplog-mms": [metrics_url(logs / f"mms{i}.log", p.pid) for i, p in sorted(cluster.mms.items())],
        "ziplog-fh": [metrics_url(logs / f"fh{i}.log", p.pid) for i, p in sorted(cluster.fh.items())],
        "ziplog-logdb": [metrics_url(logs / "logdb-coordinator0.log", ldb.coordinators[0].pid),
                         metrics_url(logs / "logdb-kv0.log", ldb.kv[0].pid)],
    }
    with cluster.client() as c:
        rid = c.insert_after(b"scraped")
        # an error answered (counted by code) and a frame refused before the core (by code):
        # their labelled counters have no series until one happens
        with pytest.raises(NotFoundError):
            c.read_record(RecordId(1, rid.shard))  # epoch 0 has no member: no record
        addrs = c.topology.replica_addrs(0)
        assert addrs is not None
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as junk:
            junk.setsockopt(zmq.LINGER, 1000)
            junk.connect(addrs[0])
            junk.send(b"not a frame")
            assert junk.poll(30_000), "no ERROR came for a malformed frame"
    with LogDB(ldb.zk_hosts) as db:
        db.run(lambda t: t.put(b"scraped", b"v"))
    # the example config's jobs and rules, with these targets and a one-second pace
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(RULES)],
              "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [u.split("/")[2] for u in urls]}]}
                                 for job, urls in jobs.items()]}
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    proc = procs.spawn([binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                        f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"], tmp_path / "prometheus.log")
    try:
        def every_target_up() -> list[dict[str, Any]] | None:
            targets = _api(base, "targets")["activeTargets"]
            up = [t for t in targets if t["health"] == "up"]
            return targets if len(targets) == sum(map(len, jobs.values())) == len(up) else None
        targets = wait_for("Prometheus to scrape every process", every_target_up)
        assert {t["labels"]["job"] for t in targets} == set(jobs)

        def every_rule_evaluated() -> list[dict[str, Any]] | None:
            rules = [r for g in _api(base, "rules")["groups"] for r in g["rules"]]
            return rules if rules and all(r["lastEvaluation"] > "2000" for r in rules) else None
        rules = wait_for("Prometheus to evaluate every rule", every_rule_evaluated)
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
        # a healthy cluster raises no alert but the slow path's, which is not in effect yet
        firing = [r["name"] for r in rules if r["state"] == "firing"]
        assert not firing, firing

        def names_now() -> set[str] | None:
            got = set(_api(base, "label/__name__/values"))
            return got if "ziplog_logdb_applied_gsn" in got and "ziplog_fh_leader" in got else None
        names = wait_for("the series of every kind of process", names_now)
        missing = sorted(n for n in readme_metric_names() if not served(n, names))
        assert not missing, f"README names metrics no process serves: {missing}"
        for r in rules:
            absent = [n for n in NAME.findall(r["query"]) if not served(n, names)]
            assert not absent, (r["name"], absent)
        # each dashboard query runs (as Grafana would send it) and names served metrics only
        panels = json.loads(DASHBOARD.read_text())["panels"]
        queries = [t["expr"] for p in panels for t in p.get("targets", []) if t.get("expr")]
        assert len(queries) > 20
        for q in queries:
            absent = [n for n in NAME.findall(q) if not served(n.removesuffix("_bucket"), names)]
            assert not absent, (q, absent)
            for var, val in GRAFANA_VARIABLES.items():
                q = q.replace(var, val)
            assert "$" not in q, q
            _api(base, "query", query=q)
    finally:
        procs.stop_many([proc])
