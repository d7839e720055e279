"""The storage server's process: its flags, the OS settings it runs under (scheduling
policy, CPUs, malloc), and the replicas it hosts, each a :class:`StorageDriver`.

    python -m ziplog.server --zk HOSTS --shard S --replica R [--replicas N] [--data-dir D]
    python -m ziplog.server --zk HOSTS --serve S:R[,S:R...] [--replicas N] [--data-dir D]

A process serves one replica, or (``--serve``) replicas of several shards on one loop:
a machine that hosts more replicas than it has CPUs runs one process per CPU, so that
one wake-up serves every shard's messages that arrived together, instead of one
process per replica each paying its own wake-ups and turns (see :func:`hosted_replicas`).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ziplog.cores.replica import ReplicaSettings
from ziplog.io.ports import StorageCoordination, wall_offset_ns
from ziplog.io.segments import SEGMENT_BYTES, SegmentLog, replica_dir
from ziplog.protocol.access import AccessTable
from ziplog.protocol.auth import ClusterKey
from ziplog.protocol.keys import ClientEntry
from ziplog.server.storage import StorageDriver
from ziplog.server.takeover import TakeOverRefused, take_over
from ziplog.shell.config import parse_args
from ziplog.shell.logs import add_log_arguments, configure_logging
from ziplog.shell.metrics import add_metrics_arguments, counter, gauge, serve_metrics
from ziplog.shell.process import (
    add_address_arguments,
    add_cluster_key_argument,
    add_security_arguments,
    check_address_arguments,
    load_cluster_key,
    member_credentials,
    serve_forever,
)

if TYPE_CHECKING:
    from prometheus_client.core import Metric

log = logging.getLogger("ziplog.server")
T = TypeVar("T")

#: ``--poll-us``'s default: off (see ziplog.io.zmq_runtime; 200 is haltpoll's default
#: guest_halt_poll_ns, longer than the gap between one closed-loop client's inserts)
DEFAULT_POLL_US = 0
#: ``--malloc-trim-mb``'s default: glibc's malloc keeps up to this much freed memory at
#: the top of its heap (see retain_freed_memory)
DEFAULT_MALLOC_TRIM_MB = 64
#: allocations up to this size come from malloc's heap, not from mappings of their own
#: (glibc's largest allowed on 64 bits)
MALLOC_MMAP_THRESHOLD = 32 << 20
#: mallopt's parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def set_scheduling(policy: str) -> None:
    """Run this process under SCHED_BATCH (``batch``) or leave it as it is (``normal``).

    Why: a client sends an INSERT to every replica of a shard, one ``send`` after the
    other. Under SCHED_OTHER the replica the first ``send`` wakes may preempt the client
    on its CPU when the other CPUs are busy (the previous insert's forwards, the
    control plane): the client's second copy then leaves only after the first replica's
    whole turn, and the replicas work one after the other instead of side by side. A
    SCHED_BATCH task never preempts on wake-up (it runs when a CPU is free or at the
    next tick) and otherwise gets the same share of the CPU as a SCHED_OTHER task of
    its nice level. Measured on a 2-core machine, one pinned client, the servers' policy
    switched every 800 inserts: the block's p50 lower in 9 of 12 pairs, by about 5 %.
    Policy needs no privilege to set; where the platform has none, this does nothing."""
    if policy != "batch" or not hasattr(os, "SCHED_BATCH"):
        return
    for tid in _own_threads():
        try:
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        except OSError as exc:
            log.warning("could not run thread %d under SCHED_BATCH (%s): its scheduling left as it is", tid, exc)


def retain_freed_memory(trim_mb: int) -> bool:
    """Let glibc's malloc keep what this process frees, up to ``trim_mb`` MiB at the top
    of its heap, and serve allocations up to MALLOC_MMAP_THRESHOLD from the heap instead
    of mapping each afresh (0: leave glibc's own, adaptive thresholds). True when set;
    where the C library is not glibc, this does nothing.

    Why: a loaded replica's every turn allocates, and frees, buffers of 100 KiB and more
    (a FORWARD of the turn's records and its ZMTP frame; the 5 ms disk batch). By default
    glibc maps such a buffer for itself and unmaps it when freed, or trims its heap
    beneath it, so the next turn's buffer is fresh memory, faulted in page by page. A
    replica under the pipelined load of ``bench throughput`` took 2.1 page faults per
    append, 1.1 with this (about one is the log's own growth: each 4 KiB record is kept),
    and 20-25 % less CPU per append; the one-shard rate went up as much."""
    if trim_mb <= 0:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_mb << 20))


def _own_threads() -> list[int]:
    """Every thread of this process (a library may have started some at import:
    numpy's BLAS pool; threads started later inherit what is set on these), or [0]
    (the calling thread) where /proc does not say."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def parse_cpu_list(spec: str) -> set[int]:
    """``taskset -c``'s CPU list: numbers and ranges, comma-separated ("0", "0,2-3")."""
    cpus: set[int] = set()
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            lo, hi = int(first), int(last if dash else first)
        except ValueError:
            raise ValueError(f"not a CPU list: {spec!r}") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"not a CPU list: {spec!r}")
        cpus.update(range(lo, hi + 1))
    return cpus


def runtime_metrics(rt: Any) -> list[Metric]:
    """The process's loop: how often it gave its CPU away after answering, and what
    polling before sleeping costs and finds."""
    return [
        counter("ziplog_server_yields", "turns after which the loop gave its CPU away once their answers had left "
                "(--yield-after-answers)", rt.yields),
        counter("ziplog_server_yields_long", "yields after answering that kept the loop away over 200 us (other "
                "processes wanted the CPU): each pauses yielding for 20 times as long", rt.yields_long),
        counter("ziplog_server_poll_seconds", "time the loop spent polling before sleeping (--poll-us)",
                rt.polled_ns / 1e9),
        counter("ziplog_server_polls_found", "polls before sleeping that found input before their limit",
                rt.polls_found),
        counter("ziplog_server_polls_cut", "polls before sleeping cut short because other tasks wanted a CPU",
                rt.polls_cut),
        gauge("ziplog_server_poll_limit_seconds", "how long the loop polls before it sleeps next (adapts; 0: it "
              "sleeps at once)", rt.poll_limit_ns / 1e9),
    ]


def set_cpus(cpus: set[int] | None) -> None:
    """Keep every thread of this process on ``cpus`` (None: anywhere).

    Why: on a machine that runs several replicas of a shard beside their clients (the
    local cluster, a test bed), the scheduler often wakes a backup on the CPU its
    primary just used: the two replicas of one insert then run one after the other,
    and both move between CPUs with cold caches. A replica kept on a CPU of its own
    works beside its peer. Measured on a 2-core machine, one pinned client, the two
    replicas' affinity switched every 800 inserts between one CPU each and both: the
    block's p50 lower in 12 of 12 pairs, by about 20 %."""
    if cpus is None:
        return
    for tid in _own_threads():
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError as exc:
            log.warning("could not keep thread %d on CPUs %s (%s): it runs anywhere", tid, sorted(cpus), exc)


def parse_hosted(spec: str) -> list[tuple[int, int]]:
    """``--serve``'s list: ``SHARD:REPLICA`` pairs, comma-separated (``0:0,1:1``)."""
    out: list[tuple[int, int]] = []
    for part in spec.split(","):
        shard, colon, replica = part.strip().partition(":")
        try:
            pair = (int(shard), int(replica))
        except ValueError:
            raise ValueError(f"not SHARD:REPLICA pairs: {spec!r}") from None
        if not colon or pair[0] < 0 or pair[1] < 0:
            raise ValueError(f"not SHARD:REPLICA pairs: {spec!r}")
        out.append(pair)
    return out


def _argument(parse: Callable[[str], T]) -> Callable[[str], T]:
    """``parse`` as an argparse type: its ValueError becomes a usage error."""
    def convert(spec: str) -> T:
        try:
            return parse(spec)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return convert


def hosted_replicas(shard: int | None, replica: int | None, serve: list[tuple[int, int]] | None,
                    replicas: int) -> list[tuple[int, int]]:
    """The (shard, replica) pairs one process serves, from ``--shard``/``--replica`` or
    ``--serve`` (ValueError: why not).

    Two replicas of one shard are refused: one process's end would take both, which
    replication across f+1 failure domains exists to prevent. Replicas of different
    shards in one process share its fate as replicas on one machine do: the failure
    handler recovers each shard, which lost one replica."""
    if serve is not None and (shard is not None or replica is not None):
        raise ValueError("give --serve or --shard/--replica, not both")
    if serve is None:
        if shard is None or replica is None:
            raise ValueError("give --shard and --replica (or --serve SHARD:REPLICA,...)")
        serve = [(shard, replica)]
    if not serve:
        raise ValueError("--serve names no replica")
    shards = [s for s, _ in serve]
    if len(set(shards)) != len(shards):
        raise ValueError(f"--serve names two replicas of one shard ({serve}): one process's end would take both")
    for s, r in serve:
        if not 0 <= r < replicas:
            raise ValueError(f"replica {r} of shard {s}: a shard has replicas 0..{replicas - 1} (--replicas)")
    return list(serve)


def _add_passing_arguments(ap: argparse.ArgumentParser) -> None:
    """How slots pass, how NOTICEs go out and where a turn takes an epoch (each compared
    by the benches)."""
    ap.add_argument("--clock-pass-rate", type=int, default=ReplicaSettings.clock_pass_rate,
                    help="a shard scheduled at this many records/s or more passes its slots by its inserts' stamps "
                         "and gets no NOTICEs (0: every shard by NOTICEs; keep it above the membership service's "
                         "--min-rate, or an idle shard passes slots by the clock every millisecond)")
    ap.add_argument("--notice-fanout", choices=("process", "replica"), default="process",
                    help="send a NOTICE once to each process that serves replicas it tells (which hands it to each "
                         "of them), or once to each replica")
    ap.add_argument("--epoch-stamp", choices=("sent", "read"), default="sent",
                    help="take an epoch broadcast among the turn's inserts at the moment the membership service "
                         "sent it (the same at both replicas of a shard), or at the moment this replica read it")


def _add_limit_arguments(ap: argparse.ArgumentParser) -> None:
    """How large a record, and how much of them in memory, a replica takes."""
    ap.add_argument("--max-record-bytes", type=int, default=1 << 20)
    ap.add_argument("--max-log-memory-mb", type=float, default=None, metavar="MB",
                    help="the most each replica holds of its records in memory; past it a primary refuses new records "
                         "(LOG_FULL: clients move them to other shards) until a trim frees some (default: a quarter "
                         "of the machine's memory, or of its container's limit, shared by the replicas this process "
                         "serves; 0: no bound)")


def build_parser() -> argparse.ArgumentParser:
    """The storage server's flags (every one settable in a config file's ``[storage]``)."""
    ap = argparse.ArgumentParser(prog="ziplog.server",
                                 description="ziplog storage server (one replica, or replicas of several shards)")
    ap.add_argument("--zk", required=True, help="ZooKeeper hosts, host:port[,host:port...]")
    ap.add_argument("--shard", type=int, default=None)
    ap.add_argument("--replica", type=int, default=None, help="0 is the primary")
    ap.add_argument("--serve", type=_argument(parse_hosted), default=None, metavar="S:R[,S:R...]",
                    help="serve these replicas (of different shards) in this one process, on one loop, each on a "
                         "port of its own (instead of --shard/--replica): one process per CPU on a machine hosting "
                         "more replicas than CPUs")
    ap.add_argument("--replicas", type=int, default=2, help="replicas per shard (f+1)")
    ap.add_argument("--data-dir", type=Path, default=None, help="where segment files live (none: memory only)")
    ap.add_argument("--fsync", choices=["never", "interval", "always"], default="interval",
                    help="when segment writes are fsynced (interval: every --fsync-interval seconds)")
    ap.add_argument("--fsync-interval", type=float, default=1.0)
    ap.add_argument("--segment-bytes", type=int, default=SEGMENT_BYTES,
                    help="a segment file is closed and the next opened past this size (trim deletes whole files)")
    add_address_arguments(ap, port_help="port for clients and peers (0: any free one)")
    ap.add_argument("--noop-timeout-us", type=int, default=0,
                    help="also pass a slot this long after its expected time (0: only on notices and at the epoch's close)")
    ap.add_argument("--notice-interval-us", type=float, default=ReplicaSettings.notice_interval_ns / 1000,
                    help="NOTICEs go out at most this often (a burst's records together)")
    ap.add_argument("--no-notices", action="store_true",
                    help="do not tell other shards' primaries of decided records (they pass slots by clock and epoch)")
    _add_passing_arguments(ap)
    _add_limit_arguments(ap)
    ap.add_argument("--reference-min-bytes", type=int, default=ReplicaSettings.reference_min_bytes,
                    help="with --forward-by-reference: the smallest record a FORWARD names by reference")
    ap.add_argument("--forward-by-reference", action="store_true",
                    help="FORWARDs name records of --reference-min-bytes or more (the backups have the client's "
                         "copy) instead of carrying them: fewer bytes on the primary's links, more CPU")
    ap.add_argument("--forward-interval-us", type=int, default=0,
                    help="batch forwarded decisions for up to this long (fewer messages, later stability)")
    ap.add_argument("--prefix-interval-us", type=int, default=None,
                    help="a backup reports what it holds at most this often (0: after every forward; default: "
                         "1000 when it is the shard's only backup, which knows stability without it, else 0)")
    ap.add_argument("--heartbeat-ms", type=float, default=ReplicaSettings.heartbeat_ns / 1e6,
                    help="an idle replica tells its peers it is alive this often")
    ap.add_argument("--suspect-timeout-ms", type=float, default=ReplicaSettings.suspect_timeout_ns / 1e6,
                    help="a peer silent this long is suspected and failure recovery asked for (0: never)")
    ap.add_argument("--transport", choices=["zmq", "native"],
                    default="zmq" if os.environ.get("ZIPLOG_TRANSPORT") == "zmq" else "native",
                    help="serve ZeroMQ's ROUTER and DEALER natively in this process's loop (native: ziplog's ZMTP "
                         "3.1, the default) or with libzmq (zmq); the wire is the same. $ZIPLOG_TRANSPORT=zmq "
                         "switches the default")
    ap.add_argument("--sched", choices=["batch", "normal"], default="batch",
                    help="the process's Linux scheduling policy: batch (the default) lets a client on the same "
                         "machine keep its CPU when its INSERT wakes this replica, so that it sends the other "
                         "replicas' copies at once (the replicas then work in parallel); normal lets the woken "
                         "replica preempt it")
    ap.add_argument("--poll-us", type=int, default=DEFAULT_POLL_US, metavar="US",
                    help="after a turn, poll without blocking (yielding the CPU) for up to this long before sleeping, "
                         "adapting as Linux's haltpoll does: while requests arrive back to back the replica is awake "
                         "when the next one comes (lower latency for few clients; costs CPU, and throughput on a "
                         "machine whose CPUs are busy; 200 is a good value); 0, the default: sleep at once")
    ap.add_argument("--yield-after-answers", action=argparse.BooleanOptionalAction, default=False,
                    help="once a turn's ACKs and other answers have left, give the CPU away (sched_yield) before "
                         "the turn's FORWARDs and bookkeeping, so that a client woken on this CPU reads its answer "
                         "first (lower latency where clients share the replicas' CPUs on a quiet machine; on a busy "
                         "one the FORWARDs wait for other processes, and subscribers with them; off by default)")
    ap.add_argument("--malloc-trim-mb", type=int, default=DEFAULT_MALLOC_TRIM_MB, metavar="MB",
                    help="let glibc's malloc keep up to this much freed memory, and serve buffers up to 32 MiB from "
                         "its heap, so that a loaded replica's per-turn buffers are not page-faulted in afresh every "
                         "turn (0: glibc's own thresholds)")
    ap.add_argument("--cpus", type=_argument(parse_cpu_list), default=None, metavar="LIST",
                    help="keep the process on these CPUs (taskset -c's list: 0 or 0,2-3; default: anywhere); "
                         "the local cluster gives each replica of a shard a CPU of its own")
    ap.add_argument("--take-over", type=int, default=None, metavar="PID",
                    help="replace the storage server PID of this shard and replica on this machine: start up while "
                         "it serves, then stop it (SIGTERM) and take its data directory once it has exited (a "
                         "restart whose gap is the old process's stop, not this one's start)")
    add_cluster_key_argument(ap)
    add_security_arguments(ap)
    add_metrics_arguments(ap)
    add_log_arguments(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    from ziplog.io import zk
    from ziplog.io.zmq_runtime import ZmqRuntime

    ap = build_parser()
    args = parse_args(ap, argv, "storage")
    try:
        hosted = hosted_replicas(args.shard, args.replica, args.serve, args.replicas)
    except ValueError as exc:
        ap.error(str(exc))
    check_address_arguments(ap, args, one_port=len(hosted) == 1)
    if len(hosted) > 1 and args.port:
        ap.error("--port names one replica's port: with several (--serve) each listens on a free one")
    if args.poll_us < 0:
        ap.error("--poll-us must be 0 or more")
    if args.max_log_memory_mb is not None and args.max_log_memory_mb < 0:
        ap.error("--max-log-memory-mb must be 0 or more")
    if args.malloc_trim_mb < 0:
        ap.error("--malloc-trim-mb must be 0 or more")
    key = load_cluster_key(args.cluster_key_file)
    configure_logging(args, "storage" + "+".join(f"{s}.{r}" for s, r in hosted))
    set_scheduling(args.sched)  # before the process's own threads start: they inherit it
    set_cpus(args.cpus)
    if args.malloc_trim_mb and not retain_freed_memory(args.malloc_trim_mb):
        log.info("this C library has no glibc mallopt: its malloc left as it is")
    credentials = member_credentials(args, key)
    if credentials is not None and args.transport != "native":
        ap.error("CURVE (the default off loopback, or --curve) is served by the native transport only")
    rt = ZmqRuntime(native=args.transport == "native", poll_max_ns=args.poll_us * 1000,
                    yield_after_answers=args.yield_after_answers, credentials=credentials)
    # One ZooKeeper session per replica: each registration lives and ends with its own.
    coords = [zk.StorageCoordination(args.zk, key) for _ in hosted]
    if args.take_over is not None:
        # Everything above ran while the old process served; what follows needs its
        # data directory and its place in ZooKeeper. Every replica served here must be
        # registered by the process taken over.
        registered = [coord.registered_pid(s, r) for coord, (s, r) in zip(coords, hosted)]
        try:
            # the pid ZooKeeper names for every replica served here, or one it names that
            # is not the process to stop (refused)
            take_over(args.take_over, next((pid for pid in registered if pid != args.take_over), args.take_over))
        except TakeOverRefused as exc:
            log.error("not taking over: %s", exc)
            for coord in coords:
                coord.close()
            rt.close()
            return 2
    drivers = [_storage_driver(args, shard, replica, rt, coord, key) for (shard, replica), coord in zip(hosted, coords)]
    for d in drivers:
        d.notices.siblings = [other for other in drivers if other is not d]  # a hosted NOTICE is for them too
    if credentials is not None:
        _follow_client_registry(coords[0], key, rt, drivers, "storage" + "+".join(f"{s}.{r}" for s, r in hosted),
                                args.registry_lease_s)
    for driver in drivers:
        driver.start()
    metrics = serve_metrics(args, lambda: [m for d in drivers for m in d.metrics()] + runtime_metrics(rt))

    def stop_requested() -> None:
        for d in drivers:
            d.stop_requested()

    return serve_forever(rt, metrics, *drivers, *coords, on_stop=stop_requested)


def max_log_bytes(mb: float | None, hosted: int) -> int:
    """Each replica's bound on its records in memory (``--max-log-memory-mb``; 0: none):
    by default a quarter of the memory this process may use, shared by the ``hosted``
    replicas of this process (a machine running several storage processes sets it for
    each)."""
    if mb is not None:
        return int(mb * (1 << 20))
    return usable_memory() // 4 // hosted


def usable_memory(root: Path = Path("/")) -> int:
    """The machine's memory, or the limit of this process's control group where lower (a
    container's: cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``), in bytes."""
    best = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":  # v2: the unified hierarchy
            files = [root / "sys/fs/cgroup" / rel / "memory.max"]
        elif "memory" in controllers.split(","):
            files = [root / "sys/fs/cgroup/memory" / rel / "memory.limit_in_bytes"]
        else:
            continue
        for file in files:
            try:
                text = file.read_text().strip()
            except OSError:
                continue
            if text.isdigit() and 0 < int(text) < best:
                best = int(text)
    return best


def _storage_driver(args: argparse.Namespace, shard: int, replica: int, rt: Any, coord: StorageCoordination,
                    key: ClusterKey) -> StorageDriver:
    """One hosted replica's driver, from the process's flags."""
    settings = ReplicaSettings(shard=shard, replica=replica, replicas=args.replicas,
                               wall_offset_ns=wall_offset_ns(),
                               max_record_bytes=args.max_record_bytes, noop_timeout_ns=args.noop_timeout_us * 1000,
                               max_log_bytes=max_log_bytes(args.max_log_memory_mb, len(args.serve or [shard])),
                               notices=not args.no_notices, notice_interval_ns=int(args.notice_interval_us * 1000),
                               epoch_stamp_sent=args.epoch_stamp == "sent",
                               clock_pass_rate=args.clock_pass_rate,
                               notice_per_process=args.notice_fanout == "process",
                               forward_by_reference=args.forward_by_reference,
                               reference_min_bytes=args.reference_min_bytes,
                               forward_interval_ns=args.forward_interval_us * 1000,
                               prefix_interval_ns=None if args.prefix_interval_us is None else args.prefix_interval_us * 1000,
                               heartbeat_ns=int(args.heartbeat_ms * 1e6), suspect_timeout_ns=int(args.suspect_timeout_ms * 1e6))
    disk = None
    if args.data_dir is not None:
        disk = SegmentLog(replica_dir(args.data_dir, shard, replica), fsync=args.fsync,
                          fsync_interval=args.fsync_interval, segment_bytes=args.segment_bytes)
    access = None if rt.credentials is None else AccessTable(rt.credentials.server.public)
    return StorageDriver(settings, rt, rt, coord, disk, key, host=args.bind, port=args.port, advertise=args.advertise,
                         access=access)


def _follow_client_registry(coord: Any, key: ClusterKey, rt: Any, drivers: list[StorageDriver], role: str,
                            lease_s: float) -> None:
    """Every driver's table loaded from the client key registry before it serves, and
    replaced on the runtime's thread at every change (the watch fires on kazoo's); each
    load confirmed as ``role``'s, and the tables judged by only under the process's
    registry lease (:func:`ziplog.shell.rights.follow_registry`): past it, each turn ends
    the client keys' subscriptions before they are served (:meth:`ClientRights.at_turn`)."""
    from ziplog.shell.rights import follow_registry, server_name

    def load(entries: list[ClientEntry], version: int) -> None:
        for d in drivers:
            d.on_access(entries, version)

    lease = follow_registry(coord.zk, key, rt, load, server_name(role), lease_s)
    rights = [d.rights for d in drivers if d.rights is not None]
    for r in rights:
        r.table.lease = lease

    def at_turn() -> bool:
        for r in rights:
            r.at_turn()
        return False  # nothing answered: what it ends leaves with the turn's end

    rt.at_turn_answers(at_turn)
