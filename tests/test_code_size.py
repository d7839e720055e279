"""The sizes that keep the code changeable by a newcomer: no class in the cores over 350
lines, no function of the library or the control plane over 80, the storage driver's
module under 500 (docs/ARCHITECTURE.md, The shape of the code)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_CORE_CLASS = 350
MAX_FUNCTION = 80
MAX_STORAGE_MODULE = 500


def _definitions(package: str) -> list[tuple[str, ast.AST, int]]:
    out: list[tuple[str, ast.AST, int]] = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                out.append((f"{path.relative_to(ROOT)}:{node.name}", node, node.end_lineno - node.lineno + 1))
    return out


def test_no_class_in_the_cores_is_over_350_lines() -> None:
    big = [(name, n) for name, node, n in _definitions("ziplog/cores")
           if isinstance(node, ast.ClassDef) and n > MAX_CORE_CLASS]
    assert not big, big


def test_no_function_of_the_library_or_the_control_plane_is_over_80_lines() -> None:
    big = [(name, n) for package in ("ziplog", "mms", "failure_handler") for name, node, n in _definitions(package)
           if not isinstance(node, ast.ClassDef) and n > MAX_FUNCTION]
    assert not big, big


def test_the_storage_drivers_module_is_under_500_lines() -> None:
    assert len((ROOT / "ziplog/server/storage.py").read_text().splitlines()) < MAX_STORAGE_MODULE
