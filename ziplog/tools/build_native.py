"""``python -m ziplog.tools.build_native [--force] [--check]``: compile the hot path's
modules (:data:`ziplog.native.NATIVE_MODULES`) with mypyc, in place, when a source
changed since the last build (``make setup`` runs it; the test session checks it).

mypyc turns typed Python into C that calls methods and reads attributes directly instead
of through the interpreter: the storage server's and the client's every turn. The
sources stay the reference (``ZIPLOG_PURE=1`` runs them). One shared library for the
group, from one C file per module compiled side by side: about 80 s of CPU, under a minute
on two cores (one C file for the whole group took twice that, for the same code speed).

A build is kept in a cache (``~/.cache/ziplog/native``, the last few) under a digest of
everything it was made from: every source of the package, ``pyproject.toml`` (mypy's
settings), the Python, mypy and the libraries whose types it reads, the compiler's
settings, and this build script. A checkout whose
digest was built before (a fresh clone of a built commit, a branch switched back) takes
its compiled forms from there instead of compiling again; ``--force`` always compiles."""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ziplog.native import GROUP, NATIVE_MODULES, PACKAGE_DIR, compiled_files, source_file, stale_reason

ROOT = PACKAGE_DIR.parent

_SETUP = """
import os
from concurrent.futures import ThreadPoolExecutor

from setuptools import setup
from setuptools.command.build_ext import build_ext
from mypyc.build import mypycify


class ParallelBuildExt(build_ext):
    # One C file per module (multi_file), compiled side by side on every CPU: gcc is the
    # build's longest part, and one file per process keeps each -O3 unit small.
    def build_extension(self, ext):
        compile_one = self.compiler.compile

        def compile_all(sources, *args, **kwargs):
            biggest_first = sorted(sources, key=lambda s: -os.path.getsize(s))
            with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
                objects = dict(zip(biggest_first, pool.map(
                    lambda s: compile_one([s], *args, **kwargs), biggest_first)))
            return [o for s in sources for o in objects[s]]

        self.compiler.compile = compile_all
        # mypyc writes the group's header under build/<package>/ and includes it by its
        # bare name from the per-module files
        ext.include_dirs.append(os.path.join("build", {package!r}))
        super().build_extension(ext)


setup(name="ziplog-native", packages=[], cmdclass={{"build_ext": ParallelBuildExt}},
      ext_modules=mypycify({paths!r}, group_name={group!r}, opt_level="3", multi_file=True),
      script_args=["build_ext", "--inplace", "--build-temp", {temp!r}])
"""


#: builds kept in the cache (each about 15 MB)
CACHE_KEEP = 3


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ziplog" / "native"


def build_digest() -> str:
    """What a build is made from: any change to it, and the build is another one."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "-"

    h = hashlib.sha256()
    # the libraries whose types mypyc reads, besides mypy itself and the compiler's settings
    for part in (sys.version, sys.platform, *(installed(d) for d in ("mypy", "setuptools", "msgspec", "pyzmq", "msgpack")),
                 _SETUP, repr(NATIVE_MODULES), GROUP, os.environ.get("CC", ""), os.environ.get("CFLAGS", "")):
        h.update(part.encode() + b"\0")
    for path in sorted(PACKAGE_DIR.rglob("*.py")) + [ROOT / "pyproject.toml"]:
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:32]


def from_cache(digest: str) -> bool:
    """Put the cached build of ``digest`` in place (as new files: they are then newer
    than the sources); True when it took."""
    entry = cache_dir() / digest
    names = (entry / "files").read_text().split() if (entry / "files").exists() else []
    if not names:
        return False
    for path in compiled_files():
        path.unlink()
    try:
        for name in names:
            shutil.copyfile(entry / name.replace("/", "%"), ROOT / name)
    except OSError:
        for path in compiled_files():
            path.unlink()
        return False
    return stale_reason() is None


def to_cache(digest: str) -> None:
    """Keep this build under ``digest`` (written aside, then renamed into place), and only
    the newest CACHE_KEEP builds. A cache that cannot be written costs nothing but time."""
    root = cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
        aside = Path(tempfile.mkdtemp(prefix=".new-", dir=root))
        names = [str(p.relative_to(ROOT)) for p in compiled_files()]
        for name in names:
            shutil.copyfile(ROOT / name, aside / name.replace("/", "%"))
        (aside / "files").write_text("\n".join(names))
        if (root / digest).exists():
            shutil.rmtree(aside)
        else:
            aside.rename(root / digest)
        entries = sorted((p for p in root.iterdir() if not p.name.startswith(".")), key=lambda p: p.stat().st_mtime)
        for old in entries[:-CACHE_KEEP]:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        print(f"the native build was not cached: {exc}", file=sys.stderr)


def build() -> None:
    """Compile every native module (the old compiled forms removed first, so that a
    failed build leaves the sources running, never a stale library)."""
    for path in compiled_files():
        path.unlink()
    paths = [str(source_file(m).relative_to(ROOT)) for m in NATIVE_MODULES]
    with tempfile.TemporaryDirectory(prefix="ziplog-native-") as temp:
        script = os.path.join(temp, "setup_native.py")
        with open(script, "w") as fh:
            fh.write(_SETUP.format(paths=paths, group=GROUP, package=GROUP.split(".")[0],
                                   temp=os.path.join(temp, "obj")))
        # Run from the checkout's root: mypyc names the modules by their paths from there,
        # and writes its C under build/ there (removed below).
        proc = subprocess.run([sys.executable, script], cwd=ROOT, capture_output=True, text=True)
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    if proc.returncode != 0:
        for path in compiled_files():
            path.unlink()
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"mypyc could not compile the native modules (exit {proc.returncode}); "
                         f"ZIPLOG_PURE=1 runs the sources")
    left = stale_reason()
    if left is not None:
        raise SystemExit(f"the native build did not take: {left}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ziplog.tools.build_native", description=__doc__.split("\n\n")[0])
    ap.add_argument("--force", action="store_true", help="build even if nothing changed")
    ap.add_argument("--check", action="store_true", help="only say whether the build is current (exit 1 if not)")
    args = ap.parse_args(argv)
    reason = "forced" if args.force else stale_reason()
    if args.check:
        print("current" if reason is None else f"stale: {reason}")
        return 0 if reason is None else 1
    digest = build_digest()
    if reason is None:
        if not (cache_dir() / digest).exists():
            to_cache(digest)  # built here before these sources were committed: keep it for their clones
        return 0
    if not args.force and from_cache(digest):
        print(f"{len(NATIVE_MODULES)} native modules from the build cache ({reason} here; built before from "
              f"these sources)", flush=True)
        return 0
    print(f"compiling {len(NATIVE_MODULES)} modules with mypyc ({reason})", flush=True)
    build()
    if build_digest() == digest:  # nothing changed while it compiled: the build is the digest's
        to_cache(digest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
