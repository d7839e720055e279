"""The packages type-check: hints are part of the code, kept true by this test. The tests
are checked too: above all the simulation's ports, which must stay what the drivers'
port protocols say (``ziplog.io.ports``), or the simulation would drive something the
real runtimes are not."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mypy_is_clean() -> None:
    pytest.importorskip("mypy")
    out = subprocess.run([sys.executable, "-m", "mypy", "ziplog", "mms", "failure_handler", "bench", "tests"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
