"""A client of the ziplog wire protocol written from docs/CLIENT.md alone.

Used by tests/test_conformance.py: it inserts, reads and subscribes against the
cluster that `ziplog conformance run` started, and records its history (the JSON
lines of CLIENT.md §13). It speaks msgpack over ZeroMQ DEALER sockets and reads
ZooKeeper, and nothing else. Environment: ZIPLOG_ZK (ZooKeeper's connection
string, with its chroot if any) and ZIPLOG_HISTORY (the file to write). It exits 0 on
success, 1 with a message on any failure.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack
import zmq
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

INSERT, READ, SUBSCRIBE, CREDIT, UNSUBSCRIBE = 1, 2, 4, 5, 6
ACK, READ_OK, SUB_BATCH, ACKS, ERROR = 16, 17, 19, 23, 31
SIZES = {READ_OK: 6, SUB_BATCH: 6, ACKS: 3, ERROR: 5}
ACK_SIZES = (8, 9)  # without, with the primary incarnation it names (`inc`)
REFUSALS = ("NOT_MEMBER", "NOT_READY", "TIMEOUT", "OVERLOADED", "DISK_FULL")
NOCOPY = "NOCOPY"
SUB_CREDIT, CREDIT_STEP = 4096, 1024  # small on purpose: CREDIT gets exercised


class Fail(Exception):
    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


def epoch_of(g: int) -> int:
    return (g - 1) >> 32  # gsn 0: -1


def epoch_end(e: int) -> int:
    return (e + 1) << 32


def is_uint(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 64


def pack(*fields: Any) -> bytes:
    return msgpack.packb([1, *fields], use_bin_type=True)


def unpack(raw: bytes) -> list:
    f = msgpack.unpackb(raw, raw=False)
    if not (isinstance(f, list) and len(f) >= 2 and is_uint(f[0]) and f[0] == 1 and is_uint(f[1])):
        raise Fail(f"bad frame from a server: {f!r}")
    if (f[1] in SIZES and len(f) != SIZES[f[1]]) or (f[1] == ACK and len(f) not in ACK_SIZES):
        raise Fail(f"frame of op {f[1]} with {len(f)} elements: {f!r}")
    if f[1] == ERROR and f[2] is None:
        raise Fail(f"a server could not read one of our frames: {f[3]} {f[4]}")
    return f


def check_vectors(path: Path) -> None:
    """Every frame of docs/vectors.json must decode to its fields and encode to its bytes."""
    def value(t: dict[str, Any]) -> Any:
        (kind, v), = t.items()
        readers: dict[str, Callable[[Any], Any]] = {
            "uint": int, "int": int, "bin": bytes.fromhex, "str": str, "bool": bool, "nil": lambda _: None,
            "array": lambda a: [value(x) for x in a], "map": lambda m: {value(k): value(x) for k, x in m}}
        return readers[kind](v)
    for vec in json.loads(path.read_text())["vectors"]:
        fields, raw = [value(f["value"]) for f in vec["fields"]], bytes.fromhex(vec["hex"])
        if pack(*fields[1:]) != raw or msgpack.unpackb(raw, raw=False) != fields:
            raise Fail(f"vector {vec['name']} ({vec['note']}) does not round-trip")


class Insert:
    """One record's insert (§6.2): its identity and the state of the current wait."""

    def __init__(self, data: bytes, after: int, seq: int, deadline: float) -> None:
        self.data, self.after, self.seq, self.deadline = data, after, seq, deadline
        self.stamp = time.time_ns()  # of the first send; resends keep it
        self.excluded: set[int] = set()
        self.result: tuple[int, int] | None = None
        self.round = 0  # the req_id of the latest send
        self.sent_at = self.retry_at = 0.0

    def reset(self, shard: int, addrs: list[str]) -> None:
        """A fresh wait on a shard: every answer collected is dropped."""
        self.shard, self.addrs, self.frozen = shard, addrs, False
        self.earlier: set[int] = set()
        self.decided: int | None = None
        self.refused: list | None = None
        self.first: list = [None] * len(addrs)  # per replica: its first and latest gsn, or NOCOPY
        self.latest: list = [None] * len(addrs)
        self.incs: list = [0] * len(addrs)  # the primary incarnation each latest ACK named


class Client:
    def __init__(self, zk_hosts: str, history: str) -> None:
        self.zk = KazooClient(hosts=zk_hosts)
        self.zk.start(timeout=15)
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self.tags: dict[zmq.Socket, tuple[str, Any]] = {}  # ("req", addr) or ("sub", shard)
        self.dealers: dict[str, zmq.Socket] = {}
        self.client_id = random.getrandbits(63)
        self.ids = self.seqs = 0
        self.stable: dict[int, int] = {}  # shard -> highest stable seen in an ACK or READ_OK
        self.addrs: dict[int, list[str]] = {}
        self.live: set[int] = set()
        self.history = open(history, "w")

    def next_id(self) -> int:
        self.ids += 1
        return self.ids

    def record(self, **line: Any) -> None:
        self.history.write(json.dumps(line) + "\n")
        self.history.flush()

    # -- sockets (§2) ------------------------------------------------------------
    def socket(self, addr: str, tag: tuple[str, Any]) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        for opt, v in ((zmq.LINGER, 0), (zmq.SNDHWM, 100_000), (zmq.RCVHWM, 100_000),
                       (zmq.MAXMSGSIZE, 64 << 20), (zmq.IPV6, int("[" in addr))):
            s.setsockopt(opt, v)
        s.connect(addr)
        self.poller.register(s, zmq.POLLIN)
        self.tags[s] = tag
        return s

    def close(self, s: zmq.Socket, linger_ms: int = 0) -> None:
        self.poller.unregister(s)
        del self.tags[s]
        s.close(linger=linger_ms)

    def dealer(self, addr: str) -> zmq.Socket:
        """The one DEALER of a replica address, shared by every request."""
        if addr not in self.dealers:
            self.dealers[addr] = self.socket(addr, ("req", addr))
        return self.dealers[addr]

    def poll(self, timeout: float) -> Iterator[tuple[tuple[str, Any], list]]:
        """Frames that came within timeout seconds, with their socket's tag; an ACKS unrolled."""
        for s, _ in self.poller.poll(max(0, int(timeout * 1000))):
            while s.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                if len(parts := s.recv_multipart()) != 1:
                    raise Fail(f"an answer of {len(parts)} parts")
                f = unpack(parts[0])
                for a in f[2] if f[1] == ACKS else [f]:
                    if f[1] == ACKS and not (isinstance(a, list) and len(a) in ACK_SIZES and a[:2] == [1, ACK]):
                        raise Fail(f"bad ACK in an ACKS: {a!r}")
                    yield self.tags[s], a

    # -- discovery (§5) ----------------------------------------------------------
    def zget(self, path: str) -> Any:
        data, _ = self.zk.get(path)
        return msgpack.unpackb(data, raw=False) if data else None

    def refresh(self) -> None:
        """Read every shard whose addresses are known (replica 0 first), and the live ones."""
        addrs: dict[int, list[str]] = {}
        out: set[int] = set()  # removed or recovering
        try:
            membership = self.zget("/ziplog/membership") or []
            names = self.zk.get_children("/ziplog/shards")
        except NoNodeError:
            return
        for name in names:
            try:
                meta, nodes = self.zget(f"/ziplog/shards/{name}"), {}
                for child in self.zk.get_children(f"/ziplog/shards/{name}"):
                    node = self.zget(f"/ziplog/shards/{name}/{child}")
                    if node and node.get("addr"):
                        nodes[int(child)] = node["addr"]
            except NoNodeError:
                continue
            if meta and all(r in nodes for r in range(meta["replicas"])):
                addrs[int(name)] = [nodes[r] for r in range(meta["replicas"])]
                if meta.get("removed") or meta.get("recovering") is not None:
                    out.add(int(name))
        self.addrs = addrs
        self.live = (set(membership[-1][1]) if membership else set()) & set(addrs) - out

    def wait_for_shards(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.refresh()
            if len(self.live) >= count:
                return
            if time.monotonic() > deadline:
                raise Fail(f"no {count} live shards after {timeout} s: {self.addrs}, live {self.live}")
            time.sleep(0.2)

    # -- insert (§6) -------------------------------------------------------------
    def place(self, op: Insert) -> None:
        """A fresh wait on a live shard the record has not left, and the first send there."""
        choices = sorted(self.live - op.excluded)
        if not choices:
            raise Fail(f"no live shard left for seq {op.seq} (left {op.excluded})")
        shard = choices[op.seq % len(choices)]
        op.reset(shard, self.addrs[shard])
        op.round = self.next_id()
        self.send_insert(op)

    def send_insert(self, op: Insert) -> None:
        frame = pack(INSERT, op.round, self.client_id, op.seq, op.after, op.data, op.stamp)
        for a in op.addrs:
            self.dealer(a).send(frame)
        op.sent_at = time.monotonic()
        op.retry_at = op.sent_at + (0.05 if op.frozen else 0.25)

    def resend(self, op: Insert) -> None:
        op.earlier.add(op.round)
        op.round, op.refused = self.next_id(), None
        op.latest = [None if x == NOCOPY else x for x in op.latest]
        self.send_insert(op)

    def on_insert_answer(self, op: Insert, r: int, f: list) -> None:
        if f[2] != op.round and not (f[1] == ACK and f[2] in op.earlier):
            return
        if f[1] == ACK:
            gsn = f[3]
            self.stable[op.shard] = max(self.stable.get(op.shard, 0), f[5])
            if f[7]:  # final: failure recovery settled it
                op.result = (gsn, op.shard)
                return
            if r == 0:
                if op.decided is not None and op.decided != gsn:
                    op.first, op.latest = [None] * len(op.addrs), [None] * len(op.addrs)
                    op.incs = [0] * len(op.addrs)
                op.decided = gsn
            if op.first[r] is None:
                op.first[r] = gsn
            op.latest[r] = gsn
            op.incs[r] = f[8] if len(f) > 8 else 0
            if op.decided is not None and all(x == op.decided and (i == op.incs[0] or not i or not op.incs[0])
                                              for x, i in zip(op.latest, op.incs)):
                op.result = (op.decided, op.shard)
        elif f[1] == ERROR:
            code = f[3]
            if code in ("NO_GUESS", "DISK_FULL") and r > 0:
                op.latest[r] = NOCOPY
                op.first[r] = NOCOPY if op.first[r] is None else op.first[r]
            elif code == "NOT_HELD":
                return self.move(op)
            elif code == "FROZEN":
                op.frozen = True
            elif code in REFUSALS and r == 0:
                op.refused = f
            else:
                raise Fail(f"insert of seq {op.seq} on shard {op.shard}: {code} {f[4]}", code)
            if op.frozen or op.refused is not None:  # troubled: resend 0.05 s after the last send
                op.retry_at = min(op.retry_at, op.sent_at + 0.05)
            if op.refused is not None and all(x == NOCOPY for x in op.latest[1:]):
                self.move(op)

    def move(self, op: Insert) -> None:
        """The shard provably holds no copy: the same (client_id, seq) goes to another one."""
        op.excluded.add(op.shard)
        self.place(op)

    def insert_all(self, items: list[tuple[bytes, int]], timeout: float = 30.0) -> list[tuple[int, int]]:
        """Insert (data, after) pairs concurrently on the shared DEALERs; their (gsn, shard)s."""
        deadline, ops = time.monotonic() + timeout, []
        for data, after in items:
            self.seqs += 1
            ops.append(Insert(data, after, self.seqs, deadline))
            self.place(ops[-1])
        while pending := [op for op in ops if op.result is None]:
            for (kind, addr), f in self.poll(min(op.retry_at for op in pending) - time.monotonic()):
                for op in pending:
                    if kind == "req" and op.result is None and addr in op.addrs and f[1] in (ACK, ERROR):
                        self.on_insert_answer(op, op.addrs.index(addr), f)
            now = time.monotonic()
            for op in (op for op in pending if op.result is None):
                if now >= op.deadline:
                    raise Fail(f"insert of seq {op.seq} timed out: its outcome is unknown")
                if now >= op.retry_at:
                    self.resend(op)
        results: list[tuple[int, int]] = []
        for op in ops:
            assert op.result is not None
            gsn, shard = op.result
            results.append(op.result)
            if not gsn > op.after:
                raise Fail(f"insert after {op.after} returned gsn {gsn}")
            self.record(op="insert", after=str(op.after), data=op.data.hex(), gsn=str(gsn), shard=shard)
        return results

    # -- read (§7) ---------------------------------------------------------------
    def read(self, gsn: int, shard: int, timeout: float = 10.0) -> bytes:
        addrs, ids, got = self.addrs[shard], set(), {}
        deadline = time.monotonic() + timeout
        one = gsn <= self.stable.get(shard, 0)  # decided: one replica's answer is final
        while time.monotonic() < deadline:
            ids.add(rid := self.next_id())
            for a in [random.choice(addrs)] if one else [a for a in addrs if a not in got]:
                self.dealer(a).send(pack(READ, rid, gsn))
            until = min(deadline, time.monotonic() + (0.5 if one else 0.25))
            while (left := until - time.monotonic()) > 0:
                for (kind, addr), f in self.poll(left):
                    if kind != "req" or addr not in addrs or f[1] not in (READ_OK, ERROR) or f[2] not in ids:
                        continue
                    if f[1] == ERROR:
                        raise Fail(f"read of {gsn} on shard {shard}: {f[3]} {f[4]}", f[3])
                    if f[3] != gsn:
                        raise Fail(f"READ_OK for gsn {f[3]}, asked {gsn}")
                    self.stable[shard] = max(self.stable.get(shard, 0), f[5])
                    got[addr] = f[4]
                    if one or f[5] >= gsn:
                        return f[4]
                    if len(got) == len(addrs):  # every replica answered, none knew it stable
                        if len(set(got.values())) != 1:
                            raise Fail(f"the replicas of shard {shard} disagree on gsn {gsn}")
                        return f[4]
            one = False  # no answer within 0.5 s: ask every replica
        raise Fail(f"read of {gsn} on shard {shard}: no answer")

    # -- subscribe (§8) ------------------------------------------------------------
    def subscribe(self, from_gsn: int, wanted: set[tuple[int, int]], timeout: float = 60.0) -> None:
        """Subscribe on every shard, merge (§8.7), and deliver until every rid of wanted came."""
        start = max(from_gsn, 1)
        delivered, last_out = start - 1, 0
        ranges: list[list] = []  # [first epoch, last epoch, members]
        progress: dict[int, int] = {}
        last_rx: dict[int, int] = {}
        queue: dict[int, list[tuple[int, bytes]]] = {}
        consumed: dict[int, int] = {}
        subs: dict[int, zmq.Socket] = {}
        sub_id = self.next_id()
        self.record(op="subscribe", **{"from": str(from_gsn)})

        def sub_on(s: int) -> None:
            if s not in subs and s in self.addrs:
                addrs = self.addrs[s]
                subs[s] = self.socket(addrs[1] if len(addrs) == 2 else addrs[0], ("sub", s))
                subs[s].send(pack(SUBSCRIBE, sub_id, from_gsn, SUB_CREDIT))
                queue[s], consumed[s] = [], 0

        def range_of(e: int) -> list | None:
            return next((R for R in ranges if R[0] <= e <= R[1]), None)

        def add_epochs(first: int, last: int, members: list[int]) -> None:
            e = first
            while e <= last and (R := range_of(e)) is not None:
                if sorted(R[2]) != sorted(members):
                    raise Fail(f"shards disagree on the members of epoch {e}: {R[2]} vs {members}")
                e = R[1] + 1
            if e > last:
                return
            if ranges and e != ranges[-1][1] + 1:
                raise Fail(f"a gap in the epoch ranges before epoch {e}")
            if ranges and sorted(ranges[-1][2]) == sorted(members):
                ranges[-1][1] = last
            else:
                ranges.append([e, last, list(members)])
            for m in members:
                sub_on(m)

        def deliverable() -> int:
            g = delivered
            while (R := range_of(epoch_of(g + 1))) is not None:
                p = min((progress.get(m, 0) for m in R[2]), default=None)
                if p is not None and p < epoch_end(R[1]):
                    return max(g, p)
                g = epoch_end(R[1])  # no member (all no-ops), or the whole range is final
            return g

        def on_batch(s: int, records: list, epochs: list, p: int) -> None:
            nonlocal delivered, last_out
            for first, last, members in epochs:
                add_epochs(first, last, members)
            floor = max(last_rx.get(s, 0), progress.get(s, 0), start - 1)
            for g, data in records:
                if not g > floor:
                    raise Fail(f"shard {s} sent gsn {g}, not above {floor}")
                queue[s].append((g, data))
                last_rx[s] = floor = g
            progress[s] = max(progress.get(s, 0), p)
            consumed[s] += 1024
            limit = deliverable()
            if limit > delivered:
                out = sorted((g, s2, d) for s2, q in queue.items() for g, d in q if g <= limit)
                for s2 in queue:
                    queue[s2] = [(g, d) for g, d in queue[s2] if g > limit]
                for g, s2, data in out:
                    if g <= last_out:
                        raise Fail(f"gsn {g} came from two shards")
                    if s2 not in (range_of(epoch_of(g)) or [0, 0, []])[2]:
                        raise Fail(f"shard {s2} sent gsn {g} of an epoch it is no member of")
                    self.record(op="deliver", gsn=str(g), shard=s2, data=data.hex())
                    wanted.discard((g, s2))
                    last_out = g
                    consumed[s2] += len(data)
                delivered = limit
            for s2, sock in subs.items():
                if consumed[s2] >= CREDIT_STEP:
                    sock.send(pack(CREDIT, sub_id, consumed[s2]))
                    consumed[s2] = 0

        deadline = time.monotonic() + timeout
        keepalive = looked = time.monotonic()
        for s in sorted(self.addrs):
            sub_on(s)
        while wanted:
            if time.monotonic() > deadline:
                raise Fail(f"subscription: {len(wanted)} inserted records never delivered "
                           f"(delivered up to {delivered}, progress {progress})")
            for (kind, s), f in self.poll(0.2):
                if kind == "sub" and f[2] == sub_id and f[1] == ERROR:
                    raise Fail(f"subscription on shard {s} ended: {f[3]} {f[4]}", f[3])
                if kind == "sub" and f[2] == sub_id and f[1] == SUB_BATCH:
                    on_batch(s, f[3], f[4], f[5])
            if (now := time.monotonic()) - looked > 0.2:  # shards that registered since
                self.refresh()
                for s in sorted(self.addrs):
                    sub_on(s)
                looked = now
            if now - keepalive > 10:  # renew the leases
                for sock in subs.values():
                    sock.send(pack(CREDIT, sub_id, 0))
                keepalive = now
        for sock in subs.values():
            sock.send(pack(UNSUBSCRIBE, sub_id))
            self.close(sock, linger_ms=200)

    def shutdown(self) -> None:
        self.ctx.destroy(linger=0)
        self.zk.stop()
        self.zk.close()
        self.history.close()


def run(c: Client) -> None:
    c.wait_for_shards(2, 60)
    rids: list[tuple[int, int]] = []
    datas: dict[tuple[int, int], bytes] = {}
    for wave in range(5):  # 10 records a wave; from the second on, some chain after earlier ones
        items = [(f"rec-{wave}-{i};".encode() * (5 + 7 * i),
                  0 if wave == 0 or i % 3 == 0 else random.choice(rids)[0]) for i in range(10)]
        if wave == 4:  # after a gsn 3 epochs ahead: parked, the backups answer NO_GUESS (slow path)
            items = [(b"ahead-%d" % i, max(rids)[0] + (3 << 32)) for i in range(2)]
        for (data, _), rid in zip(items, c.insert_all(items)):
            rids.append(rid)
            datas[rid] = data
    if len(set(rids)) != len(rids):
        raise Fail("two inserts returned one record id")
    # the newest record of each shard first: likely above the stable watermark known
    picks = [max(r for r in rids if r[1] == s) for s in sorted({s for _, s in rids})]
    picks += random.sample([r for r in rids if r not in picks], 6)
    if not any(g > 1 << 32 for g, _ in picks):
        raise Fail("no record above 2^32 to read")
    for g, s in picks:
        if (data := c.read(g, s)) != datas[(g, s)]:
            raise Fail(f"read of {g} on shard {s}: {data!r}, inserted {datas[(g, s)]!r}")
        c.record(op="read", gsn=str(g), shard=s, data=data.hex())
    g, s = picks[-1]  # that gsn holds no record of the other shard
    try:
        c.read(g, next(x for x in c.addrs if x != s))
        raise Fail(f"a read of {g} on a shard other than {s} found a record")
    except Fail as e:
        if e.code != "NOT_FOUND":
            raise
    for from_gsn in (0, 1):
        c.subscribe(from_gsn, set(rids))
    print(f"port client: {len(rids)} inserts, {len(picks)} reads, 2 subscriptions")


def main() -> int:
    c = None
    try:
        check_vectors(Path(__file__).resolve().parent.parent / "docs" / "vectors.json")
        c = Client(os.environ["ZIPLOG_ZK"], os.environ["ZIPLOG_HISTORY"])
        run(c)
        return 0
    except Exception as e:
        print(f"port client: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        if c is not None:
            c.shutdown()


if __name__ == "__main__":
    sys.exit(main())
