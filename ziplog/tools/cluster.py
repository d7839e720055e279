"""``ziplog.local_cluster``: a whole ziplog on this machine, the embedded default.

Starts a 3-node ZooKeeper ensemble (Debian package), the membership service
replicas and every storage replica as separate processes on loopback, and stops
every one of them on exit, also on an exception or Ctrl-C (children also die
with the parent: see ``ziplog.tools.procs``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from ziplog.io import zk as discovery
from ziplog.io.election import election_leader
from ziplog.io.segments import replica_dir
from ziplog.io.zmq_runtime import round_trip
from ziplog.protocol import frames as wire
from ziplog.protocol import layout
from ziplog.protocol.addresses import is_loopback
from ziplog.protocol.keys import Credentials
from ziplog.shell.process import load_cluster_key, write_cluster_key
from ziplog.tools import procs
from ziplog.tools.placement import Placement
from ziplog.tools.zk_ensemble import ZooKeeperEnsemble


#: An ensemble already running that every LocalCluster of this process uses, each under a
#: root of its own, unless told ``own_zookeeper`` or placed on other hosts: starting three
#: JVMs costs more CPU than the rest of a small cluster (the test suite sets it, once per
#: worker process, and hands it to the processes it starts as ``$ZIPLOG_LOCAL_ZOOKEEPER``).
#: None: each cluster starts its own.
SHARED_ZOOKEEPER: str | None = os.environ.get("ZIPLOG_LOCAL_ZOOKEEPER") or None


class ZooKeeperRoot:
    """A cluster's share of an ensemble someone else runs: its own root node (kazoo's
    chroot), the same for the same ``data_dir``, so a restart on it finds its state.
    Starting it makes the root; stopping it leaves the ensemble running."""

    BASE = "/ziplog-local"

    def __init__(self, ensemble_hosts: str, data_dir: Path) -> None:
        digest = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:16]
        self.root = f"{self.BASE}/{digest}"
        self.ensemble_hosts = ensemble_hosts
        self.hosts = ensemble_hosts + self.root

    def start(self) -> None:
        zk = discovery.connect(self.ensemble_hosts)
        try:
            zk.ensure_path(self.root)
        finally:
            discovery.stop(zk)

    def stop(self) -> None:
        pass


class LocalCluster:
    def __init__(self, data_dir: Path, shards: int = 2, replicas: int = 2, mms_replicas: int = 3,
                 epoch_interval_ms: float = 10.0, fsync: str = "interval", zk_force_sync: bool = True,
                 server_args: list[str] | None = None, mms_args: list[str] | None = None,
                 supervise: bool = True, fh_replicas: int = 3, fh_args: list[str] | None = None,
                 placement: Placement | None = None, spread_cpus: bool = True,
                 process_per_cpu: bool = False, own_zookeeper: bool = False, curve: bool = False,
                 cpu_shift: int = 0, zookeeper: str | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.logs = self.data_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.initial_shards = shards
        self.replicas = replicas
        self.mms_replicas = mms_replicas
        self.epoch_interval_ms = epoch_interval_ms
        self.fsync = fsync
        self.server_args = list(server_args or [])
        self.mms_args = list(mms_args or [])
        self.fh_args = list(fh_args or [])
        self.fh_replicas = fh_replicas
        #: which host each process runs on (loopback unless a test bed says otherwise)
        self.placement = placement or Placement()
        #: Give each replica of a shard a CPU of its own (``--cpus``), the shards' primaries
        #: on different ones, when this process may run on more than one: replicas left
        #: to the scheduler often share a CPU and serve an insert one after the other.
        self.spread_cpus = spread_cpus
        #: With ``spread_cpus``, serve the replicas of the starting shards that share a CPU
        #: in one process (``ziplog.server --serve``), as a machine with more replicas than
        #: CPUs would: a process per CPU, not per replica. Killing or restarting one of them
        #: kills or restarts its process, with every replica in it; shards added later get a
        #: process per replica.
        self.process_per_cpu = process_per_cpu
        #: With ``spread_cpus``, shard s takes the CPUs shard ``s + cpu_shift`` would: N
        #: one-shard clusters shifted 0..N-1 sit on the CPUs of one N-shard cluster (the
        #: bench's control for what shards add to one another).
        self.cpu_shift = cpu_shift
        self._grouped_shards: set[int] = set()
        #: Restart a storage replica that died, as an operator (or systemd) would.
        self.supervise = supervise
        #: How long the supervisor waits before restarting a dead replica (an operator's
        #: restart policy); longer than the suspicion timeout forces failure recovery.
        self.restart_delay_s = 0.0
        self._dead_since: dict[tuple[int, int], float] = {}
        self.restarts: list[tuple[float, int, int]] = []  # (time.monotonic(), shard, replica)
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._lock = threading.Lock()
        #: the cluster's ZooKeeper: an ensemble of its own (which a test may kill nodes
        #: of), or a root in the shared one
        self.zk: ZooKeeperEnsemble | ZooKeeperRoot
        shared = zookeeper or SHARED_ZOOKEEPER  # ``zookeeper``: the hosts of a running ensemble to use
        if shared is not None and not own_zookeeper and placement is None:
            self.zk = ZooKeeperRoot(shared, self.data_dir)
        else:
            self.zk = ZooKeeperEnsemble(self.data_dir / "zookeeper", size=3, force_sync=zk_force_sync,
                                        hosts=[self.placement.zookeeper(i) for i in range(3)])
        #: the cluster's secret: every process of it (and an operator's tools) proves
        #: membership with it; kept with the data, so a restart on it is the same cluster
        self.key_file = self.data_dir / "cluster.key"
        self.key = load_cluster_key(self.key_file) if self.key_file.exists() else write_cluster_key(self.key_file)
        #: every process speaks CURVE: asked for, or the default of processes off loopback
        self.curve = curve or not is_loopback(self.placement.server(0, 0).addr)
        #: the cluster's own keys (its tools hold every right); None under NULL
        self.credentials = Credentials.member(self.key.curve_server()) if self.curve else None
        self.mms: dict[int, subprocess.Popen[bytes]] = {}
        self.fh: dict[int, subprocess.Popen[bytes]] = {}
        self.servers: dict[tuple[int, int], subprocess.Popen[bytes]] = {}
        self.shard_ids: list[int] = []
        self._zkc: Any = None

    @property
    def zk_hosts(self) -> str:
        return self.zk.hosts

    @property
    def member_args(self) -> list[str]:
        """What a cluster process's command line needs to prove membership."""
        return ["--cluster-key-file", str(self.key_file), *(["--curve"] if self.curve else [])]

    # -- processes ------------------------------------------------------------------------------
    def _spawn_mms(self, i: int) -> None:
        host = self.placement.mms(i)
        argv = [sys.executable, "-m", "mms.server", "--zk", self.zk_hosts, "--id", str(i),
                "--interval-ms", str(self.epoch_interval_ms), *host.bind_args(), *self.member_args, *self.mms_args]
        self.mms[i] = procs.spawn(host.wrap(argv), self.logs / f"mms{i}.log")

    def _spawn_fh(self, i: int) -> None:
        host = self.placement.failure_handler(i)
        argv = [sys.executable, "-m", "failure_handler.server", "--zk", self.zk_hosts, "--id", str(i),
                *host.bind_args(), *self.member_args, *self.fh_args]
        self.fh[i] = procs.spawn(host.wrap(argv), self.logs / f"fh{i}.log")

    def _spawn_server(self, shard: int, replica: int, take_over: int | None = None) -> None:
        """Start the process that serves ``(shard, replica)``: with ``process_per_cpu``,
        the one that serves its CPU's group."""
        group = self.process_group(shard, replica)
        host = self.placement.server(shard, replica)
        if len(group) == 1:
            who = ["--shard", str(shard), "--replica", str(replica)]
            log_name = f"shard{shard}-replica{replica}.log"
        else:
            who = ["--serve", ",".join(f"{s}:{r}" for s, r in group)]
            log_name = "storage-" + "-".join(f"shard{s}-replica{r}" for s, r in group) + ".log"
        argv = [sys.executable, "-m", "ziplog.server", "--zk", self.zk_hosts, *who, "--replicas", str(self.replicas),
                "--data-dir", str(self.data_dir / "segments"), "--fsync", self.fsync, *host.bind_args(),
                *self.member_args, *self._cpu_args(shard, replica), *self.server_args]
        if take_over is not None:
            argv += ["--take-over", str(take_over)]
        proc = procs.spawn(host.wrap(argv), self.logs / log_name)
        for key in group:
            self.servers[key] = proc

    def _cpu(self, shard: int, replica: int) -> int | None:
        """The CPU ``spread_cpus`` keeps the replica on (None: anywhere)."""
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if not self.spread_cpus or len(cpus) < 2:
            return None
        return cpus[(shard + self.cpu_shift + replica) % len(cpus)]

    def _cpu_args(self, shard: int, replica: int) -> list[str]:
        cpu = self._cpu(shard, replica)
        return [] if cpu is None else ["--cpus", str(cpu)]

    def process_group(self, shard: int, replica: int) -> list[tuple[int, int]]:
        """The replicas served by the process that serves ``(shard, replica)``. Two
        replicas of one shard never share a CPU here (each shard's replicas take
        consecutive CPUs), so never a process."""
        cpu = self._cpu(shard, replica)
        if not self.process_per_cpu or cpu is None or shard not in self._grouped_shards:
            return [(shard, replica)]
        host = self.placement.server(shard, replica)  # one process runs on one host
        return [(s, r) for s in sorted(self._grouped_shards) for r in range(self.replicas)
                if self._cpu(s, r) == cpu and self.placement.server(s, r) == host]

    def start(self, timeout: float = 90.0) -> None:
        self.zk.start()
        self._zkc = discovery.connect(self.zk_hosts, key=self.key)
        self.topology = discovery.Topology(self._zkc, create=True)
        for i in range(self.mms_replicas):
            self._spawn_mms(i)
        for i in range(self.fh_replicas):
            self._spawn_fh(i)
        existing = sorted(int(c) for c in self._zkc.get_children(layout.SHARDS))
        if existing:  # restarting on an old data_dir: bring back the same shards
            self.shard_ids = existing
        else:
            self.shard_ids = list(range(self.initial_shards))
        if self.process_per_cpu and self.replicas <= len(os.sched_getaffinity(0)):
            self._grouped_shards = set(self.shard_ids)
        for s in self.shard_ids:
            for r in range(self.replicas):
                if (s, r) not in self.servers:
                    self._spawn_server(s, r)
        self.wait_ready(self.shard_ids, timeout)
        if self.supervise:
            self._supervisor = threading.Thread(target=self._supervise, name="ziplog-supervisor", daemon=True)
            self._supervisor.start()

    def _supervise(self) -> None:
        """Restart storage replicas that died (SIGKILL, crash) on their data directory."""
        while not self._stopping.wait(0.05):  # rarely: this thread shares the GIL with clients in this process
            with self._lock:
                now = time.monotonic()
                for (shard, replica) in list(self.servers):
                    p = self.servers[(shard, replica)]  # a process serving several is restarted once
                    if p.poll() is None or self._stopping.is_set():
                        continue
                    since = self._dead_since.setdefault((shard, replica), now)
                    if now - since >= self.restart_delay_s:
                        for key in self.process_group(shard, replica):  # each replica the process served
                            self._dead_since.pop(key, None)
                        self._spawn_server(shard, replica)
                        self.restarts.append((now, shard, replica))

    def wait_ready(self, shards: list[int], timeout: float = 60.0) -> None:
        """Until every shard is in the membership with all replicas up and its backups
        connected to its primary."""
        deadline = time.monotonic() + timeout
        ok = self.topology.wait(lambda: set(shards) <= set(self.topology.live_shards()), timeout)
        if not ok:
            raise RuntimeError(f"shards {shards} did not join in {timeout}s; see logs in {self.logs}\n{self._tails()}")
        for s in shards:
            while True:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"shard {s} not serving; see {self.logs}\n{self._tails()}")
                addrs = self.topology.replica_addrs(s)
                if addrs and self._primary_ready(addrs[0]):
                    break
                time.sleep(0.05)

    def _primary_ready(self, addr: str) -> bool:
        reply = replica_status(addr, 2000, self.credentials)
        if not isinstance(reply, wire.StatusOk):
            return False
        st = reply.status
        return len(st["backups_connected"]) == self.replicas - 1 and st["epoch"] >= 0

    def _tails(self, lines: int = 15) -> str:
        out = []
        for p in sorted(self.logs.glob("*.log")):
            text = p.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {p.name}\n" + "\n".join(text))
        return "\n".join(out)

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()
        procs.stop_many(list(dict.fromkeys(self.servers.values())) + list(self.mms.values()) + list(self.fh.values()))
        self.servers.clear()
        self.mms.clear()
        self.fh.clear()
        if self._zkc is not None:
            discovery.stop(self._zkc)
            self._zkc = None
        self.zk.stop()

    # -- operator actions ---------------------------------------------------------------------------
    def kill_replica(self, shard: int, replica: int) -> None:
        """SIGKILL one storage replica's process, with every replica it serves (the
        supervisor, if on, starts it again)."""
        procs.kill(self.servers[(shard, replica)])

    def restart_replica(self, shard: int, replica: int, timeout: float = 60.0) -> None:
        """Start a replica again on its data directory. A running one is replaced: the new
        process starts up while it serves and then stops it (``ziplog.server
        --take-over``), so the replica is away only for the old one's stop and the new
        one's recovery; this returns once the old one has exited."""
        with self._lock:
            old = self.servers.get((shard, replica))
            if old is None or old.poll() is not None:
                self._spawn_server(shard, replica)
                return
            self._spawn_server(shard, replica, take_over=old.pid)
            new = self.servers[(shard, replica)]
            procs.wait_first([old, new], timeout)
            if old.poll() is None:
                # The successor failed, or is still waiting, before it stopped the old one:
                # neither may go on beside the other; restart plainly.
                procs.stop_many([new, old])
                self._spawn_server(shard, replica)

    def replica_dir(self, shard: int, replica: int) -> Path:
        """Where a storage replica keeps its segment files."""
        return replica_dir(self.data_dir / "segments", shard, replica)

    def replace_replica(self, shard: int, replica: int) -> None:
        """Replace a storage replica by a new process on an empty data directory, as an
        operator replaces one whose machine is gone: the old process is killed if it
        still runs and its files are deleted; the new one registers under the same
        shard and replica number, and failure recovery installs the shard's state on it
        from the surviving replica (``ziplog replica replace`` does the same for one
        started by hand). With a process per CPU, the other replicas of its process are
        started again on their own files."""
        with self._lock:  # the supervisor must not restart the old one on its old files
            p = self.servers.get((shard, replica))
            if p is not None and p.poll() is None:
                procs.kill(p)
            shutil.rmtree(self.replica_dir(shard, replica), ignore_errors=True)
            for key in self.process_group(shard, replica):
                self._dead_since.pop(key, None)
            self._spawn_server(shard, replica)

    def kill_mms_leader(self) -> int:
        """SIGKILL the membership service's leader; returns its id (it is started again)."""
        return self._kill_leader(layout.MMS_ELECTION, self.mms, self._spawn_mms)

    def kill_fh_leader(self) -> int:
        """SIGKILL the failure handler's leader; returns its id (it is started again)."""
        return self._kill_leader(layout.fh_election_path(0), self.fh, self._spawn_fh)

    def _kill_leader(self, election: str, procs_by_id: dict[int, Any], respawn: Any) -> int:
        return kill_leader(self._zkc, election, procs_by_id, respawn)

    def add_shard(self, timeout: float = 60.0) -> int:
        """Start a new shard; returns its id once it is in the membership and serving."""
        s = max(self.shard_ids) + 1 if self.shard_ids else 0
        self.shard_ids.append(s)
        with self._lock:
            for r in range(self.replicas):
                self._spawn_server(s, r)
        self.wait_ready([s], timeout)
        return s

    def remove_shard(self, shard: int, timeout: float = 30.0) -> None:
        """Take a shard out of the next epoch's membership; it stays readable."""
        path = f"{layout.SHARDS}/{shard}"
        data, stat = self._zkc.get(path)
        meta = layout.dec(data) or {}
        meta["removed"] = True
        self._zkc.set(path, layout.enc(meta), version=stat.version)
        if not self.topology.wait(lambda: shard not in (self.topology.history[-1][1] if self.topology.history else []), timeout):
            raise RuntimeError(f"shard {shard} still a member after {timeout}s")

    def client(self, **kw: Any) -> Any:
        """A client of this cluster (under CURVE, with the cluster's own keys unless
        ``key_file`` or ``credentials`` says otherwise)."""
        from ziplog.client.blocking import Client
        if self.credentials is not None and "key_file" not in kw:
            kw.setdefault("credentials", self.credentials)
        return Client(self.zk_hosts, **kw)

    def add_client(self, name: str, rights: str) -> Path:
        """Register a client key with ``rights`` (``"append,read"``, ``"all"``) and write
        its key file under the data directory: its path."""
        from ziplog.io.keys import new_keypair, write_key_file
        from ziplog.io.zk_clients import ClientRegistry
        from ziplog.protocol.keys import parse_rights

        from ziplog.tools.cli_clients import wait_loaded

        pair = new_keypair()
        registry = ClientRegistry(self._zkc, self.key)
        version = registry.add(name, pair.public, parse_rights(rights))
        # Usable once every server holds the new registry (each refuses the key before).
        behind = wait_loaded(registry, version, 30.0)
        if behind:
            raise RuntimeError(f"servers {behind} did not load client registry version {version} within 30 s")
        path = self.data_dir / "keys" / f"{name}.key"
        path.parent.mkdir(exist_ok=True)
        write_key_file(str(path), name, pair, self.key.curve_server().public)
        return path

    def remove_client(self, name: str) -> int:
        """Remove a client key from the registry: its new version."""
        from ziplog.io.zk_clients import ClientRegistry
        return ClientRegistry(self._zkc, self.key).remove(name)

    def rolling_restart(self, timeout: float = 60.0, on_restart: Any = None) -> list[Any]:
        """Restart every process one at a time, each once the last is back
        (:func:`ziplog.tools.rolling.rolling_restart`)."""
        from ziplog.tools.rolling import rolling_restart
        return rolling_restart(self, timeout, on_restart)


def kill_leader(zkc: Any, election: str, procs_by_id: dict[int, Any], respawn: Callable[[int], None]) -> int:
    """SIGKILL the process leading the election at ``election`` (its id is the
    contender's identifier), start it again with ``respawn``; returns its id."""
    leader = election_leader(zkc, election)
    if leader is None:
        raise RuntimeError(f"no leader at {election}")
    procs.kill(procs_by_id[leader])
    respawn(leader)
    return leader


def replica_status(addr: str, timeout_ms: int, credentials: Credentials | None = None) -> wire.Reply | None:
    """One STATUS round trip to the storage replica at ``addr``: its reply, or None when
    none came within ``timeout_ms``."""
    reply = round_trip(addr, wire.encode(wire.Status(req_id=1)), timeout_ms * 1_000_000, wire.CLIENT_REPLY_LIMIT,
                       credentials)
    return None if reply is None else wire.decode_reply(reply)


@contextlib.contextmanager
def local_cluster(shards: int = 2, replicas: int = 2, data_dir: str | Path | None = None, **kw: Any) -> Iterator[LocalCluster]:
    """Run a local ziplog cluster for the duration of the ``with`` block.

    ``data_dir`` keeps ZooKeeper data, segment files and logs; None uses a temporary
    directory removed afterwards. Reusing a ``data_dir`` restarts the same log."""
    tmp = None
    if data_dir is None:
        tmp = tempfile.mkdtemp(prefix="ziplog-")
        data_dir = tmp
    cluster = LocalCluster(Path(data_dir), shards=shards, replicas=replicas, **kw)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
