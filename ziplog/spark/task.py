"""What a Spark task runs (in a Python worker process): the records of one partition,
read straight from the shard's replicas named in the partition (RANGE requests on a
ZeroMQ socket of its own: no ZooKeeper round trip), or, if none of them answers (a
replica moved or died), through a :class:`ziplog.Client` that finds the replicas in
ZooKeeper, from just past the last record returned."""

from __future__ import annotations

import logging
from typing import Any, Iterator

import zmq

from ziplog.cores.client.watermark import RangePager
from ziplog.protocol import frames as wire
from ziplog.protocol.errors import TrimmedError, from_reply
from ziplog.protocol.gsna import epoch_of

log = logging.getLogger("ziplog.spark")

#: a replica named in the partition that does not answer within this long is passed over
DIRECT_TIMEOUT_MS = 2_000

Row = tuple[int, int, int, bytes]


def _direct(addrs: tuple[str, ...], shard: int, pager: RangePager) -> Iterator[Row]:
    """Read the pager's range from the first replica that answers; stops (without
    raising) when none does."""
    ctx: Any = zmq.Context.instance()
    for addr in addrs:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.CLIENT_REPLY_LIMIT)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
        try:
            req = 0
            while not pager.done:
                req += 1
                sock.send(wire.encode(pager.request()(req)))
                if not sock.poll(DIRECT_TIMEOUT_MS):
                    break  # this replica is gone or slow: the next one
                msg = wire.decode_reply(sock.recv())
                if isinstance(msg, wire.Error):
                    err = from_reply(msg.code, msg.message)
                    if isinstance(err, TrimmedError):
                        raise err
                    break
                if not isinstance(msg, wire.RangeOk) or msg.req_id != req:
                    break
                for g, data in msg.records:
                    yield (g, shard, epoch_of(g), data)
                if not pager.on_answer(msg):
                    break  # this replica is behind: another may not be
            if pager.done:
                return
        finally:
            sock.close(0)


def read_partition(zk: str, shard: int, lo: int, hi: int, addrs: tuple[str, ...]) -> Iterator[Row]:
    """Rows ``(gsn, shard, epoch, data)`` of ``shard`` with ``lo <= gsn <= hi``, in gsn order."""
    pager = RangePager(lo, hi)
    yield from _direct(addrs, shard, pager)
    if pager.done:
        return
    log.info("shard %d: the replicas the plan named did not answer; finding them in ZooKeeper", shard)
    from ziplog.client.blocking import Client
    with Client(zk) as client:
        for rec in client.read_range(shard, pager.next, hi):
            yield (rec.rid.gsn, shard, epoch_of(rec.rid.gsn), rec.data)
