"""LogDB's coordinator and KV shard processes, unchanged, on the Scalog-style log:

    python -m bench.systems.scalog_logdb coordinator --scalog ADDRS_JSON [ziplog.logdb.coordinator options]
    python -m bench.systems.scalog_logdb kvshard --scalog ADDRS_JSON [ziplog.logdb.kvshard options]

``ADDRS_JSON`` is the storage servers' addresses, ``[[shard 0's servers], ...]``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from bench.systems.scalog_log import AsyncScalogLog


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    role = argv.pop(0)
    i = argv.index("--scalog")
    addrs = json.loads(argv[i + 1])
    del argv[i:i + 2]

    async def open_log() -> Any:
        return AsyncScalogLog(addrs)

    if role == "coordinator":
        from ziplog.logdb import coordinator
        return coordinator.main(argv, open_log)
    if role == "kvshard":
        from ziplog.logdb import kvshard
        return kvshard.main(argv, open_log)
    raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    sys.exit(main())
