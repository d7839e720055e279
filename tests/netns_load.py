"""The fault tests' load (:class:`tests.load.Load`: writers with InsertAfter chains and
two subscribers) run from another host: ``ip netns exec NS python -m tests.netns_load
ZK_HOSTS``. Driven over stdin, one command per line, each answered on stdout:

* ``acked N TIMEOUT``: until N more inserts are acknowledged -> ``ok TOTAL``
* ``finish``: stop writing, check the log (every acknowledged record delivered exactly
  once to both subscribers, in one order, gsns increasing, chains in order) -> ``passed
  {json}``

A failed check or wait ends the process with its traceback on stderr."""

from __future__ import annotations

import json
import sys
from typing import Any

import ziplog
from tests.load import Load


class RemoteCluster:
    """What the load needs of a cluster: clients of it, found through ZooKeeper."""

    def __init__(self, zk_hosts: str) -> None:
        self.zk_hosts = zk_hosts

    def client(self, **kw: Any) -> ziplog.Client:
        return ziplog.Client(self.zk_hosts, **kw)


def main(argv: list[str]) -> int:
    load = Load(RemoteCluster(argv[0]))  # type: ignore[arg-type]
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "acked":
            load.wait_acked(int(rest[0]), timeout=float(rest[1]))
            print("ok", len(load.acked), flush=True)
        elif cmd == "finish":
            load.finish()
            print("passed", json.dumps({"acked": len(load.acked), "errors": len(load.errors),
                                        "delivered": [len(d) for d in load.delivered]}), flush=True)
            return 0
        else:
            raise ValueError(f"unknown command {cmd!r}")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
