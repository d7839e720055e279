"""Slots passed by the clock (``--clock-pass-rate``, 2,500 records/s by default: every
insert takes no slot expected before its stamp, and a shard scheduled at that rate or
more expires its slots while quiet and gets no NOTICE) against slots passed on NOTICEs
and epochs' closes alone (``--clock-pass-rate 0``, how it worked before), side by side.
A shard's own inserts then pass its slots as they come, so a NOTICE that comes later
passes nothing (no FORWARD and PREFIX of the no-ops it would make), the shards scheduled
past the rate send one another none, and both replicas place each insert past the same
passed slots. Per layout (a process per replica, as shipped, and a process per CPU) two
clusters run, one per mode, every load on each in turn (the order rotated every round),
all on one ZooKeeper ensemble (the harness of :mod:`bench.experiments.epochstamp`). Per
run: the fast path, NOTICE frames and all messages the replicas sent per append, the
backups' wrong guesses and re-ACKs per insert, the storage servers' CPU per append.
Medians over the rounds; ``cpu_ratio``: by the clock / on NOTICEs within each round,
then their median.

    python -m bench clockpass [--quick] [--out DIR]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import epochstamp

MODES = {"by the clock": [], "on NOTICEs": ["--clock-pass-rate", "0"]}
COLUMNS = ["shards", "layout", "load", "mode", "rounds", "total_rate", "fast_path", "notices", "server_msgs",
           "other_wrong_guesses", "reacks", "server_cpu_us", "cpu_ratio"]


def params_for(quick: bool) -> dict[str, Any]:
    return {**epochstamp.params_for(quick), "modes": MODES,
            "loads": [("pipelined 4 x 8", 4, "saturate", 8), ("pipelined 8 x 16", 8, "saturate", 16),
                      ("500/s open loop", 4, "open", 125.0)]}


def run(quick: bool, out: Path | None) -> list[dict[str, Any]]:
    res, rows = epochstamp.paired_run("clockpass", params_for(quick), out, "both layouts, both modes")
    p = res.params
    epochstamp.bars(res, rows, ("shards", "layout", "load"), lambda r: r["server_cpu_us"] or 0,
                    lambda mode: f"slots passed {mode}",
                    lambda n, layout, load: f"{n} shards, {layout.replace('a process ', '')}\n"
                                            f"{load.replace('pipelined ', '')}",
                    "storage servers' CPU per append (us)",
                    "Slots passed by the clock against on NOTICEs alone (medians)",
                    "servers' CPU per append with slots passed by the clock and on NOTICEs alone")
    for r in rows:
        if r["mode"] == "by the clock":
            res.note(f"{r['shards']} shards, {r['layout']}, {r['load']}: servers' CPU per append {r['cpu_ratio']}x "
                     f"by the clock (rounds {r['cpu_ratio_rounds']}), fast path {r['fast_path']}")
    res.write(rows, COLUMNS, "Slots passed by the clock against on NOTICEs alone",
              intro=(epochstamp.rounds_intro(p, "both clusters of each layout") + "fast_path: the inserts "
                     "settled in two message delays; notices: NOTICE frames the primaries sent per append; "
                     "server_msgs: every message the replicas sent per append; other_wrong_guesses and reacks: the "
                     "backups' per insert; server_cpu_us: the storage servers' CPU per append; cpu_ratio: by the "
                     "clock / on NOTICEs within each round, then their median."))
    return rows
