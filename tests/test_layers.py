"""The architecture's import rules (import-linter contracts in pyproject.toml): the
library never imports the control plane or the benchmarks, the layers of ``ziplog``
only import downwards, and cores and the protocol do no I/O."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_contracts_are_kept() -> None:
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    proc = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "broken" in proc.stdout and ", 0 broken" in proc.stdout, proc.stdout[-2000:]
