"""The architecture's import rules (import-linter contracts in pyproject.toml): the
library never imports the control plane or the benchmarks, the layers of ``ziplog``
(tools, apps, clients and servers, the process shell, I/O adapters, cores, protocol)
only import downwards, cores and the protocol do no I/O, and only ``ziplog/io`` touches
pyzmq or kazoo."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_contracts_are_kept() -> None:
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    proc = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "broken" in proc.stdout and ", 0 broken" in proc.stdout, proc.stdout[-2000:]


def _imported_modules(path: str) -> list[tuple[int, str]]:
    """Every module a file imports (at any depth: inside functions too), with its line."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_only_the_io_adapters_import_pyzmq_or_kazoo() -> None:
    """A transport or coordination service swapped behind the ports reaches every driver:
    no module of the library or the services outside ``ziplog/io`` imports them."""
    io_dir = os.path.join(ROOT, "ziplog", "io") + os.sep
    offenders: list[str] = []
    scanned = 0
    for top in ("ziplog", "mms", "failure_handler"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                path = os.path.join(dirpath, name)
                if not name.endswith(".py") or path.startswith(io_dir):
                    continue
                scanned += 1
                for line, module in _imported_modules(path):
                    if module.split(".")[0] in ("zmq", "kazoo"):
                        offenders.append(f"{os.path.relpath(path, ROOT)}:{line} imports {module}")
    assert scanned > 50, "the walk found too few modules: it is looking in the wrong place"
    assert not offenders, "\n".join(offenders)


def test_the_scan_sees_imports_inside_functions(tmp_path: "os.PathLike[str]") -> None:
    sample = os.path.join(tmp_path, "sample.py")
    with open(sample, "w", encoding="utf-8") as fh:
        fh.write("def f():\n    import zmq.asyncio\n    from kazoo.client import KazooClient\n")
    assert [m for _, m in _imported_modules(sample)] == ["zmq.asyncio", "kazoo.client"]
