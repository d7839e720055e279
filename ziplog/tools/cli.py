"""The ``ziplog`` command line.

    ziplog cluster up [--shards N] [--replicas N] [--data-dir D] [--netns]
    ziplog cluster restart --rolling --data-dir D
    ziplog insert  --zk HOSTS [--after GSN:SHARD] [--shard S] DATA... | -
    ziplog tail    --zk HOSTS [--from GSN|genesis|recent] [-n COUNT]
    ziplog read    --zk HOSTS GSN:SHARD
    ziplog trim    --zk HOSTS GSN
    ziplog status  --zk HOSTS
    ziplog config check FILE [--role ROLE]

``--zk`` defaults to the environment variable ``ZIPLOG_ZK``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from ziplog.protocol.errors import ZiplogError
from ziplog.tools import conformance
from ziplog.tools.cli_clients import add_client_key_commands
from ziplog.shell.config import ROLES as CONFIG_ROLES
from ziplog.protocol.types import RID_GENESIS, RID_RECENT, Policy, RecordId

ENV_ZK = "ZIPLOG_ZK"


class _UsageError(Exception):
    """A usage problem found after parsing (exit status 2)."""


#: ``cluster up`` keeps its process id here, in its data directory, while it runs ...
UP_PID_FILE = "cluster-up.pid"
#: ... and the outcome of its latest rolling restart (``cluster restart --rolling``)
ROLLING_RESULT_FILE = "rolling-restart.json"


class _RollingRequested(Exception):
    """SIGUSR1 reached ``cluster up`` while it waited: restart every process, one by one."""


# -- argument types -------------------------------------------------------------------------------
def parse_rid(text: str) -> RecordId:
    """``GSN:SHARD`` -> RecordId."""
    gsn_s, sep, shard_s = text.partition(":")
    try:
        if not sep:
            raise ValueError
        gsn, shard = int(gsn_s), int(shard_s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a record id GSN:SHARD (e.g. 42:0), got {text!r}") from None
    if gsn <= 0 or shard < 0:
        raise argparse.ArgumentTypeError(f"a record id needs GSN >= 1 and SHARD >= 0, got {text!r}")
    return RecordId(gsn, shard)


def _position(text: str) -> RecordId:
    """``genesis``, ``recent`` or a gsn (inclusive) -> a subscription start."""
    t = text.strip().lower()
    if t == "genesis":
        return RID_GENESIS
    if t == "recent":
        return RID_RECENT
    try:
        gsn = int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GSN, 'genesis' or 'recent', got {text!r}") from None
    if gsn <= 0:
        raise argparse.ArgumentTypeError(f"GSN must be >= 1, got {text!r}")
    return RecordId(gsn, -1)


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def format_data(data: bytes) -> str:
    """Record data for a terminal: the text if it is printable UTF-8, else the bytes' repr."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return repr(data)
    return text if text.isprintable() else repr(data)


def _out(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _err(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


# -- client plumbing ------------------------------------------------------------------------------
def _zk_hosts(args: argparse.Namespace) -> str:
    hosts = args.zk or os.environ.get(ENV_ZK, "")
    if not hosts:
        raise _UsageError(f"no ZooKeeper hosts: pass --zk HOSTS or set {ENV_ZK}")
    return hosts


def _client(args: argparse.Namespace) -> Any:
    from ziplog.client.blocking import Client
    hosts = _zk_hosts(args)
    try:
        return Client(hosts, timeout=args.timeout, key_file=args.key_file)
    except ZiplogError:
        raise
    except Exception as e:  # kazoo's connection timeout and friends
        if "timeout" in type(e).__name__.lower():
            raise ZiplogError(f"cannot reach ZooKeeper at {hosts} (is the cluster up?)") from e
        raise ZiplogError(f"cannot connect to {hosts}: {type(e).__name__}: {e}") from e


# -- commands -------------------------------------------------------------------------------------
def _print_up(c: Any, bed: Any, took_s: float) -> None:
    """What `cluster up` prints once the cluster serves: where it is, and how to use it."""
    hosts = c.zk_hosts
    _out(f"ziplog is up ({took_s:.1f} s); logs in {c.logs}")
    _out("")
    if bed is not None:
        _out(f"  hosts (network namespaces on a bridge; this one is {bed.gateway}):")
        for name, host in bed.hosts.items():
            _out(f"    {name:8s} {host.addr:15s} {' '.join(host.prefix)} COMMAND")
        _out("")
    _out(f"  ZooKeeper hosts:  {hosts}")
    _out(f"  cluster key:      {c.key_file}  (cluster processes and operator tools prove membership "
         "with it)")
    key = ""
    if c.curve:
        key_file = c.add_client("operator", "all") if not (c.data_dir / "keys" / "operator.key").exists() \
            else c.data_dir / "keys" / "operator.key"
        key = f", key_file={str(key_file)!r}"
        _out(f"  client key:       {key_file}  (CURVE: every connection encrypted; this key holds every right, "
             "`ziplog client add` makes others)")
    _out("")
    _out("  from a shell:")
    _out(f"    export {ENV_ZK}={hosts}")
    if c.curve:
        _out(f"    export ZIPLOG_CLIENT_KEY_FILE={c.data_dir / 'keys' / 'operator.key'}")
    _out(f"    ziplog insert --zk {hosts} hello")
    _out(f"    ziplog tail --zk {hosts} --from genesis")
    _out(f"    ziplog status --zk {hosts}")
    _out("")
    _out("  from Python:")
    _out("    import ziplog")
    _out(f"    with ziplog.Client({hosts!r}{key}) as log:")
    _out("        rid = log.insert_after(b\"hello\")")
    _out("        print(rid, log.read_record(rid))")
    _out("")
    _out("press Ctrl-C to stop; `ziplog cluster restart --rolling --data-dir "
         f"{c.data_dir}` restarts every process, one at a time")


def cmd_cluster_up(args: argparse.Namespace) -> int:
    from ziplog.tools.cluster import local_cluster

    stopping: list[int] = []
    #: rolling restarts asked for (SIGUSR1) and not begun; True while the loop waits
    rolling_asked: list[int] = []
    waiting = [False]

    def on_signal(signum: int, _frame: Any) -> None:
        # The first Ctrl-C/SIGTERM unwinds into local_cluster's cleanup; later ones must not interrupt it.
        if stopping:
            return
        stopping.append(signum)
        raise KeyboardInterrupt

    def on_rolling(signum: int, _frame: Any) -> None:
        # Only the waiting loop is interrupted; one asked for during a restart runs after it.
        rolling_asked.append(signum)
        if waiting[0]:
            raise _RollingRequested

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, on_rolling)
    try:
        _out(f"starting ZooKeeper x3, membership service x3 and {args.shards} shard(s) x "
             f"{args.replicas} replica(s) ...")
        t0 = time.monotonic()
        try:
            with contextlib.ExitStack() as stack:
                kw: dict[str, Any] = {}
                bed = None
                if args.netns:
                    from ziplog.tools import netns
                    why = netns.unavailable()
                    if why is not None:
                        raise _UsageError(f"--netns: cannot make network namespaces here: {why}")
                    bed = stack.enter_context(netns.NetnsBed(netns.cluster_host_names(args.shards, args.replicas)))
                    kw = {"placement": netns.NetnsPlacement(bed), "mms_replicas": netns.CONTROL_HOSTS,
                          "fh_replicas": netns.CONTROL_HOSTS}
                if args.poll_us:
                    kw["server_args"] = ["--poll-us", str(args.poll_us)]
                c = stack.enter_context(local_cluster(shards=args.shards, replicas=args.replicas,
                                                      data_dir=args.data_dir, process_per_cpu=args.process_per_cpu,
                                                      curve=args.curve, **kw))
                _print_up(c, bed, time.monotonic() - t0)
                pid_file = c.data_dir / UP_PID_FILE
                pid_file.write_text(f"{os.getpid()}\n")
                stack.callback(pid_file.unlink, missing_ok=True)
                rolls = 0
                while True:
                    waiting[0] = True
                    try:
                        if not rolling_asked:
                            time.sleep(3600)
                    except _RollingRequested:
                        pass
                    finally:
                        waiting[0] = False
                    if rolling_asked:
                        rolling_asked.clear()
                        rolls += 1
                        _rolling_restart(c, rolls)
        except KeyboardInterrupt:
            pass
        _out("stopped every process")
        return 0
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _rolling_restart(cluster: Any, seq: int) -> None:
    """Restart every process of ``cluster`` one at a time (``rolling_restart``, from this,
    the main thread: the processes die with the thread that starts them), and leave the
    outcome where ``cluster restart --rolling`` looks for it."""
    from ziplog.tools.rolling import Restart, rolling_restart

    restarts: list[dict[str, Any]] = []

    def done(r: Restart) -> None:
        ms = round((r.back_at - r.stopped_at) * 1000)
        restarts.append({"kind": r.kind, "name": r.name, "ms": ms})
        _out(f"  restarted {r.name}: back after {ms} ms")

    _out(f"rolling restart {seq}: every process, one at a time")
    error = None
    try:
        rolling_restart(cluster, on_restart=done)
    except Exception as exc:  # reported, and the cluster goes on serving (a crash here would stop it all)
        error = f"{type(exc).__name__}: {exc}"
        _out(f"rolling restart {seq} stopped: {error}")
    else:
        _out(f"rolling restart {seq} done: {len(restarts)} processes")
    result = cluster.data_dir / ROLLING_RESULT_FILE
    tmp = result.with_suffix(".tmp")
    tmp.write_text(json.dumps({"seq": seq, "ok": error is None, "error": error, "restarts": restarts}))
    tmp.replace(result)  # whole or not at all for a reader


def _read_rolling_result(path: Path) -> dict[str, Any] | None:
    try:
        got: dict[str, Any] = json.loads(path.read_text())
        return got
    except (OSError, ValueError):
        return None


def cmd_cluster_restart(args: argparse.Namespace) -> int:
    """Ask the ``cluster up`` running on ``--data-dir`` for a rolling restart and follow it."""
    data = Path(args.data_dir)
    try:
        pid = int((data / UP_PID_FILE).read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        raise _UsageError(f"no `ziplog cluster up` runs on {data} (no live process in {data / UP_PID_FILE})") from None
    result_path = data / ROLLING_RESULT_FILE
    before = _read_rolling_result(result_path)
    last_seq = before["seq"] if before else 0
    os.kill(pid, signal.SIGUSR1)
    _out(f"asked cluster up (pid {pid}) for a rolling restart ...")
    deadline = time.monotonic() + args.timeout
    while True:
        got = _read_rolling_result(result_path)
        if got is not None and got["seq"] > last_seq:
            break
        try:
            os.kill(pid, 0)
        except OSError:
            raise ZiplogError(f"cluster up (pid {pid}) ended before the rolling restart did") from None
        if time.monotonic() >= deadline:
            raise ZiplogError(f"the rolling restart did not end within {args.timeout:g} s (it goes on; "
                              f"see {result_path} later)")
        time.sleep(0.2)  # the result is a file: nothing to wait on but its appearance
    for r in got["restarts"]:
        _out(f"  {r['name']}: back after {r['ms']} ms")
    if not got["ok"]:
        raise ZiplogError(f"the rolling restart stopped: {got['error']}")
    _out(f"every process restarted ({len(got['restarts'])}), one at a time")
    return 0


def _insert_payloads(args: argparse.Namespace) -> Iterable[bytes]:
    if args.data == ["-"]:
        for line in sys.stdin.buffer:
            yield line.rstrip(b"\r\n") if not args.keep_newlines else line
        return
    if "-" in args.data:
        raise _UsageError("'-' (read stdin) cannot be mixed with other DATA arguments")
    for d in args.data:
        yield d.encode("utf-8", "surrogateescape")


def cmd_insert(args: argparse.Namespace) -> int:
    with _client(args) as log:
        if args.shard is not None:
            log.set_policy(Policy.fixed(args.shard))
        after = args.after if args.after is not None else RID_GENESIS
        for data in _insert_payloads(args):
            # Each record goes after the previous one, so arguments (or lines) keep their order in the log.
            rid = log.insert_after(data, after)
            _out(f"{rid.gsn}:{rid.shard}")
            after = rid
    return 0


def cmd_tail(args: argparse.Namespace) -> int:
    with _client(args) as log:
        with log.subscribe(args.start) as sub:
            n = 0
            while args.count is None or n < args.count:
                rec = sub.next(timeout=args.idle_timeout)
                if rec is None:  # only with --idle-timeout
                    break
                _out(f"{rec.rid.gsn} {rec.rid.shard} {format_data(rec.data)}")
                n += 1
    return 0


def cmd_read(args: argparse.Namespace) -> int:
    with _client(args) as log:
        data = log.read_record(args.rid)
    if args.raw:
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    else:
        _out(format_data(data))
    return 0


def cmd_trim(args: argparse.Namespace) -> int:
    with _client(args) as log:
        log.trim(RecordId(args.gsn, -1))
    _out(f"trimmed every record below gsn {args.gsn}")
    return 0


STATUS_COLUMNS = ["shard", "replica", "answer", "role", "epoch", "frontier", "stable", "trim_point", "records",
                  "subscriptions", "disk", "addr"]


def status_rows(status: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per replica the topology names, answered or not (``answer`` says)."""
    rows = []
    for shard, replicas in sorted(status.items()):
        for i, st in enumerate(replicas):
            row = dict(st)
            row.setdefault("shard", shard)
            row.setdefault("replica", i)
            row.setdefault("answer", "ok")
            # replica 0 is the primary by construction; only an answer can say it is blocked
            row["role"] = "primary" if st.get("primary", row["replica"] == 0) else "backup"
            rows.append(row)
    return rows


def format_status(rows: list[dict[str, Any]], columns: Sequence[str] = STATUS_COLUMNS) -> str:
    # one word per cell, so the table splits on whitespace ("not registered" -> "not-registered")
    cells = [[("-" if r.get(c) is None else str(r.get(c)).replace(" ", "-")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    left = {"role", "answer", "addr"}

    def line(vals: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if c in left else v.rjust(w) for v, w, c in zip(vals, widths, columns)).rstrip()

    return "\n".join([line(list(columns))] + [line(r) for r in cells])


def _all_serving(st: dict[int, list[dict[str, Any]]], live: set[int], shards: int) -> bool:
    rows = status_rows(st)
    return (len(st) >= max(shards, 1) and set(st) <= live
            and all(r["answer"] == "ok" and not r.get("frozen") for r in rows))


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as log:
        deadline = time.monotonic() + (args.wait or 0)
        while True:
            live = set(log.live_shards())
            st = log.status()
            if not args.wait or _all_serving(st, live, args.shards):
                break
            if time.monotonic() > deadline:
                rows = status_rows(st)
                if rows:
                    _out(format_status(rows))
                raise ZiplogError(f"not every replica of {max(args.shards, len(st))} shard(s) serves after "
                                  f"{args.wait:g} s")
            time.sleep(0.2)  # status answers are not events: ask again
    rows = status_rows(st)
    if not rows:
        _out("no shard is registered in ZooKeeper")
        return 1
    _out(format_status(rows))
    for r in rows:
        if r["answer"] != "ok":
            why = r.get("error") or r["answer"]
            _out(f"shard {r['shard']} replica {r['replica']}: {why}" + (f" ({r['addr']})" if r.get("addr") else ""))
    not_live = sorted(set(st) - live)
    if not_live:
        _out(f"not accepting inserts: shards {', '.join(map(str, not_live))}")
    for warning in status_warnings(rows):
        _out(warning)
    return 0


def status_warnings(rows: list[dict[str, Any]]) -> list[str]:
    """What keeps (or will soon keep) a shard from taking new records: a disk it cannot
    write, records in memory at 90 % of their bound or more."""
    out = []
    for r in rows:
        if r.get("disk", "ok") != "ok":
            out.append(f"shard {r['shard']} replica {r['replica']} cannot write its disk ({r['disk']}): the shard "
                       "takes no new records until it can (trim, or free space)")
        held, bound = r.get("log_bytes", 0), r.get("max_log_bytes", 0)
        if bound and held * 10 >= bound * 9:
            out.append(f"shard {r['shard']} replica {r['replica']} holds {held} of its {bound} bytes of records in "
                       "memory: past the bound the shard takes no new records (LOG_FULL) until a trim frees some")
    return out


def cmd_replica_replace(args: argparse.Namespace) -> int:
    """Become the replacement of a storage replica whose machine is gone: check that the
    shard exists and the old replica is not answering, then run the storage server in
    this process on an empty data directory (failure recovery fills it)."""
    from ziplog.io import zk as discovery
    from ziplog.io.segments import replica_dir
    from ziplog.protocol import layout
    from ziplog.tools.cluster import replica_status

    hosts = _zk_hosts(args)
    data_dir = Path(args.data_dir)
    mine = replica_dir(data_dir, args.shard, args.replica)
    if mine.exists() and any(mine.iterdir()):
        raise _UsageError(f"{mine} is not empty: a replacement starts from nothing (or restart the replica "
                          "on its own files instead)")
    zk = discovery.connect(hosts, timeout=args.timeout)
    try:
        meta = layout.dec(zk.get(f"{layout.SHARDS}/{args.shard}")[0]) if zk.exists(f"{layout.SHARDS}/{args.shard}") else None
        old = zk.exists(f"{layout.SHARDS}/{args.shard}/{args.replica}") and \
            layout.dec(zk.get(f"{layout.SHARDS}/{args.shard}/{args.replica}")[0])
    finally:
        discovery.stop(zk)
    if not meta:
        raise _UsageError(f"shard {args.shard} does not exist")
    replicas = int(meta.get("replicas", 0))
    if not 0 <= args.replica < replicas:
        raise _UsageError(f"shard {args.shard} has replicas 0..{replicas - 1}")
    if old and old.get("addr"):  # registered: a dead one's session may not have expired yet
        if replica_status(old["addr"], int(args.alive_check_s * 1000)) is not None:
            raise _UsageError(f"shard {args.shard} replica {args.replica} answers at {old['addr']}: "
                              "stop it before replacing it")
    argv = [sys.executable, "-m", "ziplog.server", "--zk", hosts, "--shard", str(args.shard),
            "--replica", str(args.replica), "--replicas", str(replicas), "--data-dir", str(data_dir),
            *(["--cluster-key-file", args.cluster_key_file] if args.cluster_key_file else []), *args.server_args]
    _out(f"replacing shard {args.shard} replica {args.replica}: {' '.join(argv[1:])}")
    sys.stdout.flush()
    os.execv(sys.executable, argv)
    return 0  # not reached


def cmd_config_check(args: argparse.Namespace) -> int:
    """Check a config file against the flags of every role it has a table for (or of
    ``--role``): every problem, with its key, at once."""
    import subprocess
    import tomllib

    from ziplog.shell.config import ROLES
    try:
        with open(args.file, "rb") as fh:
            doc = tomllib.load(fh)
    except OSError as exc:
        raise _UsageError(f"{args.file}: cannot read it: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        _err(f"{args.file}: not TOML: {exc}")
        return 2
    roles = [args.role] if args.role else [r for r in ROLES if isinstance(doc.get(r), dict)]
    if not roles:
        raise _UsageError(f"{args.file} has no table of a role ({', '.join(ROLES)}): say which role it is for "
                          "with --role")
    problems: dict[str, None] = {}
    for role in roles:
        done = subprocess.run([sys.executable, "-m", ROLES[role], "--config", args.file, "--check-config"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode == 0:
            _out(done.stdout.strip())
        for line in done.stderr.splitlines():
            if line.strip():
                problems[line] = None  # a problem every role finds (a shared key) is said once
    for line in problems:
        _err(line)
    return 2 if problems else 0


def cmd_client_keys(args: argparse.Namespace) -> int:
    """``ziplog client add|remove|list`` (``ziplog/tools/cli_clients.py``)."""
    return int(args.registry_func(args, _zk_hosts(args), _out))


def cmd_keygen(args: argparse.Namespace) -> int:
    from ziplog.shell.process import write_cluster_key

    if args.client:
        return _client_keygen(args)
    try:
        write_cluster_key(Path(args.file))
    except FileExistsError:
        raise _UsageError(f"{args.file} exists (a cluster key is never overwritten)") from None
    _out(f"wrote a new cluster key to {args.file}: give it to every process of the cluster "
         "(--cluster-key-file or $ZIPLOG_CLUSTER_KEY_FILE)")
    return 0


def _client_keygen(args: argparse.Namespace) -> int:
    """``keygen --client FILE --server-key Z85``: a client's own key pair, for an operator
    to register by its public key (``client add NAME --public-key``)."""
    from ziplog.io.keys import KeyFileError, new_keypair, write_key_file, z85_key, z85_text

    if not args.server_key:
        raise _UsageError("--client needs --server-key=Z85 (the cluster's, from `ziplog client list`)")
    try:
        server = z85_key(args.server_key, "server key")
    except KeyFileError as exc:
        raise _UsageError(str(exc)) from None
    if Path(args.file).exists():
        raise _UsageError(f"{args.file} exists (a key file is never overwritten)")
    pair = new_keypair()
    write_key_file(args.file, args.name or Path(args.file).stem, pair, server)
    _out(f"wrote a new client key to {args.file}; have it registered with: "
         f"ziplog client add NAME --rights R --public-key={z85_text(pair.public)}")
    return 0


# -- LogDB ----------------------------------------------------------------------------------------
def _logdb(args: argparse.Namespace) -> Any:
    from ziplog.logdb import LogDB
    hosts = _zk_hosts(args)
    try:
        return LogDB(hosts, name=args.name, timeout=args.timeout, key_file=args.key_file)
    except ZiplogError:
        raise
    except Exception as e:  # no LogDB registered, ZooKeeper unreachable
        raise ZiplogError(f"cannot open LogDB {args.name!r} at {hosts}: {type(e).__name__}: {e}") from e


def cmd_logdb_get(args: argparse.Namespace) -> int:
    with _logdb(args) as db:
        value = db.get(args.key.encode("utf-8", "surrogateescape"))
    if value is None:
        print(f"ziplog logdb get: no value for {args.key!r}", file=sys.stderr)
        return 1
    _out(format_data(value))
    return 0


def cmd_logdb_put(args: argparse.Namespace) -> int:
    key, value = args.key.encode("utf-8", "surrogateescape"), args.value.encode("utf-8", "surrogateescape")
    with _logdb(args) as db:
        with db.transaction() as t:
            t.put(key, value)
    _out(f"committed at gsn {t.serialized_at}")
    return 0


def cmd_logdb_bank(args: argparse.Namespace) -> int:
    from ziplog.logdb.bank import run_bank
    report = run_bank(_zk_hosts(args), name=args.name, accounts=args.accounts, processes=args.processes,
                      seconds=args.seconds)
    for line in report.lines():
        _out(line)
    return 0 if report.total == report.expected_total else 1


# -- LogBook --------------------------------------------------------------------------------------
def _tag(text: str) -> int | str:
    """A tag on the command line: digits are an integer tag, anything else a string tag."""
    return int(text) if text.isdigit() else text


def _book(args: argparse.Namespace) -> Any:
    from ziplog.logbook import LogBook
    return LogBook(_zk_hosts(args), args.book, timeout=args.timeout, key_file=args.key_file)


def _print_record(rec: Any) -> int:
    if rec is None:
        print("no record", file=sys.stderr)
        return 1
    tags = ",".join(rec.names.get(t, str(t)) for t in rec.tags)
    _out(f"{rec.seqnum}\t{tags}\t{format_data(rec.data)}")
    return 0


def cmd_book_append(args: argparse.Namespace) -> int:
    with _book(args) as lb:
        _out(str(lb.append(args.data.encode("utf-8", "surrogateescape"), [_tag(t) for t in args.tag])))
    return 0


def cmd_book_read(args: argparse.Namespace) -> int:
    tag = None if args.tag is None else _tag(args.tag)
    with _book(args) as lb:
        if args.book_command == "read-next":
            return _print_record(lb.read_next(args.seqnum, tag))
        if args.book_command == "read-prev":
            return _print_record(lb.read_prev(args.seqnum, tag))
        return _print_record(lb.check_tail(tag))


def cmd_flow_steps(args: argparse.Namespace) -> int:
    from ziplog.logbook.flow.env import describe, iter_steps
    with _book(args) as lb:
        intent, outcome = describe(lb, args.workflow)
        if intent is None:
            print(f"no workflow {args.workflow!r} in book {args.book}", file=sys.stderr)
            return 1
        _out(f"workflow {args.workflow}: {intent[0]}({intent[1]!r})")
        for step, seqnum, op, value in iter_steps(lb, args.workflow):
            _out(f"{step}\t{seqnum}\t{op}\t{value!r}")
        _out("running (no outcome yet)" if outcome is None else
             f"{'returned' if outcome[0] else 'failed'}: {outcome[1]!r}")
    return 0


# -- parser ---------------------------------------------------------------------------------------
def _app_action(subs: Any, name: str, help: str, func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """An action of an app's command (``logdb``, ``book``): ZooKeeper hosts and a timeout."""
    sp: argparse.ArgumentParser = subs.add_parser(name, help=help, description=help)
    sp.add_argument("--zk", metavar="HOSTS", default=None, help=f"ZooKeeper hosts (default: ${ENV_ZK})")
    sp.add_argument("--timeout", type=float, default=30.0, metavar="S", help="per-call timeout (default 30)")
    _key_file_argument(sp)
    sp.set_defaults(func=func)
    return sp


def _key_file_argument(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--key-file", default=None, metavar="FILE",
                    help="the client key for a cluster that speaks CURVE (`ziplog client add`; default: "
                         "$ZIPLOG_CLIENT_KEY_FILE)")


def _client_cmd(sub: Any, name: str, help: str, func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """A command that talks to a running log: ``--zk`` and ``--timeout``."""
    sp = sub.add_parser(name, help=help, description=help)
    sp.add_argument("--zk", metavar="HOSTS", default=None,
                    help=f"ZooKeeper hosts, host:port[,host:port...] (default: ${ENV_ZK})")
    sp.add_argument("--timeout", type=float, default=30.0, metavar="S", help="per-operation timeout (default 30)")
    _key_file_argument(sp)
    sp.set_defaults(func=func)
    return sp


def _command_group(sub: Any, name: str, help: str, description: str) -> Any:
    """``ziplog NAME ACTION ...``: its ACTION is ``args.NAME_command``."""
    group = sub.add_parser(name, help=help, description=description)
    actions = group.add_subparsers(dest=f"{name}_command", metavar="ACTION")
    actions.required = True
    return actions


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ziplog", description="A totally ordered, sharded, replicated shared log.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_cluster_commands(sub)
    _add_operator_commands(sub)
    _add_client_commands(sub)
    _add_app_commands(sub)
    add_client_key_commands(sub, ENV_ZK, cmd_client_keys)
    conformance.add_commands(sub)
    return p


def _add_cluster_commands(sub: Any) -> None:
    """``cluster up``, ``cluster restart``: a local cluster."""
    clsub = _command_group(sub, "cluster", "run a local cluster", "Run a local cluster.")
    up = clsub.add_parser("up", help="start a local cluster in the foreground (Ctrl-C stops it)",
                          description="Start ZooKeeper, the membership service and the storage replicas on "
                                      "this machine; runs until Ctrl-C or SIGTERM, then stops every process.")
    up.add_argument("--shards", type=_positive_int, default=2, help="number of shards (default 2)")
    up.add_argument("--replicas", type=_positive_int, default=2, help="replicas per shard (default 2)")
    up.add_argument("--data-dir", default=None, metavar="D",
                    help="keep data and logs here (default: a temporary directory removed on exit); "
                         "reusing it restarts the same log")
    up.add_argument("--process-per-cpu", action="store_true",
                    help="serve the replicas that share a CPU in one storage process (a process per CPU, as on a "
                         "machine hosting more replicas than CPUs) instead of one process per replica")
    up.add_argument("--poll-us", type=_nonneg_int, default=0, metavar="US",
                    help="storage servers poll up to this long before they sleep (ziplog.server --poll-us): lower "
                         "latency for a few clients, at a cost in CPU (default 0: off; 200 is a good value)")
    up.add_argument("--curve", action="store_true",
                    help="every connection speaks CURVE (encrypted, clients need a key: one with every right is "
                         "made and printed); the default with --netns, whose hosts are not loopback")
    up.add_argument("--netns", action="store_true",
                    help="run each process on a host of its own: Linux network namespaces with their own addresses "
                         "on a bridge (three control hosts, one per storage replica, one for clients; root only)")
    up.set_defaults(func=cmd_cluster_up)
    rs = clsub.add_parser("restart", help="restart every process of a running `cluster up`, one at a time",
                          description="Ask the `ziplog cluster up` running on DATA_DIR to restart every process "
                                      "gracefully, one at a time, the next only once the last is back at work: "
                                      "ZooKeeper nodes, MMS and failure handler replicas (leaders last), then "
                                      "storage replicas shard by shard (primaries last). Inserts go on meanwhile.")
    rs.add_argument("--rolling", action="store_true", required=True,
                    help="one process at a time (the only way: a cluster restarted all at once is a new start)")
    rs.add_argument("--data-dir", required=True, metavar="D", help="the data directory `cluster up` was given")
    rs.add_argument("--timeout", type=float, default=600.0, metavar="S", help="how long to follow it")
    rs.set_defaults(func=cmd_cluster_restart)


def _add_operator_commands(sub: Any) -> None:
    """``replica replace``, ``keygen``, ``config check``."""
    rpsub = _command_group(sub, "replica", "operate on storage replicas", "Operate on storage replicas.")
    rr = rpsub.add_parser("replace", help="run a new replica in place of one whose machine is gone",
                          description="Run the storage server here, on an empty data directory, as shard SHARD "
                                      "replica REPLICA, in place of a replica that is gone for good. Failure "
                                      "recovery installs the shard's state from the surviving replica and the shard "
                                      "returns to full strength. Runs in the foreground.")
    rr.add_argument("shard", type=_nonneg_int, metavar="SHARD")
    rr.add_argument("replica", type=_nonneg_int, metavar="REPLICA")
    rr.add_argument("--zk", metavar="HOSTS", default=None, help=f"ZooKeeper hosts (default: ${ENV_ZK})")
    rr.add_argument("--data-dir", required=True, metavar="D", help="an empty (or new) directory for the segment files")
    rr.add_argument("--cluster-key-file", default=None, metavar="FILE",
                    help="the cluster's secret (default: $ZIPLOG_CLUSTER_KEY_FILE)")
    rr.add_argument("--timeout", type=float, default=30.0, metavar="S", help="ZooKeeper connection timeout")
    rr.add_argument("--alive-check-s", type=float, default=1.0, help=argparse.SUPPRESS)
    rr.add_argument("server_args", nargs="*", metavar="-- SERVER_ARGS",
                    help="more ziplog.server options after --, e.g. -- --bind 10.0.0.5")
    rr.set_defaults(func=cmd_replica_replace)

    kg = sub.add_parser("keygen", help="write a new cluster secret to FILE (readable by its owner only)",
                        description="Write a new random cluster secret. Every storage replica, membership "
                                    "service and failure handler replica of one cluster is started with it.")
    kg.add_argument("file", metavar="FILE")
    kg.add_argument("--client", action="store_true",
                    help="write a client's CURVE key pair instead (a key file; register its public key with "
                         "`ziplog client add NAME --public-key`)")
    kg.add_argument("--server-key", default=None, metavar="Z85",
                    help="with --client: the cluster's server key (write --server-key=Z85: a Z85 text may start with '-')")
    kg.add_argument("--name", default=None, help="with --client: the name in the key file (default: FILE's stem)")
    kg.set_defaults(func=cmd_keygen)

    cfsub = _command_group(sub, "config", "config files of server processes", "Config files.")
    cc = cfsub.add_parser("check", help="report every error of a config file, with its key",
                          description="Check a TOML config file against the flags of each role it has a table for "
                                      "([storage], [mms], ...), or of --role for a one-process file.")
    cc.add_argument("file", metavar="FILE")
    cc.add_argument("--role", choices=sorted(CONFIG_ROLES), default=None,
                    help="the role a file without role tables is for")
    cc.set_defaults(func=cmd_config_check)


def _add_client_commands(sub: Any) -> None:
    """``insert``, ``tail``, ``read``, ``trim``, ``status``: the log's own calls."""
    ins = _client_cmd(sub, "insert", "insert records, each after the previous one; prints each record id as GSN:SHARD",
                     cmd_insert)
    ins.add_argument("--after", type=parse_rid, default=None, metavar="GSN:SHARD",
                     help="insert the first record after this record (default: anywhere)")
    ins.add_argument("--shard", type=_nonneg_int, default=None, metavar="S", help="insert on shard S")
    ins.add_argument("--keep-newlines", action="store_true", help="with '-': keep each line's newline")
    ins.add_argument("data", nargs="+", metavar="DATA", help="record data (UTF-8), or '-' to insert each stdin line")

    tail = _client_cmd(sub, "tail", "print records in log order as 'GSN SHARD DATA'", cmd_tail)
    tail.add_argument("--from", dest="start", type=_position, default=RID_GENESIS, metavar="POS",
                      help="GSN (inclusive), 'genesis' (default) or 'recent'")
    tail.add_argument("-n", dest="count", type=_positive_int, default=None, metavar="COUNT",
                      help="stop after COUNT records (default: follow forever)")
    tail.add_argument("--idle-timeout", type=float, default=None, metavar="S",
                      help="stop when no record arrives for S seconds")

    rd = _client_cmd(sub, "read", "print one record's data", cmd_read)
    rd.add_argument("rid", type=parse_rid, metavar="GSN:SHARD")
    rd.add_argument("--raw", action="store_true", help="write the bytes exactly, without a newline")

    tr = _client_cmd(sub, "trim", "delete every record below GSN on every shard", cmd_trim)
    tr.add_argument("gsn", type=_positive_int, metavar="GSN")

    stp = _client_cmd(sub, "status", "show every shard's replicas: epoch, frontier, stable, records, subscriptions, address",
                     cmd_status)
    stp.add_argument("--wait", type=float, default=0.0, metavar="S",
                     help="first wait up to S seconds until every replica answers, unfrozen, and every shard takes "
                          "inserts (exit status 1 if not): the check between two steps of a rolling restart")
    stp.add_argument("--shards", type=int, default=0, metavar="N",
                     help="with --wait: also until at least N shards are registered")


def _add_app_commands(sub: Any) -> None:
    """``logdb ...`` and ``book ...``: the apps on the log."""
    ldsub = _command_group(sub, "logdb", "transactions on a LogDB running on the log",
                          "Transactions on a LogDB (its coordinators and KV shards must run).")

    def logdb_cmd(name: str, help: str, func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        sp = _app_action(ldsub, name, help, func)
        sp.add_argument("--name", default="default", help="the LogDB's name (default 'default')")
        return sp

    lg = logdb_cmd("get", "print the latest committed value of KEY", cmd_logdb_get)
    lg.add_argument("key", metavar="KEY")
    lp = logdb_cmd("put", "set KEY to VALUE in one transaction", cmd_logdb_put)
    lp.add_argument("key", metavar="KEY")
    lp.add_argument("value", metavar="VALUE")
    lb = logdb_cmd("bank", "open accounts and run concurrent transfers; checks the total balance", cmd_logdb_bank)
    lb.add_argument("--accounts", type=_positive_int, default=20)
    lb.add_argument("--processes", type=_positive_int, default=3)
    lb.add_argument("--seconds", type=float, default=5.0)

    bksub = _command_group(sub, "book", "Boki's LogBook on the log: append to and read a book by tag",
                          "Append to and read a LogBook book (a record's seqnum is its gsn).")

    def book_cmd(name: str, help: str, func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        sp = _app_action(bksub, name, help, func)
        sp.add_argument("book", type=int, metavar="BOOK", help="the book id (0..2**64-1)")
        return sp

    ba = book_cmd("append", "append DATA with --tag TAG (repeatable; digits: an integer tag); prints its seqnum",
                  cmd_book_append)
    ba.add_argument("data", metavar="DATA")
    ba.add_argument("--tag", action="append", default=[], metavar="TAG")
    for name, help in (("read-next", "print the first record with --tag TAG (default: any) and seqnum >= SEQNUM"),
                       ("read-prev", "print the last record with --tag TAG (default: any) and seqnum <= SEQNUM")):
        br = book_cmd(name, help, cmd_book_read)
        br.add_argument("seqnum", type=int, metavar="SEQNUM")
        br.add_argument("--tag", default=None, metavar="TAG")
    bt = book_cmd("tail", "print the book's last record with --tag TAG (default: any)", cmd_book_read)
    bt.add_argument("--tag", default=None, metavar="TAG")

    flsub = _command_group(sub, "flow", "BokiFlow's workflows in a book: what they recorded",
                           "Show BokiFlow workflows (their intent, steps and outcome).")
    fs = _app_action(flsub, "steps", "print WORKFLOW's call, its recorded steps (step, seqnum, operation, "
                     "outcome) and its outcome", cmd_flow_steps)
    fs.add_argument("workflow", metavar="WORKFLOW")
    fs.add_argument("--book", type=int, required=True, help="the workflows' book")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors (2) and --help (0)
        return e.code if isinstance(e.code, int) else 2
    action = getattr(args, f"{args.command}_command", None)  # a command group's ACTION
    name = args.command if action is None else f"{args.command} {action}"
    try:
        return args.func(args)
    except _UsageError as e:
        print(f"ziplog {name}: error: {e}", file=sys.stderr)
        return 2
    except ZiplogError as e:
        print(f"ziplog {name}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `ziplog tail | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0


if __name__ == "__main__":
    sys.exit(main())
