"""What each append costs the machine, per kind of process, over a measured window: CPU
microseconds, system calls (``perf stat``'s ``raw_syscalls:sys_enter`` tracepoint, when
perf can count it; None otherwise), context switches, and, for ziplog's storage
replicas, the frames they sent and received by kind (their STATUS counters,
``ziplog.server.frame_counts``). Numbers that do not depend on how fast the machine is,
so runs on two shared cores and on a large machine compare.

Counting syscalls with perf costs each counted process a little per call; every row of a
run is counted alike, so ratios within the run hold."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from typing import Any

from .cpu import _role

#: perf's event that counts every system call entry
SYSCALL_EVENT = "raw_syscalls:sys_enter"


def _processes_by_role() -> dict[str, list[Any]]:
    import psutil
    me = psutil.Process(os.getpid())
    out: dict[str, list[Any]] = {}
    for p in me.children(recursive=True):
        try:
            out.setdefault(_role(p.cmdline()), []).append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    out.pop("other", None)  # perf itself, shells, helpers
    return out


def ctx_switches(procs: list[Any]) -> int:
    """Context switches of ``procs`` (psutil processes) so far; one that is gone counts none."""
    total = 0
    for p in procs:
        try:
            c = p.num_ctx_switches()
            total += c.voluntary + c.involuntary
        except Exception:  # gone: its switches are not counted
            continue
    return total


class CostMeter:
    """``start()`` and ``stop()`` around the same window as a :class:`~bench.cpu.CpuMeter`."""

    def __init__(self) -> None:
        self.procs: dict[str, list[Any]] = {}
        self.perf: dict[str, subprocess.Popen[str]] = {}
        self.ctx0: dict[str, int] = {}

    @staticmethod
    def perf_usable() -> bool:
        if shutil.which("perf") is None:
            return False
        r = subprocess.run(["perf", "stat", "-x,", "-e", SYSCALL_EVENT, "true"], capture_output=True, text=True)
        return r.returncode == 0 and "not supported" not in r.stderr and "<not" not in r.stderr

    def start(self) -> None:
        self.procs = _processes_by_role()
        self.ctx0 = {role: ctx_switches(ps) for role, ps in self.procs.items()}
        if self.perf_usable():
            for role, ps in self.procs.items():
                pids = ",".join(str(p.pid) for p in ps)
                self.perf[role] = subprocess.Popen(["perf", "stat", "-x,", "-e", SYSCALL_EVENT, "-p", pids],
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def stop(self) -> dict[str, dict[str, int | None]]:
        """Per role: ``ctx_switches`` and ``syscalls`` (None: perf could not count) in the window."""
        out: dict[str, dict[str, int | None]] = {}
        for role, ps in self.procs.items():
            out[role] = {"ctx_switches": ctx_switches(ps) - self.ctx0.get(role, 0), "syscalls": None}
        for role, proc in self.perf.items():
            proc.send_signal(signal.SIGINT)
            try:
                _, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                continue
            for line in err.splitlines():
                fields = line.split(",")
                if len(fields) > 2 and fields[2] == SYSCALL_EVENT and fields[0].isdigit():
                    out[role]["syscalls"] = int(fields[0])
        self.perf = {}
        return out


def replica_frames(status: dict[int, list[dict[str, Any]]],
                   counters: tuple[str, ...] = ("inserts", "passed_on_notice")) -> dict[str, dict[str, int]]:
    """A STATUS of every replica (``Client.status()``) summed by kind of replica (primary,
    backup): the ``sent_*``/``received_*`` counters and ``counters`` (by default
    ``inserts`` and ``passed_on_notice``, NOTICEs that passed slots of the receiver's: the
    rest changed nothing there)."""
    out: dict[str, dict[str, int]] = {}
    for replicas in status.values():
        for r in replicas:
            into = out.setdefault("primary" if r.get("primary") else "backup", {})
            for key, value in r.items():
                if (key.startswith(("sent_", "received_")) or key in counters) and type(value) is int:
                    into[key] = into.get(key, 0) + value
    return out


def frames_per_append(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]],
                      appends: int) -> dict[str, dict[str, float]]:
    """Each counter's growth between two :func:`replica_frames` snapshots, per append;
    ``sent``/``received``: every kind together."""
    out: dict[str, dict[str, float]] = {}
    for kind, counters in after.items():
        row: dict[str, float] = {}
        for key, value in sorted(counters.items()):
            grown = value - before.get(kind, {}).get(key, 0)
            if grown > 0 and appends > 0 and key != "inserts":
                row[key] = round(grown / appends, 3)
        row["sent"] = round(sum(v for k, v in row.items() if k.startswith("sent_")), 3)
        row["received"] = round(sum(v for k, v in row.items() if k.startswith("received_")), 3)
        out[kind] = row
    return out


def per_append(cpu: dict[str, float], seconds: float, counts: dict[str, dict[str, int | None]],
               appends: int) -> dict[str, dict[str, float | None]]:
    """Per role: CPU us, syscalls and context switches per append over the window."""
    out: dict[str, dict[str, float | None]] = {}
    if appends <= 0:
        return out
    for role, cores in cpu.items():
        if role in ("total", "machine", "machine_cores", "harness", "other"):
            continue
        c = counts.get(role, {})
        sc, cs = c.get("syscalls"), c.get("ctx_switches")
        out[role] = {"cpu_us": round(cores * seconds * 1e6 / appends, 1),
                     "syscalls": None if sc is None else round(sc / appends, 2),
                     "ctx_switches": None if cs is None else round(cs / appends, 2)}
    return out
