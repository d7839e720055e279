"""Run a real N-node ZooKeeper quorum from the Debian ``zookeeper`` package.

Tests and the local cluster need a *real* replicated ZooKeeper (not a mock and
not a single standalone server) so that failure tests can kill a ZooKeeper
node and observe real leader election and quorum behaviour.  This module
starts one JVM per node directly with ``java ... QuorumPeerMain zoo.cfg``
instead of going through ``zkServer.sh`` because:

* the Debian scripts assume system paths (``/etc/zookeeper/conf``,
  ``/var/log/zookeeper``, a pid file in ``/var/run``) and one server per host;
* we want the JVM to be *our* child (process group + parent-death signal via
  :mod:`ziplog.tools.procs`) so nothing leaks when a test run dies;
* we want small-machine JVM flags and logs in the node directory.

Nodes are addressed by a 0-based index ``i`` in ``range(size)``; node ``i``
lives in ``base_dir/zk{i}/`` and has ZooKeeper server id (``myid``) ``i + 1``,
following the ZooKeeper convention of server ids starting at 1.
"""

from __future__ import annotations

import functools
import glob
import os
import re
import shutil
import socket
import subprocess
import time
import zipfile
from pathlib import Path
from types import TracebackType
from typing import Sequence

from ziplog.tools import procs
from ziplog.tools.placement import LOOPBACK, Host

__all__ = [
    "ZooKeeperEnsemble",
    "ZooKeeperNotInstalled",
    "find_java",
    "find_zookeeper_classpath",
    "four_letter_word",
]

#: Where the Debian packages ``zookeeper``/``libzookeeper-java`` put things.
DEBIAN_JAVA_DIR = Path("/usr/share/java")
DEBIAN_ZKENV = Path("/usr/share/zookeeper/bin/zkEnv.sh")
_MAIN_CLASS = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
_MAIN_CLASS_FILE = _MAIN_CLASS.replace(".", "/") + ".class"

_SETUP_HINT = (
    "ZooKeeper from the Debian package is required: run `make setup` "
    "(it does `apt-get install zookeeper`), or set ZIPLOG_ZK_CLASSPATH to a "
    "classpath containing QuorumPeerMain."
)


class ZooKeeperNotInstalled(RuntimeError):
    """Raised when Java or the ZooKeeper jars cannot be found."""


# ---------------------------------------------------------------------------
# Locating java and the ZooKeeper classpath
# ---------------------------------------------------------------------------


def find_java() -> str:
    """Return the ``java`` executable to run ZooKeeper with.

    Order: ``$JAVA``, ``$JAVA_HOME/bin/java``, ``java`` on ``$PATH``.  The
    Debian package depends on a JRE, so ``java`` on PATH is the normal case.
    """
    candidates: list[str] = []
    if os.environ.get("JAVA"):
        candidates.append(os.environ["JAVA"])
    if os.environ.get("JAVA_HOME"):
        candidates.append(os.path.join(os.environ["JAVA_HOME"], "bin", "java"))
    which = shutil.which("java")
    if which:
        candidates.append(which)
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise ZooKeeperNotInstalled(f"no `java` executable found. {_SETUP_HINT}")


def _jar_has_main(jar: Path) -> bool:
    """True if ``jar`` is a ZooKeeper server jar (contains QuorumPeerMain)."""
    try:
        with zipfile.ZipFile(jar) as zf:
            zf.getinfo(_MAIN_CLASS_FILE)
        return True
    except (KeyError, OSError, zipfile.BadZipFile):
        return False


def _version_key(path: Path) -> tuple[int, ...]:
    """Sort key for ``zookeeper-3.8.0.jar``-style names (unversioned sorts last)."""
    m = re.search(r"-(\d+(?:\.\d+)*)\.jar$", path.name)
    return tuple(int(x) for x in m.group(1).split(".")) if m else (1 << 30,)


def _find_zookeeper_jar(java_dir: Path) -> Path | None:
    """Locate the ZooKeeper server jar.

    Debian ships ``zookeeper.jar`` plus a ``zookeeper-<version>.jar`` symlink
    to it; prefer the unversioned name (stable across upgrades), else the
    highest versioned one, and check it really contains QuorumPeerMain (the
    glob also matches ``zookeeper-jute``, ``zookeeper-recipes-*`` ...).
    """
    candidates = [java_dir / "zookeeper.jar"]
    candidates += sorted(
        (Path(p) for p in glob.glob(str(java_dir / "zookeeper-[0-9]*.jar"))),
        key=_version_key,
        reverse=True,
    )
    for c in candidates:
        if c.is_file() and _jar_has_main(c):
            return c
    return None


def _manifest_class_path(jar: Path) -> list[Path]:
    """Entries of the jar's ``Class-Path`` manifest attribute.

    Debian does not ship a lib/ directory; instead ``zookeeper.jar``'s
    manifest lists its dependencies as absolute ``/usr/share/java/*.jar``
    paths.  The JVM would follow that by itself, but we resolve it here so we
    can drop entries that are not installed and report what is used.
    """
    with zipfile.ZipFile(jar) as zf:
        try:
            raw = zf.read("META-INF/MANIFEST.MF").decode("utf-8", "replace")
        except KeyError:
            return []
    # Manifest lines are wrapped at 72 bytes; continuation lines start with a space.
    unfolded = re.sub(r"\r?\n ", "", raw)
    for line in unfolded.splitlines():
        if line.startswith("Class-Path:"):
            return [Path(p) for p in line.split(":", 1)[1].split()]
    return []


def _zkenv_classpath(zkenv: Path) -> list[Path]:
    """Jar entries of ``CLASSPATH=`` in Debian's ``zkEnv.sh`` (fallback source)."""
    try:
        text = zkenv.read_text()
    except OSError:
        return []
    m = re.search(r'^\s*CLASSPATH="?([^"\n]*)"?', text, re.M)
    if not m:
        return []
    return [Path(p) for p in m.group(1).split(":") if p.endswith(".jar")]


def find_zookeeper_classpath() -> str:
    """Return a ``java -cp`` string that runs ZooKeeper's QuorumPeerMain.

    ``$ZIPLOG_ZK_CLASSPATH`` overrides discovery.  Otherwise the server jar is
    found in ``/usr/share/java`` (package ``libzookeeper-java``, pulled in by
    ``zookeeper``), its dependencies are read from its manifest, missing
    optional ones (``jline`` is only used by ``zkCli``) are dropped, and an
    SLF4J binding is added: Debian's classpath has only ``slf4j-api`` and no
    binding, so without one ZooKeeper silently logs nothing.  We add
    ``slf4j-simple`` (logs to stderr, which :func:`ziplog.tools.procs.spawn`
    redirects into the node directory), no log4j config file needed.
    """
    override = os.environ.get("ZIPLOG_ZK_CLASSPATH")
    if override:
        return override
    return _discover_debian_classpath()


@functools.lru_cache(maxsize=None)
def _discover_debian_classpath() -> str:
    """Classpath discovery proper; cached because it opens jars (zip files)."""
    zk_jar = _find_zookeeper_jar(DEBIAN_JAVA_DIR)
    if zk_jar is None:
        for p in _zkenv_classpath(DEBIAN_ZKENV):
            if p.is_file() and _jar_has_main(p):
                zk_jar = p
                break
    if zk_jar is None:
        raise ZooKeeperNotInstalled(
            f"ZooKeeper server jar (with {_MAIN_CLASS}) not found in {DEBIAN_JAVA_DIR}. {_SETUP_HINT}"
        )

    entries: list[Path] = [zk_jar]
    deps = _manifest_class_path(zk_jar) or _zkenv_classpath(DEBIAN_ZKENV)
    entries += [p if p.is_absolute() else zk_jar.parent / p for p in deps]
    jute = zk_jar.parent / "zookeeper-jute.jar"
    if jute not in entries:
        entries.append(jute)

    if not any("slf4j-simple" in p.name or "slf4j-log4j" in p.name or "logback" in p.name for p in entries):
        binding = zk_jar.parent / "slf4j-simple.jar"
        if binding.is_file():
            entries.append(binding)

    seen: set[Path] = set()
    cp: list[str] = []
    for p in entries:
        if p in seen or not p.is_file():
            continue
        seen.add(p)
        cp.append(str(p))
    if not any("zookeeper-jute" in c for c in cp):
        raise ZooKeeperNotInstalled(f"zookeeper-jute jar not found next to {zk_jar}. {_SETUP_HINT}")
    return os.pathsep.join(cp)


# ---------------------------------------------------------------------------
# Four-letter words
# ---------------------------------------------------------------------------


def four_letter_word(host: str, port: int, cmd: str, timeout: float = 1.0) -> str | None:
    """Send a ZooKeeper four-letter command and return the reply, or None.

    Used as the health probe because it needs no client library, no session,
    and answers even while the node has no quorum (then the reply says the
    instance "is not currently serving requests").
    """
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(cmd.encode("ascii"))
            chunks: list[bytes] = []
            while True:
                data = s.recv(4096)
                if not data:
                    break
                chunks.append(data)
    except OSError:
        return None
    return b"".join(chunks).decode("utf-8", "replace")


def _parse_mode(reply: str | None) -> str | None:
    if not reply:
        return None
    m = re.search(r"^Mode:\s*(\S+)", reply, re.M)
    return m.group(1) if m else None


def _tail(path: Path, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return "\n".join(data.splitlines()[-lines:])


# ---------------------------------------------------------------------------
# The ensemble
# ---------------------------------------------------------------------------


class _Node:
    """Static description plus the current process of one ZooKeeper server."""

    def __init__(self, index: int, node_dir: Path, client_port: int, peer_port: int, election_port: int,
                 host: Host = LOOPBACK):
        self.index = index
        #: where the node runs and what it listens on
        self.host = host
        self.myid = index + 1
        self.dir = node_dir
        self.data_dir = node_dir / "data"
        self.cfg = node_dir / "zoo.cfg"
        self.log = node_dir / "zookeeper.log"
        self.client_port = client_port
        self.peer_port = peer_port
        self.election_port = election_port
        self.proc: subprocess.Popen[bytes] | None = None


class ZooKeeperEnsemble:
    """A local N-node ZooKeeper quorum on free loopback ports.

    Usage::

        with ZooKeeperEnsemble(tmp_path, size=3) as zk:
            client = KazooClient(hosts=zk.hosts)
            ...
            zk.kill_node(0)        # crash one server (SIGKILL)
            zk.start_node(0)       # restart it with the same config and data
            zk.wait_for_mode(0)    # until it rejoined as leader/follower

    ``force_sync=False`` skips fsync of the transaction log: faster on slow
    disks and fine for benchmarks/tests that never power-cycle the machine,
    but it is no longer crash-durable against OS/machine failure.
    """

    #: JVM flags for a small (2-core) machine: small heap, serial GC, C1 only
    #: (fast startup, low background CPU), no hsperfdata files in /tmp.
    DEFAULT_JVM_FLAGS: tuple[str, ...] = (
        "-Xms32m",
        "-Xmx256m",
        "-XX:+UseSerialGC",
        "-XX:TieredStopAtLevel=1",
        "-XX:-UsePerfData",
        "-XX:+ExitOnOutOfMemoryError",
        "-Djava.net.preferIPv4Stack=true",
    )

    def __init__(
        self,
        base_dir: Path,
        size: int = 3,
        force_sync: bool = True,
        tick_time_ms: int = 500,
        jvm_flags: Sequence[str] | None = None,
        hosts: Sequence[Host] | None = None,
    ) -> None:
        if size < 1:
            raise ValueError("size must be >= 1")
        self.base_dir = Path(base_dir).resolve()
        self.size = size
        self.force_sync = force_sync
        self.tick_time_ms = tick_time_ms
        self.jvm_flags: tuple[str, ...] = tuple(jvm_flags) if jvm_flags is not None else self.DEFAULT_JVM_FLAGS
        self._started_pids: list[int] = []
        ports = procs.free_tcp_ports(3 * size)
        self._nodes = [
            _Node(i, self.base_dir / f"zk{i}", ports[3 * i], ports[3 * i + 1], ports[3 * i + 2],
                  hosts[i] if hosts is not None else LOOPBACK)
            for i in range(size)
        ]
        for node in self._nodes:
            self._write_node_files(node)

    # -- configuration ------------------------------------------------------

    def _zoo_cfg(self, node: _Node) -> str:
        """zoo.cfg for one node.

        Notes on non-default values:
        * tickTime 500 ms: quick elections and failure detection in tests;
          initLimit/syncLimit are in ticks (10 s / 5 s), generous enough for
          a loaded 2-core machine.
        * clientPortAddress: the node's host address (127.0.0.1 unless placed on a
          host of its own): never listen on other interfaces.
        * maxClientCnxns=0: the default limit of 60 connections *per IP* is
          easily hit when every process of a local cluster connects from
          127.0.0.1.
        * maxSessionTimeout 60 s: the default (20 ticks = 10 s) would silently
          clamp longer session timeouts requested by clients.
        * preAllocSize 4 MB instead of 64 MB per log file: three nodes in a
          tmp dir need not pre-allocate 192 MB.
        * reconfigEnabled=false: keeps ZooKeeper from rewriting zoo.cfg into a
          dynamic config file, so restarts use exactly this file.
        * admin.enableServer=false: the Jetty admin server would grab port 8080.
        * 4lw.commands.whitelist=srvr,ruok: ``srvr`` (a node's mode, the health probe,
          the benchmarks' version and zxid) and the liveness probe ``ruok``, as
          DEPLOY.md configures a deployment; the others (``dump``, ``envi``, ``cons``,
          ``mntr``...) would tell anyone who reaches the port the sessions, the
          ephemeral nodes' paths and the server's environment.
        """
        lines = [
            "# Generated by ziplog.tools.zk_ensemble; rewritten on every ZooKeeperEnsemble().",
            f"tickTime={self.tick_time_ms}",
            "initLimit=20",
            "syncLimit=10",
            f"dataDir={node.data_dir}",
            f"clientPort={node.client_port}",
            f"clientPortAddress={node.host.addr}",
            "maxClientCnxns=0",
            f"minSessionTimeout={2 * self.tick_time_ms}",
            "maxSessionTimeout=60000",
            f"forceSync={'yes' if self.force_sync else 'no'}",
            "preAllocSize=4096",
            "autopurge.snapRetainCount=3",
            "autopurge.purgeInterval=1",
            "4lw.commands.whitelist=srvr,ruok",
            "admin.enableServer=false",
            "reconfigEnabled=false",
        ]
        for n in self._nodes:
            lines.append(f"server.{n.myid}={n.host.addr}:{n.peer_port}:{n.election_port}")
        return "\n".join(lines) + "\n"

    def _write_node_files(self, node: _Node) -> None:
        node.data_dir.mkdir(parents=True, exist_ok=True)
        node.cfg.write_text(self._zoo_cfg(node))
        (node.data_dir / "myid").write_text(f"{node.myid}\n")

    def _argv(self, node: _Node) -> list[str]:
        return [
            find_java(),
            *self.jvm_flags,
            f"-XX:ErrorFile={node.dir}/hs_err_pid%p.log",
            f"-Dzookeeper.log.dir={node.dir}",
            "-Dzookeeper.admin.enableServer=false",
            "-Dzookeeper.jmx.log4j.disable=true",
            # slf4j-simple logs to stderr -> node.log via procs.spawn.
            "-Dorg.slf4j.simpleLogger.defaultLogLevel=info",
            "-Dorg.slf4j.simpleLogger.showDateTime=true",
            "-Dorg.slf4j.simpleLogger.dateTimeFormat=yyyy-MM-dd'T'HH:mm:ss.SSS",
            "-cp",
            find_zookeeper_classpath(),
            _MAIN_CLASS,
            str(node.cfg),
        ]

    # -- introspection -------------------------------------------------------

    @property
    def hosts(self) -> str:
        """Connection string for clients: ``127.0.0.1:p1,127.0.0.1:p2,...``."""
        return ",".join(f"{n.host.addr}:{n.client_port}" for n in self._nodes)

    def node_hosts(self, i: int) -> str:
        """Connection string for node ``i`` alone (to pin a client to it)."""
        node = self._node(i)
        return f"{node.host.addr}:{node.client_port}"

    def client_port(self, i: int) -> int:
        return self._node(i).client_port

    def node_dir(self, i: int) -> Path:
        return self._node(i).dir

    def log_path(self, i: int) -> Path:
        return self._node(i).log

    def pid(self, i: int) -> int | None:
        """PID of node ``i``'s JVM if it is running, else None."""
        p = self._node(i).proc
        return p.pid if p is not None and p.poll() is None else None

    @property
    def started_pids(self) -> list[int]:
        """PIDs of every JVM this ensemble ever started (incl. restarted nodes)."""
        return list(self._started_pids)

    def is_running(self, i: int) -> bool:
        return self.pid(i) is not None

    def node_mode(self, i: int) -> str | None:
        """``leader``/``follower``/``standalone``/``observer``, or None if not serving.

        None covers: process down, port not open yet, and "not currently
        serving requests" (node up but without a quorum / still electing).
        """
        node = self._node(i)
        return _parse_mode(four_letter_word(node.host.addr, node.client_port, "srvr"))

    def leader(self) -> int | None:
        """Index of the node currently reporting ``leader``, if any."""
        for n in self._nodes:
            if self.node_mode(n.index) == "leader":
                return n.index
        return None

    def _node(self, i: int) -> _Node:
        if not 0 <= i < self.size:
            raise IndexError(f"node index {i} out of range(0, {self.size})")
        return self._nodes[i]

    # -- lifecycle -----------------------------------------------------------

    def start_node(self, i: int) -> None:
        """Start node ``i`` (no-op if running), reusing its config and data.

        Returns as soon as the JVM is spawned; use :meth:`wait_for_mode` to
        wait until it has rejoined the quorum.
        """
        node = self._node(i)
        if node.proc is not None and node.proc.poll() is None:
            return
        self._write_node_files(node)
        with open(node.log, "ab") as f:
            f.write(f"\n===== ziplog: starting zk node {i} (myid {node.myid}) at {time.ctime()} =====\n".encode())
        node.proc = procs.spawn(node.host.wrap(self._argv(node)), node.log, cwd=node.dir)
        self._started_pids.append(node.proc.pid)

    def kill_node(self, i: int) -> None:
        """Crash node ``i`` with SIGKILL (no clean shutdown), for failure tests."""
        node = self._node(i)
        if node.proc is not None:
            procs.kill(node.proc)

    def stop_node(self, i: int, timeout: float = 5.0) -> None:
        """Stop node ``i`` gracefully (SIGTERM, then SIGKILL after ``timeout``)."""
        node = self._node(i)
        if node.proc is not None:
            procs.stop(node.proc, timeout)

    def start(self, timeout: float = 60.0) -> None:
        """Start every node and wait until the quorum serves.

        On failure every node is stopped again and a RuntimeError carrying
        the tail of each node's log is raised, so a broken setup is diagnosable
        from the test output alone.
        """
        find_zookeeper_classpath()  # fail fast with the "run make setup" hint
        find_java()
        try:
            for n in self._nodes:
                self.start_node(n.index)
            self.wait_for_quorum(timeout)
        except BaseException:
            self.stop()
            raise

    def wait_for_quorum(self, timeout: float = 60.0) -> None:
        """Wait until every running node serves and exactly one is leader."""
        deadline = time.monotonic() + timeout
        modes: list[str | None] = []
        while True:
            for n in self._nodes:
                if n.proc is not None and n.proc.poll() is not None:
                    raise RuntimeError(
                        f"ZooKeeper node {n.index} exited with code {n.proc.returncode} during startup\n"
                        + self._diagnostics()
                    )
            running = [n for n in self._nodes if n.proc is not None]
            modes = [self.node_mode(n.index) for n in running]
            if self.size == 1 and modes in (["standalone"], ["leader"]):
                return
            if (
                running
                and all(m in ("leader", "follower", "observer") for m in modes)
                and modes.count("leader") == 1
            ):
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"ZooKeeper quorum not serving after {timeout:.0f}s (modes {modes})\n" + self._diagnostics()
                )
            time.sleep(0.1)

    def wait_for_mode(self, i: int, timeout: float = 30.0) -> str:
        """Poll until node ``i`` serves (has a mode); return the mode."""
        deadline = time.monotonic() + timeout
        while True:
            node = self._node(i)
            if node.proc is None or node.proc.poll() is not None:
                raise RuntimeError(f"ZooKeeper node {i} is not running\n" + self._diagnostics([i]))
            mode = self.node_mode(i)
            if mode is not None:
                return mode
            if time.monotonic() >= deadline:
                raise RuntimeError(f"ZooKeeper node {i} not serving after {timeout:.0f}s\n" + self._diagnostics([i]))
            time.sleep(0.1)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every node (concurrently); safe to call repeatedly."""
        procs.stop_many([n.proc for n in self._nodes if n.proc is not None], timeout)

    def _diagnostics(self, indexes: Sequence[int] | None = None) -> str:
        parts = []
        for i in indexes if indexes is not None else range(self.size):
            n = self._nodes[i]
            parts.append(f"--- tail of {n.log} ---\n{_tail(n.log)}")
        return "\n".join(parts)

    def __enter__(self) -> "ZooKeeperEnsemble":
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ZooKeeperEnsemble(size={self.size}, hosts={self.hosts!r}, base_dir={str(self.base_dir)!r})"
