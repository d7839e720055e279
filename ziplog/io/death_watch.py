"""A leader's death seen at once, with no ZooKeeper write: the leader listens on a TCP
port of its own and sends each connection a token; the next contender in line connects,
reads the token, and waits. The connection carries nothing more. When the leader's
process dies, its kernel closes the connection (a FIN, or a reset), and the follower
learns it that moment rather than after a silence of heartbeats.

What it does not see: a leader alive but stuck, or one whose whole machine died (no
kernel is left to end the connection); the heartbeats in ZooKeeper stay for those (see
:mod:`ziplog.io.election`), at a slower pace than they would need on their own. Nor does
a cut link end the connection (a dropped packet ends none), rightly: a leader cut off
from its follower alone is no reason to depose it.

Only a connection that delivered the leader's token and then ended counts as a death: a
follower that cannot connect, or is refused or closed before the token (a full listener,
a port reused by another process), falls back on the heartbeats. The listener holds at
most :data:`MAX_WATCHERS` connections and closes the ones whose peers left or sent
anything (a follower sends nothing); a connection beyond the bound is closed before its
token, so a stranger filling the listener delays a failover to the heartbeats' pace and
never deposes a live leader.
"""

from __future__ import annotations

import logging
import secrets
import selectors
import socket
import threading
from typing import Callable

from ziplog.protocol.addresses import is_ipv6, parse_host_port, tcp_addr
from ziplog.protocol.zmtp import parse_endpoint

log = logging.getLogger("ziplog.election")

#: connections a leader holds open at once (the next contender in line keeps one)
MAX_WATCHERS = 16
TOKEN_BYTES = 16
#: how long a follower waits to connect and to read the token
CONNECT_TIMEOUT_S = 2.0


class DeathWatchListener:
    """The leader's side, for one term: a listening socket and a thread that accepts
    connections, sends each the term's token, and holds them until :meth:`close` (or
    the process's end, which is the point)."""

    def __init__(self, bind: str, advertise: str | None) -> None:
        self._sock = socket.socket(socket.AF_INET6 if is_ipv6(bind) else socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind((bind.strip("[]"), 0))
            self._sock.listen(MAX_WATCHERS)
        except OSError:
            self._sock.close()
            raise
        port = self._sock.getsockname()[1]
        self.token = secrets.token_bytes(TOKEN_BYTES)
        #: what the leader's beat node holds: where to connect and what to expect there
        host = parse_host_port(advertise)[0] if advertise is not None else bind  # --advertise may name a port
        self.data = f"{tcp_addr(host, port)} {self.token.hex()}".encode()
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name="election-death-watch", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        held: set[socket.socket] = set()
        try:
            while True:
                for key, _ in sel.select():
                    sock = key.fileobj
                    if sock is self._wake_r:
                        return
                    if sock is self._sock:
                        try:
                            conn, _ = self._sock.accept()
                        except OSError:
                            continue
                        if len(held) >= MAX_WATCHERS:
                            conn.close()  # before the token: the follower falls back on the beats
                            continue
                        try:
                            conn.setblocking(False)
                            conn.send(self.token)  # 16 bytes into an empty buffer: all of it
                        except OSError:
                            conn.close()
                            continue
                        held.add(conn)
                        sel.register(conn, selectors.EVENT_READ)
                        continue
                    assert isinstance(sock, socket.socket)
                    # A follower sends nothing: readable means it left, or broke the rule
                    # (then its watch ends as if we died: its business, and no spinning here).
                    sel.unregister(sock)
                    held.discard(sock)
                    sock.close()
        finally:
            for conn in held:
                conn.close()
            sel.close()
            self._sock.close()
            self._wake_r.close()

    def close(self) -> None:
        """The term ended: the followers' connections close (one may depose a leader that
        is leaving anyway; the transaction finds its nodes gone)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._wake_w.send(b"x")
        finally:
            self._wake_w.close()
        self._thread.join(5)


def parse_beat(data: bytes | None) -> tuple[str, int, bytes] | None:
    """``(host, port, token)`` from a beat node's data, None when it names no death
    watch (a leader without one, or an older version that wrote its identifier)."""
    if not data:
        return None
    try:
        addr, token_hex = data.decode().split(" ")
        host, port = parse_endpoint(addr)
        token = bytes.fromhex(token_hex)
    except (UnicodeDecodeError, ValueError):
        return None
    if len(token) != TOKEN_BYTES or not 0 < port < 65536:
        return None
    return host, port, token


class DeathWatch:
    """The follower's side, for one leader: a thread that connects, checks the token,
    and calls ``on_death`` when the connection then ends, unless :meth:`stop` came
    first; ``on_watching`` once the token checked out (the watch is in place)."""

    def __init__(self, host: str, port: int, token: bytes, on_death: Callable[[], None],
                 on_watching: Callable[[], None] | None = None) -> None:
        self.addr = (host, port, token)
        self._on_death = on_death
        self._on_watching = on_watching
        self._lock = threading.Lock()
        self._stopped = False
        self._sock: socket.socket | None = None
        #: set when the watch is over (the leader died, we stopped, or it could not start)
        self.finished = threading.Event()
        threading.Thread(target=self._run, name="election-watch-death", daemon=True).start()

    def _run(self) -> None:
        try:
            self._watch()
        finally:
            self.finished.set()

    def _watch(self) -> None:
        host, port, token = self.addr
        try:
            sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        except OSError:
            return  # cannot reach it this way: the heartbeats decide
        with self._lock:
            if self._stopped:
                sock.close()
                return
            self._sock = sock
        try:
            got = b""
            while len(got) < TOKEN_BYTES:
                part = sock.recv(TOKEN_BYTES - len(got))
                if not part:
                    return  # refused before the token: not a death
                got += part
            if got != token:
                return  # another process at that port
            sock.settimeout(None)
            if self._on_watching is not None:
                self._on_watching()
            while sock.recv(64):
                pass  # the leader sends nothing more
        except socket.timeout:
            return
        except OSError:
            pass  # reset: the leader's process is gone
        finally:
            sock.close()
        with self._lock:
            if self._stopped:
                return  # we hung up (the leader changed): nobody died
            self._stopped = True
        self._on_death()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # ends the blocked recv at once
            except OSError:
                pass
