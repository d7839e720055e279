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


def run_demo(zk_hosts: str, seconds: float = 3.0, writers: int = 4, record_size: int = 4096,
             reads: int = 100, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the demo workload against the cluster at ``zk_hosts``; returns a summary dict
    whose ``ok`` is True when every check passed (``failures`` lists the others)."""
    from ziplog.client.blocking import Client
    from ziplog.tools.stats import summarize

    say = log or (lambda msg: print(msg, flush=True))
    run_id = int.from_bytes(os.urandom(4), "big")
    failures: list[str] = []
    lock = threading.Lock()

    # -- subscriber ---------------------------------------------------------------------------
    writers_done = threading.Event()
    expected_total: list[int] = []  # set once the writers have finished
    sub_ready = threading.Event()
    seen: list[RecordId] = []
    delivery_ns: list[int] = []
    sub_state: dict[str, Any] = {"error": None, "order_ok": True, "others": 0}

    def subscriber() -> None:
        try:
            with Client(zk_hosts) as c, c.subscribe(RID_GENESIS) as sub:
                sub_ready.set()
                last_gsn = 0
                deadline = None
                while True:
                    rec = sub.next(timeout=0.2)
                    now = time.perf_counter_ns()
                    if rec is not None:
                        if rec.rid.gsn <= last_gsn:
                            sub_state["order_ok"] = False
                            sub_state["error"] = f"gsn {rec.rid.gsn} delivered after gsn {last_gsn}"
                        last_gsn = rec.rid.gsn
                        h = _header(rec.data)
                        if h is not None and h[0] == run_id:
                            seen.append(rec.rid)
                            delivery_ns.append(now - h[3])
                        else:
                            sub_state["others"] += 1  # records from before this run
                    if writers_done.is_set():
                        if deadline is None:
                            deadline = time.monotonic() + 20.0
                        if len(seen) >= expected_total[0] or time.monotonic() > deadline:
                            return
        except BaseException as e:  # reported in the summary
            sub_state["error"] = f"{type(e).__name__}: {e}"
            sub_ready.set()

    # -- writers ------------------------------------------------------------------------------
    written: dict[RecordId, int] = {}  # rid -> crc32 of its data
    chains: list[list[RecordId]] = [[] for _ in range(writers)]
    insert_ns: list[int] = []
    path = {"fast_path": 0, "slow_path": 0, "retries": 0}
    writer_errors: list[str] = []
    stop_at = [0.0, 0.0]  # end, start (set by the barrier's action, before any writer is released)

    def go() -> None:
        stop_at[1] = time.perf_counter()
        stop_at[0] = stop_at[1] + seconds

    start = threading.Barrier(writers + 1, action=go)

    def writer(w: int) -> None:
        lat: list[int] = []
        mine: dict[RecordId, int] = {}
        try:
            with Client(zk_hosts) as c:
                start.wait()
                after = RID_GENESIS
                i = 0
                while time.perf_counter() < stop_at[0]:
                    t0 = time.perf_counter_ns()
                    data = _payload(run_id, w, i, t0, record_size)
                    rid = c.insert_after(data, after)
                    lat.append(time.perf_counter_ns() - t0)
                    if rid.gsn <= after.gsn:
                        writer_errors.append(f"writer {w}: {rid} is not after {after}")
                    mine[rid] = zlib.crc32(data)
                    chains[w].append(rid)
                    after = rid
                    i += 1
                with lock:
                    for k in path:
                        path[k] += c.stats.get(k, 0)
        except BaseException as e:
            writer_errors.append(f"writer {w}: {type(e).__name__}: {e}")
            try:
                start.abort()
            except Exception:
                pass
        finally:
            with lock:
                insert_ns.extend(lat)
                written.update(mine)

    sub_thread = threading.Thread(target=subscriber, name="demo-subscriber", daemon=True)
    sub_thread.start()
    sub_ready.wait(30.0)
    threads = [threading.Thread(target=writer, args=(w,), name=f"demo-writer-{w}", daemon=True)
               for w in range(writers)]
    for t in threads:
        t.start()
    say(f"{writers} writers inserting {record_size} B records (InsertAfter chains) for {seconds:g} s; "
        "1 subscriber following from the start of the log")
    try:
        start.wait(60.0)
    except threading.BrokenBarrierError:
        failures.append("the writers did not start")
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - (stop_at[1] or time.perf_counter())
    failures.extend(writer_errors)
    if not written:
        failures.append("no record was written")
    expected_total.append(len(written))
    writers_done.set()
    say(f"wrote {len(written)} records in {elapsed:.1f} s; waiting for the subscriber to see them all")
    if len({rid.gsn for rid in written}) != len(written):
        failures.append("two records share a gsn")

    sub_thread.join(30.0)
    if sub_thread.is_alive():
        failures.append("subscriber did not finish")
    if sub_state["error"]:
        failures.append(f"subscriber: {sub_state['error']}")
    if len(seen) != len(set(seen)):
        failures.append("subscriber saw a record twice")
    if set(seen) != set(written):
        missing = len(set(written) - set(seen))
        failures.append(f"subscriber saw {len(set(seen))} of {len(written)} records ({missing} missing)")

    # -- read back ----------------------------------------------------------------------------
    read_ns: list[int] = []
    read_ok = 0
    if written:
        order = sorted(written)
        rng = random.Random(run_id)
        sample = order[:10] + order[-10:] + rng.sample(order, min(max(reads - 20, 0), len(order)))
        say(f"reading back {len(sample)} records (oldest, most recent and random ones)")
        try:
            with Client(zk_hosts) as c:
                for rid in sample:
                    t0 = time.perf_counter_ns()
                    data = c.read_record(rid)
                    read_ns.append(time.perf_counter_ns() - t0)
                    h = _header(data)
                    if zlib.crc32(data) != written[rid] or h is None or h[0] != run_id:
                        failures.append(f"read_record({rid}) returned different contents")
                    else:
                        read_ok += 1
        except Exception as e:
            failures.append(f"read_record: {type(e).__name__}: {e}")

    ins = summarize(insert_ns)
    rd = summarize(read_ns)
    dl = summarize(delivery_ns)
    decided = path["fast_path"] + path["slow_path"]
    return {
        "ok": not failures,
        "failures": failures,
        "writers": writers,
        "seconds": elapsed,
        "record_bytes": record_size,
        "records_written": len(written),
        "records_seen": len(set(seen) & set(written)),
        "inserts_per_s": len(written) / elapsed if elapsed > 0 else 0.0,
        "shards_used": sorted({rid.shard for rid in written}),
        "insert_p50_us": ins["p50_us"],
        "insert_p99_us": ins["p99_us"],
        "fast_path": path["fast_path"],
        "slow_path": path["slow_path"],
        "retries": path["retries"],
        "fast_path_ratio": path["fast_path"] / decided if decided else None,
        "reads": len(read_ns),
        "reads_ok": read_ok,
        "read_p50_us": rd["p50_us"],
        "delivery_p50_us": dl["p50_us"],
        "delivery_p99_us": dl["p99_us"],
        "order_ok": sub_state["order_ok"],
        "earlier_records_seen": sub_state["others"],
    }


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
