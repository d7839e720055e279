"""What a NOTICE costs a process that serves replicas of several shards (a process per
CPU, ``ziplog.server --serve``): sent once per process told, which hands it to every
replica it serves (the default), against once per replica (``--notice-fanout replica``,
how it worked before), side by side. Two clusters of a process per CPU per shard count,
one per mode, every load on each in turn (the order rotated every round), all on one
ZooKeeper ensemble (the harness of :mod:`bench.experiments.epochstamp`). Per run: NOTICE
frames and all messages the replicas sent per append, the storage servers' CPU per
append, the fast path. Medians over the rounds; ``cpu_ratio``: per process / per replica
within each round, then their median.

    python -m bench noticefanout [--quick] [--out DIR]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import epochstamp

MODES = {"per process": [], "per replica": ["--notice-fanout", "replica"]}
LAYOUTS = {"a process per CPU": True}
COLUMNS = ["shards", "layout", "load", "mode", "rounds", "total_rate", "notices", "server_msgs", "server_cpu_us",
           "cpu_ratio", "fast_path"]


def params_for(quick: bool) -> dict[str, Any]:
    return {**epochstamp.params_for(quick), "modes": MODES, "layouts": LAYOUTS,
            "loads": [("pipelined 4 x 8", 4, "saturate", 8), ("pipelined 8 x 16", 8, "saturate", 16),
                      ("250/s open loop", 4, "open", 62.5), ("500/s open loop", 4, "open", 125.0)]}


def run(quick: bool, out: Path | None) -> list[dict[str, Any]]:
    res, rows = epochstamp.paired_run("noticefanout", params_for(quick), out, "a process per CPU, both modes")
    p = res.params
    epochstamp.bars(res, rows, ("shards", "load"), lambda r: r["server_cpu_us"] or 0, lambda mode: f"a NOTICE {mode}",
                    lambda n, load: f"{n} shards\n{load.replace('pipelined ', '')}",
                    "storage servers' CPU per append (us)",
                    "A process per CPU: a NOTICE once per process against once per replica (medians)",
                    "servers' CPU per append with a NOTICE sent once per process and once per replica")
    for r in rows:
        if r["mode"] == "per process":
            res.note(f"{r['shards']} shards, {r['load']}: servers' CPU per append {r['cpu_ratio']}x with a NOTICE "
                     f"per process (rounds {r['cpu_ratio_rounds']})")
    res.write(rows, COLUMNS, "A process per CPU: a NOTICE once per process told against once per replica",
              intro=(epochstamp.rounds_intro(p, "both clusters") + "notices: NOTICE frames the "
                     "primaries sent per append; server_msgs: every message the replicas sent per append; "
                     "server_cpu_us: the storage servers' CPU per append; cpu_ratio: per process / per replica "
                     "within each round, then their median; fast_path: the inserts settled in two message delays."))
    return rows
