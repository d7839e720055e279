"""Background load for fault tests: writers with InsertAfter chains and two
subscribers, against a running cluster, recording a history (``tests/history.py``) that
every fault test ends by checking."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import ziplog
from tests.history import History, assert_holds
from ziplog.protocol import layout
from ziplog.protocol.types import RecordId

#: acknowledged records read back at the end of a load (reads are part of the history)
READ_BACK = 20


class Load:
    """``writers`` clients inserting (each after its own previous record) and two
    subscribers reading the whole log, each on its own thread and client."""

    def __init__(self, cluster: ziplog.LocalCluster, writers: int = 2, pace_s: float = 0.002) -> None:
        self.cluster = cluster
        self.cond = threading.Condition()
        self.stop_writing = threading.Event()
        self.stop_reading_event = threading.Event()
        self.acked: list[tuple[RecordId, bytes]] = []
        self.acked_at: list[float] = []  # when each ack arrived (time.monotonic())
        self.chains: dict[int, list[RecordId]] = {i: [] for i in range(writers)}
        self.errors: list[str] = []
        self.delivered: list[list[tuple[RecordId, bytes]]] = [[], []]
        #: when each delivery happened (time.monotonic()), per subscriber
        self.delivered_at: list[list[float]] = [[], []]
        self.stats: list[dict[str, int]] = []
        self.pace_s = pace_s
        self.tag = os.urandom(4).hex()  # this load's records, among earlier ones in the log
        #: what every client was told and every subscriber shown
        self.history = History()
        self.threads = [threading.Thread(target=self._subscriber, args=(i,), daemon=True) for i in range(2)]
        self.threads += [threading.Thread(target=self._writer, args=(i,), daemon=True) for i in range(writers)]
        self._subscribed = threading.Barrier(3)
        for t in self.threads[:2]:
            t.start()
        self._subscribed.wait(60)  # subscribers are on before the first record is written
        for t in self.threads[2:]:
            t.start()

    def _writer(self, i: int) -> None:
        with self.cluster.client(timeout=30) as client:
            prev = ziplog.RID_GENESIS
            n = 0
            while not self.stop_writing.is_set():
                data = f"{self.tag}-w{i}-{n}".encode()
                n += 1  # every call its own data, so the history tells the calls apart
                op = self.history.invoke(data, prev.gsn)
                try:
                    rid = client.insert_after(data, prev)
                except ziplog.ZiplogError as e:
                    self.history.fail(op, e)
                    with self.cond:
                        self.errors.append(f"writer {i}: {e!r}")
                    continue
                self.history.ok(op, rid)
                prev = rid
                with self.cond:
                    self.acked.append((rid, data))
                    self.acked_at.append(time.monotonic())
                    self.chains[i].append(rid)
                    self.cond.notify_all()
                self.stop_writing.wait(self.pace_s)  # pacing, so two cores keep up
            with self.cond:
                self.stats.append(dict(client.stats))

    def _subscriber(self, i: int) -> None:
        with self.cluster.client(timeout=30) as client:
            sub = client.subscribe()
            self._subscribed.wait(60)
            while not self.stop_reading_event.is_set():
                rec = sub.next(timeout=0.2)
                if rec is None:
                    continue
                self.history.delivered(f"subscriber{i}", rec.rid, rec.data)
                with self.cond:
                    self.delivered[i].append((rec.rid, rec.data))
                    self.delivered_at[i].append(time.monotonic())
                    self.cond.notify_all()
            sub.close()

    # -- waiting on events ------------------------------------------------------------------------
    def wait_acked(self, more: int, timeout: float = 60.0) -> None:
        """Until ``more`` further inserts are acknowledged."""
        with self.cond:
            target = len(self.acked) + more
            ok = self.cond.wait_for(lambda: len(self.acked) >= target, timeout)
        assert ok, f"writes stalled: {len(self.acked)} acked, wanted {target}; errors {self.errors[-3:]}"

    def wait_delivered(self, rids: set[RecordId], timeout: float = 60.0) -> bool:
        """Until both subscribers delivered every record of ``rids``."""
        with self.cond:
            return self.cond.wait_for(lambda: all(rids <= {r for r, _ in d} for d in self.delivered), timeout)

    def stop_reading(self, timeout: float = 60.0) -> None:
        self.stop_reading_event.set()
        for t in self.threads[:2]:
            t.join(timeout)

    def finish(self, timeout: float = 60.0) -> None:
        """Stop writing, wait until both subscribers delivered every acknowledged record,
        read some of them back, then check the history (``tests.history.check``): every
        acknowledged record exactly once, at its rid, in one order both subscribers share,
        gsns increasing, InsertAfter kept, records of unknown outcome at most once, reads
        that agree with the subscriptions."""
        self.stop_writing.set()
        for t in self.threads[2:]:
            t.join(timeout)
        with self.cond:
            want = {rid for rid, _ in self.acked}
        ok = self.wait_delivered(want, timeout)
        with self.cond:
            delivered = [list(d) for d in self.delivered]
        self.stop_reading(timeout)
        missing = [len(want - {r for r, _ in d}) for d in delivered]
        assert ok, f"acknowledged records not delivered: {missing} missing of {len(want)}"
        if self.acked:
            with self.cluster.client(timeout=30) as client:
                for rid, _ in self.acked[::max(1, len(self.acked) // READ_BACK)]:
                    try:
                        data: bytes | None = client.read_record(rid)
                    except ziplog.ZiplogError:
                        data = None  # trimmed since, say: says nothing against the log
                    self.history.read(rid, data)
        tag = self.tag.encode()
        assert_holds(self.history, ours=lambda data: data.startswith(tag))

    def longest_stall(self, start: float, end: float) -> float:
        """The longest time between ``start`` and ``end`` either subscriber delivered nothing."""
        with self.cond:
            return max(_longest_gap(times, start, end) for times in self.delivered_at)

    def longest_write_stall(self, start: float, end: float) -> float:
        """The longest time between ``start`` and ``end`` no insert was acknowledged."""
        with self.cond:
            return _longest_gap(self.acked_at, start, end)

    @property
    def redirects(self) -> int:
        return sum(s.get("redirects", 0) for s in self.stats)


def _longest_gap(times: list[float], start: float, end: float) -> float:
    inside = [start] + [t for t in times if start < t < end] + [end]
    return max(b - a for a, b in zip(inside, inside[1:]))


def recovery_record(cluster: ziplog.LocalCluster, shard: int) -> dict[str, Any] | None:
    from ziplog.io.zk_recovery import read_record
    return read_record(cluster._zkc, cluster.key, shard)[0]


def next_recovery_gen(cluster: ziplog.LocalCluster, shard: int) -> int:
    """The generation the shard's next recovery will have."""
    rec = recovery_record(cluster, shard)
    return int(rec["gen"]) + 1 if rec else 0


def wait_recovery(cluster: ziplog.LocalCluster, shard: int, phase: str, min_gen: int = 0,
                  timeout: float = 60.0) -> dict[str, Any]:
    """Until the shard's durable recovery record reaches ``phase`` (a ZooKeeper watch)."""
    zk = cluster._zkc
    path = f"{layout.RECOVERY}/{shard}"
    done = threading.Event()
    seen: dict[str, Any] = {}

    def watch(data: bytes | None, stat: Any) -> bool:
        rec = layout.dec(data) or {}
        if rec.get("phase") == phase and int(rec.get("gen", -1)) >= min_gen:
            seen.update(rec)
            done.set()
            return False  # stop watching
        return True

    zk.ensure_path(layout.RECOVERY)
    zk.DataWatch(path, watch)
    assert done.wait(timeout), f"shard {shard}: recovery did not reach {phase} (record {recovery_record(cluster, shard)})"
    return seen


def recovery_generations(cluster: ziplog.LocalCluster) -> dict[int, int]:
    """Each shard's recovery generation in ZooKeeper (-1: never recovered)."""
    zk = cluster._zkc
    out = {}
    for s in cluster.shard_ids:
        data = zk.exists(f"{layout.RECOVERY}/{s}") and zk.get(f"{layout.RECOVERY}/{s}")[0]
        out[s] = (layout.dec(data) or {}).get("gen", -1) if data else -1
    return out


def leader_lines(cluster: ziplog.LocalCluster) -> int:
    """How many times a control-plane replica logged that it leads."""
    return sum(p.read_text(errors="replace").count("is leader") for p in cluster.logs.glob("*.log"))


def tracebacks(cluster: ziplog.LocalCluster) -> list[str]:
    """The cluster's process logs that hold a traceback."""
    return [p.name for p in cluster.logs.glob("*.log") if "Traceback" in p.read_text(errors="replace")]


#: status() has no change event: a test waiting for a replica's state asks this often
STATUS_POLL_S = 0.05


def wait_status(client: ziplog.Client, shards: list[int] | None = None,
                until: Callable[[dict[int, list[dict[str, Any]]]], bool] = lambda st: True,
                timeout: float = 60.0) -> dict[int, list[dict[str, Any]]]:
    """``client.status()`` of ``shards`` (default: every shard) once every replica of them
    answered and ``until(status)`` holds: a replica restarting or recovering is waited
    for, never indexed while it may be missing."""
    deadline = time.monotonic() + timeout
    while True:
        st = client.status(wait=min(5.0, max(0.1, deadline - time.monotonic())))
        got = st if shards is None else {s: st.get(s, []) for s in shards}
        if all(got.values()) and all(r["answer"] == "ok" for reps in got.values() for r in reps) and until(got):
            return got
        assert time.monotonic() < deadline, f"the replicas never reached the state wanted: {got}"
        time.sleep(STATUS_POLL_S)


class RegistrationWatch:
    """A process's registration node in ZooKeeper, watched: ``gone`` once it disappears
    (the session expired), ``back`` once it is there again after that."""

    def __init__(self, zk: Any, node: str) -> None:
        self.gone, self.back = threading.Event(), threading.Event()
        zk.DataWatch(node, self._watch)

    def _watch(self, data: bytes | None, stat: Any) -> bool:
        if data is None:
            self.gone.set()
        elif self.gone.is_set():
            self.back.set()
            return False  # seen: stop watching
        return True


def pinned_inserts_then_read_all(client: ziplog.Client, shard: int, prefix: str, acked: dict[RecordId, bytes],
                                 stalled: str) -> None:
    """Insert 20 records on ``shard`` (pinned), add them to ``acked``, then subscribe from
    genesis until every record of ``acked`` came once, with the data acknowledged."""
    for n in range(20):
        data = f"{prefix}{n}".encode()
        rid = client.insert_after(data)
        assert rid.shard == shard
        acked[rid] = data
    with client.subscribe() as sub:
        seen: dict[RecordId, bytes] = {}
        while not set(acked) <= set(seen):
            rec = sub.next(timeout=30)
            assert rec is not None, stalled.format(missing=len(set(acked) - set(seen)))
            assert rec.rid not in seen, "a record delivered twice"
            seen[rec.rid] = rec.data
    assert all(seen[rid] == data for rid, data in acked.items())


def trim_and_resume(client: ziplog.Client, acked: dict[RecordId, bytes], refused: type[Exception],
                    state: Callable[[], object]) -> tuple[RecordId, RecordId]:
    """Trim below every acknowledged record, then insert on ``client``'s shard until it
    takes a record again (a shard that refused with ``refused`` comes back by itself, within
    30 s; ``state`` says how it stands if not): the trimmed top and the new record's rid."""
    top = max(acked)
    client.trim(RecordId(top.gsn + 1, top.shard))
    deadline = time.monotonic() + 30
    while True:
        try:
            return top, client.insert_after(b"after the trim")
        except refused:
            assert time.monotonic() < deadline, f"still full after the trim: {state()}"


def delivered_until(sub: Any, want: Iterable[RecordId], timeout: float = 60.0) -> list[Any]:
    """The records ``sub`` delivers until every rid of ``want`` came (none may take longer
    than ``timeout``), checked to come in increasing gsn order, each once."""
    missing = set(want)
    got: list[Any] = []
    while missing:
        rec = sub.next(timeout=timeout)
        assert rec is not None, f"subscription stalled, {len(missing)} missing"
        got.append(rec)
        missing.discard(rec.rid)
    rids = [rec.rid for rec in got]
    assert rids == sorted(rids) and len(set(rids)) == len(rids)
    return got


#: the repository's root: ``python -m ziplog...`` runs from it
REPO_ROOT = str(Path(__file__).resolve().parents[1])


def cli_env() -> dict[str, str]:
    """The environment a ``python -m ziplog...`` subprocess of a test runs in."""
    return dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def cluster_up(data: Path, *flags: str, own_zookeeper: bool = False) -> tuple[subprocess.Popen[str], str]:
    """``ziplog cluster up --data-dir data FLAGS...`` started, and what it printed up to
    its "press Ctrl-C" line (or until it stopped printing, within 90 s). Its ZooKeeper is
    a root in this worker's ensemble, as a LocalCluster's in the test process is, unless
    it must run its own (a test that restarts the ZooKeeper nodes)."""
    from ziplog.tools import cluster
    env = cli_env()
    if not own_zookeeper and cluster.SHARED_ZOOKEEPER is not None:
        env["ZIPLOG_LOCAL_ZOOKEEPER"] = cluster.SHARED_ZOOKEEPER
    else:
        env.pop("ZIPLOG_LOCAL_ZOOKEEPER", None)
    proc = subprocess.Popen([sys.executable, "-m", "ziplog.tools.cli", "cluster", "up", *flags,
                             "--data-dir", str(data)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO_ROOT)
    seen = []
    deadline = time.monotonic() + 90
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if "press Ctrl-C" in line:
            break
    return proc, "".join(seen)


@contextlib.contextmanager
def running_cluster_up(data: Path, *flags: str,
                       own_zookeeper: bool = False) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """:func:`cluster_up` for the body of a ``with``; killed at its end if still running."""
    proc, text = cluster_up(data, *flags, own_zookeeper=own_zookeeper)
    try:
        yield proc, text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stop_cluster_up(proc: subprocess.Popen[str]) -> str:
    """SIGTERM to a running ``cluster up``: it must stop cleanly; what it printed after."""
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
    return rest


def storage_cmdlines(proc: subprocess.Popen[str]) -> list[list[str]]:
    """The command lines of the storage servers a ``cluster up`` runs."""
    import psutil

    return [p.cmdline() for p in psutil.Process(proc.pid).children(recursive=True) if "ziplog.server" in p.cmdline()]
