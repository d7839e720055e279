"""Where a system's server processes run: each on a CPU of its own, round-robin, as the
local ziplog cluster places its replicas (``LocalCluster.spread_cpus``). Every system
measured beside ziplog gets the same placement, so that no row's figure comes from
the scheduler stacking two servers on one CPU while another row's does not."""

from __future__ import annotations

import os
import shutil
from typing import Sequence


class CpuSpread:
    """Hands each server process a system starts the next CPU (``taskset -c``)."""

    def __init__(self) -> None:
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.taskset = shutil.which("taskset")
        self.started = 0

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on the next CPU (unchanged with one CPU, or without taskset)."""
        if len(self.cpus) < 2 or self.taskset is None:
            return list(argv)
        cpu = self.cpus[self.started % len(self.cpus)]
        self.started += 1
        return [self.taskset, "-c", str(cpu), *argv]
