"""``python -m ziplog.tools.build_native [--force] [--check]``: compile the hot path's
modules (:data:`ziplog.native.NATIVE_MODULES`) with mypyc, in place, when a source
changed since the last build (``make setup`` runs it; the test session checks it).

mypyc turns typed Python into C that calls methods and reads attributes directly instead
of through the interpreter: the storage server's and the client's every turn. The
sources stay the reference (``ZIPLOG_PURE=1`` runs them). One shared library for the
group; about a minute of one core."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

from ziplog.native import GROUP, NATIVE_MODULES, PACKAGE_DIR, compiled_files, source_file, stale_reason

ROOT = PACKAGE_DIR.parent

_SETUP = """
from setuptools import setup
from mypyc.build import mypycify

setup(name="ziplog-native", packages=[],
      ext_modules=mypycify({paths!r}, group_name={group!r}, opt_level="3"),
      script_args=["build_ext", "--inplace", "--build-temp", {temp!r}])
"""


def build() -> None:
    """Compile every native module (the old compiled forms removed first, so that a
    failed build leaves the sources running, never a stale library)."""
    for path in compiled_files():
        path.unlink()
    paths = [str(source_file(m).relative_to(ROOT)) for m in NATIVE_MODULES]
    with tempfile.TemporaryDirectory(prefix="ziplog-native-") as temp:
        script = os.path.join(temp, "setup_native.py")
        with open(script, "w") as fh:
            fh.write(_SETUP.format(paths=paths, group=GROUP, temp=os.path.join(temp, "obj")))
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
    if reason is None:
        return 0
    print(f"compiling {len(NATIVE_MODULES)} modules with mypyc ({reason})", flush=True)
    build()
    return 0


if __name__ == "__main__":
    sys.exit(main())
