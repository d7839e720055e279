"""Binding a ZeroMQ socket again to the port a closed one held (a peer restarted at the
same address)."""

from __future__ import annotations

import time
from typing import Callable

import zmq


def bind_again(sock: zmq.Socket, port: int, between: Callable[[], None] = lambda: time.sleep(0.005),
               timeout_s: float = 20.0) -> None:
    """Bind ``sock`` to ``tcp://127.0.0.1:port``, which a socket closed just before held.
    libzmq releases a closed socket's listener in its own thread, some time after
    ``close()``, and nothing says when: a bind at once may find the port still in use, so
    it is tried again (``between`` each try: a short sleep, or a turn of the caller's
    loop) until it is free, for at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.bind(f"tcp://127.0.0.1:{port}")
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
        between()
