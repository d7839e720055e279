"""What the coordinator and KV shard processes share around their drivers: the ROUTER
clients talk to (on the process's runtime), the loop that feeds the log's records and
positions to a driver, and running the process's tasks until a signal or a failure."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Iterable, Protocol

from ziplog.io.ports import Router
from ziplog.shell.inbound import InboundGuard
from ziplog.shell.rights import RouterRights
from ziplog.logdb.core import frames as f
from ziplog.protocol.errors import TrimmedError
from ziplog.protocol.types import RecordId

if TYPE_CHECKING:
    from ziplog.client.driver import Record

log = logging.getLogger("ziplog.logdb")


class Replayer(Protocol):
    def on_record(self, gsn: int, shard: int, data: bytes) -> None: ...

    def on_position(self, gsn: int) -> None: ...


def serve_requests(rt: Any, handle: Callable[[bytes, bytes], None], guard: InboundGuard,
                   host: str = "127.0.0.1", port: int = 0, rights: RouterRights | None = None) -> Router:
    """Bind the clients' ROUTER on the process's runtime (``port`` 0: any free one): each
    request is one frame after its route, handled under ``guard`` (a failure answers the
    sender INTERNAL and the process goes on); a message of more parts is answered
    BAD_REQUEST. ``handle`` answers through the returned router's ``send_to``. Under
    CURVE (``rights``), a request whose sender's key lacks its right
    (:data:`~ziplog.logdb.core.frames.REQUEST_RIGHTS`) is answered FORBIDDEN before it
    reaches ``handle``, and every client key's request BUSY while the server's registry
    lease has lapsed (:mod:`ziplog.shell.rights`)."""
    router: Router | None = None

    def judged(route: bytes, frame: bytes) -> None:
        if rights is not None:
            try:
                req: f.Request | None = f.decode_request(frame)
            except f.BadFrame:
                req = None  # the handler answers it BAD_REQUEST
            why = None if req is None else rights.refusal(route, req)
            if why is not None:
                assert router is not None and req is not None
                code = f.BUSY if why.lapsed else f.FORBIDDEN  # a lapsed lease: ask again (another server)
                router.send_to(route, f.encode(f.Failed(req=req.req, code=code, message=why.why)))
                return
        handle(route, frame)

    def internal(route: bytes, frame: bytes, exc: Exception) -> None:
        assert router is not None
        router.send_to(route, f.encode(f.Failed(req=_req_of(frame), code=f.INTERNAL,
                                                message=f"{type(exc).__name__} while handling the request")))

    def multipart(route: bytes, parts: int) -> None:
        assert router is not None
        router.send_to(route, f.encode(f.Failed(req=0, code=f.BAD_REQUEST,
                                                message=f"a request is one frame, got {parts}")))

    router = rt.router(guard.routed("the clients' ROUTER", judged, internal), multipart, host, port,
                       max_bytes=f.REQUEST_LIMIT)
    if rights is not None:
        rights.bind(router)
    return router


def _req_of(frame: bytes) -> int:
    try:
        return f.decode_request(frame).req
    except f.BadFrame:
        return 0


async def replay(log_client: Any, first_gsn: int, driver: Replayer, idle_s: float,
                 turn_end: Callable[[], object] = lambda: None, paused: Callable[[], bool] = lambda: False,
                 retry_s: float = 0.2) -> None:
    """Feed ``driver`` the log from ``first_gsn`` on, for good: every record, then the
    subscription's position, then ``turn_end``, per batch (or every ``idle_s`` when the
    log is idle). While ``paused()`` no more is read (``turn_end`` is tried every
    ``retry_s``)."""
    async with log_client.subscribe(RecordId(first_gsn, -1)) as sub:
        while True:
            while paused():
                await asyncio.sleep(retry_s)
                turn_end()
            batch: list[Record] = []
            rec = await sub.next(timeout=idle_s)
            while rec is not None:  # what the subscription holds now: at most its credit's worth
                batch.append(rec)
                rec = await sub.next(timeout=0)
            feed(driver, batch, sub.position, turn_end)


def feed(driver: Replayer, records: Iterable[Record], position: int, turn_end: Callable[[], object]) -> None:
    """One batch of the log to ``driver``: every record in gsn order, then the
    subscription's position (every gsn up to it is delivered), then the turn's end (where
    the driver writes and answers). The processes' replay and the simulation's both feed
    their drivers with it."""
    for rec in records:
        driver.on_record(rec.rid.gsn, rec.rid.shard, rec.data)
    driver.on_position(position)
    turn_end()


async def run_until_stopped(stop: asyncio.Event, bodies: list[Coroutine[Any, Any, None]],
                            when_trimmed: Callable[[], str]) -> int:
    """Run the process's tasks until ``stop`` is set (0) or one of them fails: the log
    trimmed past where it must replay from is logged with ``when_trimmed()`` (2); any
    other failure is raised."""
    tasks = [asyncio.create_task(b) for b in bodies]
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([*tasks, waiter], return_when=asyncio.FIRST_COMPLETED)
    for t in [*tasks, waiter]:
        t.cancel()
    for t in done:
        exc = None if t is waiter else t.exception()
        if isinstance(exc, TrimmedError):
            log.error("%s", when_trimmed())
            return 2
        if exc is not None:
            raise exc
    return 0
