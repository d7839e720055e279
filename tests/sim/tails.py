"""Where a subscriber's delivery waits, with the machine taken out: the whole system
(``tests/sim/system.py``: the same drivers and cores) in a quiet world, with no fault,
no loss, no reordering, 10 ms epochs, hops of 20-200 us and no time spent computing.
``bench sequential`` measures the same figures on real processes, where a busy machine's
scheduling adds to every hop; what remains here is the protocol's own share.

Per record (reader 0, reading each shard from the replica ``Client.subscribe`` picks: the
first to know a record is stable, the backup of a two-replica shard):
when the app called InsertAfter, when it was acknowledged, when it was delivered, and
whether it was delivered only after the next epoch was broadcast although it was
acknowledged before (**released at the close**: no NOTICE let the other shards pass it
in time). ::

    python -m tests.sim.tails --seeds 20 [--first 0]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Callable

from tests.sim.system import MS, US, App, SystemSim
from tests.sim.world import NetParams
from ziplog.cores.client.calls import InsertCall
from ziplog.cores.client.subscription import first_to_know
from ziplog.cores.replica.settings import ReplicaSettings
from ziplog.protocol.gsna import epoch_of

#: a NOTICE held back by the notice interval (1 ms), then its hops and the pass's
#: replication (a few hops of at most 200 us)
NOTICE_ROUND_NS = 2 * MS
#: records are timed from one epoch after the first began
WARMUP_NS = 10 * MS


def quiet() -> NetParams:
    """A world with nothing but hop delays."""
    return NetParams(min_delay=20 * US, max_delay=200 * US, reorder=0.0, duplicate=0.0, client_loss=0.0,
                     peer_loss=0.0, epoch_loss=0.0, control_loss=0.0, notice_loss=0.0)


@dataclass
class Tails:
    """What one or more seeds measured (times in ns)."""

    records: int = 0
    at_close: int = 0
    #: ... of which acknowledged at least NOTICE_ROUND_NS before the close: time enough
    #: for a NOTICE and the pass it asks for, so the close was not their only way out
    at_close_in_time: int = 0
    #: per delivered record: (InsertAfter -> ack, InsertAfter -> delivery)
    latencies: list[tuple[int, int]] = field(default_factory=list)

    def add(self, other: "Tails") -> None:
        self.records += other.records
        self.at_close += other.at_close
        self.at_close_in_time += other.at_close_in_time
        self.latencies += other.latencies

    def summary(self) -> dict[str, Any]:
        ins = sorted(a for a, _ in self.latencies)
        seq = sorted(d for _, d in self.latencies)

        def pct(xs: list[int], q: float) -> int:
            return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0

        return {"records": self.records,
                "released_at_close_pct": round(100.0 * self.at_close / max(self.records, 1), 2),
                "of_them_acked_in_time_pct": round(100.0 * self.at_close_in_time / max(self.records, 1), 2),
                "insert_p50_us": pct(ins, 0.5) // 1000, "seq_p50_us": pct(seq, 0.5) // 1000,
                "seq_p99_us": pct(seq, 0.99) // 1000,
                "seq_over_insert": round(pct(seq, 0.5) / max(pct(ins, 0.5), 1), 2),
                "seq_p99_over_p50": round(pct(seq, 0.99) / max(pct(seq, 0.5), 1), 2)}


class TailsSim(SystemSim):
    """The system simulation in the quiet world, timing every record."""

    def __init__(self, seed: int, shards: int = 6, clients: int = 12, inserts: int = 40, think_ms: int = 20,
                 trace: bool = False) -> None:
        super().__init__(seed, trace=trace, shards=shards, clients=clients, inserts=inserts, faults=0,
                         net=quiet(), add_shard=False, remove_shard=False, stops=0)
        self.epoch_ns = 10 * MS
        self.think_us = think_ms * 1000
        self.replicas = 2
        self.power_after_install = 0.0
        self.world.requeue_unbound = 0.0
        # the shipped settings for what decides when a slot passes
        self.settings.update(noop_timeout_ns=0, notice_interval_ns=1 * MS, forward_by_reference=False,
                             clock_pass_rate=ReplicaSettings.clock_pass_rate)
        self.published_at: dict[int, int] = {}
        self.started_at: dict[bytes, int] = {}
        self.acked_at: dict[bytes, int] = {}
        self.delivered_at: dict[bytes, tuple[int, int]] = {}  # data -> (gsn, when)
        for app in self.clients:
            self._time_app(app)
        self._time_reader()

    def _tap(self, kind: str, endpoint: Any, frame: bytes, route: bytes | None) -> Callable[[], None] | None:
        known = set(self.configs)
        after = super()._tap(kind, endpoint, frame, route)
        for e in set(self.configs) - known:
            self.published_at[e] = self.now
        return after

    def _time_app(self, app: App) -> None:
        insert, finished = app.insert, app.finished

        def timed_insert() -> None:
            insert()
            if app.call is not None:
                self.started_at[app.call.data] = self.now

        def timed_finished(call: InsertCall) -> None:
            self.acked_at[call.data] = self.now
            finished(call)

        app.insert = timed_insert  # type: ignore[method-assign]
        app.finished = timed_finished  # type: ignore[method-assign]

    def _time_reader(self) -> None:
        rd = self.readers[0]
        rd.pick = first_to_know  # type: ignore[method-assign, assignment]
        drain = rd.drain

        def timed_drain() -> None:
            n = len(rd.delivered)
            drain()
            for gsn, _, data in rd.delivered[n:]:
                self.delivered_at.setdefault(data, (gsn, self.now))

        rd.drain = timed_drain  # type: ignore[method-assign]

    def tails(self) -> Tails:
        """The records whose InsertAfter was called after the warm-up: once the first
        epoch had run (calls made before any epoch began wait for it, as at a real
        cluster's start, which ``bench sequential`` leaves out too)."""
        out = Tails()
        warm = min(self.published_at.values(), default=0) + WARMUP_NS
        for data, (gsn, when) in self.delivered_at.items():
            start, acked = self.started_at.get(data), self.acked_at.get(data)
            if start is None or acked is None or start < warm:
                continue  # an app retried it under a new call (timed there), or warming up
            out.records += 1
            out.latencies.append((acked - start, when - start))
            close = self.published_at.get(epoch_of(gsn) + 1)
            if close is not None and acked < close <= when:
                out.at_close += 1
                out.at_close_in_time += close - acked >= NOTICE_ROUND_NS
        return out


def run(seed: int, **kw: Any) -> Tails:
    sim = TailsSim(seed, **kw)
    try:
        sim.run()  # every invariant is checked as in the system simulation
        return sim.tails()
    finally:
        sim.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.sim.tails", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--first", type=int, default=0)
    args = ap.parse_args(argv)
    total = Tails()
    for seed in range(args.first, args.first + args.seeds):
        t = run(seed)
        print(f"seed {seed}: {t.summary()}", flush=True)
        total.add(t)
    print(f"all: {total.summary()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
