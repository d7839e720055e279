"""One results folder per experiment run: JSON, a Markdown table, PNG plots, progress.

Every experiment writes through :class:`Results`:

* ``<name>.json``: the rows (a list of objects, one per system and setting), each with the
  raw samples' summary and, where useful, a histogram;
* ``<name>_meta.json``: machine info, versions, parameters, systems that could not start;
* ``<name>.md``: a title, the parameters, the table, notes, the plots;
* ``<name>*.png``: matplotlib figures (Agg backend: no display needed).

:func:`progress` prints one line per step with the elapsed time and an estimate of what
is left, to stderr, so a long run shows it is alive without filling a log.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence, TypeVar

import numpy as np

from .machine import machine_info
from .stats import format_table

T = TypeVar("T")


def default_out(name: str) -> Path:
    return Path("results") / f"{name}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def log(name: str, msg: str) -> None:
    print(f"[{name}] {msg}", file=sys.stderr, flush=True)


def progress(name: str, items: Sequence[T], label: Any = str) -> Iterator[T]:
    """Yield ``items``, printing ``[name] i/n label (elapsed, ~left)`` before each."""
    t0 = time.monotonic()
    n = len(items)
    for i, item in enumerate(items):
        el = time.monotonic() - t0
        left = f", ~{el / i * (n - i):.0f} s left" if i else ""
        log(name, f"{i + 1}/{n} {label(item)} ({el:.0f} s{left})")
        yield item
    log(name, f"{n}/{n} done in {time.monotonic() - t0:.0f} s")


def histogram(samples_ns: Iterable[int], bins_per_decade: int = 20) -> dict[str, list[float]]:
    """Log-spaced latency histogram in microseconds: ``edges_us`` (n+1) and ``counts`` (n)."""
    a = np.asarray(list(samples_ns) if not isinstance(samples_ns, np.ndarray) else samples_ns,
                   dtype=np.float64) / 1000.0
    if a.size == 0:
        return {"edges_us": [], "counts": []}
    lo, hi = max(a.min(), 1.0), max(a.max(), 2.0)
    n = max(1, int(np.ceil(np.log10(hi / lo) * bins_per_decade)))
    edges = np.logspace(np.log10(lo), np.log10(hi), n + 1)
    edges[0], edges[-1] = lo, hi  # exact ends: floating-point logspace can leave the extremes outside
    counts, _ = np.histogram(np.clip(a, lo, hi), bins=edges)
    return {"edges_us": [round(float(e), 3) for e in edges], "counts": [int(c) for c in counts]}


class Results:
    """The output folder of one experiment run."""

    def __init__(self, name: str, out: Path | None, params: dict[str, Any]) -> None:
        self.name = name
        self.dir = Path(out) if out is not None else default_out(name)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.params = params
        self.machine = machine_info()
        self.unavailable: dict[str, str] = {}  # system -> why it could not start
        self.notes: list[str] = []
        self.plots: list[tuple[str, str]] = []  # (file name, caption)
        self.started = time.monotonic()

    def log(self, msg: str) -> None:
        log(self.name, msg)

    def not_started(self, system: str, reason: str) -> None:
        """Record (and say plainly) that ``system`` could not be started."""
        self.unavailable[system] = reason
        self.log(f"{system} NOT STARTED: {reason}")

    def note(self, text: str) -> None:
        self.notes.append(text)

    def figure(self, suffix: str = "") -> tuple[Any, Path]:
        """A new matplotlib figure and the path it will be saved to (``<name><suffix>.png``)."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig = plt.figure(figsize=(7.5, 4.5), dpi=110)
        return fig, self.dir / f"{self.name}{suffix}.png"

    def cdf_figure(self, rows: list[dict[str, Any]], label_key: str, xlabel: str, caption: str,
                   suffix: str = "") -> None:
        """One CDF per row from its ``histogram``, log x axis, p50 in the legend."""
        fig, path = self.figure(suffix)
        ax = fig.add_subplot(1, 1, 1)
        for row in rows:
            h = row["histogram"]
            if not h["counts"]:
                continue
            cdf = np.cumsum(h["counts"]) / max(1, sum(h["counts"]))
            ax.step(h["edges_us"][1:], cdf, where="post", label=f"{row[label_key]} (p50 {row['p50_us']:.0f} us)")
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("CDF")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        self.save_figure(fig, path, caption)

    def save_figure(self, fig: Any, path: Path, caption: str) -> None:
        import matplotlib.pyplot as plt
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        self.plots.append((path.name, caption))
        self.log(f"wrote {path}")

    def write(self, rows: list[dict[str, Any]], columns: list[str], title: str, intro: str = "",
              extra_tables: Sequence[tuple[str, list[dict[str, Any]], list[str]]] = ()) -> str:
        """Write ``<name>.json`` (rows), ``<name>_meta.json`` and ``<name>.md``; return the
        main Markdown table (also printed to stdout)."""
        elapsed = time.monotonic() - self.started
        meta = {"experiment": self.name, "params": self.params, "machine": self.machine,
                "not_started": self.unavailable, "elapsed_s": round(elapsed, 1), "notes": self.notes}
        (self.dir / f"{self.name}.json").write_text(json.dumps(rows, indent=1, default=_json_default) + "\n")
        (self.dir / f"{self.name}_meta.json").write_text(json.dumps(meta, indent=1, default=_json_default) + "\n")
        table = format_table(rows, columns) if rows else "(no rows)\n"
        m = self.machine
        md = [f"# {title}", ""]
        if intro:
            md += [intro, ""]
        md += [table]
        for caption, trows, tcols in extra_tables:
            md += [f"**{caption}**", "", format_table(trows, tcols) if trows else "(no rows)\n"]
        if self.unavailable:
            md += ["**Not started:**", ""] + [f"- {s}: {why}" for s, why in self.unavailable.items()] + [""]
        if self.notes:
            md += [f"- {n}" for n in self.notes] + [""]
        for fname, caption in self.plots:
            md += [f"![{caption}]({fname})", ""]
        md += [f"Parameters: `{json.dumps(self.params, default=_json_default)}`", "",
               f"Machine: {m['cpu_count']} x {m['cpu_model']}, Python {m['python']}, pyzmq {m['pyzmq']} / "
               f"libzmq {m['libzmq']}, {m['platform']}, {m['date']}; run took {elapsed:.0f} s.", ""]
        (self.dir / f"{self.name}.md").write_text("\n".join(md))
        print(table)
        for caption, trows, tcols in extra_tables:
            print(caption)
            print(format_table(trows, tcols) if trows else "(no rows)")
        for s, why in self.unavailable.items():
            print(f"NOT STARTED: {s}: {why}")
        self.log(f"wrote {self.dir / (self.name + '.json')}, {self.dir / (self.name + '.md')}")
        return table


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    return repr(o)
