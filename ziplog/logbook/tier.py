"""Asking the index tier over the ports: the thin driver over
:class:`~ziplog.logbook.core.aggregator.AggregatorCore` that the aggregator process runs
(its sources: the index nodes) and an engine runs (its source: an aggregator, or the
nodes themselves). One DEALER per source address; answers are routed to the core by
the address they came from; a timer asks again what went unanswered.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Hashable, cast

from ziplog.cores.effects import Messages
from ziplog.io import zk
from ziplog.io.ports import Connector, Endpoint, Runtime, Timer
from ziplog.io.zk_logbook import TierDirectory
from ziplog.logbook.core import frames as f
from ziplog.logbook.core.aggregator import AggregatorCore, Result

#: the driver looks at what is unanswered this often while lookups are in flight
TICK_NS = 100_000_000


class AskDriver:
    def __init__(self, rt: Runtime, net: Connector, core: AggregatorCore,
                 on_result: Callable[[Result], None]) -> None:
        self.rt = rt
        self.net = net
        self.core = core
        self.on_result = on_result
        self.conns: dict[str, Endpoint] = {}
        self._timer: Timer | None = None
        self.closed = False

    def set_sources(self, addrs: list[str | None]) -> None:
        """The sources now (closing connections to addresses no longer among them)."""
        live = {a for a in addrs if a is not None}
        for addr in [a for a in self.conns if a not in live]:
            self.conns.pop(addr).close()
        self._perform(self.core.set_sources(addrs, self.rt.now()), [])

    def lookup(self, key: Hashable, how: int, book: int, tag: int | None, seqnum: int, min_cut: int,
               exact: bool = False, record: bool = False) -> None:
        """Start a lookup; its :class:`Result` comes to ``on_result``."""
        self._perform(*self.core.lookup(key, how, book, tag, seqnum, min_cut, self.rt.now(), exact, record))
        self._arm()

    def close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()

    def _perform(self, messages: Messages, results: list[Result]) -> None:
        for dest, frame in messages:
            addr = cast(tuple[str], dest)[0]
            self._conn(addr).send(f.encode(frame))
        for res in results:
            self.on_result(res)

    def _conn(self, addr: str) -> Endpoint:
        conn = self.conns.get(addr)
        if conn is None:
            conn = self.conns[addr] = self.net.dealer(addr, lambda frame: self._on_frame(addr, frame), "logbook-tier",
                                                      f.ANSWER_LIMIT)
        return conn

    def _on_frame(self, addr: str, frame: bytes) -> None:
        try:
            ans = f.decode_answer(frame)
        except f.BadFrame:
            return  # a broken answer: the source is asked again on the next tick
        try:
            source = self.core.sources.index(addr)
        except ValueError:
            return  # from a source no longer asked
        self._perform(*self.core.on_answer(source, ans, self.rt.now()))

    def _arm(self) -> None:
        if self._timer is None and not self.closed and self.core.pending:
            self._timer = self.rt.call_at(self.rt.now() + TICK_NS, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if self.closed:
            return
        self._perform(*self.core.tick(self.rt.now()))
        self._arm()


def node_sources(directory: Any) -> list[str | None]:
    """The assignment's nodes, by number, at the addresses registered now."""
    nodes = directory.nodes()
    return [nodes.get(i) for i in range(directory.node_count())]


class TierLink:
    """An engine's way to the tier: its own ZooKeeper view of where the tier is, and an
    :class:`AskDriver` on the engine's runtime whose sources are one aggregator
    (``via="aggregator"``) or every index node (``via="nodes"``: the engine aggregates)."""

    def __init__(self, rt: Any, zk_hosts: str, via: str, timeout_ns: int,
                 on_result: Callable[[Result], None]) -> None:
        if via not in ("aggregator", "nodes"):
            raise ValueError(f"the tier is asked via 'aggregator' or 'nodes', not {via!r}")
        self.via = via
        self.rt = rt
        #: which aggregator this engine asks (engines spread over them)
        self._pick = random.randrange(1 << 30)
        self.zk = zk.connect(zk_hosts, timeout=timeout_ns / 1e9)
        try:
            self.ask = AskDriver(rt, rt, AggregatorCore(timeout_ns), on_result)
            self.directory = TierDirectory(self.zk, lambda: rt.call_soon_threadsafe(self._refresh))
            self._refresh()
        except BaseException:
            zk.stop(self.zk)
            raise

    def _sources(self) -> list[str | None]:
        if self.via == "nodes":
            return node_sources(self.directory)
        aggregators = self.directory.aggregators()
        return [aggregators[self._pick % len(aggregators)] if aggregators else None]

    def _refresh(self) -> None:
        if not self.ask.closed:
            self.ask.set_sources(self._sources())

    def lookup(self, key: Hashable, how: str, book: int, tag: int | None, seqnum: int, min_cut: int,
               record: bool = False) -> None:
        self.ask.lookup(key, f.NEXT if how == "next" else f.PREV, book, tag, seqnum, min_cut, record=record)

    def close(self) -> None:
        self.ask.close()
        zk.stop(self.zk)
