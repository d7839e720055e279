"""The production :class:`~ziplog.io.ports.Runtime` and :class:`~ziplog.io.ports.Network`
on pyzmq: one thread polls every socket, runs due timers and calls handed over by other
threads, then ends the turn.

A server process runs it for good (:meth:`ZmqRuntime.run_forever`); the blocking client
runs it only while a call waits (:meth:`ZmqRuntime.run_until`).

One turn: poll (timeout: the next timer, at most 100 ms) -> each ready socket drained
(at most 256 frames or 20 ms of them, each handed to its handler, which may send at once: an ACK leaves
before anything else is done) -> due timers -> calls from other threads -> the answer
hooks (a storage server's inserts of the turn are decided and their ACKs leave) -> the
turn-end hooks (where drivers flush their batches: FORWARDs, PREFIXes, the disk).

A server may give its CPU away once after a turn's answers have left
(``yield_after_answers``, a storage server's ``--yield-after-answers``; off unless asked
for): a client woken by an ACK on this CPU reads it now, instead of after the turn's
FORWARD, its bookkeeping and the process's next sleep. With nothing else runnable the
yield is one system call; with other processes due the CPU, the turn's FORWARD waits for
them too, so a yield that took long pauses the yields (``YIELD_LONG_NS``).

A server may poll briefly before it sleeps (``poll_max_ns``, a storage server's
``--poll-us``; off unless asked for): after a turn, the loop keeps polling without
blocking, yielding its CPU between polls, for as long as :func:`next_poll_limit` says, so
that input arriving back to back finds it awake. Waking a sleeping process costs the
waker an interprocessor interrupt and the woken a context switch, and on a virtual
machine whose idle vCPUs halt at once (the host allows no guest halt polling) about
25 us more before the process runs. How long to poll adapts the way Linux's
cpuidle-haltpoll governor does: it grows while idle periods are shorter than the maximum
and shrinks when they are longer, so an idle process (an epoch every 10 ms) does not
poll. A poll ends when a yield lets another task run (this CPU is wanted). What it cannot
see is a task waiting on another CPU, or a sibling hyperthread slowed by the polling: a
busy machine pays for it in throughput (docs/DEPLOY.md says when to turn it on).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import select
import signal
import socket
import threading
import time
from collections import deque
from typing import Any, Callable

import zmq
from zmq import zmq_poll

from ziplog.io.ports import FrameHandler, MultipartHandler, RoutedHandler
from ziplog.protocol.addresses import is_ipv6, tcp_addr
from ziplog.protocol.keys import Credentials

log = logging.getLogger("ziplog.io")

# Plain ints: pyzmq's flag enums cost a Python-level enum operation per call.
POLLIN = int(zmq.POLLIN)
POLLOUT = int(zmq.POLLOUT)
NOBLOCK = int(zmq.NOBLOCK)
SNDMORE = int(zmq.SNDMORE)
EVENTS = int(zmq.EVENTS)
RCVMORE = int(zmq.RCVMORE)
#: frames read from one socket per turn, so one busy peer cannot starve the others
DRAIN_LIMIT = 256
#: ... and for at most this long: frames that are costly to refuse (a flood of large
#: junk) wait for the next turn, and the timers (heartbeats, expiries) run in between
DRAIN_BUDGET_NS = 20_000_000
#: longest poll: the loop looks at its stop flag at least this often
MAX_WAIT_MS = 100
#: ... and a server's, whose other threads and signals wake it through its own pipes
#: (:meth:`ZmqRuntime.wake_on_signals`): an idle process turns once a second, not ten times
IDLE_WAIT_MS = 1000
#: send queue of a ROUTER or DEALER (frames); a frame to a full queue is dropped
HWM = 100_000
#: polling before sleeping: how the time to poll grows and shrinks (haltpoll's defaults:
#: guest_halt_poll_grow, guest_halt_poll_grow_start, guest_halt_poll_shrink)
POLL_GROW = 2
POLL_GROW_START_NS = 50_000
POLL_SHRINK = 2
#: one poll and yield take a few microseconds; one that took longer than this ran
#: another task in between, and ends the polling: this CPU is wanted
POLL_YIELDED_NS = 30_000
#: a yield after answering that kept the loop away longer than this gave its CPU to more
#: than a client reading its answer (other processes wanted it): the turn's FORWARD
#: waited for them, so the loop stops yielding for YIELD_PAUSE_FACTOR times as long
#: (long yields then hold the loop at most 1/(1 + YIELD_PAUSE_FACTOR) of the time)
YIELD_LONG_NS = 200_000
YIELD_PAUSE_FACTOR = 20


def next_poll_limit(limit_ns: int, idle_ns: int, max_ns: int) -> int:
    """How long to poll before sleeping after the next turn, given ``limit_ns`` (how long
    it is now) and ``idle_ns`` (how long the idle period that just ended lasted, polling
    and sleeping together), the rule of Linux's haltpoll ``adjust_poll_limit``: an idle
    period that polling did not cover but ``max_ns`` would have -> poll longer (at least
    POLL_GROW_START_NS, at most ``max_ns``); one longer than ``max_ns`` -> poll less; one
    polling covered -> unchanged."""
    if limit_ns < idle_ns <= max_ns:
        return min(max(limit_ns * POLL_GROW, POLL_GROW_START_NS), max_ns)
    if idle_ns > max_ns:
        return limit_ns // POLL_SHRINK
    return limit_ns


def bind(sock: Any, host: str, port: int) -> str:
    """Bind ``sock`` (a pyzmq socket, plain or asyncio) on ``host`` (IPv4 or IPv6), at
    ``port`` or (0) any free port; its address."""
    if is_ipv6(host):
        sock.setsockopt(zmq.IPV6, 1)  # libzmq binds IPv4 only unless told
    if port:
        sock.bind(tcp_addr(host, port))
    else:
        port = sock.bind_to_random_port(tcp_addr(host, 0).rpartition(":")[0])
    return tcp_addr(host, port)


def connect(sock: Any, addr: str) -> None:
    """Connect ``sock`` (a pyzmq socket, plain or asyncio) to ``addr``, IPv6 included."""
    if "[" in addr:
        sock.setsockopt(zmq.IPV6, 1)  # libzmq dials IPv4 only unless told
    sock.connect(addr)


class _TimerHandle:
    __slots__ = ("when", "fn", "cancelled")

    def __init__(self, when: int, fn: Callable[[], None]) -> None:
        self.when = when
        self.fn = fn
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _Socket:
    """A socket and what to do when it is readable."""

    __slots__ = ("rt", "sock", "addr", "drain")

    def __init__(self, rt: "ZmqRuntime", sock: zmq.Socket, addr: str) -> None:
        self.rt = rt
        self.sock = sock
        self.addr = addr
        self.drain: Callable[[], None] | None = None

    def send(self, frame: bytes) -> bool:
        try:
            # zero-copy only pays off for large frames
            if len(frame) < 65536:
                self.sock.send(frame, NOBLOCK)
            else:
                self.sock.send(frame, NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError:
            return False

    def connect(self, addr: str) -> None:
        """Connect to one more peer (a SUB to another publisher)."""
        connect(self.sock, addr)

    def close(self, linger_ms: int = 0) -> None:
        self.rt._forget(self)
        self.sock.close(linger_ms)


class _Puller(_Socket):
    __slots__ = ("reader",)

    def pause(self) -> None:
        if self.drain is not None:
            self.reader = self.drain
            self.rt._forget(self)
            self.rt._all.add(self)
            self.drain = None

    def resume(self, discard_queued: bool = False) -> None:
        if self.drain is None:
            if discard_queued:
                while True:
                    try:
                        self.sock.recv(NOBLOCK)
                    except zmq.Again:
                        break
            self.rt._add(self, self.reader)


class _Router(_Socket):
    __slots__ = ()

    def peer_key(self, route: bytes) -> bytes | None:
        return None  # NULL only

    def send_to(self, route: bytes, frame: bytes) -> bool:
        try:
            self.sock.send(route, SNDMORE | NOBLOCK)
            self.sock.send(frame, NOBLOCK)
            return True
        except zmq.Again:
            log.warning("dropped a frame to a slow peer")
            return False
        except zmq.ZMQError:
            return False


class _MembersOnly:
    """pyzmq's ZAP credentials provider: a CURVE client passes when its key is ``member``."""

    def __init__(self, member: bytes) -> None:
        self.member = member

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.member


class ZmqRuntime:
    def __init__(self, ctx: zmq.Context | None = None, precise_timers: bool = False, wake: bool = True,
                 drain_limit: int = DRAIN_LIMIT, native: bool = False, poll_max_ns: int = 0,
                 yield_after_answers: bool = False, credentials: Credentials | None = None) -> None:
        #: CURVE keys for every endpoint made here (None: NULL), and libzmq's ZAP handler
        self.credentials = credentials
        self._zap: Any = None
        #: ROUTERs and DEALERs served natively (:mod:`ziplog.io.zmtp_poll`: plain sockets in
        #: this loop, ZMTP spoken by ziplog's codec) instead of by libzmq
        self.native = native
        #: the native endpoints' shared per-loop state (:mod:`ziplog.io.zmtp_poll`), made by
        #: the first of them (a declared attribute: the loop may run compiled, with slots)
        self._zmtp_loop_state: Any = None
        #: file descriptor -> (on readable, on writable) of the native endpoints' sockets
        self._fds: dict[int, tuple[Callable[[], None] | None, Callable[[], None] | None]] = {}
        self._native: set[Any] = set()
        #: polling before sleeping (see the module's docstring): at most this long after a
        #: turn of :meth:`run_forever` (0: never)
        assert poll_max_ns >= 0
        self.poll_max_ns = poll_max_ns
        #: how long the next poll before sleeping lasts (:func:`next_poll_limit`)
        self.poll_limit_ns = 0
        #: when the last turn ended (0: no turn yet), the start of the idle period
        self._turn_done_ns = 0
        #: time spent polling before sleeping, and how many of those polls found input
        #: before their limit (for the metrics)
        self.polled_ns = 0
        self.polls_found = 0
        self.polls_cut = 0
        #: give the CPU away (``sched_yield``) after a turn whose answer hooks sent anything
        self.yield_after_answers = yield_after_answers
        #: turns after which it did, and those whose yield took longer than YIELD_LONG_NS
        #: (for the metrics)
        self.yields = 0
        self.yields_long = 0
        #: no yield before this time (monotonic ns): the last long one said the CPU is busy
        self._yield_paused_until = 0
        #: poll's timeout is in milliseconds: by default a timer may fire up to 1 ms late;
        #: precise timers sleep out the last millisecond instead (the membership service's
        #: epochs), at the price of input waiting that long
        self.precise_timers = precise_timers
        #: frames read from a socket per turn: a server drains a batch (fewer polls under
        #: load); a client that waits for one reply per replica reads one and polls again
        #: (no EVENTS check after it)
        self.drain_limit = drain_limit
        self.ctx = ctx if ctx is not None else zmq.Context()
        self._own_ctx = ctx is None
        #: (socket, POLLIN) of every readable socket, for zmq_poll (a Poller copies its
        #: registrations into such a list at every poll)
        self._poll_items: list[tuple[Any, int]] = []  # sockets, and the signal pipe's fd
        self._sockets: dict[zmq.Socket, _Socket] = {}  # the readable ones
        self._all: set[_Socket] = set()
        self._timers: list[tuple[int, int, _TimerHandle]] = []
        self._seq = itertools.count()
        self._turn_answers: list[Callable[[], bool]] = []
        self._turn_end: list[Callable[[], None]] = []
        #: run before every poll: the native endpoints' held-back writes leave (a turn
        #: nested in a handler, say a blocking call made from one, must not wait for an
        #: answer to a request still held)
        self._before_poll: list[Callable[[], None]] = []
        self._calls: deque[Callable[[], None]] = deque()
        #: the same poll set's file descriptors in a ``select.poll`` (events in its own
        #: flags), used while no libzmq socket is in the set: one system call per wait,
        #: where ``zmq_poll`` makes two (a first pass with no timeout, then the wait) and
        #: asks each libzmq socket for its events on both
        self._fd_poller = select.poll()
        # Other threads wake the loop with a byte on this socket pair. Without it
        # (``wake=False``: a one-off probe's runtime, which nobody else calls into), calls
        # from other threads wait for the next turn, at most MAX_WAIT_MS.
        self._wake_rx: socket.socket | None = None
        self._wake_tx: socket.socket | None = None
        if wake:
            self._wake_rx, self._wake_tx = self._pipe()
        #: the read end of the pipe Python writes a byte to when a signal arrives (see
        #: :meth:`wake_on_signals`), and the write end
        self._signal_rx: socket.socket | None = None
        self._signal_tx: socket.socket | None = None
        self.running = True
        #: the last ``focus`` list run_once saw, and its poll set
        self._focus: list[Any] | None = None
        self._focus_items: list[tuple[Any, int]] = []  # libzmq sockets, and the wake-up pipe's fd

    # -- Runtime ----------------------------------------------------------------------------------
    #: monotonic nanoseconds (the C function itself: no Python frame on the hot path)
    now = staticmethod(time.monotonic_ns)

    def call_at(self, when_ns: int, fn: Callable[[], None]) -> _TimerHandle:
        h = _TimerHandle(when_ns, fn)
        heapq.heappush(self._timers, (when_ns, next(self._seq), h))
        return h

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        self._calls.append(fn)
        tx = self._wake_tx  # (read once: close() may run in the loop's thread meanwhile)
        if tx is not None:
            try:
                tx.send(b"\0")
            except OSError:
                pass  # full (a wake-up is pending anyway) or closed

    def _pipe(self) -> tuple[socket.socket, socket.socket]:
        """A socket pair whose read end the loop polls and empties (its bytes only wake
        the poll)."""
        rx, tx = socket.socketpair()
        rx.setblocking(False)
        tx.setblocking(False)

        def drain() -> None:
            try:
                while rx.recv(4096):
                    pass
            except (BlockingIOError, InterruptedError):
                pass

        self.watch_fd(rx.fileno(), drain, None)
        return rx, tx

    @property
    def _zmq_polled(self) -> int:
        """libzmq sockets in the poll set (0: the fd poller serves the turn)."""
        return len(self._sockets)

    def at_turn_answers(self, fn: Callable[[], bool]) -> None:
        self._turn_answers.append(fn)

    def at_turn_end(self, fn: Callable[[], None]) -> None:
        self._turn_end.append(fn)

    # -- Network ----------------------------------------------------------------------------------
    def _add(self, s: _Socket, drain: Callable[[], None] | None) -> None:
        s.drain = drain
        self._all.add(s)
        if drain is not None:
            self._sockets[s.sock] = s
            self._poll_items = [*self._poll_items, (s.sock, POLLIN)]

    def _forget(self, s: _Socket) -> None:
        self._all.discard(s)
        if self._sockets.pop(s.sock, None) is not None:
            self._poll_items = [item for item in self._poll_items if item[0] is not s.sock]

    # -- native endpoints' file descriptors ---------------------------------------------------------
    def watch_fd(self, fd: int, on_read: Callable[[], None] | None, on_write: Callable[[], None] | None) -> None:
        self._fds[fd] = (on_read, on_write)
        self._set_fd_events(fd, POLLIN if on_read is not None else 0)

    def want_write(self, fd: int, on: bool) -> None:
        if fd in self._fds:
            read = POLLIN if self._fds[fd][0] is not None else 0
            self._set_fd_events(fd, read | (POLLOUT if on else 0))

    def unwatch_fd(self, fd: int) -> None:
        self._fds.pop(fd, None)
        self._set_fd_events(fd, 0)

    def _set_fd_events(self, fd: int, events: int) -> None:
        items = [item for item in self._poll_items if item[0] != fd]
        if events:
            items.append((fd, events))
            self._fd_poller.register(fd, (select.POLLIN if events & POLLIN else 0)
                                     | (select.POLLOUT if events & POLLOUT else 0))
        else:
            try:
                self._fd_poller.unregister(fd)
            except KeyError:
                pass
        self._poll_items = items

    def router(self, on_frame: RoutedHandler, on_multipart: MultipartHandler, host: str = "127.0.0.1",
               port: int = 0, max_bytes: int = -1) -> Any:
        if self.native:
            from ziplog.io.zmtp_poll import NativeRouter
            return NativeRouter(self, on_frame, on_multipart, host, port, max_bytes, self.credentials)
        if self.credentials is not None:
            # libzmq tells a ROUTER's reader who sent a frame only through ZAP's User-Id
            # on each message; the rights checks read the native ROUTER's peer_key.
            raise ValueError("a ROUTER under CURVE is served by the native transport (not --transport zmq)")
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        sock.setsockopt(zmq.SNDHWM, HWM)
        sock.setsockopt(zmq.RCVHWM, HWM)
        sock.setsockopt(zmq.LINGER, 0)
        r = _Router(self, sock, bind(sock, host, port))

        def drain() -> None:
            recv, getsockopt, clock = sock.recv, sock.getsockopt, time.monotonic_ns
            until = clock() + DRAIN_BUDGET_NS
            for i in range(self.drain_limit):
                # Poll said a message is there; after it, EVENTS before each recv instead
                # of catching zmq.Again: an exception per drained socket costs more than
                # the request itself.
                if i and (not int(getsockopt(EVENTS)) & POLLIN or clock() >= until):
                    return
                route = recv()
                frame = recv()
                if getsockopt(RCVMORE):
                    parts = 2
                    while getsockopt(RCVMORE):
                        recv()
                        parts += 1
                    on_multipart(route, parts - 1)
                    continue
                on_frame(route, frame)

        self._add(r, drain)
        return r

    def _connected(self, kind: int, addr: str, on_frame: FrameHandler | None, hwm: int,
                   max_bytes: int = -1) -> _Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        self._curve_client(sock)
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        connect(sock, addr)
        s = _Socket(self, sock, addr)
        self._add(s, None if on_frame is None else self._drainer(sock, on_frame))
        return s

    def _drainer(self, sock: zmq.Socket, on_frame: FrameHandler) -> Callable[[], None]:
        if self.drain_limit == 1:
            recv = sock.recv
            return lambda: on_frame(recv())  # poll said a frame is there
        def drain() -> None:
            recv, getsockopt, clock = sock.recv, sock.getsockopt, time.monotonic_ns
            until = clock() + DRAIN_BUDGET_NS
            for i in range(self.drain_limit):
                if i and (not int(getsockopt(EVENTS)) & POLLIN or clock() >= until):
                    return
                on_frame(recv())
        return drain

    def dealer(self, addr: str, on_frame: FrameHandler, label: str = "", max_bytes: int = -1) -> Any:
        if self.native:
            from ziplog.io.zmtp_poll import NativeDealer
            return NativeDealer(self, addr, on_frame, max_bytes, self.credentials)
        s = self._connected(zmq.DEALER, addr, on_frame, HWM, max_bytes)
        s.sock.setsockopt(zmq.RCVHWM, HWM)
        return s

    def subscriber(self, addr: str, on_frame: FrameHandler, max_bytes: int = -1) -> Any:
        """A SUB socket; ``connect`` adds publishers to it (one socket for all of them
        keeps the poll set small)."""
        if self.native:
            from ziplog.io.zmtp_poll import NativeSubscriber
            return NativeSubscriber(self, addr, on_frame, max_bytes, self.credentials)
        return self._connected(zmq.SUB, addr, on_frame, 1000, max_bytes)

    def pusher(self, addr: str) -> _Socket:
        return self._connected(zmq.PUSH, addr, None, 1000)

    def publisher(self, host: str = "127.0.0.1") -> _Socket:
        sock = self.ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        self._curve_server(sock)
        s = _Socket(self, sock, bind(sock, host, 0))
        self._add(s, None)
        return s

    def puller(self, on_frame: FrameHandler, host: str = "127.0.0.1", paused: bool = False,
               max_bytes: int = -1) -> _Puller:
        sock = self.ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        self._curve_server(sock)
        s = _Puller(self, sock, bind(sock, host, 0))
        s.reader = self._drainer(sock, on_frame)
        self._add(s, None if paused else s.reader)
        return s

    def _curve_client(self, sock: zmq.Socket) -> None:
        cred = self.credentials
        if cred is not None:
            sock.curve_serverkey = cred.server_public
            sock.curve_publickey = cred.client.public
            sock.curve_secretkey = cred.client.secret

    def _curve_server(self, sock: zmq.Socket) -> None:
        """A bound libzmq socket (the MMS's PUB, a PULL) under CURVE: only members (the
        cluster's own key) pass its ZAP handler; what they send is sealed besides."""
        cred = self.credentials
        if cred is None:
            return
        assert cred.server is not None, "a bound socket under CURVE needs the server's key pair"
        if self._zap is None:
            from zmq.auth.thread import ThreadAuthenticator
            from zmq.utils import z85

            member = z85.encode(cred.server.public)
            self._zap = ThreadAuthenticator(self.ctx, log=logging.getLogger("ziplog.io.zap"))
            self._zap.start()
            self._zap.configure_curve_callback("*", _MembersOnly(member))
        sock.curve_server = True
        sock.curve_publickey = cred.server.public
        sock.curve_secretkey = cred.server.secret

    # -- the loop ---------------------------------------------------------------------------------
    def _next_timer(self) -> int | None:
        timers = self._timers
        while timers and timers[0][2].cancelled:
            heapq.heappop(timers)
        return timers[0][0] if timers else None

    def run_once(self, max_wait_ms: int = MAX_WAIT_MS, focus: list[Any] | None = None) -> None:
        """One turn: wait for input or the next timer (at most ``max_wait_ms``), handle
        it, end the turn. ``focus``: listen to these endpoints only this turn (what the
        caller waits on; the others' frames wait in their queues)."""
        for fn in self._before_poll:
            fn()
        wait_ms = max_wait_ms
        sleep_ns = 0
        timers = self._timers
        if self._calls:
            wait_ms = 0
        elif timers:
            t = self._next_timer()
            if t is not None:
                left = t - time.monotonic_ns()
                if left <= 0:
                    wait_ms = 0
                elif not self.precise_timers:
                    wait_ms = min(wait_ms, -(-left // 1_000_000))
                elif left < 1_000_000:
                    wait_ms, sleep_ns = 0, left
                else:
                    wait_ms = min(wait_ms, left // 1_000_000)
        out = POLLOUT  # the writable bit in ``ready``'s flags
        if focus is None or self.native:  # a native endpoint's socket comes and goes: poll all
            if self._sockets:  # a libzmq socket to poll
                ready = zmq_poll(self._poll_items, wait_ms)
            else:
                ready = self._fd_poller.poll(wait_ms)
                out = select.POLLOUT
        else:
            if focus is not self._focus:  # else the caller's list is unchanged: so is the poll set
                self._focus = focus
                self._focus_items = [(ep.sock, POLLIN) for ep in focus]
                if self._wake_rx is not None:  # other threads' calls end the wait too
                    self._focus_items.append((self._wake_rx.fileno(), POLLIN))
            ready = zmq_poll(self._focus_items, wait_ms)
        if sleep_ns and not ready:
            time.sleep(sleep_ns / 1e9)
        if self.poll_max_ns and self._turn_done_ns:
            self.poll_limit_ns = next_poll_limit(self.poll_limit_ns, time.monotonic_ns() - self._turn_done_ns,
                                                 self.poll_max_ns)
        sockets = self._sockets
        fds = self._fds
        for sock, revents in ready:
            if type(sock) is int:  # a native endpoint's socket, or a wake-up pipe
                handlers = fds.get(sock)
                if handlers is None:
                    continue  # closed earlier in this turn
                on_read, on_write = handlers
                if revents & out and on_write is not None:
                    on_write()
                if revents & ~out and on_read is not None and sock in fds:
                    on_read()
                continue
            s = sockets.get(sock)
            if s is not None and s.drain is not None:
                s.drain()
        if timers:
            now = time.monotonic_ns()
            while timers and timers[0][0] <= now:
                h = heapq.heappop(timers)[2]
                if not h.cancelled:
                    h.cancelled = True
                    h.fn()
        calls = self._calls
        while calls:
            calls.popleft()()
        answered = False
        for answers in self._turn_answers:
            if answers():
                answered = True
        if answered and self.yield_after_answers:
            self._yield_after_answers()
        for fn in self._turn_end:
            fn()
        if self.poll_max_ns:
            self._turn_done_ns = time.monotonic_ns()

    def _yield_after_answers(self) -> None:
        """Every answer hook's answers have left: a client they woke on this CPU runs
        first, the turn's FORWARDs and bookkeeping after it. A yield that kept the loop
        away long ran other processes too, and whatever the turn still has to send waited
        for them: the loop then stops yielding for a while (the CPU is busy)."""
        start = time.monotonic_ns()
        if start < self._yield_paused_until:
            return
        self.yields += 1
        os.sched_yield()
        took = time.monotonic_ns() - start
        if took > YIELD_LONG_NS:
            self.yields_long += 1
            self._yield_paused_until = start + took * (1 + YIELD_PAUSE_FACTOR)

    def _poll_before_sleeping(self) -> None:
        """Poll without blocking for up to ``poll_limit_ns`` (never past the next timer),
        yielding the CPU between polls so that whatever else is runnable on it goes first;
        back as soon as anything is ready (the next turn's poll returns at once)."""
        start = time.monotonic_ns()
        for fn in self._before_poll:
            fn()
        end = start + self.poll_limit_ns
        t = self._next_timer()
        if t is not None and t < end:
            end = t
        items = self._poll_items
        poller = self._fd_poller
        now = start
        while not self._calls:
            ready = zmq_poll(items, 0) if self._sockets else poller.poll(0)
            before = now
            now = time.monotonic_ns()
            if ready:
                self.polls_found += 1
                break
            if now >= end:
                break
            if now - before > POLL_YIELDED_NS:
                # The yield let another task run: polling on would take turns with it
                # (the kernel's haltpoll polls only on a CPU with nothing else to run).
                self.polls_cut += 1
                break
            os.sched_yield()
        self.polled_ns += now - start

    def wake_on_signals(self) -> None:
        """Let a signal end the poll (the handler runs, and may :meth:`stop` the loop, at
        once), so that :meth:`run_forever` can wait up to IDLE_WAIT_MS. Main thread only."""
        if self._signal_rx is not None:
            return
        self._signal_rx, self._signal_tx = self._pipe()
        signal.set_wakeup_fd(self._signal_tx.fileno(), warn_on_full_buffer=False)

    def run_forever(self) -> None:
        # Without both wake-ups (other threads', signals') a longer poll would delay them.
        wait_ms = IDLE_WAIT_MS if self._wake_rx is not None and self._signal_rx is not None else MAX_WAIT_MS
        while self.running:
            self.run_once(wait_ms)
            if self.poll_limit_ns and self.running:
                self._poll_before_sleeping()

    def run_until(self, done: Callable[[], bool], timeout_ns: int | None = None,
                  focus: Callable[[], list[Any]] | None = None) -> bool:
        """Turn until ``done()`` (True) or ``timeout_ns`` passed (False). ``focus`` (if
        given) names, before each turn, the only endpoints worth listening to."""
        if done():
            return True
        deadline = None if timeout_ns is None else time.monotonic_ns() + timeout_ns
        while True:
            wait_ms = MAX_WAIT_MS
            if deadline is not None:
                left = deadline - time.monotonic_ns()
                if left <= 0:
                    return done()
                wait_ms = min(wait_ms, -(-left // 1_000_000))
            self.run_once(wait_ms, None if focus is None else focus())
            if done():
                return True

    def stop(self) -> None:
        self.running = False

    def close(self) -> None:
        """Close every socket (and the context, if this runtime made it)."""
        for ep in list(self._native):
            ep.close()
        for s in list(self._all):
            s.sock.close(0)
        self._sockets.clear()
        self._all.clear()
        if self._zap is not None:
            self._zap.stop()
            self._zap = None
        if self._signal_rx is not None:
            signal.set_wakeup_fd(-1)
        for pipe_end in (self._wake_rx, self._wake_tx, self._signal_rx, self._signal_tx):
            if pipe_end is not None:
                pipe_end.close()
        self._wake_rx = self._wake_tx = self._signal_rx = self._signal_tx = None
        self._poll_items = []
        self._fds.clear()
        self._fd_poller = select.poll()
        if self._own_ctx:
            self.ctx.destroy(linger=0)


def round_trip(addr: str, frame: bytes, timeout_ns: int, max_bytes: int = -1,
               credentials: Credentials | None = None) -> bytes | None:
    """Send ``frame`` on a DEALER to the ROUTER at ``addr`` and wait for one frame back
    (None: nothing came within ``timeout_ns``); for one-off probes (a replica's STATUS)."""
    rt = ZmqRuntime(wake=False, drain_limit=1, credentials=credentials)
    got: list[bytes] = []
    try:
        rt.dealer(addr, got.append, "probe", max_bytes).send(frame)
        rt.run_until(lambda: bool(got), timeout_ns)
        return got[0] if got else None
    finally:
        rt.close()
