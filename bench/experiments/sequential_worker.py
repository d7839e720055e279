"""Process bodies of the sequential-access experiment: open-loop writers and one subscriber.

Both run in fresh interpreters (multiprocessing "spawn") and talk to the orchestrator in
:mod:`bench.experiments.sequential` through queues only.

Every record carries a header that the subscriber decodes: the phase it belongs to, the
writer's shard, the logical client, its sequence number, the time it was *meant* to be
issued (the open-loop schedule) and the time InsertAfter was actually called, both from
``time.monotonic_ns()``, which reads CLOCK_MONOTONIC: one clock for every process on the
machine, so a latency can be computed in another process than the one that stamped it.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import struct
import time
from dataclasses import dataclass
from typing import Any

import numpy as np


def _attach_release_tracker(sub: Any) -> "_ReleaseTracker":
    """Watch ``sub``'s batches through its documented diagnostic hook."""
    tracker = _ReleaseTracker()
    sub.observe_batches(tracker.on_batch)
    return tracker


def _buffered_records(sub: Any) -> int:
    return int(sub.buffered)


MAGIC = b"ZLSQ"
#: magic, phase, shard, logical client, sequence number, intended issue time, call time
HEADER = struct.Struct("<4sHHIIqq")
RECORD_BYTES = 4096
_FILL = bytes(RECORD_BYTES - HEADER.size)

#: Columns of a writer's per-insert array (int64 each).
ACK_COLUMNS = ("t_intended", "t_call", "t_ack", "gsn", "shard")
#: Columns of the subscriber's per-delivery array (int64 each). ``t_arrive``: when the
#: batch holding the record reached the subscriber; ``t_release``: when the batch that made
#: it deliverable arrived (the merge waited for that shard's progress); ``release_shard``:
#: which shard's batch that was; ``release_to``: how far that batch let delivery advance.
DELIVERY_COLUMNS = ("t_deliver", "phase", "shard", "client", "seq", "t_intended", "t_call", "gsn",
                    "t_arrive", "t_release", "release_shard", "release_to", "release_nrec")


@dataclass(frozen=True)
class Segment:
    """``clients`` open-loop clients on ``shard`` from ``start_s`` to ``end_s`` (seconds
    after the phase start), each calling InsertAfter every t ~ U(0, 2T) microseconds."""

    shard: int
    start_s: float
    end_s: float
    clients: int
    T_us: float


@dataclass(frozen=True)
class PhaseSpec:
    phase: int
    start_ns: int  # monotonic; the schedule's time zero
    segments: tuple[Segment, ...]
    #: A writer process never has more inserts outstanding than this: past it, scheduled
    #: calls are counted as not issued rather than piling up tasks on a saturated cluster.
    max_in_flight: int
    #: After the last scheduled call, how long outstanding inserts may still take.
    drain_s: float
    seed: int


def payload(phase: int, shard: int, client: int, seq: int, t_intended: int, t_call: int) -> bytes:
    return HEADER.pack(MAGIC, phase, shard, client, seq, t_intended, t_call) + _FILL


def schedule(spec: PhaseSpec, shards: list[int]) -> np.ndarray:
    """The phase's intended calls for ``shards``, sorted by time: rows of (t_ns, shard, client).

    Each client's first call comes U(0, 2T) after its segment starts (so the clients are
    not in step), then one every U(0, 2T)."""
    rng = np.random.default_rng(spec.seed)
    parts: list[np.ndarray] = []
    for si, seg in enumerate(spec.segments):
        if seg.shard not in shards or seg.clients <= 0:
            continue
        span_ns = (seg.end_s - seg.start_s) * 1e9
        mean_ns = seg.T_us * 1e3
        n_expected = span_ns / mean_ns
        n_draw = int(n_expected + 6 * np.sqrt(n_expected) + 16)
        for c in range(seg.clients):
            gaps = rng.uniform(0.0, 2.0 * mean_ns, n_draw)
            times = np.cumsum(gaps)
            while times[-1] < span_ns:  # (practically never) drew too few
                times = np.concatenate([times, times[-1] + np.cumsum(rng.uniform(0.0, 2.0 * mean_ns, n_draw))])
            times = times[times < span_ns]
            t_ns = spec.start_ns + int(seg.start_s * 1e9) + times.astype(np.int64)
            rows = np.empty((t_ns.size, 3), dtype=np.int64)
            rows[:, 0] = t_ns
            rows[:, 1] = seg.shard
            rows[:, 2] = si * 4096 + c
            parts.append(rows)
    if not parts:
        return np.empty((0, 3), dtype=np.int64)
    allrows = np.concatenate(parts)
    return allrows[np.argsort(allrows[:, 0], kind="stable")]


# -- writer ---------------------------------------------------------------------------------------

class _ScalogShard:
    """The Scalog-style log pinned to one shard, as the phases use a client."""

    def __init__(self, log: Any, shard: int) -> None:
        self.log, self.shard = log, shard
        self.stats: dict[str, Any] = {}

    async def insert_after(self, data: bytes) -> Any:
        return await self.log.insert_after(data, shard=self.shard)

    async def close(self) -> None:
        pass


def writer_main(worker: int, shards: list[int], zk_hosts: str | list[list[str]], cmd_q: Any, res_q: Any,
                insert_timeout_s: float) -> None:
    """A writer process for ``shards`` (one AsyncClient per shard, ``Policy.fixed``; or,
    when ``zk_hosts`` is the Scalog-style log's server addresses, its client pinned to
    each shard).

    Waits for ``("phase", PhaseSpec)`` commands on ``cmd_q`` and answers each with
    ``("phase_done", worker, phase, result)``; ``("quit",)`` ends it. Sends ``("ready",
    worker, None)`` or ``("failed", worker, why)`` first."""
    import ziplog
    import ziplog.aio

    async def main() -> None:
        clients: dict[int, Any] = {}
        scalog = None
        try:
            if isinstance(zk_hosts, list):
                from bench.systems.scalog_log import AsyncScalogLog
                scalog = AsyncScalogLog(zk_hosts, timeout_s=insert_timeout_s)
                clients = {s: _ScalogShard(scalog, s) for s in shards}
            for s in shards:
                if s not in clients:
                    clients[s] = await ziplog.AsyncClient.connect(zk_hosts, timeout=insert_timeout_s,  # type: ignore[arg-type]
                                                                  policy=ziplog.Policy.fixed(s))
        except BaseException as e:
            res_q.put(("failed", worker, f"{type(e).__name__}: {e}"))
            for c in clients.values():
                with contextlib.suppress(Exception):
                    await c.close()
            return
        res_q.put(("ready", worker, None))
        try:
            while True:
                try:
                    cmd = await asyncio.to_thread(cmd_q.get, True, 1.0)
                except queue.Empty:
                    continue
                if cmd[0] == "quit":
                    return
                if cmd[0] == "phase":
                    result = await _run_phase(cmd[1], shards, clients)
                    res_q.put(("phase_done", worker, cmd[1].phase, result))
        finally:
            for c in clients.values():
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(c.close(), 5.0)
            if scalog is not None:
                await scalog.close()

    try:
        ziplog.aio.run(main())
    except BaseException as e:
        with contextlib.suppress(Exception):
            res_q.put(("failed", worker, f"{type(e).__name__}: {e}"))


async def _run_phase(spec: PhaseSpec, shards: list[int], clients: dict[int, Any]) -> dict[str, Any]:
    """Issue the phase's calls on schedule, each in its own task (open loop: a call never
    waits for an earlier one), and collect every acknowledgement."""
    plan = schedule(spec, shards)
    acks: list[tuple[int, int, int, int, int]] = []
    errors: dict[str, int] = {}
    first_errors: list[str] = []
    lag_ns: list[int] = []
    tasks: set[asyncio.Task[None]] = set()
    not_issued = 0
    seqs: dict[int, int] = {}
    stats_before = {s: dict(c.stats) for s, c in clients.items()}

    async def one(shard: int, client_no: int, seq: int, t_intended: int) -> None:
        t_call = time.monotonic_ns()
        data = payload(spec.phase, shard, client_no, seq, t_intended, t_call)
        try:
            rid = await clients[shard].insert_after(data)
        except Exception as e:  # ziplog errors (timeouts, no shard) are counted, not fatal
            errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
            if len(first_errors) < 5:
                first_errors.append(f"{(time.monotonic_ns() - spec.start_ns) / 1e9:.3f} s, shard {shard}: "
                                    f"{type(e).__name__}: {e}")
            return
        acks.append((t_intended, t_call, time.monotonic_ns(), rid.gsn, rid.shard))

    loop = asyncio.get_running_loop()
    i, n = 0, len(plan)
    while i < n:
        now = time.monotonic_ns()
        t_next = int(plan[i, 0])
        if t_next > now:
            await asyncio.sleep((t_next - now) / 1e9)
            continue
        # Everything due by now goes out in this turn: timers have ~1 ms resolution, so
        # a late wake-up issues the calls it overslept, each still stamped with when it
        # was meant to go (t_intended) and when it went (t_call).
        while i < n and plan[i, 0] <= now:
            shard, client_no = int(plan[i, 1]), int(plan[i, 2])
            if len(tasks) >= spec.max_in_flight:
                not_issued += 1
            else:
                seq = seqs.get(client_no, 0) + 1
                seqs[client_no] = seq
                lag_ns.append(now - int(plan[i, 0]))
                t = loop.create_task(one(shard, client_no, seq, int(plan[i, 0])))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            i += 1
        await asyncio.sleep(0)  # let the new tasks send before the next check
    if tasks:
        _, still = await asyncio.wait(set(tasks), timeout=spec.drain_s)
        for t in still:
            t.cancel()
        if still:
            await asyncio.gather(*still, return_exceptions=True)
            errors["cancelled_at_drain"] = errors.get("cancelled_at_drain", 0) + len(still)
    stats = {s: {k: c.stats.get(k, 0) - stats_before[s].get(k, 0) for k in c.stats} for s, c in clients.items()}
    arr = np.asarray(acks, dtype=np.int64).reshape(-1, len(ACK_COLUMNS))
    return {"acks": arr, "scheduled": n, "not_issued": not_issued, "errors": errors, "first_errors": first_errors,
            "lag_ns": np.asarray(lag_ns, dtype=np.int64), "client_stats": stats}


# -- subscriber -----------------------------------------------------------------------------------

class _ReleaseTracker:
    """Learns from a subscription's batches, per record, when its own batch arrived and
    which shard's batch finally let the merge deliver it (the shard it waited for)."""

    def __init__(self) -> None:
        self.arrive: dict[int, int] = {}  # gsn -> arrival time of its batch
        #: (t, shard, delivered up to, records in the batch), in arrival order
        self.releases: list[tuple[int, int, int, int]] = []
        self._next = 0

    def on_batch(self, shard: int, gsns: list[int], before: int, delivered: int) -> None:
        t = time.monotonic_ns()
        arrive = self.arrive
        for g in gsns:
            arrive[g] = t
        if delivered > before:
            self.releases.append((t, shard, delivered, len(gsns)))

    def release_of(self, gsn: int) -> tuple[int, int, int, int]:
        """The first release whose delivery point covers ``gsn`` (deliveries come in gsn
        order, so a pointer that only moves forward finds it)."""
        rel = self.releases
        j = self._next
        while j < len(rel) - 1 and rel[j][2] < gsn:
            j += 1
        if j > 4096:  # forget what no later record can need
            del rel[:j]
            j = 0
        self._next = j
        return rel[j] if rel else (0, -1, 0, 0)


def subscriber_main(zk_hosts: str | list[list[str]], ctrl_q: Any, res_q: Any, stop: Any) -> None:
    """Follows the log from its start and records, per record of this experiment, the
    columns of :data:`DELIVERY_COLUMNS`. ``("flush", n)`` on ``ctrl_q`` sends
    ``("deliveries", n, array, info)`` with what was delivered since the last flush.
    ``zk_hosts`` a list: the Scalog-style log's servers (no batch hook: the release
    columns stay 0)."""
    import ziplog

    client: Any = None
    try:
        if isinstance(zk_hosts, list):
            from bench.systems.scalog_log import BlockingScalogSubscription
            sub: Any = BlockingScalogSubscription(zk_hosts)
            tracker = _ReleaseTracker()
        else:
            client = ziplog.Client(zk_hosts, timeout=10.0)
            sub = client.subscribe(ziplog.RID_GENESIS)
            tracker = _attach_release_tracker(sub)
    except BaseException as e:
        res_q.put(("failed", "sub", f"{type(e).__name__}: {e}"))
        return
    res_q.put(("ready", "sub", None))
    rows: list[tuple[int, ...]] = []
    info: dict[str, Any] = {"others": 0, "order_violations": 0, "errors": []}
    last_gsn = 0
    unpack = HEADER.unpack_from
    hsize = HEADER.size
    next_ctrl = 0
    try:
        while not stop.is_set():
            now = time.monotonic_ns()
            if now >= next_ctrl:
                # A multiprocessing queue costs a lock and a poll per look: not per record.
                next_ctrl = now + 50_000_000
                with contextlib.suppress(queue.Empty):
                    while True:
                        msg = ctrl_q.get_nowait()
                        if msg[0] == "flush":
                            arr = np.asarray(rows, dtype=np.int64).reshape(-1, len(DELIVERY_COLUMNS))
                            rows = []
                            res_q.put(("deliveries", msg[1], arr, dict(info, buffered=_buffered_records(sub))))
            try:
                rec = sub.next(timeout=0.05)
            except Exception as e:
                if len(info["errors"]) < 20:
                    info["errors"].append(f"{type(e).__name__}: {e}")
                time.sleep(0.05)
                continue
            if rec is None:
                continue
            t = time.monotonic_ns()
            gsn = rec.rid.gsn
            if gsn <= last_gsn:
                info["order_violations"] += 1
            last_gsn = gsn
            t_arrive = tracker.arrive.pop(gsn, 0)
            rel = tracker.release_of(gsn)
            data = rec.data
            if len(data) < hsize or data[:4] != MAGIC:
                info["others"] += 1
                continue
            _, phase, _, client_no, seq, t_int, t_call = unpack(data)
            rows.append((t, phase, rec.rid.shard, client_no, seq, t_int, t_call, gsn,
                         t_arrive, rel[0], rel[1], rel[2], rel[3]))
    except BaseException as e:
        info["errors"].append(f"{type(e).__name__}: {e}")
        res_q.put(("failed", "sub", f"{type(e).__name__}: {e}"))
    finally:
        with contextlib.suppress(Exception):
            sub.close()
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
