"""Load generators. Every client runs in a worker process of its own (multiprocessing,
``spawn``), so a client's CPU never shares the GIL with another system's client or with
the harness, and the harness can drive several systems in alternating rounds.

* :class:`ClosedLoopClient`: one blocking appender; ``measure(n)`` times ``n``
  sequential appends (the latency of one client with nothing else in flight).
* :class:`ClientPool`: ``clients`` asyncio appenders spread over a few worker processes
  (one event loop each, uvloop when installed), each appender its own connection(s):
  - ``open_loop(rate, seconds)``: the dissertation's open loop (4.4.1): for a target of
    x appends/s and n clients, each client appends x/n times within each second, at
    times chosen uniformly at random, without waiting for earlier appends. A
    request's latency runs from its call to its acknowledgement (the paper's
    definition); how late the call left after its intended time (``lag``: the event
    loop's timers have 1 ms resolution, and a saturated client falls behind) is
    reported beside it, so a run whose generator could not keep up shows it.
  - ``saturate(depth, seconds)``: each client keeps ``depth`` appends in flight
    (pipelined); the throughput a system sustains.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random
import time
import traceback
from array import array
from dataclasses import dataclass, field
from typing import Any

from .systems.base import ClientSpec, Unavailable, counters

_CTX = mp.get_context("spawn")
START_TIMEOUT_S = 120.0
#: an open-loop append may leave this much before its intended time
EARLY_NS = 100_000


def stop_processes(procs: list[Any], grace_s: float) -> None:
    """Wait up to ``grace_s`` in all for ``procs`` (multiprocessing processes) to end by
    themselves, then terminate, then kill whatever is left."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(deadline - time.monotonic(), 0.05))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=1.0)


def fast_path_ratio(counts: dict[str, int]) -> float | None:
    """ziplog's clients' fast-path inserts over all their settled inserts (None for a
    system whose clients count no paths)."""
    fast, slow = counts.get("fast_path"), counts.get("slow_path")
    if fast is None or slow is None or fast + slow == 0:
        return None
    return fast / (fast + slow)


def _merge_counts(into: dict[str, int], more: dict[str, int]) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0) + int(v)


def _reply(conn: Any, timeout: float, what: str, proc: Any) -> Any:
    """The worker's next answer; Unavailable when it reports an error, dies or is silent."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise Unavailable(f"{what}: worker process exited ({proc.exitcode})")
        if time.monotonic() > deadline:
            raise Unavailable(f"{what}: no answer in {timeout:.0f} s")
    status, *rest = conn.recv()
    if status == "error":
        raise Unavailable(f"{what}: {rest[0]}")
    return rest


# -- closed loop, one blocking client ----------------------------------------------------------
def _closed_loop_main(spec: ClientSpec, conn: Any) -> None:
    try:
        appender = spec.open_sync()
    except BaseException:
        conn.send(("error", traceback.format_exc(limit=3)))
        return
    conn.send(("ready",))
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "close":
                break
            _, n, size, warmup = cmd
            payload = os.urandom(size)
            append, clock = appender.append, time.perf_counter_ns
            try:
                for _ in range(warmup):
                    append(payload)
                before = counters(appender)
                out = array("q", bytes(8 * n))
                import gc
                gc.collect()
                for i in range(n):
                    t0 = clock()
                    append(payload)
                    out[i] = clock() - t0
                after = counters(appender)
                conn.send(("ok", out.tobytes(), {k: after[k] - before.get(k, 0) for k in after}))
            except BaseException:
                conn.send(("error", traceback.format_exc(limit=3)))
    finally:
        appender.close()


class ClosedLoopClient:
    """One blocking client of ``spec`` in its own process."""

    def __init__(self, spec: ClientSpec, name: str) -> None:
        self.name = name
        self.conn, child = _CTX.Pipe()
        self.proc = _CTX.Process(target=_closed_loop_main, args=(spec, child), daemon=True, name=f"client-{name}")
        self.proc.start()
        try:
            _reply(self.conn, START_TIMEOUT_S, f"{name} client", self.proc)
        except BaseException:
            self.close()
            raise

    def measure(self, n: int, size: int, warmup: int = 0, timeout: float = 600.0) -> tuple[array, dict[str, int]]:
        """``warmup`` untimed appends, then ``n`` timed ones: latencies in ns, counters."""
        self.conn.send(("measure", n, size, warmup))
        raw, counts = _reply(self.conn, timeout, f"{self.name} measurement", self.proc)
        samples = array("q")
        samples.frombytes(raw)
        return samples, counts

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("close",))
            except (BrokenPipeError, OSError):
                pass
            stop_processes([self.proc], 10)

    def __enter__(self) -> "ClosedLoopClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- many asyncio clients --------------------------------------------------------------------
@dataclass
class LoadResult:
    """What one open-loop or saturating run measured, over every client."""

    samples_ns: array = field(default_factory=lambda: array("q"))  # per append: called -> acked
    lag_ns: array = field(default_factory=lambda: array("q"))      # open loop: intended -> sent
    acked: int = 0
    errors: int = 0
    unfinished: int = 0       # still in flight when the run's drain time was up
    seconds: float = 0.0      # measured window
    counters: dict[str, int] = field(default_factory=dict)
    error_examples: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.acked / self.seconds if self.seconds > 0 else 0.0

    def add(self, other: "LoadResult") -> None:
        self.samples_ns.extend(other.samples_ns)
        self.lag_ns.extend(other.lag_ns)
        self.acked += other.acked
        self.errors += other.errors
        self.unfinished += other.unfinished
        self.seconds = max(self.seconds, other.seconds)
        _merge_counts(self.counters, other.counters)
        self.error_examples.extend(other.error_examples[: 3 - len(self.error_examples)])


def _uniform_schedule(rng: random.Random, rate: float, seconds: float) -> list[float]:
    """The paper's open loop for one client: ``rate`` appends in each second (the
    fraction carried over), at uniformly random times within that second."""
    out: list[float] = []
    carry = 0.0
    sec = 0
    while sec < seconds:
        span = min(1.0, seconds - sec)
        want = rate * span + carry
        k = int(want)
        carry = want - k
        out.extend(sec + rng.random() * span for _ in range(k))
        sec += 1
    out.sort()
    return out


async def _open_loop_client(appender: Any, times: list[float], t0_ns: int, warmup_s: float, payload: bytes,
                            res: LoadResult, inflight: set[asyncio.Task[None]]) -> None:
    """``times`` are offsets in seconds from ``t0_ns`` (a ``perf_counter_ns``: the event
    loop's own clock has millisecond resolution under uvloop, too coarse for lag)."""
    clock = time.perf_counter_ns

    async def one(intended_ns: int, counted: bool) -> None:
        sent = clock()
        try:
            await appender.append(payload)
        except Exception as e:
            if counted:
                res.errors += 1
                if len(res.error_examples) < 3:
                    res.error_examples.append(f"{type(e).__name__}: {e}")
            return
        if counted:
            res.samples_ns.append(clock() - sent)
            res.lag_ns.append(sent - intended_ns)
            res.acked += 1

    for t in times:
        intended_ns = t0_ns + int(t * 1e9)
        # libuv's timers count from a cached loop time and can fire up to ~1 ms early:
        # sleep again until within EARLY_NS of the intended time
        while (delay_ns := intended_ns - clock()) > EARLY_NS:
            await asyncio.sleep(delay_ns / 1e9)
        task = asyncio.ensure_future(one(intended_ns, t >= warmup_s))
        inflight.add(task)
        task.add_done_callback(inflight.discard)


async def _saturating_client(appender: Any, depth: int, t_start: float, t_end: float, payload: bytes,
                             res: LoadResult) -> None:
    loop = asyncio.get_running_loop()
    clock = time.perf_counter_ns

    async def lane() -> None:
        while loop.time() < t_end:
            t0 = clock()
            try:
                await appender.append(payload)
            except Exception as e:
                res.errors += 1
                if len(res.error_examples) < 3:
                    res.error_examples.append(f"{type(e).__name__}: {e}")
                continue
            if loop.time() >= t_start:
                res.samples_ns.append(clock() - t0)
                res.acked += 1

    await asyncio.gather(*(lane() for _ in range(depth)))


async def _pool_worker(spec: ClientSpec, n_clients: int, seed: int, conn: Any) -> None:
    loop = asyncio.get_running_loop()
    appenders: list[Any] = []
    try:
        for _ in range(n_clients):
            appenders.append(await spec.open_async())
    except BaseException:
        conn.send(("error", traceback.format_exc(limit=3)))
        for a in appenders:
            await a.close()
        return
    conn.send(("ready",))
    rng = random.Random(seed)
    try:
        while True:
            cmd = await loop.run_in_executor(None, conn.recv)
            if cmd[0] == "close":
                break
            kind, arg, seconds, warmup_s, size, drain_s, start_wall = cmd
            payload = os.urandom(size)
            res = LoadResult()
            before: dict[str, int] = {}
            for a in appenders:
                _merge_counts(before, counters(a))
            # every worker starts at the same wall-clock instant
            await asyncio.sleep(max(0.0, start_wall - time.time()))
            t0 = loop.time()
            if kind == "open":
                inflight: set[asyncio.Task[None]] = set()
                t0_ns = time.perf_counter_ns()
                await asyncio.gather(*(
                    _open_loop_client(a, _uniform_schedule(rng, arg, seconds + warmup_s), t0_ns, warmup_s, payload,
                                      res, inflight)
                    for a in appenders))
                if inflight:
                    await asyncio.wait(set(inflight), timeout=drain_s)
                res.unfinished = len(inflight)
                for t in list(inflight):
                    t.cancel()
                res.seconds = seconds
            else:
                await asyncio.gather(*(_saturating_client(a, int(arg), t0 + warmup_s, t0 + warmup_s + seconds,
                                                          payload, res) for a in appenders))
                res.seconds = seconds
            after: dict[str, int] = {}
            for a in appenders:
                _merge_counts(after, counters(a))
            res.counters = {k: v - before.get(k, 0) for k, v in after.items()}
            conn.send(("ok", res))
    finally:
        for a in appenders:
            try:
                await asyncio.wait_for(a.close(), 10)
            except Exception:
                pass


def _pool_main(spec: ClientSpec, n_clients: int, seed: int, conn: Any) -> None:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_pool_worker(spec, n_clients, seed, conn))


class ClientPool:
    """``clients`` asyncio clients of ``spec`` over ``min(clients, max_workers)`` processes."""

    def __init__(self, spec: ClientSpec, clients: int, name: str, max_workers: int = 4, seed: int = 1) -> None:
        self.name = name
        self.clients = clients
        self._pending = 0.0
        n_workers = max(1, min(clients, max_workers))
        shares = [clients // n_workers + (1 if i < clients % n_workers else 0) for i in range(n_workers)]
        self.workers: list[tuple[Any, Any]] = []
        try:
            for i, share in enumerate(shares):
                conn, child = _CTX.Pipe()
                proc = _CTX.Process(target=_pool_main, args=(spec, share, seed * 1000 + i, child), daemon=True,
                                    name=f"pool-{name}-{i}")
                proc.start()
                self.workers.append((proc, conn))
            for proc, conn in self.workers:
                _reply(conn, START_TIMEOUT_S + clients, f"{name} clients", proc)
        except BaseException:
            self.close()
            raise

    def begin(self, kind: str, arg: float, seconds: float, warmup_s: float, size: int, drain_s: float,
              start_wall: float | None = None) -> None:
        """Start a run in every worker (at ``start_wall``, a ``time.time()``, so that several
        pools can start together); :meth:`finish` collects it."""
        start_wall = time.time() + 0.2 if start_wall is None else start_wall
        self._pending = seconds + warmup_s + drain_s + 60 + max(0.0, start_wall - time.time())
        for _, conn in self.workers:
            conn.send((kind, arg, seconds, warmup_s, size, drain_s, start_wall))

    def finish(self) -> LoadResult:
        total = LoadResult()
        for proc, conn in self.workers:
            (res,) = _reply(conn, self._pending, f"{self.name} load", proc)
            total.add(res)
        return total

    def _run(self, kind: str, arg: float, seconds: float, warmup_s: float, size: int, drain_s: float) -> LoadResult:
        self.begin(kind, arg, seconds, warmup_s, size, drain_s)
        return self.finish()

    def open_loop(self, rate: float, seconds: float, size: int, warmup_s: float = 0.5,
                  drain_s: float = 5.0) -> LoadResult:
        """Offer ``rate`` appends/s in all (split evenly over the clients) for ``seconds``."""
        return self._run("open", rate / self.clients, seconds, warmup_s, size, drain_s)

    def saturate(self, depth: int, seconds: float, size: int, warmup_s: float = 0.5) -> LoadResult:
        """Every client keeps ``depth`` appends in flight for ``seconds``."""
        return self._run("saturate", depth, seconds, warmup_s, size, 0.0)

    def close(self) -> None:
        for proc, conn in self.workers:
            if proc.is_alive():
                try:
                    conn.send(("close",))
                except (BrokenPipeError, OSError):
                    pass
        stop_processes([proc for proc, _ in self.workers], 15)
        self.workers = []

    def __enter__(self) -> "ClientPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
