"""Which modules of the hot path run compiled to C (mypyc), and how to run them
interpreted instead.

The modules below are plain, fully typed Python; ``make setup`` compiles them with mypyc
(``python -m ziplog.tools.build_native``) into extension modules that sit beside their
sources, one shared library for the group (``ziplog/_compiled__mypyc*.so``). Python then
imports the compiled form first. The source stays the reference: with ``ZIPLOG_PURE=1``
in the environment (inherited by every process a local cluster starts), this package
hides the compiled forms and every module runs interpreted, so the same test or
benchmark can run both ways (``tests/test_native.py`` holds the simulation's outcome
equal seed by seed).

Left interpreted: modules whose classes are msgspec Structs (``protocol.frames``,
``protocol.events``: msgspec reads their class options, which a compiled class would not
carry), the settings dataclass (read as class attributes for command-line defaults) and
package ``__init__``s (a compiled package would hide its interpreted submodules).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Sequence

#: set to 1: every process runs the sources, compiled forms or not
PURE_ENV = "ZIPLOG_PURE"

#: the mypyc group: its shared library is the module ``ziplog._compiled__mypyc``
GROUP = "ziplog._compiled"

#: the compiled modules: a storage server's and a client's every turn
NATIVE_MODULES: tuple[str, ...] = (
    "ziplog.protocol.zmtp",
    "ziplog.protocol.gsna",
    "ziplog.cores.effects",
    "ziplog.cores.replica.admission",
    "ziplog.cores.replica.backup",
    "ziplog.cores.replica.clock_pass",
    "ziplog.cores.replica.core",
    "ziplog.cores.replica.fanout",
    "ziplog.cores.replica.forwarding",
    "ziplog.cores.replica.link",
    "ziplog.cores.replica.liveness",
    "ziplog.cores.replica.log",
    "ziplog.cores.replica.memory",
    "ziplog.cores.replica.parking",
    "ziplog.cores.replica.primary",
    "ziplog.cores.replica.progress",
    "ziplog.cores.replica.received",
    "ziplog.cores.replica.recovery",
    "ziplog.cores.client.calls",
    "ziplog.cores.client.state",
    "ziplog.cores.client.waits",
    "ziplog.io.zmq_runtime",
    "ziplog.io.zmtp_poll",
    "ziplog.client.driver",
    "ziplog.server.frame_counts",
    "ziplog.server.fences",
    "ziplog.server.links",
    "ziplog.server.storage",
)

#: the packages whose sources the compiled code was built from (mypyc may inline what it
#: reads of them, a constant say): a source newer than the build makes it stale
SOURCE_PACKAGES: tuple[str, ...] = ("protocol", "cores", "io", "shell", "server", "client")

PACKAGE_DIR = Path(__file__).resolve().parent


def source_file(module: str) -> Path:
    """The .py file of one of this package's modules (never a package: see above)."""
    return (PACKAGE_DIR / Path(*module.split(".")[1:])).with_suffix(".py")


def compiled_files() -> list[Path]:
    """Every compiled form on disk: the group's shared library and one module each."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    out = [p for p in PACKAGE_DIR.glob(GROUP.split(".")[1] + "__mypyc*") if p.name.endswith(suffixes)]
    for module in NATIVE_MODULES:
        src = source_file(module)
        out += [p for p in src.parent.glob(src.stem + ".*") if p.name.endswith(suffixes)]
    return out


def stale_reason() -> str | None:
    """Why the compiled forms do not match the sources (None: they do)."""
    built = compiled_files()
    if len(built) < len(NATIVE_MODULES) + 1:
        return "not built"
    oldest = min(p.stat().st_mtime for p in built)
    for pkg in SOURCE_PACKAGES:
        for src in (PACKAGE_DIR / pkg).rglob("*.py"):
            if src.stat().st_mtime > oldest:
                return f"{src.relative_to(PACKAGE_DIR.parent)} changed since the build"
    return None


def running_compiled(modules: Sequence[ModuleType]) -> bool:
    """Every one of ``modules`` was imported from its compiled form."""
    return all(str(getattr(m, "__file__", "")).endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
               for m in modules)


class _SourcesFirst:
    """Finds the compiled modules' sources, so that no compiled form is imported (a
    meta path finder needs only ``find_spec``; ``importlib.abc`` is left unimported, as
    it pulls in ``importlib.resources`` and ``tempfile`` at every process's start)."""

    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name not in NATIVE_MODULES:
            return None
        return importlib.util.spec_from_file_location(name, source_file(name))


def run_interpreted_if_asked() -> None:
    """With ``ZIPLOG_PURE=1``, make every later import of a compiled module load its
    source (called by the package before any of them is imported)."""
    if os.environ.get(PURE_ENV) == "1" and not any(isinstance(f, _SourcesFirst) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourcesFirst())
