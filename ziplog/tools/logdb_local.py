"""``ziplog.logdb.local_logdb``: a LogDB (coordinator replicas and KV shards, each its own
process) on a running ``local_cluster``, stopped on exit.

    with ziplog.local_cluster() as cluster, local_logdb(cluster) as ldb:
        with LogDB(ldb.zk_hosts) as db:
            db.run(lambda t: t.put(b"k", b"v"))
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from ziplog.io import zk
from ziplog.io.zk_logdb import db_path
from ziplog.protocol.layout import dec
from ziplog.logdb.store import SqliteStore
from ziplog.tools import procs
from ziplog.tools.cluster import kill_leader


class LocalLogDB:
    def __init__(self, cluster: Any, coordinators: int = 2, kv_shards: int = 3, name: str = "default",
                 coordinator_args: list[str] | None = None, kv_args: list[str] | None = None) -> None:
        self.cluster = cluster
        self.name = name
        self.coordinator_count = coordinators
        self.kv_shards = kv_shards
        self.coordinator_args = coordinator_args or []
        self.kv_args = kv_args or []
        self.data_dir = Path(cluster.data_dir) / "logdb" / name
        self.coordinators: dict[int, subprocess.Popen[bytes]] = {}
        self.kv: dict[int, subprocess.Popen[bytes]] = {}
        self._zk: Any = None

    @property
    def zk_hosts(self) -> str:
        return str(self.cluster.zk_hosts)

    def _spawn_coordinator(self, i: int) -> None:
        argv = [sys.executable, "-m", "ziplog.logdb.coordinator", "--zk", self.zk_hosts, "--name", self.name,
                "--id", str(i), "--kv-shards", str(self.kv_shards), "--data-dir", str(self.data_dir),
                *self.cluster.member_args, *self.coordinator_args]
        self.coordinators[i] = procs.spawn(argv, self.cluster.logs / f"logdb-coordinator{i}.log")

    def _spawn_kv(self, i: int) -> None:
        argv = [sys.executable, "-m", "ziplog.logdb.kvshard", "--zk", self.zk_hosts, "--name", self.name,
                "--index", str(i), "--shards", str(self.kv_shards), "--data-dir", str(self.data_dir),
                *self.cluster.member_args, *self.kv_args]
        self.kv[i] = procs.spawn(argv, self.cluster.logs / f"logdb-kv{i}.log")

    def start(self, timeout: float = 60.0) -> None:
        self._zk = zk.connect(self.zk_hosts)
        for i in range(self.coordinator_count):
            self._spawn_coordinator(i)
        for i in range(self.kv_shards):
            self._spawn_kv(i)
        self.wait_ready(timeout)

    def _registered(self, sub: str, procs_by_id: dict[int, subprocess.Popen[bytes]]) -> set[int]:
        """The ids whose registration is the current process's (a SIGKILLed one's stays
        until its ZooKeeper session expires)."""
        out = set()
        for i, p in procs_by_id.items():
            try:
                meta = dec(self._zk.get(f"{db_path(self.name)}/{sub}/{i}")[0]) or {}
            except Exception:
                continue
            if meta.get("pid") == p.pid:
                out.add(i)
        return out

    def _alive(self, procs_by_id: dict[int, subprocess.Popen[bytes]], what: str) -> None:
        for i, p in procs_by_id.items():
            if p.poll() is not None:
                raise RuntimeError(f"LogDB {what} {i} exited with {p.returncode}; see its log in {self.cluster.logs}")

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until every coordinator replica and KV shard is registered by the process
        running now and one leads."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._alive(self.coordinators, "coordinator")
            self._alive(self.kv, "KV shard")
            if (self._registered("coordinators", self.coordinators) == set(self.coordinators)
                    and self._registered("kv", self.kv) == set(self.kv)
                    and self.leader() is not None):
                return
            time.sleep(0.05)
        raise RuntimeError(f"LogDB not ready within {timeout}s")

    def leader(self) -> int | None:
        try:
            contenders = self._zk.Election(f"{db_path(self.name)}/election").contenders()
        except Exception:
            return None
        return int(contenders[0]) if contenders else None

    # -- faults -----------------------------------------------------------------------------------
    def kill_coordinator_leader(self) -> int:
        """SIGKILL the coordinator leader (it is started again at once, on its snapshot);
        returns its id."""
        return kill_leader(self._zk, f"{db_path(self.name)}/election", self.coordinators, self._spawn_coordinator)

    def kill_kv_shard(self, i: int) -> None:
        """SIGKILL KV shard ``i`` (it stays down until :meth:`restart_kv_shard`)."""
        procs.kill(self.kv[i])

    def restart_kv_shard(self, i: int) -> None:
        p = self.kv.get(i)
        if p is not None and p.poll() is None:
            procs.kill(p)
        self._spawn_kv(i)

    def kv_store(self, i: int) -> SqliteStore:
        """KV shard ``i``'s store, opened read-side by this process (close it)."""
        return SqliteStore(self.data_dir / f"kv-{i}-of-{self.kv_shards}.sqlite3", i, self.kv_shards)

    def stop(self) -> None:
        procs.stop_many([*self.coordinators.values(), *self.kv.values()])
        self.coordinators.clear()
        self.kv.clear()
        if self._zk is not None:
            zk.stop(self._zk)
            self._zk = None


@contextlib.contextmanager
def local_logdb(cluster: Any, coordinators: int = 2, kv_shards: int = 3, **kw: Any) -> Iterator[LocalLogDB]:
    """Start a LogDB on ``cluster`` (a ``local_cluster``) for the ``with`` block."""
    ldb = LocalLogDB(cluster, coordinators=coordinators, kv_shards=kv_shards, **kw)
    try:
        ldb.start()
        yield ldb
    finally:
        ldb.stop()
