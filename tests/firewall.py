"""Network partitions on loopback for tests: nftables rules in a table of the test's own
(removed on exit), cutting chosen TCP connections of chosen processes.

A process is cut in two ways at once, because a socket keeps the cgroup it was created
in: its connections that exist now are matched by their port pairs (read with psutil),
and the ones it opens later (kazoo and ZeroMQ reconnect) by moving the process into a
cgroup v2 of its own that a rule matches. Needs root, nft and a cgroup v2 mount;
:func:`unavailable` says why not.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterable

import psutil

_CGROUP_ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
_labels = itertools.count()


def _cgroup2_root() -> Path | None:
    """Where cgroup v2 is mounted: beside v1 (a hybrid host) or alone."""
    unified, alone = _CGROUP_ROOTS
    if (unified / "cgroup.procs").exists():
        return unified
    if (alone / "cgroup.controllers").exists():
        return alone
    return None


def unavailable() -> str | None:
    """Why these partitions cannot be made here, or None."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("nft") is None:
        return "nft is not installed"
    if _cgroup2_root() is None:
        return "no cgroup v2 mount"
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True)
    if out.returncode != 0:
        return f"nft cannot run here: {out.stderr.strip()}"
    return None


class Firewall:
    def __init__(self) -> None:
        self.table = f"ziplog_test_{os.getpid()}_{next(_labels)}"
        root = _cgroup2_root()
        assert root is not None
        self.root = root
        self.cgroups: list[Path] = []
        self.moved: list[int] = []
        self._nft(f"add table inet {self.table}")
        self._nft(f"add chain inet {self.table} out {{ type filter hook output priority 0 ; policy accept ; }}")

    def _nft(self, command: str) -> None:
        out = subprocess.run(["nft", command], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"nft {command!r}: {out.stderr.strip()}")

    def _rule(self, rule: str) -> None:
        self._nft(f"add rule inet {self.table} out {rule}")

    def _cgroup_of(self, pid: int) -> str:
        """Move ``pid`` into a cgroup of its own (level 1 of the v2 hierarchy); the path
        nft names it by (relative to /sys/fs/cgroup)."""
        path = self.root / f"{self.table}_{pid}"
        path.mkdir(exist_ok=True)
        (path / "cgroup.procs").write_text(str(pid))
        self.cgroups.append(path)
        self.moved.append(pid)
        return str(path.relative_to(Path("/sys/fs/cgroup")))

    def cut(self, pid: int, ports: Iterable[int]) -> None:
        """Cut ``pid``'s TCP connections to ``ports`` (both ways), now and later."""
        ports = sorted(set(ports))
        if not ports:
            return
        group = self._cgroup_of(pid)
        want = ", ".join(map(str, ports))
        self._rule(f'socket cgroupv2 level 1 "{group}" tcp dport {{ {want} }} drop')
        for c in psutil.Process(pid).net_connections(kind="tcp"):
            if c.raddr and c.raddr.port in ports:
                self._rule(f"tcp sport {c.laddr.port} tcp dport {c.raddr.port} drop")
                self._rule(f"tcp sport {c.raddr.port} tcp dport {c.laddr.port} drop")

    def isolate(self, pid: int, listening: Iterable[int]) -> None:
        """Cut ``pid`` from everyone: everything it sends, everything sent to its
        ``listening`` ports, now and later."""
        group = self._cgroup_of(pid)
        self._rule(f'socket cgroupv2 level 1 "{group}" meta l4proto tcp drop')
        for port in listening:
            self._rule(f"tcp dport {port} drop")
        for c in psutil.Process(pid).net_connections(kind="tcp"):
            if c.raddr:
                self._rule(f"tcp sport {c.laddr.port} tcp dport {c.raddr.port} drop")
                self._rule(f"tcp sport {c.raddr.port} tcp dport {c.laddr.port} drop")

    def heal(self) -> None:
        """Remove every rule and give the processes back their cgroup."""
        subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True)
        for pid in self.moved:
            try:
                (self.root / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass  # it exited
        for path in self.cgroups:
            try:
                path.rmdir()
            except OSError:
                pass
        self.moved, self.cgroups = [], []

    def __enter__(self) -> "Firewall":
        return self

    def __exit__(self, *exc: object) -> None:
        self.heal()
