"""``ziplog.logbook.local_logbook``: the LogBook index tier (a feeder, index nodes and an
aggregator, each its own process) on a running ``local_cluster``, stopped on exit.

    with ziplog.local_cluster() as cluster, local_logbook(cluster, index_nodes=2) as tier:
        with LogBook(tier.zk_hosts, book_id=1) as lb:   # engines find the tier in ZooKeeper
            lb.append(b"x", tags=["t"])
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from typing import Any, Iterator

from ziplog.io import zk
from ziplog.io.zk_logbook import AGGREGATORS, NODES, ensure_tier, set_desired
from ziplog.logbook.core import frames as f
from ziplog.io.zmq_runtime import round_trip
from ziplog.protocol.layout import dec
from ziplog.tools import procs


class LocalLogBook:
    def __init__(self, cluster: Any, index_nodes: int = 2, aggregators: int = 1) -> None:
        self.cluster = cluster
        self.index_nodes = index_nodes
        self.aggregator_count = aggregators
        self.nodes: dict[int, subprocess.Popen[bytes]] = {}
        self.aggregators: dict[int, subprocess.Popen[bytes]] = {}
        self.feeder: subprocess.Popen[bytes] | None = None
        self._zk: Any = None

    @property
    def zk_hosts(self) -> str:
        return str(self.cluster.zk_hosts)

    def _spawn(self, module: str, name: str, *extra: str) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", module, "--zk", self.zk_hosts, *extra, *self.cluster.member_args]
        return procs.spawn(argv, self.cluster.logs / f"{name}.log")

    def _spawn_node(self, i: int) -> None:
        self.nodes[i] = self._spawn("ziplog.logbook.index_node", f"logbook-index{i}", "--node", str(i))

    def _spawn_feeder(self, *extra: str) -> None:
        self.feeder = self._spawn("ziplog.logbook.feeder", "logbook-feeder", *extra)

    def _spawn_aggregator(self, i: int) -> None:
        self.aggregators[i] = self._spawn("ziplog.logbook.aggregator", f"logbook-aggregator{i}")

    def start(self, timeout: float = 60.0) -> None:
        self._zk = zk.connect(self.zk_hosts, key=self.cluster.key)
        ensure_tier(self._zk, self.index_nodes)
        for i in range(self.index_nodes):
            self._spawn_node(i)
        self._spawn_feeder()
        for i in range(self.aggregator_count):
            self._spawn_aggregator(i)
        self.wait_ready(timeout)

    def _registered(self, path: str) -> dict[int, str]:
        """pid -> address of the processes registered under ``path`` now."""
        out: dict[int, str] = {}
        try:
            kids = self._zk.get_children(path)
        except Exception:
            return out
        for k in kids:
            try:
                meta = dec(self._zk.get(f"{path}/{k}")[0]) or {}
            except Exception:
                continue
            if isinstance(meta.get("pid"), int) and isinstance(meta.get("addr"), str):
                out[meta["pid"]] = meta["addr"]
        return out

    def _alive(self) -> None:
        every = [*self.nodes.items(), *((f"aggregator {i}", p) for i, p in self.aggregators.items())]
        if self.feeder is not None:
            every.append(("feeder", self.feeder))
        for what, p in every:
            if p.poll() is not None:
                raise RuntimeError(f"LogBook tier process {what} exited with {p.returncode}; see {self.cluster.logs}")

    def wait_ready(self, timeout: float = 60.0, at_least: int | None = None) -> None:
        """Until every index node and aggregator running now is registered, and every node
        is fed up to the log's watermark as it was when the wait began (``at_least``)."""
        deadline = time.monotonic() + timeout
        if at_least is None:
            with self.cluster.client(timeout=timeout) as c:
                at_least = c.watermark()
        while time.monotonic() < deadline:
            self._alive()
            nodes = self._registered(NODES)
            aggs = self._registered(AGGREGATORS)
            if (all(p.pid in nodes for p in self.nodes.values())
                    and all(p.pid in aggs for p in self.aggregators.values())
                    and min((self.node_state(i) or (-1,))[0] for i in self.nodes) >= at_least):
                return
            time.sleep(0.05)
        raise RuntimeError(f"the LogBook index tier was not ready within {timeout}s")

    def node_state(self, i: int) -> tuple[int, int, int, int] | None:
        """Index node ``i``'s (watermark, floor, size, records kept), or None when it does
        not answer."""
        p = self.nodes.get(i)
        addr = self._registered(NODES).get(p.pid) if p is not None else None
        if addr is None:
            return None
        got = round_trip(addr, f.encode(f.Status(req=1)), 2_000_000_000, f.ANSWER_LIMIT, self.cluster.credentials)
        if got is None:
            return None
        try:
            ans = f.decode_answer(got)
        except f.BadFrame:
            return None
        return (ans.watermark, ans.floor, ans.size, ans.kept) if type(ans) is f.NodeState else None

    def node_pid(self, i: int) -> int:
        return self.nodes[i].pid

    # -- faults -----------------------------------------------------------------------------------
    def kill_index_node(self, i: int) -> None:
        """SIGKILL index node ``i`` (it stays down until :meth:`restart_index_node`)."""
        procs.kill(self.nodes[i])

    def restart_index_node(self, i: int) -> None:
        p = self.nodes.get(i)
        if p is not None and p.poll() is None:
            procs.kill(p)
        self._spawn_node(i)

    def kill_feeder(self) -> None:
        if self.feeder is not None:
            procs.kill(self.feeder)

    def restart_feeder(self, *extra: str) -> None:
        """SIGKILL the feeder and start it again (with ``extra`` arguments: e.g.
        ``--record-max-bytes 0``)."""
        if self.feeder is not None and self.feeder.poll() is None:
            procs.kill(self.feeder)
        self._spawn_feeder(*extra)

    def add_index_node(self) -> int:
        """Start one more index node and want it in the assignment; its number."""
        i = len(self.nodes)
        set_desired(self._zk, i + 1)
        self._spawn_node(i)
        return i

    def stop(self) -> None:
        every = [*self.nodes.values(), *self.aggregators.values()]
        if self.feeder is not None:
            every.append(self.feeder)
        procs.stop_many(every)
        self.nodes.clear()
        self.aggregators.clear()
        self.feeder = None
        if self._zk is not None:
            zk.stop(self._zk)
            self._zk = None


@contextlib.contextmanager
def local_logbook(cluster: Any, index_nodes: int = 2, aggregators: int = 1) -> Iterator[LocalLogBook]:
    """Start the LogBook index tier on ``cluster`` (a ``local_cluster``) for the ``with`` block."""
    tier = LocalLogBook(cluster, index_nodes=index_nodes, aggregators=aggregators)
    try:
        tier.start()
        yield tier
    finally:
        tier.stop()
