"""NOPaxos-style log servers: an end-host sequencer and 2f+1 replicas (dissertation
4.4: "the sequencer in our NOPaxos implementation is a server ... and uses multiple TCP
connections to broadcast messages").

    python -m bench.baselines.nopaxos replica --index I --data FILE
    python -m bench.baselines.nopaxos sequencer --replica ADDR [--replica ADDR ...]

Each prints ``READY <port>`` once it serves. An append takes three message delays:

1. client -> sequencer (DEALER -> ROUTER): ``[req_id, data]``
2. sequencer -> every replica, one DEALER (one TCP connection) per replica, two parts:
   ``[seqno, client_id]`` and the client's frame unchanged (the sequencer stamps, it
   does not parse the record, as an in-network sequencer would)
3. every replica -> client, on its ROUTER to the client's routing id:
   ``[req_id, seqno, replica]``

The client is done with f+1 matching replies including the leader's (replica 0).
Replicas append in sequence order; a gap (a sequence number other than the next) stops
the replica with an error instead of acknowledging past it. There is no view change:
this baseline measures the normal case only.

A client connects one DEALER to every replica (replies only) and greets each with
HELLO before its first append: a ROUTER can route to a routing id only once that
peer's connection is up, and a reply routed too early would be dropped.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import msgpack
import zmq

from . import MAX_BLOCK_MS, RecordFile, StopFlag, announce_ready

#: client -> replica ``[HELLO]``; the reply is ``[HELLO_REQ_ID, -1, replica]``
HELLO = "hello"
HELLO_REQ_ID = 0
#: the first log position (positions are 0-based and dense)
FIRST_POSITION = 0
#: routing id of the sequencer's DEALERs at the replicas
SEQUENCER_ID = b"sequencer"
HWM = 100_000
#: a replica with buffered records and no messages wakes after this long to flush them
DISK_WAKE_MS = 5

SNDMORE = int(zmq.SNDMORE)


class GapError(RuntimeError):
    """A replica received a sequence number other than the next one."""


def run_replica(index: int, data_path: Path, stop: StopFlag, host: str = "127.0.0.1") -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, HWM)
    router.setsockopt(zmq.RCVHWM, HWM)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply raises, it is not dropped silently
    # Busy: one blocking recv per message, no poll set. Records buffered: wake up after
    # DISK_WAKE_MS without messages to flush them. Nothing buffered: block for longer.
    router.setsockopt(zmq.RCVTIMEO, MAX_BLOCK_MS)
    port = router.bind_to_random_port(f"tcp://{host}")
    disk = RecordFile(data_path)
    announce_ready(port)

    recv = router.recv_multipart
    send = router.send_multipart
    # A reused Packer: msgpack.packb builds a new one per call (about 1.5 us here).
    packb, unpackb, clock = msgpack.Packer().pack, msgpack.unpackb, time.monotonic_ns
    write = disk.write
    expected = FIRST_POSITION
    unroutable = 0
    waking_for_disk = False  # RCVTIMEO is DISK_WAKE_MS (else MAX_BLOCK_MS)
    try:
        while not stop.requested:
            try:
                parts = recv()
            except zmq.Again:  # no message for RCVTIMEO
                disk.flush_if_due(clock())
                if waking_for_disk and not disk.dirty:
                    router.setsockopt(zmq.RCVTIMEO, MAX_BLOCK_MS)
                    waking_for_disk = False
                continue
            if len(parts) == 3:  # [SEQUENCER_ID, header, client frame]
                header, body = parts[1], parts[2]
                seqno, client = unpackb(header)
                if seqno != expected:
                    raise GapError(f"replica {index}: got sequence number {seqno}, expected {expected}; "
                                   "stopping rather than acknowledging past a gap")
                expected += 1
                try:
                    send([client, packb([unpackb(body)[0], seqno, index])])
                except zmq.ZMQError:  # the client is gone (EHOSTUNREACH)
                    unroutable += 1
                write(header)  # header + frame: a msgpack stream [seqno, client] [req_id, data] ...
                write(body)
                disk.dirty = True
                disk.flush_if_due(clock())
                if not waking_for_disk:
                    router.setsockopt(zmq.RCVTIMEO, DISK_WAKE_MS)
                    waking_for_disk = True
            elif len(parts) == 2:  # [client, HELLO]
                send([parts[0], packb([HELLO_REQ_ID, -1, index])])
            else:
                print(f"replica {index}: ignored a {len(parts)}-part message", file=sys.stderr, flush=True)
    finally:
        disk.close()
        print(f"replica {index}: {expected - FIRST_POSITION} records, {unroutable} replies to departed clients",
              flush=True)
        ctx.destroy(linger=0)


def run_sequencer(replicas: list[str], stop: StopFlag, host: str = "127.0.0.1") -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVHWM, HWM)
    router.setsockopt(zmq.RCVTIMEO, MAX_BLOCK_MS)  # idle: return now and then to see stop signals
    port = router.bind_to_random_port(f"tcp://{host}")
    dealers: list[zmq.Socket[bytes]] = []
    for addr in replicas:
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.SNDHWM, HWM)  # full: the send blocks (back-pressure), it never drops
        d.setsockopt(zmq.ROUTING_ID, SEQUENCER_ID)
        d.connect(addr)
        dealers.append(d)
    announce_ready(port)

    recv = router.recv_multipart
    sends = [d.send for d in dealers]
    packb = msgpack.Packer().pack  # reused: msgpack.packb builds a new Packer per call
    seqno = FIRST_POSITION
    try:
        while not stop.requested:
            try:
                parts = recv()
            except zmq.Again:
                continue
            if len(parts) != 2:
                print(f"sequencer: ignored a {len(parts)}-part message", file=sys.stderr, flush=True)
                continue
            client, frame = parts
            header = packb((seqno, client))
            seqno += 1
            for send in sends:
                send(header, SNDMORE)
                send(frame)
    finally:
        print(f"sequencer: {seqno - FIRST_POSITION} records sequenced", flush=True)
        ctx.destroy(linger=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.baselines.nopaxos")
    sub = ap.add_subparsers(dest="role", required=True)
    rp = sub.add_parser("replica", help="one of the 2f+1 replicas (0 is the leader)")
    rp.add_argument("--index", type=int, required=True)
    rp.add_argument("--data", type=Path, required=True, help="the record file")
    sp = sub.add_parser("sequencer", help="the end-host sequencer")
    sp.add_argument("--replica", action="append", required=True, help="a replica's address, in index order")
    args = ap.parse_args(argv)
    stop = StopFlag()
    if args.role == "replica":
        run_replica(args.index, args.data, stop)
    else:
        run_sequencer(args.replica, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
