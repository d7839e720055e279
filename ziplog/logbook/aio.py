"""LogBook's asyncio twin: ``ziplog.logbook.aio.AsyncLogBook``, the same calls awaited.

    async with AsyncLogBook(zk_hosts, book_id=7) as lb:
        s = await lb.append(b"hello", tags=["user:42"])
        rec = await lb.read_next(0, tag="user:42")

It drives the same session steps (:mod:`ziplog.logbook.core.session`) as the blocking
:class:`~ziplog.logbook.LogBook`, on an :class:`AsyncEngine`: an ``AsyncClient`` and the
same local index (:class:`~ziplog.logbook.client.EngineState`). Sessions of one event
loop may share an engine (``child()``); lookups of concurrent tasks are serialized on it.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from ziplog.client.aio import AsyncClient
from ziplog.logbook.client import AUX_ENTRIES, CACHE_ENTRIES, RECORD_BYTES, EngineState, LogRecord, SessionBase, choose_mode
from ziplog.cores.app_session import drive_async
from ziplog.logbook.core import session as s
from ziplog.logbook.core.aggregator import Result
from ziplog.logbook.tier import TierLink
from ziplog.protocol.types import RecordId

__all__ = ["AsyncLogBook", "AsyncEngine", "LogRecord"]


class AsyncEngine(EngineState):
    def __init__(self, zk_hosts: str, timeout: float = 30.0, aux_entries: int = AUX_ENTRIES, index: str = "auto",
                 cache_entries: int = CACHE_ENTRIES, key_file: str | None = None,
                 record_bytes: int = RECORD_BYTES) -> None:
        super().__init__(timeout, aux_entries, record_bytes)
        self.zk_hosts = zk_hosts
        self.key_file = key_file
        self.index_mode = index
        self.cache_entries = cache_entries
        self.client: AsyncClient | None = None
        self.sub: Any = None
        self.tier: TierLink | None = None
        #: tier lookups in flight: key -> the future their result sets
        self._waiting: dict[int, asyncio.Future[None]] = {}
        #: one catch-up at a time (the subscription has one reader)
        self._feeding = asyncio.Lock()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        mode = await loop.run_in_executor(None, choose_mode, self.index_mode, self.zk_hosts, self.timeout)
        self.client = await AsyncClient.connect(self.zk_hosts, timeout=self.timeout, key_file=self.key_file)
        try:
            start = self.start_at(await self.client.watermark(), mode, self.cache_entries)
            self.sub = self.client.subscribe(RecordId(start, -1))
            if mode != "local":
                self.tier = await loop.run_in_executor(None, lambda: TierLink(
                    self.client.runtime, self.zk_hosts, "nodes" if mode == "nodes" else "aggregator",  # type: ignore[union-attr]
                    int(self.timeout * 1e9), self.on_result))
        except BaseException:
            await self.client.close()
            raise

    def on_result(self, res: Result) -> None:
        super().on_result(res)
        fut = self._waiting.pop(cast(int, res.key), None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def close(self) -> None:
        if self.tier is not None:
            tier, self.tier = self.tier, None
            tier.close()
        if self.client is not None:
            client, self.client = self.client, None
            await client.close()

    async def catch_up(self, position: int) -> None:
        """Feed the index everything delivered so far, and at least up to ``position``."""
        async with self._feeding:
            sub = self.sub
            while True:
                rec = await sub.next_until(position, self.timeout)
                if self.caught_up(rec, sub.position, position):
                    return

    async def perform(self, op: s.Op) -> Any:
        client = self.client
        assert client is not None, "the engine is not started"
        if type(op) is s.Insert:
            rid = await client.insert_after(op.data, RecordId(*op.after))
            return rid.gsn, rid.shard
        if type(op) is s.ReadRecord:
            return await client.read_record(RecordId(*op.rid))
        assert type(op) is s.Lookup
        await self.catch_up(max(op.min_cut, self.floor))
        got = self.answer(op)
        if got is not None:
            return got
        assert self.tier is not None
        fut = asyncio.get_running_loop().create_future()
        key = self.ask_tier(self.tier, op)
        self._waiting[key] = fut
        await fut
        return self.take(key, op)


class AsyncLogBook(SessionBase):
    """A session on book ``book_id``: ``async with AsyncLogBook(zk_hosts, book_id)`` (or
    ``await AsyncLogBook.connect(...)``)."""

    def __init__(self, zk_hosts: str, book_id: int, *, timeout: float = 30.0, index: str = "auto",
                 key_file: str | None = None, _engine: AsyncEngine | None = None, _position: int = 0) -> None:
        super().__init__(book_id, _engine if _engine is not None else AsyncEngine(zk_hosts, timeout, index=index,
                                                                                 key_file=key_file),
                         _engine is None, _position)
        self._engine: AsyncEngine

    @classmethod
    async def connect(cls, zk_hosts: str, book_id: int, **kw: Any) -> "AsyncLogBook":
        lb = cls(zk_hosts, book_id, **kw)
        await lb.__aenter__()
        return lb

    async def __aenter__(self) -> "AsyncLogBook":
        if self._own_engine and self._engine.client is None:
            await self._engine.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_engine:
            await self._engine.close()

    def child(self) -> "AsyncLogBook":
        """A session on the same book and engine that starts at this one's position."""
        return AsyncLogBook("", self.book_id, **self._child_args())

    async def _drive(self, steps: s.Steps) -> Any:
        return await drive_async(steps, self._engine.perform)

    async def append(self, data: bytes, tags: "list[int | str] | tuple[int | str, ...]" = ()) -> int:
        result: int = await self._drive(s.append(self._pos, self.book_id, data, tags))
        return result

    async def read_next(self, min_seqnum: int, tag: int | str | None = None, *,
                        gapless: bool = False) -> LogRecord | None:
        return self._engine.with_aux(await self._drive(s.read(self._pos, "next", self.book_id, tag, min_seqnum,
                                                                gapless)))

    async def read_prev(self, max_seqnum: int, tag: int | str | None = None) -> LogRecord | None:
        return self._engine.with_aux(await self._drive(s.read(self._pos, "prev", self.book_id, tag, max_seqnum)))

    async def check_tail(self, tag: int | str | None = None) -> LogRecord | None:
        return await self.read_prev(s.MAX_SEQNUM, tag)

    async def trim(self, trim_seqnum: int) -> None:
        await self._drive(s.trim(self._pos, self.book_id, trim_seqnum))

    async def set_aux_data(self, seqnum: int, aux: bytes) -> None:
        self._engine.set_aux(seqnum, bytes(aux))
