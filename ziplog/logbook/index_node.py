"""A LogBook index node: ``python -m ziplog.logbook.index_node --zk HOSTS --node I``.

:class:`IndexNodeDriver` is the thin driver over :class:`~ziplog.logbook.core.node.NodeCore`:
frames in on one ROUTER (the feeder's sealed Feeds; anyone's Lookups and Status), frames
out to their senders. The process registers its address at
``/ziplog/logbook/tier/nodes/<I>`` and keeps its index in memory only: a restarted node
is fed again from the start of the log by the feeder and answers as before.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Callable

from ziplog.cores.effects import Messages
from ziplog.logbook.core import frames as f
from ziplog.logbook.core.kept import KEEP_BYTES
from ziplog.logbook.core.node import NodeCore
from ziplog.protocol.auth import ClusterKey
from ziplog.shell.rights import Refusal

log = logging.getLogger("ziplog.logbook.index_node")

#: parked lookups are looked at this often
TICK_S = 0.1


class IndexNodeDriver:
    def __init__(self, core: NodeCore, key: ClusterKey, send: Callable[[bytes, bytes], object],
                 now: Callable[[], int], refuse: Refusal | None = None) -> None:
        self.core = core
        self.key = key
        self.send = send
        self.now = now
        #: under CURVE: why a route may not make a request (its key's rights)
        self.refuse = refuse
        #: frames refused, by error code
        self.refused: dict[str, int] = {}

    def on_frame(self, route: bytes, frame: bytes) -> None:
        try:
            req = f.decode_request(frame)
        except f.BadFrame as exc:
            if f.claims_authority(frame):  # authority first: nothing it holds is judged
                self._refuse(route, 0, f.UNAUTHENTICATED, "a Feed is taken only in a Signed that is exactly "
                             "[2, frame:bin, mac:bin], with the cluster's MAC")
            else:
                self._refuse(route, 0, f.BAD_REQUEST, f"malformed request: {exc}")
            return
        now = self.now()
        if type(req) is f.Signed:
            if not self.key.verify(req.frame, req.mac):
                self._refuse(route, 0, f.UNAUTHENTICATED, "the seal does not check with the cluster key")
                return
            try:
                feed = f.decode_feed(req.frame)
            except f.BadFrame as exc:
                self._refuse(route, 0, f.BAD_REQUEST, f"a sealed frame that is not a Feed: {exc}")
                return
            self._perform(self.core.on_feed(route, feed, now))
        elif type(req) is f.Feed:
            self._refuse(route, 0, f.UNAUTHENTICATED, "a Feed is taken only sealed by a cluster member")
        else:
            assert type(req) is f.Lookup or type(req) is f.Status
            if forbidden(self.refuse, route, req, self._refuse):
                return
            if type(req) is f.Lookup:
                self._perform(self.core.on_lookup(route, req, now))
            else:
                self.send(route, f.encode(self.core.status(req.req)))

    def on_multipart(self, route: bytes, parts: int) -> None:
        self._refuse(route, 0, f.BAD_REQUEST, f"a request is one frame, got {parts}")

    def tick(self) -> None:
        self._perform(self.core.tick(self.now()))

    def _refuse(self, route: bytes, req: int, code: str, message: str) -> None:
        self.refused[code] = self.refused.get(code, 0) + 1
        self.send(route, f.encode(f.Failed(req=req, code=code, message=message)))

    def _perform(self, messages: Messages) -> None:
        for route, frame in messages:
            assert type(route) is bytes
            self.send(route, f.encode(frame))


def forbidden(refuse: Refusal | None, route: bytes, req: f.Lookup | f.Status,
              answer: Callable[[bytes, int, str, str], None]) -> bool:
    """Whether ``req`` was refused: answered FORBIDDEN when its sender's key lacks the
    right it needs (:data:`~ziplog.logbook.core.frames.REQUEST_RIGHTS`), BUSY (ask again)
    while this server's registry lease has lapsed (:mod:`ziplog.shell.rights`)."""
    why = None if refuse is None else refuse(route, req)
    if why is None:
        return False
    answer(route, req.req, f.BUSY if why.lapsed else f.FORBIDDEN, why.why)
    return True


def internal(send: Callable[[bytes, bytes], object]) -> Callable[[bytes, bytes, Exception], None]:
    """The answer to a frame whose handling failed (the process goes on serving)."""
    def reply(route: bytes, frame: bytes, exc: Exception) -> None:
        send(route, f.encode(f.Failed(req=0, code=f.INTERNAL, message=f"{type(exc).__name__} while handling the frame")))
    return reply


async def serve(args: argparse.Namespace) -> int:
    import asyncio

    from ziplog.io.zk_logbook import NODES
    from ziplog.logbook.process import tier_process
    from ziplog.shell.inbound import InboundGuard
    from ziplog.shell.rights import router_rights
    from ziplog.protocol.addresses import advertised

    async with tier_process(args) as (key, session, stop, rt):
        core = NodeCore(args.node, keep_bytes=args.keep_record_bytes)
        rights = router_rights(rt, session.zk, key, f.REQUEST_RIGHTS, f"logbook-index{args.node}",
                               args.registry_lease_s)
        driver = IndexNodeDriver(core, key, lambda route, frame: router.send_to(route, frame), time.monotonic_ns,
                                 None if rights is None else rights.refusal)
        guard = InboundGuard(log, rt)
        router = rt.router(guard.routed("the index node's ROUTER", driver.on_frame, internal(lambda r, d: router.send_to(r, d))),
                           driver.on_multipart, args.bind,
                           args.port, max_bytes=f.REQUEST_LIMIT)
        if rights is not None:
            rights.bind(router)
        session.keep_registered(f"{NODES}/{args.node}",
                                {"addr": advertised(router.addr, args.advertise), "pid": os.getpid()})
        log.info("index node %d serving at %s", args.node, router.addr)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), TICK_S)
            except asyncio.TimeoutError:
                rt.turn(driver.tick)
        return 0


def main(argv: list[str] | None = None) -> int:
    from ziplog.logbook.process import parse_tier_args
    from ziplog.shell.logs import configure_logging
    ap = argparse.ArgumentParser(prog="python -m ziplog.logbook.index_node", description=__doc__.split("\n\n")[0])
    ap.add_argument("--zk", required=True, help="ZooKeeper hosts")
    ap.add_argument("--node", type=int, required=True, help="this index node's number, 0..N-1")
    ap.add_argument("--keep-record-bytes", type=int, default=KEEP_BYTES,
                    help="the bytes of its newest entries' records the node keeps to answer lookups with (0: none)")
    args = parse_tier_args(ap, argv, "index_node", serves=True)
    if args.node < 0:
        ap.error("--node must be 0 or more")
    if args.keep_record_bytes < 0:
        ap.error("--keep-record-bytes must be 0 or more")
    configure_logging(args, f"index-node{args.node}")
    from ziplog.client.aio import run
    return run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
