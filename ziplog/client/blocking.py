"""The blocking client: ``ziplog.Client``.

InsertAfter (dissertation 4.2.4): the record goes to every replica of one shard; each
answers with the gsn it assigned. The primary's answer is the decision; the insert is
done once every backup's latest answer equals it. When the backups' first answers
already equal it, that was the two-message-delay fast path; otherwise a backup re-acked
after the primary's forward (slow path).

A thin façade: the protocol is the client core (``ziplog.cores.client``), driven by
:class:`~ziplog.client.driver.ClientDriver` on a :class:`ZmqRuntime` that runs only while
a call of this client waits.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any, Callable, Iterator, Sequence

from ziplog.client.common import (
    INSERT_WINDOW,
    ClientBase,
    SubscriptionBase,
    new_client_id,
    payloads_of,
)
from ziplog.client.driver import ClientDriver, Record, SubscriptionDriver
from ziplog.cores.client.calls import Call
from ziplog.cores.client.state import NS_PER_S, ClientState
from ziplog.cores.client.watermark import RangePager, WatermarkQuery
from ziplog.io import zk
from ziplog.io.keys import client_credentials
from ziplog.io.ports import wall_offset_ns
from ziplog.io.zmq_runtime import ZmqRuntime
from ziplog.io.zmtp_poll import native_transport_wanted
from ziplog.protocol import frames as wire
from ziplog.protocol.keys import Credentials
from ziplog.protocol.errors import (
    ClientClosedError,
    NoShardAvailableError,
    ZiplogError,
    ZiplogTimeoutError,
)
from ziplog.protocol.topology import TopologyView
from ziplog.protocol.types import RID_GENESIS, Policy, RecordId

__all__ = ["Client", "Record", "Subscription"]


class Client(ClientBase):
    """A ziplog client. Thread-compatible, not thread-safe: use one per thread."""

    def __init__(self, zk_hosts: str, *, timeout: float = 30.0, policy: Policy | None = None,
                 client_id: int | None = None, key_file: str | os.PathLike[str] | None = None,
                 credentials: Credentials | None = None) -> None:
        """``key_file``: the client key (``ziplog client add``) for a cluster that speaks
        CURVE; default: the file ``$ZIPLOG_CLIENT_KEY_FILE`` names, else none (NULL).
        ``credentials``: the keys themselves instead (a cluster's own tools connect with
        the cluster's key pair, which holds every right)."""
        if credentials is None:
            credentials = client_credentials(key_file)
        zk_session = zk.connect(zk_hosts)
        topology = zk.Topology(zk_session)
        self._start(zk_session, topology, timeout, policy, client_id, credentials)
        topology.on_change(lambda: self._rt.call_soon_threadsafe(self._driver.on_topology))
        if not topology.wait(lambda: bool(topology.live_shards()), timeout):
            self.close()
            raise NoShardAvailableError("no live shard appeared in ZooKeeper")

    @classmethod
    def direct(cls, replicas: dict[int, Sequence[str]], *, timeout: float = 30.0,
               key_file: str | os.PathLike[str] | None = None) -> "Client":
        """A client of the named replicas only (shard -> its replicas' addresses, the
        primary first), with no ZooKeeper session: for reads where the caller knows where
        a shard lives (a Spark task, from its plan). ``read_range``, ``count_range`` and
        ``read_record`` of those shards work; a replica that does not answer is passed
        over for the next, and none answering is a ZiplogTimeoutError after ``timeout``."""
        topology = TopologyView()
        topology.replicas = {s: dict(enumerate(addrs)) for s, addrs in replicas.items()}
        topology.replica_counts = {s: len(addrs) for s, addrs in replicas.items()}
        topology.changed()
        client = cls.__new__(cls)
        client._start(None, topology, timeout, None, None, client_credentials(key_file))
        return client

    def _start(self, zk_session: Any, topology: TopologyView, timeout: float, policy: Policy | None,
               client_id: int | None, credentials: Credentials | None) -> None:
        self.timeout = timeout
        self._closed = False
        self._zk = zk_session
        self.topology = topology
        # It runs only while a call waits, reading one reply per replica per turn (no
        # batches to drain). Its wake-up socket lets ZooKeeper's thread end a call's wait
        # when the topology moves (a replica restarted at a new address, a shard back
        # from recovery): without it the call saw the change only when its poll timed
        # out, up to MAX_WAIT_MS later, and a restart stalled the writer that much longer.
        self._rt = ZmqRuntime(wake=True, drain_limit=1, native=native_transport_wanted(), credentials=credentials)
        self._state = ClientState(client_id if client_id is not None else new_client_id(), policy, random.Random(),
                                  int(timeout * 1e9), wall_offset_ns=wall_offset_ns())
        self._driver = ClientDriver(self._rt, self._rt, self.topology, self._state)
        self._subs: list[Subscription] = []

    def live_shards(self) -> list[int]:
        """Shards in the current membership with every replica up."""
        return list(self.topology.live_shards())

    # -- lifecycle --------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sub in list(self._subs):
            sub.close()
        self._driver.close()
        self._rt.close()
        if self._zk is not None:
            zk.stop(self._zk)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosedError("client is closed")

    def _wait(self, call: Call) -> Any:
        """Turn the runtime until ``call`` is done, listening to the replicas it waits on."""
        driver = self._driver
        rt = self._rt
        # A native runtime polls every connection whatever it is told (no focus to build).
        rt.run_until(lambda: call.done, None, None if rt.native else lambda: driver.endpoints_of(call))
        return call.result()

    # -- the calls --------------------------------------------------------------------------------
    def insert_after(self, data: bytes, after: RecordId = RID_GENESIS, *, key: bytes | None = None) -> RecordId:
        """Insert ``data`` somewhere after record ``after``; returns its record id, whose
        gsn is greater than ``after.gsn``. Raises ``ReusedIdentityError`` (the record is
        already in the log, at its ``rid``) if a replica answers a gsn not above it: this
        client's id was used before, and this record's sequence number placed after
        another rid."""
        self._check_open()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError("data must be bytes")
        rid: RecordId = self._wait(self._driver.insert(bytes(data), max(after.gsn, 0), key))
        assert rid.gsn > after.gsn, ("InsertAfter returned a gsn not above the rid", rid, after)
        return rid

    def insert_many(self, records: Sequence[bytes], after: RecordId = RID_GENESIS, *, key: bytes | None = None,
                    window: int = INSERT_WINDOW) -> list[RecordId]:
        """Insert every record of ``records`` somewhere after ``after``, pipelined (at most
        ``window`` in flight); their record ids, in the order given. Each record is an
        insert of its own: exactly once, a gsn above ``after.gsn``, no order among the
        records of one call. If one fails, the rest already in flight finish and the first
        error is raised (the others that were acknowledged stay in the log)."""
        self._check_open()
        payloads = payloads_of(records)
        after_gsn = max(after.gsn, 0)
        driver = self._driver
        calls: dict[int, Call] = {}
        rids: list[RecordId | None] = [None] * len(payloads)
        error: BaseException | None = None
        todo = 0
        while todo < len(payloads) or calls:
            while error is None and todo < len(payloads) and len(calls) < window:
                calls[todo] = driver.insert(payloads[todo], after_gsn, key)
                todo += 1
            if error is not None:
                todo = len(payloads)
            self._rt.run_until(lambda: any(c.done for c in calls.values()))
            for i in [i for i, c in calls.items() if c.done]:
                call = calls.pop(i)
                if call.error is not None:
                    error = error or call.error
                else:
                    rids[i] = call.value
                    assert call.value.gsn > after.gsn, ("InsertAfter returned a gsn not above the rid", call.value, after)
        if error is not None:
            raise error
        return rids  # type: ignore[return-value]

    def read_record(self, rid: RecordId) -> bytes:
        """The record with id ``rid``. Raises TrimmedError below the trim point and
        NotFoundError where the log holds no record."""
        self._check_open()
        data: bytes = self._wait(self._driver.read(rid))
        return data

    def trim(self, rid: RecordId) -> None:
        """Delete every record below ``rid`` on every shard."""
        self._check_open()
        if rid.gsn <= 0:
            return
        shards = self.topology.shards()
        for shard in shards:
            if self.topology.replica_addrs(shard) is None:
                raise ZiplogError(f"shard {shard} is not fully up; cannot trim everywhere")
        self._wait(self._driver.each_replica(shards, lambda req: wire.Trim(req_id=req, gsn=rid.gsn), "trim"))

    def status(self, wait: float = 1.0) -> dict[int, list[dict[str, Any]]]:
        """Every shard ZooKeeper knows, with one entry per replica in replica order, each
        with ``answer``: ``"ok"`` (the entry is the replica's status map), ``"not
        registered"`` (no address in ZooKeeper: down or restarting), ``"unreachable"``
        (registered, silent for ``wait`` seconds) or ``"error"``. Waits for no replica
        longer than ``wait``."""
        self._check_open()
        result: dict[int, list[dict[str, Any]]] = self._wait(self._driver.status(int(wait * NS_PER_S)))
        return result

    def subscribe(self, start: RecordId = RID_GENESIS, end: int | None = None) -> "Subscription":
        """Iterate the log in gsn order from ``start`` (inclusive): forever, or up to gsn
        ``end`` (inclusive; iteration stops once every record up to it was returned)."""
        self._check_open()
        sub = Subscription(self, self._driver.subscribe(start), end)
        self._subs.append(sub)
        return sub

    # -- ranges and the watermark ---------------------------------------------------------------
    def watermark(self) -> int:
        """The stable-prefix watermark W: every gsn <= W is decided on every member shard
        of its epoch, so no record can appear at or below W any more (it moves every
        epoch, also when nothing is written)."""
        self._check_open()
        query = WatermarkQuery(self.topology.history, self._state)
        while True:
            calls = {s: self._driver.shard_query(s, query.request, "watermark") for s in query.to_ask()}
            for s, call in calls.items():
                try:
                    query.got(s, self._wait(call))
                except ZiplogError:
                    query.got(s, None)
            # read after the stables: the history covers every epoch they reach
            w = query.on_history(zk.read_membership_history(self._zk))
            if w is not None:
                return w

    def count_range(self, shard: int, lo: int, hi: int, nth: int = 0) -> tuple[int, int, int]:
        """On ``shard``: how many stable records have ``lo <= gsn <= hi``, the gsn of the
        ``nth`` of them (1-based; 0 if there are fewer or nth is 0), and up to which gsn
        that was counted (``hi``, or less when the replica's stable watermark is below
        it). Moves no data."""
        self._check_open()
        msg = self._wait(self._driver.shard_query(
            shard, lambda req: wire.Count(req_id=req, lo=lo, hi=hi, nth=nth), "count"))
        return msg.count, msg.nth_gsn, msg.upto

    def read_range(self, shard: int, lo: int, hi: int) -> Iterator[Record]:
        """Every record of ``shard`` with ``lo <= gsn <= hi``, in gsn order, a batch per
        request (``hi`` at or below the watermark: those are all stable). Raises
        TrimmedError if ``lo`` is below the trim point."""
        for page in self.read_range_pages(shard, lo, hi):
            for g, data in page:
                yield Record(RecordId(g, shard), data)

    def read_range_pages(self, shard: int, lo: int, hi: int) -> Iterator[list[tuple[int, bytes]]]:
        """:meth:`read_range` a page at a time, as the replica answered it: lists of
        ``(gsn, data)`` in gsn order, up to about 1 MiB of data each (never empty), for
        readers that move records in bulk (Spark's Arrow batches) rather than one by one."""
        self._check_open()
        deadline = time.monotonic() + self.timeout
        pager = RangePager(lo, hi)
        while not pager.done:
            msg = self._wait(self._driver.shard_query(shard, pager.request(), "range"))
            if msg.records:
                yield msg.records
            if pager.on_answer(msg):
                deadline = time.monotonic() + self.timeout
            elif time.monotonic() > deadline:
                raise ZiplogTimeoutError(f"shard {shard} is not stable up to gsn {hi}")
            else:
                time.sleep(0.005)  # the replica asked is behind the watermark: ask again


class Subscription(SubscriptionBase):
    """Iterator over records in gsn order. Close it (or use ``with``) to free its sockets."""

    def __init__(self, client: Client, sub: SubscriptionDriver, end: int | None = None) -> None:
        self._client = client
        self._sub = sub
        self._closed = False
        self.end = end

    def __iter__(self) -> Iterator[Record]:
        return self

    def __next__(self) -> Record:
        rec = self.next(timeout=None)
        if rec is None:
            assert self.ended
            raise StopIteration
        return rec

    def next(self, timeout: float | None = None) -> Record | None:
        """The next record, or None if none arrives within ``timeout`` seconds (or the
        subscription reached its ``end``: see :attr:`ended`)."""
        if self.end is None:
            return self._next(timeout, lambda core: False)
        return self._next(timeout, lambda core: self.ended, final=True)

    def next_until(self, position: int, timeout: float | None = None) -> Record | None:
        """The next record, or None as soon as none is buffered and :attr:`position` is
        at or past ``position`` (or after ``timeout`` seconds): a reader catches up to
        a position without waiting for a record that may never come."""
        return self._next(timeout, lambda core: core.position >= position)

    def _next(self, timeout: float | None, enough: Callable[[Any], bool], final: bool = False) -> Record | None:
        """Turn the client's runtime until a record is here, the subscription failed, or
        ``enough(core)``; the record, if one is (none once ``enough`` if ``final``: the
        subscription is over)."""
        if self._closed:
            raise ClientClosedError("subscription is closed")
        sub = self._sub
        sub.read()
        core = sub.core
        self._client._rt.run_until(lambda: core.has_record() or core.error is not None or enough(core),
                                   None if timeout is None else int(timeout * 1e9))
        if final and enough(core):
            return None
        rec = sub.pop()
        if rec is None:
            core.raise_error()
        return rec

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sub.close()
        if self in self._client._subs:
            self._client._subs.remove(self)

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
