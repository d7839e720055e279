"""The hot path runs compiled (mypyc, ``ziplog/native.py``) and the sources stay its
reference: the same simulations give the same outcome, seed by seed, compiled and
interpreted (``ZIPLOG_PURE=1``); a storage server of a local cluster runs the compiled
forms; the modules mypy checks for narrowing hazards are the compiled ones."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import ziplog
from ziplog.native import GROUP, NATIVE_MODULES, running_compiled

ROOT = Path(__file__).resolve().parent.parent
PURE = os.environ.get("ZIPLOG_PURE") == "1"


def _run(args: list[str], pure: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "ZIPLOG_PURE"}
    if pure:
        env["ZIPLOG_PURE"] = "1"
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.skipif(PURE, reason="ZIPLOG_PURE=1: the sources run")
def test_the_compiled_forms_are_the_ones_imported() -> None:
    modules = [importlib.import_module(m) for m in NATIVE_MODULES]
    assert running_compiled(modules), [m.__file__ for m in modules]


def test_pure_mode_imports_every_source() -> None:
    code = ("import importlib, ziplog, ziplog.native as n; "
            "print('\\n'.join(importlib.import_module(m).__file__ for m in n.NATIVE_MODULES))")
    files = _run(["-c", code], pure=True).split()
    assert len(files) == len(NATIVE_MODULES) and all(f.endswith(".py") for f in files), files


@pytest.mark.parametrize("sim", [["--system", "--seeds", "6", "--jobs", "1"], ["--seeds", "24"]],
                         ids=["system", "shard"])
def test_the_simulation_is_the_same_compiled_and_interpreted(sim: list[str]) -> None:
    """Deterministic seeds: every count (inserts acknowledged on the fast and the slow
    path, crashes, recoveries, stops, epochs, events...) must match exactly."""
    def totals(pure: bool) -> str:
        out = _run(["-m", "tests.sim", *sim], pure)
        # the system simulation's counts, or the shard simulation's summary without its time
        line = next(line for line in out.splitlines() if line.startswith("totals:") or " seeds passed in " in line)
        return re.sub(r" in [0-9.]+s;", ";", line)

    compiled, interpreted = totals(pure=False), totals(pure=True)
    assert compiled == interpreted


@pytest.mark.skipif(PURE, reason="ZIPLOG_PURE=1: the sources run")
def test_a_local_clusters_storage_servers_run_compiled() -> None:
    with ziplog.local_cluster(shards=1, replicas=2) as cluster:
        with cluster.client() as c:
            c.insert_after(b"compiled")
        for p in cluster.servers.values():
            maps = Path(f"/proc/{p.pid}/maps").read_text()
            assert GROUP.split(".")[1] + "__mypyc" in maps


def test_mypy_checks_narrowing_in_exactly_the_compiled_modules() -> None:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    checked = [o for o in conf if o.get("warn_unreachable")]
    assert len(checked) == 1 and tuple(checked[0]["module"]) == NATIVE_MODULES


def test_the_build_cache_is_keyed_by_content_and_restores_what_it_kept(tmp_path: Path, monkeypatch) -> None:
    """A cached build is found again by the digest of what it was made from: a source's
    content moves the digest (its mtime does not), and the files it kept come back into
    place as new files (so the build counts as current)."""
    from ziplog.tools import build_native as bn

    pkg = tmp_path / "ziplog"
    (pkg / "cores").mkdir(parents=True)
    src = pkg / "cores" / "core.py"
    src.write_text("x = 1\n")
    (tmp_path / "pyproject.toml").write_text("[tool.mypy]\n")
    monkeypatch.setattr(bn, "ROOT", tmp_path)
    monkeypatch.setattr(bn, "PACKAGE_DIR", pkg)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = bn.build_digest()
    os.utime(src, (1, 1))
    assert bn.build_digest() == first
    src.write_text("x = 2\n")
    assert bn.build_digest() != first

    built = pkg / "cores" / "core.cpython-x.so"
    built.write_bytes(b"compiled")
    monkeypatch.setattr(bn, "compiled_files", lambda: [p for p in [built] if p.exists()])
    monkeypatch.setattr(bn, "stale_reason", lambda: None if built.exists() and built.stat().st_mtime >= src.stat().st_mtime else "stale")
    digest = bn.build_digest()
    bn.to_cache(digest)
    built.unlink()
    assert not bn.from_cache("another digest") and not built.exists()
    os.utime(src)  # the source is newer than anything cached
    assert bn.from_cache(digest) and built.read_bytes() == b"compiled"
    for i in range(bn.CACHE_KEEP + 2):  # only the newest few are kept
        bn.to_cache(f"d{i}")
    kept = [p.name for p in (tmp_path / "cache" / "ziplog" / "native").iterdir()]
    assert len(kept) == bn.CACHE_KEEP and not any(n.startswith(".") for n in kept), kept
