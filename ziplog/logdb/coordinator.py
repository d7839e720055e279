"""A LogDB coordinator replica: ``python -m ziplog.logdb.coordinator --zk HOSTS --id N``.

:class:`CoordinatorDriver` is the thin driver over :class:`CoordinatorCore`: the log's
records and positions and the clients' requests in, answers out, a snapshot of the
validator and the outcomes to disk every ``SNAPSHOT_NS`` (a restart replays only what
follows it, and answers the outcomes it answered before).
Every replica replays the same log and answers any client (the answers are a function
of the log prefix); the replicas elect a leader through ZooKeeper, which clients ask
first and which alone collects garbage: every ``GC_EVERY_S`` it trims the log below
the smallest position every KV shard and coordinator replica can replay from
(:func:`collectable`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from ziplog.cores.effects import Messages
from ziplog.logdb.core import frames as f
from ziplog.logdb.core.coordinator import CoordinatorCore, collection_point
from ziplog.shell.elected import ElectedDriver, ElectionPort
from ziplog.shell.metrics import counter, gauge

if TYPE_CHECKING:
    from prometheus_client.core import Metric

log = logging.getLogger("ziplog.logdb.coordinator")

#: a snapshot of the validator is written this often (if the position moved)
SNAPSHOT_NS = 5_000_000_000
#: the leader looks for a new trim point this often
GC_EVERY_S = 2.0


def collectable(zk: Any, name: str) -> int:
    """The gsn the log may be trimmed below: the smallest published position, once every
    KV shard has published one (0 until then)."""
    from ziplog.io.zk_logdb import gc_positions
    return collection_point(*gc_positions(zk, name))


class SnapshotFile:
    """The validator snapshot on disk, replaced atomically (write, fsync, rename)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return None

    def save(self, data: bytes) -> None:
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        dfd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


class CoordinatorDriver(ElectedDriver):
    kind = "logdb-coordinator"

    def __init__(self, rt: Any, election: ElectionPort, election_path: str, replica_id: int,
                 core: CoordinatorCore, send: Callable[[bytes, bytes], object],
                 save_snapshot: Callable[[int, bytes], None], snapshot_ns: int = SNAPSHOT_NS) -> None:
        super().__init__(rt, election, election_path, replica_id)
        self.snapshot_ns = snapshot_ns
        self.core = core
        self.send = send
        self.save_snapshot = save_snapshot
        self._snapshot_at = rt.now()
        self._snapshot_position = core.position
        #: commit records this replica validated since it started (a restart replays
        #: from its snapshot and counts those again): committed, aborted
        self.commits = 0
        self.aborts = 0

    def _perform(self, messages: Messages) -> None:
        """Send the core's answers, encoded, to their routes."""
        for route, answer in messages:
            self.send(route, f.encode(answer))  # type: ignore[arg-type]  # a coordinator answers routes

    def on_record(self, gsn: int, shard: int, data: bytes) -> None:
        self._perform(self.core.on_record(gsn, shard, data))
        decided = self.core.validator.decided
        if decided:  # a first decision is added last: this record's, when it is at this gsn
            d = next(reversed(decided.values()))
            if d.gsn == gsn and d.shard == shard:
                if d.committed:
                    self.commits += 1
                elif not d.unknown:
                    self.aborts += 1

    def on_position(self, gsn: int) -> None:
        self._perform(self.core.on_position(gsn))

    def on_request(self, route: Any, frame: bytes) -> None:
        self._perform(self.core.on_request(route, frame))

    def on_collected(self, point: int) -> None:
        """LogDB's collection point, read from ZooKeeper (outcomes below it may go)."""
        self.core.on_collected(point)

    def on_tick(self) -> None:
        now = self.rt.now()
        self._perform(self.core.on_tick(now))
        if now - self._snapshot_at >= self.snapshot_ns and self.core.position > self._snapshot_position:
            self._snapshot_at = now
            self._snapshot_position = self.core.position
            self.save_snapshot(self.core.position, self.core.snapshot_bytes())

    def metrics(self, labels: dict[str, str]) -> list[Metric]:
        """Prometheus families (called at scrape time from the metrics server's thread)."""
        return [
            gauge("ziplog_logdb_coordinator_leader", "1 while this replica leads (clients ask it first; it collects "
                  "garbage)", int(self.leading), labels),
            counter("ziplog_logdb_commits", "transactions validated as committed since this process started",
                    self.commits, labels),
            counter("ziplog_logdb_aborts", "transactions validated as aborted since this process started",
                    self.aborts, labels),
            gauge("ziplog_logdb_position_gsn", "every gsn up to here has been replayed", self.core.position, labels),
            gauge("ziplog_logdb_snapshot_gsn", "the position of the last validator snapshot written",
                  self._snapshot_position, labels),
            gauge("ziplog_logdb_waiting_requests", "requests waiting for the replay to reach their position",
                  self.core.waiting, labels),
        ]

    def lead_begin(self) -> None:
        pass  # the process's collector looks at ``leading``

    def lead_end(self) -> None:
        pass


async def serve(args: argparse.Namespace, open_log: Callable[[], Awaitable[Any]] | None = None) -> int:
    """The process's body. ``open_log`` opens the log it replays (default: a ziplog
    ``AsyncClient``; the benchmark runs the same process on another log)."""
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
    from ziplog.shell.rights import router_rights
    from ziplog.shell.metrics import serve_metrics

    key = load_cluster_key(args.cluster_key_file)
    loop = asyncio.get_running_loop()
    credentials = member_credentials(args, key)
    rt = AsyncioRuntime(loop, native=native_transport_wanted() or credentials is not None,
                        credentials=credentials)
    session = zk.ElectedSession(args.zk, key, rt, args.bind, args.advertise)
    stop = stop_event()
    client = None
    metrics = None
    try:
        ensure_db(session.zk, args.name, args.kv_shards)
        args.data_dir.mkdir(parents=True, exist_ok=True)
        snapshots = SnapshotFile(args.data_dir / f"coordinator-{args.id}.snapshot")
        stored = snapshots.load()
        core = CoordinatorCore.from_snapshot(stored)
        who = f"coordinator-{args.id}"
        guard = InboundGuard(log, rt)
        rights = router_rights(rt, session.zk, key, f.REQUEST_RIGHTS, f"logdb-{args.name}-{who}",
                               args.registry_lease_s)
        router = serve_requests(rt, lambda route, frame: driver.on_request(route, frame), guard, args.bind, args.port,
                                rights)

        def send(route: bytes, frame: bytes) -> None:
            router.send_to(route, frame)

        async def save(position: int, data: bytes) -> None:
            await loop.run_in_executor(None, snapshots.save, data)
            publish_gc(session.zk, args.name, who, position)

        def save_snapshot(position: int, data: bytes) -> None:
            loop.create_task(save(position, data))

        path = db_path(args.name)
        driver = CoordinatorDriver(rt, session.election, f"{path}/election", args.id, core, send, save_snapshot,
                                   int(args.snapshot_every * 1e9))
        labels = {"name": args.name, "role": "coordinator", "id": str(args.id)}
        metrics = serve_metrics(args, lambda: driver.metrics(labels))
        log.info("coordinator %d: replaying from gsn %d", args.id, core.position + 1)
        client = await (open_log() if open_log is not None else AsyncClient.connect(args.zk, credentials=credentials))
        session.keep_registered(f"{path}/coordinators/{args.id}",
                                {"addr": advertised(router.addr, args.advertise), "pid": os.getpid()})
        driver.contend()

        return await run_until_stopped(
            stop, [replay(client, core.position + 1, driver, 0.05), _tick(driver),
                   _collect(args, driver, client, session.zk)],
            lambda: f"the log is trimmed past this replica's snapshot (gsn {core.position}): copy a peer's "
                    "snapshot file into its data directory")
    finally:
        if metrics is not None:
            metrics.close()
        if client is not None:
            await client.close()
        session.close()
        await rt.aclose()


async def _tick(driver: CoordinatorDriver) -> None:
    while True:
        await asyncio.sleep(0.1)
        driver.on_tick()


async def _collect(args: argparse.Namespace, driver: CoordinatorDriver, client: Any, zk_client: Any) -> None:
    """Every ``--gc-every`` seconds: every replica learns the collection point (what every
    KV shard and coordinator can replay from: ``collectable``; its outcomes below it may
    go), and the leader trims the log below it."""
    from ziplog.protocol.types import RecordId

    loop = asyncio.get_running_loop()
    trimmed = 0
    while True:
        await asyncio.sleep(args.gc_every)
        try:
            point = await loop.run_in_executor(None, collectable, zk_client, args.name)
            driver.on_collected(point)
            if not driver.leading or not args.gc:
                continue
            if point > trimmed + 1:
                await client.trim(RecordId(point, -1))
                log.info("trimmed the log below gsn %d", point)
                trimmed = point
        except Exception as exc:
            log.warning("collection failed (tried again): %r", exc)


def main(argv: list[str] | None = None, open_log: Callable[[], Awaitable[Any]] | None = None) -> int:
    from ziplog.client.aio import run
    from ziplog.shell.metrics import add_metrics_arguments
    from ziplog.shell.config import parse_args
    from ziplog.shell.logs import add_log_arguments, configure_logging
    from ziplog.shell.process import (
        add_address_arguments,
        add_cluster_key_argument,
        add_security_arguments,
        check_address_arguments,
    )
    ap = argparse.ArgumentParser(prog="python -m ziplog.logdb.coordinator", description=__doc__.split("\n\n")[0])
    ap.add_argument("--zk", required=True, help="ZooKeeper hosts")
    ap.add_argument("--name", default="default", help="the LogDB's name")
    ap.add_argument("--id", type=int, required=True, help="this replica's id")
    ap.add_argument("--kv-shards", type=int, required=True, help="how many KV shards the LogDB has")
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--snapshot-every", type=float, default=SNAPSHOT_NS / 1e9,
                    help="seconds between validator snapshots (a restart replays from the last one)")
    ap.add_argument("--gc-every", type=float, default=GC_EVERY_S, help="seconds between the leader's trims")
    ap.add_argument("--no-gc", dest="gc", action="store_false",
                    help="never trim the log (it is shared with applications that still need old records)")
    add_address_arguments(ap, port_help="port for clients (0: any free one)")
    add_cluster_key_argument(ap)
    add_security_arguments(ap)
    add_metrics_arguments(ap)
    add_log_arguments(ap)
    args = parse_args(ap, argv, "logdb_coordinator")
    check_address_arguments(ap, args)
    configure_logging(args, f"coordinator{args.id}")
    return run(serve(args, open_log))


if __name__ == "__main__":
    sys.exit(main())
