"""The LogBook index tier's aggregator: ``python -m ziplog.logbook.aggregator --zk HOSTS``.

Engines send it a ``Lookup`` at their session's position; it asks every index node of
the assignment at one common cut and answers with the smallest (read_next) or largest
(read_prev) hit (:class:`~ziplog.logbook.core.aggregator.AggregatorCore`, driven by
:class:`~ziplog.logbook.tier.AskDriver`). It keeps nothing: any number may run, each
registered at ``/ziplog/logbook/tier/aggregators/<pid>@<host>``.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import Any, cast

from ziplog.logbook.core import frames as f
from ziplog.logbook.core.aggregator import AggregatorCore, Result
from ziplog.logbook.index_node import forbidden, internal
from ziplog.logbook.tier import AskDriver, node_sources
from ziplog.shell.rights import Refusal

log = logging.getLogger("ziplog.logbook.aggregator")

#: a lookup the nodes do not answer within this long fails BEHIND (the engine asks again)
TIMEOUT_NS = 10_000_000_000


class AggregatorFrontend:
    """Engines' frames in, the tier's results out to them."""

    def __init__(self, ask: AskDriver, send: Any, refuse: Refusal | None = None) -> None:
        self.ask = ask
        self.send = send
        #: under CURVE: why a route may not make a request (its key's rights)
        self.refuse = refuse

    def on_frame(self, route: bytes, frame: bytes) -> None:
        try:
            req = f.decode_request(frame)
        except f.BadFrame as exc:
            self.send(route, f.encode(f.Failed(req=0, code=f.BAD_REQUEST, message=f"malformed request: {exc}")))
            return
        if type(req) is f.Lookup or type(req) is f.Status:
            if forbidden(self.refuse, route, req, self._failed):
                return
        if type(req) is f.Lookup:
            self.ask.lookup((route, req.req), req.how, req.book, req.tag, req.seqnum, req.cut, req.exact, req.record)
        elif type(req) is f.Status:
            core = self.ask.core
            self.send(route, f.encode(f.NodeState(req=req.req, node=0, watermark=min(core.watermarks, default=0),
                                                  floor=0, size=0, nodes=len(core.sources))))
        else:
            self.send(route, f.encode(f.Failed(req=0, code=f.BAD_REQUEST, message="an aggregator serves Lookup and Status")))

    def _failed(self, route: bytes, req: int, code: str, message: str) -> None:
        self.send(route, f.encode(f.Failed(req=req, code=code, message=message)))

    def on_multipart(self, route: bytes, parts: int) -> None:
        self.send(route, f.encode(f.Failed(req=0, code=f.BAD_REQUEST, message=f"a request is one frame, got {parts}")))

    def on_result(self, res: Result) -> None:
        route, req = cast(tuple[bytes, int], res.key)
        if res.error is not None:
            self.send(route, f.encode(f.Failed(req=req, code=res.error, message=res.message)))
            return
        hit = res.hit
        self.send(route, f.encode(f.Found(req=req, cut=res.cut, found=hit is not None, gsn=hit.gsn if hit else 0,
                                          shard=hit.shard if hit else 0, trim_point=res.trim_point,
                                          watermark=res.cut, trimmed_top=res.trimmed_top, record=res.record)))


async def serve(args: argparse.Namespace) -> int:
    from ziplog.io.zk_logbook import AGGREGATORS, TierDirectory
    from ziplog.logbook.process import tier_process
    from ziplog.shell.inbound import InboundGuard
    from ziplog.shell.rights import router_rights
    from ziplog.protocol.addresses import advertised

    async with tier_process(args) as (key, session, stop, rt):
        front: AggregatorFrontend
        ask = AskDriver(rt, rt, AggregatorCore(TIMEOUT_NS), lambda res: front.on_result(res))
        routers: list[Any] = []
        rights = router_rights(rt, session.zk, key, f.REQUEST_RIGHTS, "logbook-aggregator", args.registry_lease_s)
        front = AggregatorFrontend(ask, lambda route, frame: routers[0].send_to(route, frame),
                                   None if rights is None else rights.refusal)
        directories: list[TierDirectory] = []

        def refresh() -> None:
            ask.set_sources(node_sources(directories[0]))

        directories.append(TierDirectory(session.zk, lambda: rt.call_soon_threadsafe(refresh)))
        refresh()
        guard = InboundGuard(log, rt)
        router = rt.router(guard.routed("the aggregator's ROUTER", front.on_frame,
                                        internal(lambda r, d: routers[0].send_to(r, d))), front.on_multipart, args.bind,
                           args.port, max_bytes=f.ANSWER_LIMIT)
        routers.append(router)
        if rights is not None:
            rights.bind(router)
        session.keep_registered(f"{AGGREGATORS}/{os.getpid()}@{socket.gethostname()}",
                                {"addr": advertised(router.addr, args.advertise), "pid": os.getpid()})
        log.info("aggregator serving at %s (advertised: %s)", router.addr, advertised(router.addr, args.advertise))
        await stop.wait()
        return 0


def main(argv: list[str] | None = None) -> int:
    from ziplog.logbook.process import parse_tier_args
    from ziplog.shell.logs import configure_logging
    ap = argparse.ArgumentParser(prog="python -m ziplog.logbook.aggregator", description=__doc__.split("\n\n")[0])
    ap.add_argument("--zk", required=True, help="ZooKeeper hosts")
    args = parse_tier_args(ap, argv, "aggregator", serves=True)
    configure_logging(args, "aggregator")
    from ziplog.client.aio import run
    return run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
