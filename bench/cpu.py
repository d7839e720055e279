"""Where the CPU went during a measurement: every process below this one (servers,
ZooKeeper, client workers), grouped by role, in cores (CPU seconds per wall second)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

#: command-line fragments -> role, first match wins
ROLES = [
    ("ziplog.server", "storage servers"),
    ("mms.server", "membership service"),
    ("failure_handler", "failure handlers"),
    ("zookeeper", "ZooKeeper"),
    ("multiprocessing", "load generator"),
    ("nats-server", "nats-server"),
    ("redis-server", "redis-server"),
    ("bench.baselines", "baseline servers"),
    ("bench.echo_server", "echo servers"),
    ("bench.shard_swarm", "simulated shards"),
]


def _role(cmdline: list[str]) -> str:
    text = " ".join(cmdline)
    for frag, role in ROLES:
        if frag in text:
            return role
    return "other"


class CpuMeter:
    """``start()`` and ``stop()`` around a window; ``stop`` returns cores used per role,
    ``total`` and ``machine`` (every process on the machine, from /proc/stat)."""

    def __init__(self) -> None:
        import psutil
        self.psutil = psutil
        self.t0 = 0.0
        self.before: dict[int, tuple[str, float]] = {}
        self.sys0: Any = None

    def _sample(self) -> dict[int, tuple[str, float]]:
        out: dict[int, tuple[str, float]] = {}
        me = self.psutil.Process(os.getpid())
        for p in [me, *me.children(recursive=True)]:
            try:
                t = p.cpu_times()
                role = "harness" if p.pid == me.pid else _role(p.cmdline())
                out[p.pid] = (role, t.user + t.system)
            except (self.psutil.NoSuchProcess, self.psutil.AccessDenied, self.psutil.ZombieProcess):
                continue
        return out

    def start(self) -> None:
        self.before = self._sample()
        self.sys0 = self.psutil.cpu_times()
        self.t0 = time.monotonic()

    def stop(self) -> dict[str, float]:
        after = self._sample()
        wall = max(1e-9, time.monotonic() - self.t0)
        sys1 = self.psutil.cpu_times()
        roles: dict[str, float] = {}
        for pid, (role, cpu) in after.items():
            base = self.before.get(pid, (role, 0.0))[1]
            roles[role] = roles.get(role, 0.0) + max(0.0, cpu - base)
        cores = {r: round(v / wall, 2) for r, v in sorted(roles.items(), key=lambda kv: -kv[1])}
        busy = (sys1.user + sys1.system + sys1.nice + getattr(sys1, "softirq", 0) + getattr(sys1, "irq", 0)) - (
            self.sys0.user + self.sys0.system + self.sys0.nice + getattr(self.sys0, "softirq", 0)
            + getattr(self.sys0, "irq", 0))
        cores["total"] = round(sum(v for k, v in cores.items()), 2)
        cores["machine"] = round(busy / wall, 2)
        cores["machine_cores"] = float(self.psutil.cpu_count() or 0)
        return cores


def disk_written_bytes() -> int:
    import psutil
    io = psutil.disk_io_counters()
    return int(io.write_bytes) if io is not None else 0


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of ``pids`` (all their threads), from /proc; 0 where unreadable."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick
