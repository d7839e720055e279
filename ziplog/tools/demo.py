"""``python -m ziplog.tools.demo`` (what ``make run`` runs): a local cluster and a short workload.

Starts ZooKeeper x3, the membership service x3 and 2 shards x 2 replicas on this
machine, then for a few seconds runs several writer threads (each its own Client)
doing InsertAfter chains of 4 KiB records while a subscriber follows the log from
its start. Checks that every insert returned a gsn above the record it was inserted
after, that the subscriber saw every record exactly once in strictly increasing gsn
order, and that old and recent records read back intact; then prints latencies.
Exits non-zero if a check fails.
"""

from __future__ import annotations

import os
import random
import struct
import sys
import threading
import time
import zlib
from typing import Any, Callable

from ziplog.protocol.types import RID_GENESIS, RecordId

MAGIC = b"ZLDM"
_HEADER = struct.Struct("<4sIIIQ")  # magic, run id, writer, index, insert start (perf_counter_ns)


def _payload(run_id: int, writer: int, index: int, t_ns: int, size: int) -> bytes:
    head = _HEADER.pack(MAGIC, run_id, writer, index, t_ns)
    fill = f"writer {writer} record {index};".encode()
    n = max(size - len(head), 0)
    return head + (fill * (n // len(fill) + 1))[:n]


def _header(data: bytes) -> tuple[int, int, int, int] | None:
    if len(data) < _HEADER.size or not data.startswith(MAGIC):
        return None
    _, run_id, writer, index, t_ns = _HEADER.unpack_from(data)
    return run_id, writer, index, t_ns


def _us(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v / 1000:.2f} ms" if v >= 1000 else f"{v:.0f} us"


class _DemoRun:
    """One run of the workload: writer threads doing InsertAfter chains, a subscriber
    following from the log's start, a read-back; each phase a method, every failure
    collected in ``failures``."""

    def __init__(self, zk_hosts: str, seconds: float, writers: int, record_size: int,
                 say: Callable[[str], None]) -> None:
        self.zk_hosts = zk_hosts
        self.seconds = seconds
        self.writers = writers
        self.record_size = record_size
        self.say = say
        self.run_id = int.from_bytes(os.urandom(4), "big")
        self.failures: list[str] = []
        self.lock = threading.Lock()
        # -- the subscriber's --
        self.writers_done = threading.Event()
        self.expected_total = 0  # set once the writers have finished
        self.sub_ready = threading.Event()
        self.seen: list[RecordId] = []
        self.delivery_ns: list[int] = []
        self.sub_state: dict[str, Any] = {"error": None, "order_ok": True, "others": 0}
        # -- the writers' --
        self.written: dict[RecordId, int] = {}  # rid -> crc32 of its data
        self.insert_ns: list[int] = []
        self.path = {"fast_path": 0, "slow_path": 0, "retries": 0}
        self.writer_errors: list[str] = []
        self.stop_at = 0.0  # set by the barrier's action, before any writer is released
        self.started_at = 0.0
        self.start = threading.Barrier(writers + 1, action=self._go)
        self.elapsed = 0.0
        # -- the read-back's --
        self.read_ns: list[int] = []
        self.read_ok = 0

    def _go(self) -> None:
        self.started_at = time.perf_counter()
        self.stop_at = self.started_at + self.seconds

    def subscriber(self) -> None:
        from ziplog.client.blocking import Client

        try:
            with Client(self.zk_hosts) as c, c.subscribe(RID_GENESIS) as sub:
                self.sub_ready.set()
                last_gsn = 0
                deadline = None
                while True:
                    rec = sub.next(timeout=0.2)
                    now = time.perf_counter_ns()
                    if rec is not None:
                        if rec.rid.gsn <= last_gsn:
                            self.sub_state["order_ok"] = False
                            self.sub_state["error"] = f"gsn {rec.rid.gsn} delivered after gsn {last_gsn}"
                        last_gsn = rec.rid.gsn
                        h = _header(rec.data)
                        if h is not None and h[0] == self.run_id:
                            self.seen.append(rec.rid)
                            self.delivery_ns.append(now - h[3])
                        else:
                            self.sub_state["others"] += 1  # records from before this run
                    if self.writers_done.is_set():
                        if deadline is None:
                            deadline = time.monotonic() + 20.0
                        if len(self.seen) >= self.expected_total or time.monotonic() > deadline:
                            return
        except BaseException as e:  # reported in the summary
            self.sub_state["error"] = f"{type(e).__name__}: {e}"
            self.sub_ready.set()

    def writer(self, w: int) -> None:
        from ziplog.client.blocking import Client

        lat: list[int] = []
        mine: dict[RecordId, int] = {}
        try:
            with Client(self.zk_hosts) as c:
                self.start.wait()
                after = RID_GENESIS
                i = 0
                while time.perf_counter() < self.stop_at:
                    t0 = time.perf_counter_ns()
                    data = _payload(self.run_id, w, i, t0, self.record_size)
                    rid = c.insert_after(data, after)
                    lat.append(time.perf_counter_ns() - t0)
                    if rid.gsn <= after.gsn:
                        self.writer_errors.append(f"writer {w}: {rid} is not after {after}")
                    mine[rid] = zlib.crc32(data)
                    after = rid
                    i += 1
                with self.lock:
                    for k in self.path:
                        self.path[k] += c.stats.get(k, 0)
        except BaseException as e:
            self.writer_errors.append(f"writer {w}: {type(e).__name__}: {e}")
            try:
                self.start.abort()
            except Exception:
                pass
        finally:
            with self.lock:
                self.insert_ns.extend(lat)
                self.written.update(mine)

    def write_and_follow(self) -> None:
        """The writers for ``seconds`` while the subscriber follows; then every record
        must have reached it, once."""
        sub_thread = threading.Thread(target=self.subscriber, name="demo-subscriber", daemon=True)
        sub_thread.start()
        self.sub_ready.wait(30.0)
        threads = [threading.Thread(target=self.writer, args=(w,), name=f"demo-writer-{w}", daemon=True)
                   for w in range(self.writers)]
        for t in threads:
            t.start()
        self.say(f"{self.writers} writers inserting {self.record_size} B records (InsertAfter chains) for "
                 f"{self.seconds:g} s; 1 subscriber following from the start of the log")
        try:
            self.start.wait(60.0)
        except threading.BrokenBarrierError:
            self.failures.append("the writers did not start")
        for t in threads:
            t.join()
        self.elapsed = time.perf_counter() - (self.started_at or time.perf_counter())
        written, failures = self.written, self.failures
        failures.extend(self.writer_errors)
        if not written:
            failures.append("no record was written")
        self.expected_total = len(written)
        self.writers_done.set()
        self.say(f"wrote {len(written)} records in {self.elapsed:.1f} s; waiting for the subscriber to see them all")
        if len({rid.gsn for rid in written}) != len(written):
            failures.append("two records share a gsn")
        sub_thread.join(30.0)
        if sub_thread.is_alive():
            failures.append("subscriber did not finish")
        if self.sub_state["error"]:
            failures.append(f"subscriber: {self.sub_state['error']}")
        seen = self.seen
        if len(seen) != len(set(seen)):
            failures.append("subscriber saw a record twice")
        if set(seen) != set(written):
            missing = len(set(written) - set(seen))
            failures.append(f"subscriber saw {len(set(seen))} of {len(written)} records ({missing} missing)")

    def read_back(self, reads: int) -> None:
        """The oldest, the most recent and random records read back intact."""
        from ziplog.client.blocking import Client

        written = self.written
        if not written:
            return
        order = sorted(written)
        rng = random.Random(self.run_id)
        sample = order[:10] + order[-10:] + rng.sample(order, min(max(reads - 20, 0), len(order)))
        self.say(f"reading back {len(sample)} records (oldest, most recent and random ones)")
        try:
            with Client(self.zk_hosts) as c:
                for rid in sample:
                    t0 = time.perf_counter_ns()
                    data = c.read_record(rid)
                    self.read_ns.append(time.perf_counter_ns() - t0)
                    h = _header(data)
                    if zlib.crc32(data) != written[rid] or h is None or h[0] != self.run_id:
                        self.failures.append(f"read_record({rid}) returned different contents")
                    else:
                        self.read_ok += 1
        except Exception as e:
            self.failures.append(f"read_record: {type(e).__name__}: {e}")

    def summary(self) -> dict[str, Any]:
        from ziplog.tools.stats import summarize

        ins, rd, dl = summarize(self.insert_ns), summarize(self.read_ns), summarize(self.delivery_ns)
        path, written, elapsed = self.path, self.written, self.elapsed
        decided = path["fast_path"] + path["slow_path"]
        return {
            "ok": not self.failures,
            "failures": self.failures,
            "writers": self.writers,
            "seconds": elapsed,
            "record_bytes": self.record_size,
            "records_written": len(written),
            "records_seen": len(set(self.seen) & set(written)),
            "inserts_per_s": len(written) / elapsed if elapsed > 0 else 0.0,
            "shards_used": sorted({rid.shard for rid in written}),
            "insert_p50_us": ins["p50_us"],
            "insert_p99_us": ins["p99_us"],
            "fast_path": path["fast_path"],
            "slow_path": path["slow_path"],
            "retries": path["retries"],
            "fast_path_ratio": path["fast_path"] / decided if decided else None,
            "reads": len(self.read_ns),
            "reads_ok": self.read_ok,
            "read_p50_us": rd["p50_us"],
            "delivery_p50_us": dl["p50_us"],
            "delivery_p99_us": dl["p99_us"],
            "order_ok": self.sub_state["order_ok"],
            "earlier_records_seen": self.sub_state["others"],
        }


def run_demo(zk_hosts: str, seconds: float = 3.0, writers: int = 4, record_size: int = 4096,
             reads: int = 100, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the demo workload against the cluster at ``zk_hosts``; returns a summary dict
    whose ``ok`` is True when every check passed (``failures`` lists the others)."""
    run = _DemoRun(zk_hosts, seconds, writers, record_size, log or (lambda msg: print(msg, flush=True)))
    run.write_and_follow()
    run.read_back(reads)
    return run.summary()


def format_summary(s: dict[str, Any]) -> str:
    ratio = s["fast_path_ratio"]
    order = "strictly increasing gsns" if s["order_ok"] else "OUT OF ORDER"
    rows = [
        ("records written", f"{s['records_written']} ({s['writers']} writers, {s['record_bytes']} B each, "
                            f"{s['inserts_per_s']:.0f} inserts/s, shards {', '.join(map(str, s['shards_used'])) or '-'})"),
        ("subscriber saw", f"{s['records_seen']} of them, {order}"),
        ("InsertAfter latency", f"p50 {_us(s['insert_p50_us'])}, p99 {_us(s['insert_p99_us'])}"),
        ("fast path", f"{'n/a' if ratio is None else f'{ratio:.1%}'} "
                      f"({s['fast_path']} fast, {s['slow_path']} slow, {s['retries']} resends)"),
        ("read_record latency", f"p50 {_us(s['read_p50_us'])} ({s['reads_ok']}/{s['reads']} read back intact)"),
        ("insert-to-delivery", f"p50 {_us(s['delivery_p50_us'])}, p99 {_us(s['delivery_p99_us'])}"),
    ]
    lines = [f"{k:<21}{v}" for k, v in rows]
    if s["failures"]:
        lines.append("FAILED:")
        lines.extend(f"  - {f}" for f in s["failures"])
    else:
        lines.append("all checks passed")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from ziplog.tools.cluster import local_cluster

    p = argparse.ArgumentParser(prog="python -m ziplog.tools.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=3.0, help="how long the writers run (default 3)")
    p.add_argument("--writers", type=int, default=4, help="writer threads, each its own Client (default 4)")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--replicas", type=int, default=2)
    args = p.parse_args(argv)

    def say(msg: str) -> None:
        print(f"[demo] {msg}", flush=True)

    say(f"starting a local cluster: ZooKeeper x3, membership service x3, {args.shards} shards x "
        f"{args.replicas} replicas")
    t0 = time.monotonic()
    try:
        with local_cluster(shards=args.shards, replicas=args.replicas) as cluster:
            say(f"cluster up in {time.monotonic() - t0:.1f} s (ZooKeeper at {cluster.zk_hosts})")
            summary = run_demo(cluster.zk_hosts, seconds=args.seconds, writers=args.writers, log=say)
            say("stopping the cluster")
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        print(f"demo failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print()
    print(format_summary(summary), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
