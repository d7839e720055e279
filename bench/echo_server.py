"""Echo process for the raw ZeroMQ latency floor.

``python -m bench.echo_server --port P`` binds a ROUTER on 127.0.0.1:P (P=0 picks a free
port) and sends every message straight back to its sender in a tight loop. Once bound it
prints ``READY <port>`` on stdout so the parent knows the port and that it may connect.
The process exits on SIGTERM/SIGINT or when its parent dies (checked once a second by a
watchdog thread, so no per-message cost)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

import zmq


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.echo_server")
    ap.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (0 = any free port)")
    args = ap.parse_args(argv)

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()

    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if args.port:
        sock.bind(f"tcp://127.0.0.1:{args.port}")
        port = args.port
    else:
        port = sock.bind_to_random_port("tcp://127.0.0.1")
    sys.stdout.write(f"READY {port}\n")
    sys.stdout.flush()

    recv = sock.recv_multipart
    send = sock.send_multipart
    try:
        while True:  # [identity, payload...] goes back to the same identity unchanged
            send(recv(copy=False), copy=False)
    except KeyboardInterrupt:
        pass
    finally:
        sock.close(0)
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
