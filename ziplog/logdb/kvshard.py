"""A LogDB KV shard: ``python -m ziplog.logdb.kvshard --zk HOSTS --index I --shards N``.

:class:`KvShardDriver` is the thin driver over :class:`KvShardCore` and a store
(:class:`SqliteStore`): records and positions in, one atomic store write per turn out,
reads of applied values answered. The process runs it on asyncio with its own
subscription of the log (from the validator snapshot's position), a ROUTER socket for
clients' ``KvGet`` and ZooKeeper for its registration and its collection position. The
simulation in ``tests`` runs the same driver over a scripted log and a crashing store.
"""

from __future__ import annotations

import argparse
import logging
import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from ziplog.logdb.core import frames as f
from ziplog.logdb.core.kvshard import SNAPSHOT_NS, KvShardCore, owner
from ziplog.logdb.store import SqliteStore
from ziplog.shell.metrics import counter, gauge

if TYPE_CHECKING:
    from prometheus_client.core import Metric

log = logging.getLogger("ziplog.logdb.kvshard")

#: a store write that failed (a full disk) is tried again this often
STORE_RETRY_NS = 200_000_000


class KvShardDriver:
    def __init__(self, core: KvShardCore, store: Any, now: Callable[[], int],
                 on_snapshot: Callable[[int], None] = lambda position: None) -> None:
        self.core = core
        self.store = store
        self.now = now
        self.on_snapshot = on_snapshot
        #: a batch the store refused (a full disk): tried again before anything else
        self._unstored: Any = None
        self._retry_at = 0
        #: commit records validated since the process started (a restart replays from
        #: the last snapshot and counts those again): committed, aborted
        self.commits = 0
        self.aborts = 0

    @property
    def blocked(self) -> bool:
        """The store refused a write: read no more of the log until it takes it."""
        return self._unstored is not None

    def on_record(self, gsn: int, shard: int, data: bytes) -> None:
        d = self.core.on_record(gsn, shard, data)
        if d is not None and not d.duplicate:
            if d.committed:
                self.commits += 1
            elif not d.unknown:
                self.aborts += 1

    def on_position(self, gsn: int) -> None:
        self.core.on_position(gsn)

    def flush(self) -> bool:
        """Store what is due (one atomic write); False when the store refused it."""
        now = self.now()
        batch = self._unstored
        if batch is not None and now < self._retry_at:
            return False
        if batch is None:
            due = self.core.due(now).persist
            if not due:
                return True
            batch, = due  # one atomic write at a time
        try:
            self.store.apply(batch)
        except sqlite3.IntegrityError:
            raise  # a transaction applied twice: a bug that must stop the shard, loudly
        except sqlite3.Error as exc:
            if self._unstored is None:
                log.error("the store refused a write (%s): applying stops until it takes it", exc)
            self._unstored = batch
            self._retry_at = now + STORE_RETRY_NS
            return False
        if self._unstored is not None:
            log.warning("the store takes writes again")
        self._unstored = None
        self.core.on_stored(batch, now)
        if batch.snapshot is not None:
            self.on_snapshot(batch.position)
        return True

    def metrics(self, labels: dict[str, str]) -> list[Metric]:
        """Prometheus families (called at scrape time from the metrics server's thread)."""
        core = self.core
        return [
            counter("ziplog_logdb_commits", "transactions validated as committed since this process started",
                    self.commits, labels),
            counter("ziplog_logdb_aborts", "transactions validated as aborted since this process started",
                    self.aborts, labels),
            gauge("ziplog_logdb_position_gsn", "every gsn up to here has been replayed", core.position, labels),
            gauge("ziplog_logdb_applied_gsn", "every committed write up to this gsn is in the store", core.applied,
                  labels),
            gauge("ziplog_logdb_store_blocked", "1 while the store refuses a write (a full disk): replay waits",
                  int(self.blocked), labels),
        ]

    def answer(self, data: bytes) -> bytes:
        try:
            req = f.decode_request(data)
        except f.BadFrame as exc:
            return f.encode(f.Failed(req=0, code=f.BAD_REQUEST, message=f"malformed request: {exc}"))
        if type(req) is not f.KvGet:
            return f.encode(f.Failed(req=req.req, code=f.BAD_REQUEST, message="a KV shard serves KvGet only"))
        if not self.core.owns(req.key):
            return f.encode(f.Failed(req=req.req, code=f.NOT_OWNER, message=(
                f"key {req.key!r} belongs to KV shard {owner(req.key, self.core.shards)}")))
        row = self.store.get(req.key)
        applied = self.core.applied
        if row is None:
            return f.encode(f.KvValue(req=req.req, found=False, value=None, gsn=0, shard=0, applied=applied))
        value, gsn, shard = row
        return f.encode(f.KvValue(req=req.req, found=True, value=value, gsn=gsn, shard=shard, applied=applied))


# -- the process ------------------------------------------------------------------------------------
async def serve(args: argparse.Namespace, open_log: Callable[[], Awaitable[Any]] | None = None) -> int:
    """The process's body. ``open_log`` opens the log it replays (default: a ziplog
    ``AsyncClient``; the benchmark runs the same process on another log)."""
    import asyncio

    from ziplog.client.aio import AsyncClient
    from ziplog.io import zk
    from ziplog.io.asyncio_runtime import AsyncioRuntime
    from ziplog.io.zmtp_poll import native_transport_wanted
    from ziplog.io.zk_logdb import db_path, ensure_db, publish_gc
    from ziplog.logdb.process import replay, run_until_stopped, serve_requests
    from ziplog.shell.process import stop_event
    from ziplog.shell.inbound import InboundGuard
    from ziplog.protocol.addresses import advertised
    from ziplog.shell.process import load_cluster_key, member_credentials
    from ziplog.shell.metrics import serve_metrics
    from ziplog.shell.rights import router_rights

    key = load_cluster_key(args.cluster_key_file)
    session = zk.Session(args.zk, key)
    stop = stop_event()
    credentials = member_credentials(args, key)
    rt = AsyncioRuntime(asyncio.get_running_loop(), native=native_transport_wanted() or credentials is not None,
                        credentials=credentials)
    client = None
    store = None
    metrics = None
    try:
        ensure_db(session.zk, args.name, args.shards)
        args.data_dir.mkdir(parents=True, exist_ok=True)
        store = SqliteStore(args.data_dir / f"kv-{args.index}-of-{args.shards}.sqlite3", args.index, args.shards)
        core = KvShardCore(args.index, args.shards, store.load(), time.monotonic_ns(),
                           snapshot_ns=int(args.snapshot_every * 1e9))
        who = f"kv-{args.index}"
        driver = KvShardDriver(core, store, time.monotonic_ns,
                               lambda position: publish_gc(session.zk, args.name, who, position))
        labels = {"name": args.name, "role": "kv", "id": str(args.index)}
        metrics = serve_metrics(args, lambda: driver.metrics(labels))
        log.info("KV shard %d of %d: applied up to gsn %d, replaying from gsn %d", args.index, args.shards,
                 core.applied, core.replay_from)
        client = await (open_log() if open_log is not None else AsyncClient.connect(args.zk, credentials=credentials))
        def answer(route: bytes, frame: bytes) -> None:
            router.send_to(route, driver.answer(frame))

        rights = router_rights(rt, session.zk, key, f.REQUEST_RIGHTS, f"logdb-{args.name}-{who}",
                               args.registry_lease_s)
        router = serve_requests(rt, answer, InboundGuard(log, rt), args.bind, args.port, rights)
        session.keep_registered(f"{db_path(args.name)}/kv/{args.index}",
                                {"addr": advertised(router.addr, args.advertise), "pid": os.getpid()})
        code = await run_until_stopped(
            stop, [replay(client, core.replay_from, driver, 0.1, driver.flush, lambda: driver.blocked,
                          STORE_RETRY_NS / 1e9)],
            lambda: f"the log is trimmed past this shard's snapshot (gsn {core.position}): restore the shard "
                    "from a peer's copy or from the start of the log")
        driver.flush()
        return code
    finally:
        if metrics is not None:
            metrics.close()
        if client is not None:
            await client.close()
        await rt.aclose()
        if store is not None:
            store.close()
        session.close()


def main(argv: list[str] | None = None, open_log: Callable[[], Awaitable[Any]] | None = None) -> int:
    from ziplog.shell.metrics import add_metrics_arguments
    from ziplog.shell.config import parse_args
    from ziplog.shell.logs import add_log_arguments, configure_logging
    from ziplog.shell.process import (
        add_address_arguments,
        add_cluster_key_argument,
        add_security_arguments,
        check_address_arguments,
    )
    ap = argparse.ArgumentParser(prog="python -m ziplog.logdb.kvshard", description=__doc__.split("\n\n")[0])
    ap.add_argument("--zk", required=True, help="ZooKeeper hosts")
    ap.add_argument("--name", default="default", help="the LogDB's name")
    ap.add_argument("--index", type=int, required=True, help="this shard's index, 0..N-1")
    ap.add_argument("--shards", type=int, required=True, help="N: how many KV shards the keys are spread over")
    ap.add_argument("--data-dir", type=Path, required=True)
    add_address_arguments(ap, port_help="port for clients (0: any free one)")
    ap.add_argument("--snapshot-every", type=float, default=SNAPSHOT_NS / 1e9,
                    help="seconds between validator snapshots (the log can be trimmed only up to the last one)")
    add_cluster_key_argument(ap)
    add_security_arguments(ap)
    add_metrics_arguments(ap)
    add_log_arguments(ap)
    args = parse_args(ap, argv, "kvshard")
    check_address_arguments(ap, args)
    if not 0 <= args.index < args.shards:
        ap.error("--index must be in 0..N-1")
    configure_logging(args, f"kvshard{args.index}")
    from ziplog.client.aio import run
    return run(serve(args, open_log))


if __name__ == "__main__":
    sys.exit(main())
