"""Latency summaries and Markdown tables."""

from __future__ import annotations

from typing import Any


def _cell(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if v != v:
            return "nan"
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.2f}"
    return str(v).replace("|", "\\|")


def format_table(rows: list[dict], columns: list[str]) -> str:
    """A Markdown table of ``rows`` restricted to ``columns`` (missing values shown as –)."""
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows) and rows for c in columns]

    def line(vals: list[str]) -> str:
        return "| " + " | ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric)) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2)) for w, num in zip(widths, numeric)) + "|"
    return "\n".join([line(list(columns)), sep] + [line(r) for r in cells]) + "\n"
