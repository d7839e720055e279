"""The blocking client: ``ziplog.Client``.

InsertAfter (dissertation 4.2.4): the record goes to every replica of one shard;
each answers with the gsn it assigned. The primary's answer is the decision;
the insert is done once every backup's latest answer equals it. When the
backups' first answers already equal it, that was the two-message-delay fast
path; otherwise a backup re-acked after the primary's forward (slow path).
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import zmq

from ziplog.io import zk as discovery
from ziplog.protocol import frames as wire
from ziplog.protocol.errors import (ClientClosedError, NoShardAvailableError, UnknownRecordError, ZiplogError,
                     ZiplogTimeoutError, from_reply)
from ziplog.cores.client import RETRY_AFTER_S, RETRY_TROUBLED_S, ClientCommon, EachReplica, InsertWait, ReadWait, Redirect
from ziplog.cores.merge import SubscriberMerge
from ziplog.protocol.types import RID_GENESIS, RID_RECENT, Policy, RecordId
from ziplog.protocol.frames import PROTOCOL_VERSION as V
from ziplog.protocol.frames import pack, unpack

POLLIN = int(zmq.POLLIN)  # a plain int: enum arithmetic costs on the hot path
SUB_CREDIT_BYTES = 8 << 20
#: How long an insert waits replica by replica before it listens to all replicas at once.
QUICK_WAIT_S = 0.05
#: A stable read asks one replica; after this long without an answer it asks all.
STABLE_READ_WAIT_S = 0.5
SUB_KEEPALIVE_S = 10.0
#: Resubscribe when not called for this long: a little under the servers' lease on a
#: silent subscription (ReplicaSettings.subscription_lease_ns, 60 s).
SUB_LEASE_S = 50.0


class Record:
    """A record delivered by a subscription."""

    __slots__ = ("rid", "data")

    def __init__(self, rid: RecordId, data: bytes) -> None:
        self.rid = rid
        self.data = data

    def __repr__(self) -> str:
        return f"Record(rid={self.rid!r}, data={self.data[:32]!r}{'...' if len(self.data) > 32 else ''})"


class _Replicas:
    """One DEALER per replica of a shard (a DEALER connected to several would
    round-robin, and we must reach every replica)."""

    def __init__(self, ctx: zmq.Context, addrs: list[str]) -> None:
        self.addrs = addrs
        self.generation = -1  # Topology generation these addresses were checked against
        self.socks: list[zmq.Socket] = []
        for a in addrs:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(a)
            self.socks.append(s)

        self.poller = zmq.Poller()
        for s in self.socks:
            self.poller.register(s, zmq.POLLIN)
        self.index = {s: i for i, s in enumerate(self.socks)}

    def send_all(self, frame: bytes) -> None:
        # zero-copy only pays off for large frames
        if len(frame) < 65536:
            for s in self.socks:
                s.send(frame)
        else:
            for s in self.socks:
                s.send(frame, copy=False)

    def collect_insert(self, wait: InsertWait, until: float) -> bool:
        """Feed acks into ``wait`` replica by replica: the primary's decision first, then
        each backup until it agrees. One blocking receive per reply, no poll set: the
        cheapest way to wait on this path. When that takes long (a replica is down, the
        shard recovers) it waits on all replicas at once: any of them may settle it."""
        quick = min(until, time.monotonic() + QUICK_WAIT_S)
        for i, sock in enumerate(self.socks):
            while not wait.settled(i):
                if not sock.poll(max(0, int((quick - time.monotonic()) * 1000)) + 1):
                    if time.monotonic() >= quick:
                        return wait.done or self.collect(wait, until)
                    continue
                if wait.feed(i, unpack(sock.recv())):
                    return True
        return wait.done or self.collect(wait, until)

    def collect(self, wait: InsertWait | ReadWait | EachReplica, until: float, only: int | None = None) -> bool:
        """Feed replies into ``wait`` until it is settled (True) or ``until`` passes."""
        while True:
            left = until - time.monotonic()
            if left <= 0:
                return False
            for sock, _ in self.poller.poll(int(left * 1000) + 1):
                i = self.index[sock]
                while sock.getsockopt(zmq.EVENTS) & POLLIN:
                    frame = sock.recv()
                    if only is not None and i != only:
                        continue
                    if wait.feed(0 if only is not None else i, unpack(frame)):
                        return True

    def close(self) -> None:
        for s in self.socks:
            s.close(0)


class Client(ClientCommon):
    """A ziplog client. Thread-compatible, not thread-safe: use one per thread."""

    def __init__(self, zk_hosts: str, *, timeout: float = 30.0, policy: Policy | None = None,
                 client_id: int | None = None) -> None:
        self._init_identity(timeout, policy, client_id)
        self._zk = discovery.connect(zk_hosts)
        self.topology = discovery.Topology(self._zk)
        self._ctx = zmq.Context()
        self._shards: dict[int, _Replicas] = {}
        self._closed = False
        self._subs: list[Subscription] = []
        self.stats: dict[str, int] = {"fast_path": 0, "slow_path": 0, "retries": 0, "redirects": 0}
        if not self.topology.wait(lambda: bool(self.topology.live_shards()), timeout):
            self.close()
            raise NoShardAvailableError("no live shard appeared in ZooKeeper")

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sub in list(self._subs):
            sub.close()
        for r in self._shards.values():
            r.close()
        self._ctx.destroy(linger=0)
        try:
            self._zk.stop()
            self._zk.close()
        except Exception:
            pass

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosedError("client is closed")

    # -- routing --------------------------------------------------------------------------------
    def _replicas(self, shard: int) -> _Replicas:
        r = self._shards.get(shard)
        gen = self.topology._generation  # read first: a change racing with us shows next time
        if r is not None and r.generation == gen:
            return r  # nothing changed in ZooKeeper since we last looked
        addrs = self.topology.replica_addrs(shard)
        if addrs is None:
            raise UnknownRecordError(f"shard {shard} is unknown or not all of its replicas are up")
        r = self._shards.get(shard)
        if r is None or r.addrs != addrs:
            if r is not None:
                r.close()
            r = _Replicas(self._ctx, addrs)
            self._shards[shard] = r
        r.generation = gen
        return r

    # -- insert ---------------------------------------------------------------------------------
    def insert_after(self, data: bytes, after: RecordId = RID_GENESIS, *, key: bytes | None = None) -> RecordId:
        """Insert ``data`` somewhere after record ``after``; returns its record id, whose
        gsn is greater than ``after.gsn``."""
        self._check_open()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError("data must be bytes")
        data = bytes(data)
        after_gsn = max(after.gsn, 0)
        seq = next(self._seq)
        deadline = time.monotonic() + self.timeout
        excluded: set[int] = set()
        while True:
            shard = self._choose_shard(key, data, excluded, time.monotonic())
            if shard is None and self._pinned_shard_may_return(excluded):
                # The pinned shard is out for now (failure recovery, a replica restarting):
                # wait for ZooKeeper to show it live again, within this insert's deadline.
                self.topology.wait(lambda: self._policy.shard in self.topology.live_shards(),
                                   max(0.0, deadline - time.monotonic()))
                shard = self._choose_shard(key, data, excluded, time.monotonic())
            if shard is None:
                if self._policy.kind == "fixed":
                    raise NoShardAvailableError(f"shard {self._policy.shard} is not live")
                raise NoShardAvailableError("no live shard accepts inserts")
            try:
                gsn = self._insert_on(shard, seq, after_gsn, data, deadline)
            except Redirect:
                # The shard provably holds no copy: the same id on another shard is safe.
                excluded.add(shard)
                self._avoid(shard, time.monotonic())
                self.stats["redirects"] += 1
                continue
            assert gsn > after_gsn, ("InsertAfter returned a gsn not above the rid", gsn, after_gsn)
            return RecordId(gsn, shard)

    def _insert_on(self, shard: int, seq: int, after_gsn: int, data: bytes, deadline: float) -> int:
        reps = self._replicas(shard)
        wait = InsertWait(next(self._req), len(reps.socks))
        frame = pack([V, wire.INSERT, wait.req_id, self.client_id, seq, after_gsn, data])
        reps.send_all(frame)
        retry_at = time.monotonic() + RETRY_AFTER_S
        while not reps.collect_insert(wait, min(deadline, retry_at)):
            now = time.monotonic()
            if now >= deadline:
                raise ZiplogTimeoutError(f"insert on shard {shard} not acknowledged in time")
            # Unanswered: resend with the same client id and sequence number; replicas
            # answer a duplicate with the gsn they already gave it. A replica that restarted
            # has a new address: look it up again.
            self.stats["retries"] += 1
            self._avoid(shard, now)
            try:
                new = self._replicas(shard)
                if new is not reps:
                    wait = InsertWait(wait.req_id, len(new.socks))  # answers of the old sockets are gone
                    reps = new
            except UnknownRecordError:
                pass  # a replica is down right now; keep asking the ones we know
            reps.send_all(frame)
            retry_at = now + (RETRY_TROUBLED_S if wait.troubled else RETRY_AFTER_S)
        self.stats["fast_path" if wait.fast else "slow_path"] += 1
        self._learn_stable(shard, wait.stable)
        assert wait.decided is not None
        return wait.decided

    # -- read -----------------------------------------------------------------------------------
    def read_record(self, rid: RecordId) -> bytes:
        """The record with id ``rid``. Raises TrimmedError below the trim point and
        NotFoundError where the log holds no record."""
        self._check_open()
        if rid.gsn <= 0 or rid.shard < 0:
            raise UnknownRecordError(f"{rid!r} names no record")
        reps = self._replicas(rid.shard)
        deadline = time.monotonic() + self.timeout
        if rid.gsn <= self._stable.get(rid.shard, 0):
            # Stable: every replica holds it, so one answer suffices (and spreads the load).
            i = self._rng.randrange(len(reps.socks))
            wait = ReadWait(next(self._req), rid.gsn, 1)
            reps.socks[i].send(pack([V, wire.READ, wait.req_id, rid.gsn]))
            if reps.collect(wait, min(deadline, time.monotonic() + STABLE_READ_WAIT_S), only=i):
                assert wait.data is not None
                self._learn_stable(rid.shard, wait.stable)
                return wait.data
            # That replica is slow or gone: fall through and ask them all.
        # Recent: ask every replica; a stable answer or agreement of all settles it.
        wait = ReadWait(next(self._req), rid.gsn, len(reps.socks))
        reps.send_all(pack([V, wire.READ, wait.req_id, rid.gsn]))
        if not reps.collect(wait, deadline):
            raise ZiplogTimeoutError(f"read of {rid!r} not answered in time")
        assert wait.data is not None
        self._learn_stable(rid.shard, wait.stable)
        return wait.data

    def _await(self, sock: zmq.Socket, req_id: int, deadline: float) -> list[Any]:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ZiplogTimeoutError("no answer in time")
            if not sock.poll(int(left * 1000) + 1):
                continue
            msg = unpack(sock.recv())
            if len(msg) > 2 and msg[2] == req_id:
                return msg

    # -- trim -----------------------------------------------------------------------------------
    def trim(self, rid: RecordId) -> None:
        """Delete every record below ``rid`` on every shard."""
        self._check_open()
        if rid.gsn <= 0:
            return
        req_id = next(self._req)
        frame = pack([V, wire.TRIM, req_id, rid.gsn])
        deadline = time.monotonic() + self.timeout
        targets = []
        for shard in sorted(self.topology.replica_counts):
            addrs = self.topology.replica_addrs(shard)
            if addrs is None:
                raise ZiplogError(f"shard {shard} is not fully up; cannot trim everywhere")
            targets.extend(self._replicas(shard).socks)
        for s in targets:
            s.send(frame)
        for s in targets:
            msg = self._await(s, req_id, deadline)
            if msg[1] == wire.ERROR:
                raise from_reply(msg[3], msg[4])

    # -- status ---------------------------------------------------------------------------------
    def status(self) -> dict[int, list[dict[str, Any]]]:
        """Every replica's status map, by shard."""
        out: dict[int, list[dict[str, Any]]] = {}
        deadline = time.monotonic() + self.timeout
        for shard in sorted(self.topology.replica_counts):
            if self.topology.replica_addrs(shard) is None:
                continue
            out[shard] = self._status_of(shard, deadline)
        return out

    def _status_of(self, shard: int, deadline: float) -> list[dict[str, Any]]:
        """Every replica of ``shard`` answers STATUS. It is idempotent, so an unanswered
        request is sent again every RETRY_AFTER_S, to the addresses ZooKeeper holds then:
        a replica that restarted since we connected listens elsewhere."""
        while True:
            try:
                reps = self._replicas(shard)
            except UnknownRecordError:  # a replica is down right now: it may come back
                reps = None
            if reps is not None:
                wait = EachReplica(next(self._req), len(reps.socks))
                reps.send_all(pack([V, wire.STATUS, wait.req_id]))
                if reps.collect(wait, min(deadline, time.monotonic() + RETRY_AFTER_S)):
                    return [wait.replies[i][3] for i in range(wait.n)]
            elif time.monotonic() < deadline:
                time.sleep(RETRY_AFTER_S)
            if time.monotonic() >= deadline:
                raise ZiplogTimeoutError(f"status of shard {shard} not answered in time")

    # -- subscribe ------------------------------------------------------------------------------
    def subscribe(self, start: RecordId = RID_GENESIS) -> "Subscription":
        """Iterate the log in gsn order from ``start`` (inclusive), forever."""
        self._check_open()
        if start == RID_RECENT:
            from_gsn = self._recent_position()
        else:
            from_gsn = max(start.gsn, 1)
        sub = Subscription(self, from_gsn, explicit=start.gsn > 0)
        self._subs.append(sub)
        return sub

    def _recent_position(self) -> int:
        st = self.status()
        stables = [min(r["stable"] for r in reps) for reps in st.values() if reps]
        return max(min(stables), 0) + 1 if stables else 1


class Subscription:
    """Iterator over records in gsn order. Close it (or use ``with``) to free its sockets."""

    def __init__(self, client: Client, from_gsn: int, explicit: bool) -> None:
        self._client = client
        self.from_gsn = from_gsn
        self._explicit = explicit
        self._merge = SubscriberMerge(from_gsn)
        self._ctx = client._ctx
        self._socks: dict[int, zmq.Socket] = {}
        self._addrs: dict[int, str] = {}
        self._shard_of: dict[zmq.Socket, int] = {}
        self._sub_id = next(client._req)
        self._poller = zmq.Poller()
        self._consumed: dict[int, int] = {}
        self._last_keepalive = time.monotonic()
        self._last_call = time.monotonic()
        self._topology_seen = client.topology._generation
        self._closed = False
        self._connect_known()

    def _connect_known(self) -> None:
        """Subscribe on every shard we know of; re-subscribe where a shard's serving
        replica moved (restarted), from just past what that shard already sent us."""
        topo = self._client.topology
        wanted = set(topo.replica_counts) | self._merge.known_shards()
        for shard in sorted(wanted):
            addrs = topo.replica_addrs(shard)
            if addrs is None:
                continue
            old = self._socks.get(shard)
            if old is not None:
                if self._addrs.get(shard) == addrs[0]:
                    continue
                self._poller.unregister(old)
                old.close(0)
                del self._socks[shard]
                del self._shard_of[old]
                resume = self._merge.resume_point(shard)
            else:
                resume = None
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(addrs[0])
            # 0 asks for the start of the log (no TrimmedError); an explicit position must exist.
            start = self.from_gsn if self._explicit else (0 if self.from_gsn == 1 else self.from_gsn)
            if resume is not None:
                start = resume
            self._addrs[shard] = addrs[0]
            s.send(pack([V, wire.SUBSCRIBE, self._sub_id, start, SUB_CREDIT_BYTES]))
            self._socks[shard] = s
            self._shard_of[s] = shard
            self._poller.register(s, zmq.POLLIN)

    def __iter__(self) -> Iterator[Record]:
        return self

    def __next__(self) -> Record:
        rec = self.next(timeout=None)
        assert rec is not None
        return rec

    def next(self, timeout: float | None = None) -> Record | None:
        """The next record, or None if none arrives within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        now = time.monotonic()
        if now - self._last_call > SUB_LEASE_S:
            # We were not called for longer than the servers keep a silent subscription:
            # they may have dropped it. Subscribe again from where each shard left off.
            self._resubscribe_all()
        self._last_call = now
        while True:
            if self._closed:
                raise ClientClosedError("subscription is closed")
            if self._client.topology._generation != self._topology_seen:
                # Something moved in ZooKeeper (a replica restarted, a shard joined).
                self._topology_seen = self._client.topology._generation
                self._connect_known()
            item = self._merge.pop()
            if item is not None:
                gsn, shard, data = item
                self._credit(shard, len(data))
                return Record(RecordId(gsn, shard), data)
            wait_ms = 200
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                wait_ms = min(wait_ms, int(left * 1000) + 1)
            events = self._poller.poll(wait_ms)
            for sock, _ in events:
                self._drain(sock)
            now = time.monotonic()
            if now - self._last_keepalive > SUB_KEEPALIVE_S:
                self._last_keepalive = now
                for s in self._socks.values():
                    s.send(pack([V, wire.CREDIT, self._sub_id, 0]))
            if not events:
                self._connect_known()

    def _drain(self, sock: zmq.Socket) -> None:
        shard = self._shard_of[sock]
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = unpack(frame)
            if msg[1] == wire.SUB_BATCH and msg[2] == self._sub_id:
                self._merge.on_batch(shard, msg[3], msg[4], msg[5])
                self._credit(shard, wire.SUB_BATCH_COST)
            elif msg[1] == wire.ERROR:
                raise from_reply(msg[3], msg[4])
        if self._merge.known_shards() - set(self._socks):
            self._connect_known()

    def _resubscribe_all(self) -> None:
        self._last_keepalive = time.monotonic()
        self._addrs.clear()  # every socket looks moved: _connect_known resumes each shard
        self._connect_known()

    def _credit(self, shard: int, nbytes: int) -> None:
        c = self._consumed.get(shard, 0) + nbytes
        if c >= SUB_CREDIT_BYTES // 4:
            self._socks[shard].send(pack([V, wire.CREDIT, self._sub_id, c]))
            c = 0
        self._consumed[shard] = c

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for s in self._socks.values():
            try:
                s.send(pack([V, wire.UNSUBSCRIBE, self._sub_id]), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            s.close(linger=200)  # long enough for the UNSUBSCRIBE to leave
        self._socks.clear()
        self._shard_of.clear()
        if self in self._client._subs:
            self._client._subs.remove(self)

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
