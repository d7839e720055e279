"""The LogBook index tier's feeder: ``python -m ziplog.logbook.feeder --zk HOSTS``.

One subscription of the log, routed to the index nodes by
:class:`~ziplog.logbook.core.feeder.FeederCore`: each entry to the node of its epoch,
every trim to all, each batch closed by the subscription's position. Feeds are sealed
with the cluster key (they decide what the nodes answer). The feeder keeps no state of
its own: a restarted feeder asks the nodes where they are and reads from the lowest of
their watermarks; a second feeder running at once changes no answer (nodes skip what
they have). It also turns a larger wanted node count (``/ziplog/logbook/tier``) into a
new step of the assignment history.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from typing import Any, cast

from ziplog.cores.effects import Messages
from ziplog.logbook.core import frames as f
from ziplog.logbook.core.feeder import FeederCore
from ziplog.protocol.auth import ClusterKey

log = logging.getLogger("ziplog.logbook.feeder")

#: records routed in one batch at most
BATCH = 4096
#: the feeder looks at its links, and the idle log's position, this often
IDLE_S = 0.05


class FeederDriver:
    """Sends the core's Feeds (sealed) and Status requests; hands it the nodes' answers,
    the directory's changes and what the log reader read; tells the reader what to do
    next (:meth:`next_action`). The process runs it on asyncio with a subscription as
    the reader; the simulation on a scripted log."""

    def __init__(self, core: FeederCore, key: ClusterKey, net: Any, now: Any) -> None:
        self.core = core
        self.key = key
        self.net = net
        self.now = now
        self.conns: dict[str, Any] = {}
        #: set when a node answers (the feeder may go on when it was paused)
        self.answered = asyncio.Event()
        #: the reader has a position to read from
        self.reading = False

    def on_directory(self, nodes: dict[int, str], wanted: int) -> None:
        """The nodes registered now and the node count wanted."""
        self.perform(self.core.on_nodes(nodes, self.now()))
        self.core.on_desired(wanted)

    def next_action(self) -> tuple[str, Any]:
        """``("assign", w)``: write the assignment ``w`` to ZooKeeper first (then
        :meth:`FeederCore.on_assignment_written`); ``("wait", 0)``: nothing to read now
        (not started, or paused: wait for an answer); ``("open", g)``: read the log again
        from after gsn ``g``; ``("read", 0)``: read on, then :meth:`on_read`."""
        self.perform(self.core.tick(self.now()))
        start = self.core.start()
        write = self.core.growth()
        if write is not None:
            return "assign", write
        if start is None or self.core.paused:
            return "wait", 0
        if not self.reading or self.core.rewind_to is not None:
            self.reading = True
            return "open", self.core.rewound() if self.core.rewind_to is not None else start
        return "read", 0

    def on_read(self, batch: list[tuple[int, int, bytes]], position: int) -> None:
        """Records read (gsn order) and the reader's position after them."""
        if batch or position > (self.core.position or 0):
            self.perform(self.core.on_batch(batch, position, self.now()))

    def perform(self, messages: Messages) -> None:
        live = {link.addr for link in self.core.links.values()}
        for addr in [a for a in self.conns if a not in live]:
            self.conns.pop(addr).close()
        for dest, frame in messages:
            addr = cast(tuple[str], dest)[0]
            data = f.encode(frame)
            if type(frame) is f.Feed:
                data = f.encode(f.Signed(frame=data, mac=self.key.mac(data)))
            conn = self.conns.get(addr)
            if conn is None:
                conn = self.conns[addr] = self.net.dealer(addr, self.on_answer, "logbook-feed", f.ANSWER_LIMIT)
            conn.send(data)

    def on_answer(self, frame: bytes) -> None:
        try:
            ans = f.decode_answer(frame)
        except f.BadFrame:
            return
        now = self.now()
        if type(ans) is f.Fed:
            self.core.on_fed(ans, now)
        elif type(ans) is f.NodeState:
            self.perform(self.core.on_state(ans, now))
        elif type(ans) is f.Failed:
            log.error("an index node refused a feed: %s %s", ans.code, ans.message)
        self.answered.set()


async def serve(args: argparse.Namespace) -> int:
    from ziplog.client.aio import AsyncClient
    from ziplog.io.zk_logbook import TierDirectory, read_assignment, write_assignment
    from ziplog.logbook.process import tier_process
    from ziplog.protocol.types import RecordId

    async with tier_process(args) as (key, session, stop, rt):
        loop = asyncio.get_running_loop()
        client = None
        sub: Any = None
        now = time.monotonic_ns
        try:
            history, version = read_assignment(session.zk)
            core = FeederCore(history, version, record_max=args.record_max_bytes)
            driver = FeederDriver(core, key, rt, now)
            changed = asyncio.Event()
            directory = TierDirectory(session.zk, lambda: _set_soon(loop, changed))
            client = await AsyncClient.connect(args.zk, credentials=rt.credentials)
            log.info("feeder up; assignment %s", history)
            while not stop.is_set():
                if changed.is_set():
                    changed.clear()
                    rt.turn(lambda: driver.on_directory(directory.nodes(), directory.wanted))
                actions: list[tuple[str, Any]] = []
                rt.turn(lambda: actions.append(driver.next_action()))
                what, frm = actions[0]
                if what == "assign":
                    got = await loop.run_in_executor(None, write_assignment, session.zk, frm.history, frm.version)
                    core.on_assignment_written(*got)
                    log.info("index nodes added: assignment %s", got[0])
                    continue
                if what == "wait":
                    driver.answered.clear()
                    await _first(stop, changed, driver.answered, IDLE_S)
                    continue
                if what == "open":
                    if sub is not None:
                        await sub.aclose()
                        log.info("reading the log again from gsn %d (rewind %d)", frm + 1, core.rewinds)
                    sub = client.subscribe(RecordId(frm + 1, -1))
                rec = await sub.next(timeout=IDLE_S)
                batch: list[tuple[int, int, bytes]] = []
                while rec is not None:
                    batch.append((rec.rid.gsn, rec.rid.shard, rec.data))
                    if len(batch) >= BATCH:
                        break
                    rec = await sub.next(timeout=0)
                position = max(sub.position, batch[-1][0]) if batch else sub.position
                rt.turn(lambda: driver.on_read(batch, position))
            return 0
        finally:
            if client is not None:
                await client.close()


def _set_soon(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
    """Set ``event`` on ``loop`` from another thread (a ZooKeeper watch)."""
    loop.call_soon_threadsafe(event.set)


async def _first(*waits: Any) -> None:
    """Until one of the events is set, or the timeout (the last argument) passed."""
    *events, timeout = waits
    tasks = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def main(argv: list[str] | None = None) -> int:
    from ziplog.logbook.process import parse_tier_args
    from ziplog.shell.logs import configure_logging
    ap = argparse.ArgumentParser(prog="python -m ziplog.logbook.feeder", description=__doc__.split("\n\n")[0])
    ap.add_argument("--zk", required=True, help="ZooKeeper hosts")
    ap.add_argument("--record-max-bytes", type=int, default=f.RECORD_IN_ANSWER_MAX,
                    help=("an entry's record of at most this many bytes goes to its index node with it, which "
                          f"answers lookups with it (0: none; at most {f.RECORD_IN_ANSWER_MAX})"))
    args = parse_tier_args(ap, argv, "feeder", serves=False)
    if not 0 <= args.record_max_bytes <= f.RECORD_IN_ANSWER_MAX:
        ap.error(f"--record-max-bytes is in 0..{f.RECORD_IN_ANSWER_MAX}")
    configure_logging(args, "feeder")
    from ziplog.client.aio import run
    return run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
