"""What a Spark task runs (in a Python worker process): the records of one partition,
read straight from the shard's replicas named in the partition (RANGE requests on a
ZeroMQ socket of its own: no ZooKeeper round trip), or, if none of them answers (a
replica moved or died), through a :class:`ziplog.Client` that finds the replicas in
ZooKeeper, from just past the last record returned."""

from __future__ import annotations

import logging
from typing import Any, Iterator

import zmq

from ziplog.client.common import RANGE_BYTES
from ziplog.protocol import frames as wire
from ziplog.protocol.errors import TrimmedError, from_reply
from ziplog.protocol.gsna import epoch_of

log = logging.getLogger("ziplog.spark")

#: a replica named in the partition that does not answer within this long is passed over
DIRECT_TIMEOUT_MS = 2_000

Row = tuple[int, int, int, bytes]


def _direct(addrs: tuple[str, ...], shard: int, lo: int, hi: int, done: list[int]) -> Iterator[Row]:
    """Read [lo, hi] from the first replica that answers; ``done[0]`` is the last gsn
    returned. Stops (without raising) when no replica answers."""
    ctx: Any = zmq.Context.instance()
    for addr in addrs:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
        try:
            req = 0
            while done[0] < hi:
                req += 1
                sock.send(wire.encode(wire.Range(req_id=req, lo=done[0] + 1, hi=hi, max_bytes=RANGE_BYTES)))
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
                    done[0] = g
                if msg.upto < done[0] + 1 and not msg.records:
                    break  # this replica is behind: another may not be
                done[0] = max(done[0], msg.upto)
            if done[0] >= hi:
                return
        finally:
            sock.close(0)


def read_partition(zk: str, shard: int, lo: int, hi: int, addrs: tuple[str, ...]) -> Iterator[Row]:
    """Rows ``(gsn, shard, epoch, data)`` of ``shard`` with ``lo <= gsn <= hi``, in gsn order."""
    done = [lo - 1]
    yield from _direct(addrs, shard, lo, hi, done)
    if done[0] >= hi:
        return
    log.info("shard %d: the replicas the plan named did not answer; finding them in ZooKeeper", shard)
    from ziplog.client.blocking import Client
    with Client(zk) as client:
        for rec in client.read_range(shard, done[0] + 1, hi):
            yield (rec.rid.gsn, shard, epoch_of(rec.rid.gsn), rec.data)
