"""A cluster across hosts: every process in a Linux network namespace of its own, with its
own address on a bridge (``ziplog/tools/netns.py``): three control hosts (a ZooKeeper
node, an MMS replica and a failure handler replica each), one host per storage replica
of 2 shards x 2 replicas, and a client host running the fault tests' load (writers and
two subscribers, ``tests/netns_load.py``). The test runner is the operator's host on the
bridge.

* Replicas register and talk over their hosts' addresses, not loopback: ``ziplog
  status`` from the client host lists them, and the backup's host holds a TCP
  connection to the primary's address.
* Under the load: a replica killed (restarted by the supervisor on its host), then a
  primary's host cut off from every other host (its link down) for a few seconds and
  brought back. Nothing acknowledged is lost, moved or duplicated and both subscribers
  agree (the load's own check, run on the client host).

Skipped, with the reason, only where the kernel or the user cannot make namespaces.
Bounded: each wait has a deadline; the module takes about a minute."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

import ziplog
from tests.load import next_recovery_gen, wait_recovery, wait_status
from ziplog.tools import netns, procs
from ziplog.tools.placement import Host

why = netns.unavailable()
if why is not None:  # pragma: no cover - depends on the machine
    pytest.skip(f"no network namespaces here: {why}", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
SHARDS, REPLICAS = 2, 2
#: how long a host stays cut off (well under the 10 s ZooKeeper session timeout)
CUT_S = 3.0


@pytest.fixture(scope="module")
def bed() -> Iterator[netns.NetnsBed]:
    with netns.NetnsBed(netns.cluster_host_names(SHARDS, REPLICAS)) as b:
        yield b


@pytest.fixture(scope="module")
def cluster(bed: netns.NetnsBed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=SHARDS, replicas=REPLICAS, data_dir=tmp_path_factory.mktemp("netns"),
                              placement=netns.NetnsPlacement(bed), mms_replicas=netns.CONTROL_HOSTS,
                              fh_replicas=netns.CONTROL_HOSTS) as c:
        yield c


def _on(host: Host, argv: list[str], timeout: float = 60) -> str:
    done = subprocess.run(host.wrap(argv), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_replicas_register_and_talk_over_their_hosts_addresses(bed: netns.NetnsBed,
                                                               cluster: ziplog.LocalCluster) -> None:
    want = {(s, r): bed.hosts[f"s{s}r{r}"].addr for s in range(SHARDS) for r in range(REPLICAS)}
    client_host = bed.hosts["client"]
    assert cluster.curve, "off loopback a cluster speaks CURVE by default"
    key = cluster.add_client("operator", "admin")
    out = _on(client_host, [sys.executable, "-m", "ziplog.tools.cli", "status", "--zk", cluster.zk_hosts,
                            "--key-file", str(key)])
    assert "127.0.0.1" not in out, out
    for addr in want.values():
        assert f"tcp://{addr}:" in out, out
    with cluster.client() as c:
        st = wait_status(c, list(range(SHARDS)))
        assert all(r["answer"] == "ok" for reps in st.values() for r in reps)
        for s in range(SHARDS):
            addrs = c.topology.replica_addrs(s)
            assert addrs is not None
            assert [a.split("//")[1].rsplit(":", 1)[0] for a in addrs] == [want[(s, r)] for r in range(REPLICAS)]
            primary_host, primary_port = addrs[0].split("//")[1].rsplit(":", 1)
            # the backup's host holds an established TCP connection to the primary's address
            conns = _on(bed.hosts[f"s{s}r1"], ["ss", "-Htn", "state", "established"])
            assert f"{primary_host}:{primary_port}" in conns, conns


def test_no_record_crosses_the_bridge_in_clear(bed: netns.NetnsBed, cluster: ziplog.LocalCluster,
                                               tmp_path: Path) -> None:
    """Every frame between hosts is a CURVE box: ``tcpdump`` on the bridge, full packets,
    while records are inserted (client to both replicas, primary to backup), read and
    subscribed to, never shows a record's bytes. The capture is shown to see payloads: a
    ZooKeeper write (ZooKeeper's protocol is plain) made meanwhile shows up in it."""
    marker = b"clear-text-record-" + os.urandom(6).hex().encode()
    control = b"zookeeper-sees-this-" + os.urandom(6).hex().encode()
    pcap = tmp_path / "bridge.pcap"
    # --immediate-mode: each packet is written as it comes (buffered ones are lost at the
    # stop); -Z root: it writes into the test's own directory
    dump = subprocess.Popen(["tcpdump", "-Z", "root", "-i", bed.bridge, "-s", "0", "--immediate-mode", "-U",
                             "-w", str(pcap)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert dump.stderr is not None
        while b"listening on" not in (line := dump.stderr.readline()):
            assert line, "tcpdump did not start"
        with cluster.client() as c:
            rids = [c.insert_after(marker + b"-%d" % i) for i in range(20)]
            assert all(c.read_record(r).startswith(marker) for r in rids)
            with c.subscribe(ziplog.RID_GENESIS, end=max(r.gsn for r in rids)) as sub:
                assert sum(1 for rec in sub if rec.data.startswith(marker)) == len(rids)
        from ziplog.io import zk
        # a session goes to a ZooKeeper server its client picks at random, and not every
        # path to one crosses the bridge: a new session each time, until the capture (written
        # packet by packet) holds the write, 20 at most
        for attempt in range(20):
            session = zk.connect(cluster.zk_hosts, key=cluster.key)  # a member: anyone else may not create
            try:
                session.create(f"/capture-control-{os.getpid()}-{attempt}", control, ephemeral=True)
            finally:
                zk.stop(session)
            if control in pcap.read_bytes():
                break
    finally:
        dump.send_signal(2)
        dump.wait(30)
    captured = pcap.read_bytes()
    assert control in captured, "the capture saw no plain payload: it proves nothing"
    assert marker not in captured, "a record crossed the bridge in clear"
    # and it saw the replicas talk: packets between a shard's primary and backup hosts
    primary, backup = bed.hosts["s0r0"].addr, bed.hosts["s0r1"].addr
    between = subprocess.run(["tcpdump", "-nn", "-r", str(pcap), f"host {primary} and host {backup}"],
                             capture_output=True, text=True, timeout=60).stdout.splitlines()
    assert len(between) >= 10, between


class RemoteLoad:
    """``tests/netns_load.py`` on the client host, asked over its stdin."""

    def __init__(self, host: Host, zk_hosts: str, log: Path, key_file: Path) -> None:
        self.stderr = open(log, "wb")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "ZIPLOG_CLIENT_KEY_FILE": str(key_file)}
        self.proc = subprocess.Popen(host.wrap([sys.executable, "-m", "tests.netns_load", zk_hosts]), cwd=ROOT,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True)
        self.log = log
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._answer("ready", 120)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def _answer(self, expect: str, timeout: float) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            line = None
        assert line is not None and line.startswith(expect), (
            f"the load on the client host answered {line!r}:\n{self.log.read_text(errors='replace')[-4000:]}")
        return line

    def ask(self, command: str, expect: str, timeout: float) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._answer(expect, timeout)

    def acked(self, more: int, timeout: float = 60) -> None:
        self.ask(f"acked {more} {timeout}", "ok", timeout + 10)

    def close(self) -> None:
        if self.proc.poll() is None:
            procs.kill(self.proc)
        self.proc.wait(30)
        self.stderr.close()


def test_a_killed_replica_and_a_host_cut_off_lose_nothing(bed: netns.NetnsBed, cluster: ziplog.LocalCluster,
                                                          tmp_path: Path) -> None:
    load = RemoteLoad(bed.hosts["client"], cluster.zk_hosts, tmp_path / "load.log",
                      cluster.add_client("load", "append,read,admin"))
    try:
        load.acked(200)
        # a backup killed: the supervisor starts it again on its own host
        restarts = len(cluster.restarts)
        procs.kill(cluster.servers[(1, 1)])
        with cluster.client() as c:
            wait_status(c, [1], until=lambda st: len(cluster.restarts) > restarts)
        load.acked(200)
        # shard 0's primary cut off from every host, then back
        shard, cut_host = 0, "s0r0"
        gen = next_recovery_gen(cluster, shard)
        bed.link_down(cut_host)
        try:
            wait_recovery(cluster, shard, "acquired", min_gen=gen, timeout=30)  # somebody suspected
            until = time.monotonic() + CUT_S
            while time.monotonic() < until:
                load.acked(20, timeout=30)  # writes go on while the host is away
        finally:
            bed.link_up(cut_host)
        wait_recovery(cluster, shard, "done", min_gen=gen, timeout=60)
        load.acked(200)
        result = load.ask("finish", "passed", 180)
        assert '"acked"' in result
    finally:
        load.close()
