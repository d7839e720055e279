"""Experiment ``flow``: what BokiFlow's exactly-once costs (Boki journal Figs. 12-13).

On 2 shards x 2 replicas, one LogBook engine (its local index) and an SQLite database,
in one run, rounds taking turns:

* the **primitives** as a function sees them: ``env.write``, ``env.read``,
  ``env.invoke`` of a function that returns its input, ``env.try_lock`` + ``env.unlock``;
* one **workflow**: the demo's trip (``book_trip``: two invokes, a search of eight reads,
  a transaction of two locked reads and three writes), run from its intent to its end;

each beside an **unsafe baseline that logs nothing**: the same function on an
environment that goes straight to the database (a write at a fresh version, a read, a
plain call, a lock row written and cleared), which is what the functions would cost
without exactly-once. Ratios are BokiFlow / baseline medians (and p99s) of this run,
beside Boki's 3.3x / 1.8x for its workflows. The **time waiting for the log**: the share
of a BokiFlow workflow's time spent in the log's operations (appends and reads), the
rest being the database and the function itself. **Kept records**: the engine answers
a step's read of a record its subscription delivered from the records it keeps; every
other round sets those aside, so each read ends with a ``read_record`` as before, and
the table puts the two beside each other.

    python -m bench flow [--quick] [--out DIR]
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from ziplog.logbook.core import flow as fc
from ziplog.logbook.core import flow_records as fr
from ziplog.tools.stats import summarize

from ..report import Results, progress

COLUMNS = ["operation", "count", "flow_p50_us", "flow_p99_us", "unsafe_p50_us", "unsafe_p99_us", "p50_ratio",
           "p99_ratio", "added_p50_us", "log_share", "flow_p50_us, records read", "kept / read (p50)"]
#: Boki journal, Fig. 12-13: exactly-once over the unsafe baseline, median latency
BOKI_RATIOS = "3.3x (movie) / 1.8x (travel)"


def params_for(quick: bool) -> dict[str, Any]:
    return {"quick": quick, "shards": 2, "replicas": 2, "rounds": 4 if quick else 10,
            "per_round": 25 if quick else 50, "workflows_per_round": 5 if quick else 10}


class UnsafeEnv:
    """A function's environment that logs nothing: the baseline."""

    def __init__(self, db: Any, workflow: str, version: list[int]) -> None:
        self.db = db
        self.workflow = workflow
        self._version = version
        self.step = 0

    def _v(self) -> int:
        self._version[0] += 1
        return self._version[0]

    def write(self, table: str, key: str, value: Any) -> None:
        self.db.write(table, key, fc.pack(value), self._v())

    def read(self, table: str, key: str, default: Any = None) -> Any:
        data = self.db.read(table, key)
        return default if data is None else fc.unpack(data)

    def remember(self, make: Callable[[], Any]) -> Any:
        return make()

    def invoke(self, function: str, input: Any = None) -> Any:
        fn = FUNCTIONS.get(function)
        assert fn is not None, function
        self.step += 1
        return fn(UnsafeEnv(self.db, fr.callee_of(self.workflow, self.step), self._version), input)  # type: ignore[arg-type]

    def try_lock(self, name: str) -> bool:
        self.db.write("locks", name, self.workflow.encode(), self._v())
        return True

    def unlock(self, name: str) -> None:
        self.db.write("locks", name, b"", self._v())

    def transaction(self) -> "UnsafeTransaction":
        return UnsafeTransaction(self)


class UnsafeTransaction:
    def __init__(self, env: UnsafeEnv) -> None:
        self.env = env
        self.committed = False

    def read(self, table: str, key: str, default: Any = None) -> Any:
        return self.env.read(table, key, default)

    def write(self, table: str, key: str, value: Any) -> None:
        self.env.write(table, key, value)

    def __enter__(self) -> "UnsafeTransaction":
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        self.committed = kind is None


def _functions() -> Any:
    """The demo's travel functions, and ``echo`` (returns its input)."""
    from ziplog.logbook.flow import Functions
    from ziplog.logbook.flow import travel

    fns = Functions()
    for name in travel.functions.names():
        fns.register(travel.functions.get(name), name=name)
    fns.register(lambda env, value: value, name="echo")
    return fns


FUNCTIONS = _functions()


class LogClock:
    """The time a FlowBook spends in the log's operations (its hook's before/after)."""

    def __init__(self) -> None:
        self.log_ns = 0
        self._t = 0

    def hook(self, op: Any, phase: str) -> None:
        if type(op) in (fc.DbWrite, fc.DbRead, fc.Call):
            return
        if phase == "before":
            self._t = time.perf_counter_ns()
        else:
            self.log_ns += time.perf_counter_ns() - self._t


@contextlib.contextmanager
def _setup(p: dict[str, Any]) -> Iterator[tuple[Any, Any, Any]]:
    import ziplog
    from ziplog.logbook import LogBook
    from ziplog.logbook.flow import FlowBook, SqliteDatabase, Worker

    with tempfile.TemporaryDirectory(prefix="bench-flow-") as tmp, \
            ziplog.local_cluster(shards=p["shards"], replicas=p["replicas"]) as cluster:
        db = SqliteDatabase(os.path.join(tmp, "flow.sqlite"))
        unsafe_db = SqliteDatabase(os.path.join(tmp, "unsafe.sqlite"))
        lb = LogBook(cluster.zk_hosts, 70)
        try:
            flow = FlowBook(lb, db)
            Worker(flow, FUNCTIONS)  # runs the flow's invokes (it sets flow.call)
            yield flow, db, unsafe_db
        finally:
            lb.close()
            db.close()
            unsafe_db.close()


def _primitive(name: str, env: Any, i: int) -> None:
    if name == "write":
        env.write("bench", f"k{i % 64}", i)
    elif name == "read":
        env.read("bench", f"k{i % 64}")
    elif name == "invoke":
        env.invoke("echo", i)
    else:
        assert env.try_lock(f"lock{i % 64}")
        env.unlock(f"lock{i % 64}")


def run(quick: bool, out: Path | None) -> list[dict[str, Any]]:
    from ziplog.logbook.core.kept import KeptRecords
    from ziplog.logbook.flow import Env, FlowClient, run_workflow
    from ziplog.logbook.flow import travel

    p = params_for(quick)
    res = Results("flow", out, p)
    samples: dict[tuple[str, str], list[int]] = {}
    log_share: list[float] = []
    with _setup(p) as (flow, db, unsafe_db):
        version = [0]
        client = FlowClient(flow.lb)
        travel_setup = [("hotels", h, 10 ** 9) for h in travel.HOTELS] + [("flights", f, 10 ** 9) for f in travel.FLIGHTS]
        for table, key, n in travel_setup:  # rooms and seats that never run out
            db.write(table, key, fc.pack(n), 1)
            unsafe_db.write(table, key, fc.pack(n), 1)
        n = 0
        engine = flow.lb._engine
        kept = engine.kept
        for r in progress("flow", list(range(p["rounds"])), lambda r: f"round {r + 1}"):
            # even rounds: the engine's kept records; odd: set aside (each read reads the log)
            engine.kept = kept if r % 2 == 0 else KeptRecords(0)
            arm = "flow" if r % 2 == 0 else "flow, records read"
            for name in ("write", "read", "invoke", "lock"):
                env = Env(flow, f"prim-{r}-{name}")
                unsafe = UnsafeEnv(unsafe_db, f"u-{r}-{name}", version)
                for i in range(p["per_round"]):
                    for kind, e in ((arm, env), ("unsafe", unsafe)) if i % 2 == 0 else (("unsafe", unsafe), (arm, env)):
                        t0 = time.perf_counter_ns()
                        _primitive(name, e, n)
                        samples.setdefault((name, kind), []).append(time.perf_counter_ns() - t0)
                    n += 1
            for i in range(p["workflows_per_round"]):
                wf = f"trip-{r}-{i}"
                req = {"prefer": i % len(travel.HOTELS)}
                client.start("book_trip", req, wf)
                clock = LogClock()
                flow.hook = clock.hook
                t0 = time.perf_counter_ns()
                outcome = fc.unpack_outcome(run_workflow(flow, wf, FUNCTIONS.get))
                took = time.perf_counter_ns() - t0
                flow.hook = None
                assert outcome["booked"], outcome
                samples.setdefault(("workflow", arm), []).append(took)
                if arm == "flow":
                    log_share.append(clock.log_ns / took)
                t0 = time.perf_counter_ns()
                travel.book_trip(UnsafeEnv(unsafe_db, f"u-{wf}", version), req)  # type: ignore[arg-type]
                samples.setdefault(("workflow", "unsafe"), []).append(time.perf_counter_ns() - t0)
    rows = []
    for name in ("write", "read", "invoke", "lock", "workflow"):
        f, u = summarize(samples[(name, "flow")]), summarize(samples[(name, "unsafe")])
        row = {"operation": name if name != "lock" else "try_lock + unlock", "count": len(samples[(name, "flow")]),
               "flow_p50_us": round(f["p50_us"], 1), "flow_p99_us": round(f["p99_us"], 1),
               "unsafe_p50_us": round(u["p50_us"], 1), "unsafe_p99_us": round(u["p99_us"], 1),
               "p50_ratio": round(f["p50_us"] / u["p50_us"], 1), "p99_ratio": round(f["p99_us"] / u["p99_us"], 1),
               "added_p50_us": round(f["p50_us"] - u["p50_us"]), "log_share": ""}
        read = samples.get((name, "flow, records read"))
        if read:
            rp50 = summarize(read)["p50_us"]
            row["flow_p50_us, records read"] = round(rp50, 1)
            row["kept / read (p50)"] = round(f["p50_us"] / rp50, 2)
        if name == "workflow":
            share = sorted(log_share)[len(log_share) // 2]
            row["log_share"] = f"{share:.0%}"
        rows.append(row)
        res.log(f"  {row['operation']}: BokiFlow p50 {row['flow_p50_us']} us, unsafe {row['unsafe_p50_us']} us, "
                f"{row['p50_ratio']}x")
    res.write(rows, COLUMNS, "BokiFlow vs an unsafe baseline that logs nothing",
              intro=(f"{p['rounds']} rounds of {p['per_round']} of each primitive and {p['workflows_per_round']} trips "
                     f"(the demo's book_trip), BokiFlow and the baseline taking turns; one engine with its local "
                     f"index, SQLite, 2 shards x 2 replicas. Ratios are BokiFlow / baseline of this run; Boki "
                     f"reports {BOKI_RATIOS} for its workflows. log_share: the median share of a trip's time "
                     f"spent in the log's appends and reads; added_p50_us: what exactly-once adds to the median. "
                     f"BokiFlow's columns are the rounds whose engine answered reads from the records it kept; "
                     f"'records read': the other rounds, each read ending with a read_record."))
    return rows
