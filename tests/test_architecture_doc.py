"""``docs/ARCHITECTURE.md`` stays true of the code: its package map names every module on
disk (package ``__init__.py``s aside) and no module that is not there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGES = ("ziplog", "mms", "failure_handler")
#: a map line: its indentation, then a package (``name/``) or a module (``name.py``); a
#: wrapped description is indented further than any name
ENTRY = re.compile(r"^( {0,18})(\S+(?:/|\.py))(?:\s|$)")


def package_map(text: str) -> set[str]:
    """The modules the map names, as paths from the repository's root."""
    section = text.split("### Packages and layers", 1)[1]
    block = section.split("```\n", 2)[1]
    names: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indentation, directory)
    for line in block.splitlines():
        m = ENTRY.match(line)
        if m is None:
            continue
        indent, name = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "".join(d for _, d in stack) + name
        if name.endswith("/"):
            stack.append((indent, name))
        else:
            names.add(path)
    return names


def modules_on_disk() -> set[str]:
    return {str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
            if p.name != "__init__.py" or p.parent == ROOT / "ziplog"}


def test_the_package_map_names_every_module_and_only_those() -> None:
    named = package_map(DOC.read_text())
    on_disk = modules_on_disk()
    assert not on_disk - named, f"modules ARCHITECTURE.md's package map misses: {sorted(on_disk - named)}"
    assert not named - on_disk, f"modules the package map names that do not exist: {sorted(named - on_disk)}"


def test_the_check_sees_a_missing_and_a_made_up_module() -> None:
    text = DOC.read_text()
    named = package_map(text)
    assert "ziplog/io/segments.py" in named and "ziplog/cores/replica/primary.py" in named
    without = package_map(text.replace("    segments.py ", "    ", 1))
    assert "ziplog/io/segments.py" not in without
    made_up = package_map(text.replace("    segments.py ", "    segments.py \n    imaginary.py ", 1))
    assert "ziplog/io/imaginary.py" in made_up
