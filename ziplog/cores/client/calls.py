"""One client call at a time, as a state machine (sans-I/O): InsertAfter, ReadRecord,
trim and status. A call takes the replies to its requests, the passage of time and
changes of the topology, and hands back the frames to send (to which replicas'
addresses); ``wake_at`` says when it wants :meth:`Call.on_timer`; once ``done``,
:meth:`Call.result` is its value or raises its error. The blocking and the asyncio
clients and the simulation's clients drive the same calls through one driver
(``ziplog.client.driver``).
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Sequence

from ziplog.cores.effects import Messages
from ziplog.cores.client.state import STABLE_READ_WAIT_NS, ClientState
from ziplog.cores.client.waits import EachReplica, InsertWait, ReadWait, Redirect
from ziplog.protocol import frames as wire
from ziplog.protocol.errors import (
    NoShardAvailableError,
    ReusedIdentityError,
    UnknownRecordError,
    ZiplogError,
    ZiplogTimeoutError,
    from_reply,
)
from ziplog.protocol.topology import TopologyView
from ziplog.protocol.types import RecordId

#: what a call hands back: messages to replica addresses (``(tuple of addresses,
#: frame)``; the effects' vocabulary, :mod:`ziplog.cores.effects`)
Sends = Messages


class Call:
    """What every call has: its requests' ids (the driver routes replies by them), when
    it wants the timer, and its outcome."""

    def __init__(self, deadline_ns: int) -> None:
        self.deadline_ns = deadline_ns
        self.done = False
        self.error: BaseException | None = None
        self.value: Any = None
        self.wake_at: int | None = deadline_ns
        self.req_ids: list[int] = []

    def result(self) -> Any:
        assert self.done, "the call is not done"
        if self.error is not None:
            raise self.error
        return self.value

    def _finish(self, value: Any) -> Sends:
        self.done, self.value, self.wake_at = True, value, None
        return []

    def fail(self, error: BaseException) -> Sends:
        self.done, self.error, self.wake_at = True, error, None
        return []

    def start(self, now: int, topo: TopologyView) -> Sends:
        raise NotImplementedError

    def on_reply(self, addr: str, msg: wire.Reply, now: int, topo: TopologyView) -> Sends:
        raise NotImplementedError

    def on_timer(self, now: int, topo: TopologyView) -> Sends:
        raise NotImplementedError

    def on_topology(self, now: int, topo: TopologyView) -> Sends:
        return []

    def waiting_on(self) -> Sequence[str]:
        """The replica addresses whose replies this call waits for now."""
        return ()


#: refusals that end an insert once no other shard is left to try: what stopped it is the
#: answer (a pinned insert refused otherwise tries its shard again under a new id)
FINAL_REFUSALS = frozenset((wire.E_OVERLOADED, wire.E_DISK_FULL, wire.E_LOG_FULL))
#: a refusal that says only that the shard could not place the record in time: it waited
#: (2 s) for an epoch that did not come, while the membership service or ZooKeeper
#: stalled or the shard rejoined. Once every shard tried has said so, the record is tried
#: again under a new id after a pause, within the call's deadline (each shard holds no
#: copy of the old id and never will), and the refusal is the answer at the deadline.
STALLED_REFUSALS = frozenset((wire.E_TIMEOUT,))


class InsertState(enum.Enum):
    #: no shard this call may use is live right now (or every one refused this id, none
    #: for good): wait (within the deadline) for one to return
    WAITING_FOR_SHARD = "waiting_for_shard"
    #: sent to every replica of ``shard``; resent every retry interval until settled
    SENT = "sent"
    DONE = "done"


class InsertCall(Call):
    """``insert_after``: the record goes to every replica of one live shard; the primary's
    ACK is the decision, and the insert is done when every backup's latest ACK equals it
    (``InsertWait``). Unanswered, the record is sent again under a new request id
    (replicas answer a duplicate with the gsn they gave it; a refusal counts only in
    reply to the latest id); a shard that provably holds no copy
    (``Redirect``) is left for another under the same (client id, seq), so the record
    still appears once, or, when the policy pins the shard and the refusal is not final,
    tried again on it under a new seq. When no shard it may use is live (a restart, a
    recovery), it waits for one; when every live shard refused it, none for good, it
    tries them all again under a new seq after a retry interval: a planned restart stalls
    an insert, it does not fail it. The deadline covers the whole call."""

    def __init__(self, client: ClientState, data: bytes, after_gsn: int, key: bytes | None, deadline_ns: int) -> None:
        super().__init__(deadline_ns)
        self.client = client
        self.data = data
        self.after = after_gsn
        self.key = key
        self.seq = client.next_seq()
        #: ids this call gave up, each one provably held by no shard (one per retry
        #: interval at most: bounded by the deadline)
        self.given_up: list[int] = []
        self.excluded: set[int] = set()
        #: the last final refusal a primary gave (what to say if no shard is left)
        self.refusal: wire.Error | None = None
        #: the last STALLED_REFUSALS refusal: the answer if the deadline passes waiting
        self.stalled: wire.Error | None = None
        self.state = InsertState.WAITING_FOR_SHARD
        self.shard = -1
        self.targets: tuple[str, ...] = ()  # replica i's address at i
        self.wait: InsertWait | None = None
        self.msg: wire.Insert | None = None
        self.retry_at = 0

    def start(self, now: int, topo: TopologyView) -> Sends:
        return self._choose(now, topo)

    def _choose(self, now: int, topo: TopologyView) -> Sends:
        client = self.client
        shard = client.choose_shard(topo.live_shards(), self.key, self.data, self.excluded, now)
        if shard is None:
            if self.refusal is not None and self.refusal.code in STALLED_REFUSALS:
                # Every shard tried waited in vain for an epoch: try them again, later.
                self._start_over(now)
                return []
            if client.pinned_shard_may_return(self.excluded, topo.replica_counts):
                # The pinned shard is out for now (failure recovery, a replica restarting):
                # wait for ZooKeeper to show it live again, within this call's deadline.
                self.state = InsertState.WAITING_FOR_SHARD
                self.wake_at = self.deadline_ns
                return []
            if self.refusal is not None and self.refusal.code in FINAL_REFUSALS:
                # Every shard tried refused it for good and holds no copy: the record is
                # nowhere, and what stopped it is the answer.
                return self.fail(from_reply(self.refusal.code, self.refusal.message))
            if client.policy.kind != "fixed":
                if self.excluded:
                    # Every live shard refused this id, none for good, and holds no copy:
                    # after a retry interval, every shard again under a new id.
                    self._start_over(now)
                    return []
                if any(s not in topo.removed for s in topo.replica_counts):
                    # No shard is live right now (a restart of a process serving a replica
                    # of each, a recovery, a view that has not seen the registrations yet):
                    # wait for ZooKeeper to show one, within this call's deadline.
                    self.state = InsertState.WAITING_FOR_SHARD
                    self.wake_at = self.deadline_ns
                    return []
            if client.policy.kind == "fixed":
                return self.fail(NoShardAvailableError(f"shard {client.policy.shard} is not live"))
            return self.fail(NoShardAvailableError("no live shard accepts inserts"))
        addrs = topo.replica_addrs(shard)
        if addrs is None:
            return self.fail(UnknownRecordError(f"shard {shard} is unknown or not all of its replicas are up"))
        req = client.next_req()
        self.req_ids.append(req)
        self.state = InsertState.SENT
        self.shard = shard
        self.targets = tuple(addrs)
        self.wait = InsertWait(req, len(addrs))
        self.msg = wire.Insert(req_id=req, client_id=client.client_id, seq=self.seq, after=self.after, data=self.data,
                               stamp=client.stamp(now))
        self.retry_at = now + client.retry_after_ns
        self.wake_at = min(self.retry_at, self.deadline_ns)
        return [(self.targets, self.msg)]

    def _start_over(self, now: int) -> None:
        """Every shard tried refused this id for good and holds no copy of it: wait a
        retry interval, then choose again among every shard under a new id."""
        if self.refusal is not None and self.refusal.code in STALLED_REFUSALS:
            self.stalled = self.refusal
        self.given_up.append(self.seq)
        self.seq = self.client.next_seq()
        self.refusal = None
        self.excluded.clear()
        self.state = InsertState.WAITING_FOR_SHARD
        self.wake_at = min(now + self.client.retry_after_ns, self.deadline_ns)

    def waiting_on(self) -> Sequence[str]:
        return self.targets if self.state is InsertState.SENT else ()

    def on_reply(self, addr: str, msg: wire.Reply, now: int, topo: TopologyView) -> Sends:
        wait = self.wait
        targets = self.targets
        if addr not in targets or wait is None or self.state is not InsertState.SENT:
            return []  # an answer on a connection we no longer wait on
        i = targets.index(addr)
        try:
            settled = wait.feed(i, msg)
        except Redirect as r:
            # The shard provably holds no copy: the same id on another shard is safe.
            if r.refusal is not None:
                self.refusal = r.refusal
            self.client.stats["redirects"] += 1
            if self.client.policy.kind == "fixed" and (self.refusal is None or self.refusal.code not in FINAL_REFUSALS):
                # Pinned, and refused for a while (a restarting or recovering primary): the
                # shard holds no copy of this id and refuses it for good, so the record goes
                # to the same shard again under a new id, once it takes inserts again
                # (still exactly once: the old id is nowhere and never will be).
                self._start_over(now)
                return []
            self.excluded.add(self.shard)
            self.client.avoid(self.shard, now)
            return self._choose(now, topo)
        except ZiplogError as exc:
            self.state = InsertState.DONE
            return self.fail(exc)
        if not settled:
            return []
        self.state = InsertState.DONE
        gsn = wait.decided
        assert gsn is not None, "a settled insert has a decision"
        self.client.learn_stable(self.shard, wait.stable)
        if gsn <= self.after:
            # The replicas' answer, not this call's placement: a primary places a record
            # only above its rid, so this is a duplicate of (client id, seq), placed
            # before after another rid (a retry or a re-run that reused the identity).
            # Input never reaches an assertion: the call fails, typed, and the record
            # stays where it is, once.
            if gsn <= 0:
                return self.fail(ZiplogError(f"shard {self.shard} answered an insert with gsn {gsn}, "
                                             f"which names no record"))
            return self.fail(ReusedIdentityError(self.client.client_id, self.seq, RecordId(gsn, self.shard),
                                                 self.after))
        self.client.stats["fast_path" if wait.fast else "slow_path"] += 1
        return self._finish(RecordId(gsn, self.shard))

    def on_timer(self, now: int, topo: TopologyView) -> Sends:
        if self.state is InsertState.WAITING_FOR_SHARD:
            if now >= self.deadline_ns:
                if self.stalled is not None:
                    return self.fail(from_reply(self.stalled.code, self.stalled.message))
                if self.client.policy.kind == "fixed":
                    return self.fail(NoShardAvailableError(f"shard {self.client.policy.shard} is not live"))
                return self.fail(NoShardAvailableError("no shard took inserts within the deadline"))
            return self._choose(now, topo)
        if self.state is not InsertState.SENT:
            return []
        if now >= self.deadline_ns:
            self.state = InsertState.DONE
            return self.fail(ZiplogTimeoutError(f"insert on shard {self.shard} not acknowledged in time"))
        if now < self.retry_at:
            return []
        # Unanswered: send the record again (a new request id, the same client id and
        # seq); replicas answer a duplicate with the gsn they already gave it. A replica
        # that restarted may listen elsewhere now.
        self.client.stats["retries"] += 1
        self.client.avoid(self.shard, now)
        return self._resend(now, topo)

    def _resend(self, now: int, topo: TopologyView) -> Sends:
        """The same record again, under a new request id (a new round of
        :class:`InsertWait`: only this round's refusals count)."""
        wait, msg = self.wait, self.msg
        assert wait is not None and msg is not None
        troubled = wait.troubled
        req = self.client.next_req()
        self.req_ids.append(req)
        new = topo.replica_addrs(self.shard)
        if new is not None and tuple(new) != self.targets:
            self.wait = InsertWait(req, len(new))  # answers on the old connections are gone
            self.targets = tuple(new)
        else:
            wait.next_round(req)
        self.msg = msg = wire.Insert(req_id=req, client_id=msg.client_id, seq=msg.seq, after=msg.after, data=msg.data,
                                     stamp=msg.stamp)
        self.retry_at = now + (self.client.retry_troubled_ns if troubled else self.client.retry_after_ns)
        self.wake_at = min(self.retry_at, self.deadline_ns)
        return [(self.targets, msg)]

    def on_topology(self, now: int, topo: TopologyView) -> Sends:
        if self.state is InsertState.WAITING_FOR_SHARD:
            return self._choose(now, topo)
        if self.state is InsertState.SENT:
            new = topo.replica_addrs(self.shard)
            if new is not None and tuple(new) != self.targets:
                return self._resend(now, topo)  # a replica moved: ask it where it is now
        return []


class ReadCall(Call):
    """``read_record``: a gsn the client knows is stable (every replica holds it) is read
    from one random replica, and from all if that one has not answered within
    STABLE_READ_WAIT; any other from all replicas, settled by the first answer that
    reports it stable or by all answers agreeing (``ReadWait``). A replica that is not
    registered (restarting) does not fail the read: the registered ones are asked (one
    stable answer settles it), and the rest as they register, within the deadline. A
    replica that has not answered is asked again every retry interval, at the address it
    is registered at then (the request or the answer was lost: a replica restarted on
    the same address in between, say); a read is idempotent."""

    def __init__(self, client: ClientState, rid: RecordId, deadline_ns: int) -> None:
        super().__init__(deadline_ns)
        self.client = client
        self.rid = rid
        self.replicas = 0
        #: address -> replica number, of every replica asked in the all-replica phase
        self.asked: dict[str, int] = {}
        self.only: str | None = None  # the one replica asked, while asking one
        self.wait: ReadWait | None = None

    def start(self, now: int, topo: TopologyView) -> Sends:
        rid = self.rid
        if rid.gsn <= 0 or rid.shard < 0:
            return self.fail(UnknownRecordError(f"{rid!r} names no record"))
        self.replicas = topo.replica_counts.get(rid.shard, 0)
        if self.replicas == 0:
            return self.fail(UnknownRecordError(f"shard {rid.shard} is unknown"))
        addrs = topo.replica_addrs(rid.shard)
        if addrs is not None and rid.gsn <= self.client.stable.get(rid.shard, 0):
            # Stable: every replica holds it, so one answer suffices (and spreads the load).
            self.only = addrs[self.client.rng.randrange(len(addrs))]
            self.wait = ReadWait(self._req(), rid.gsn, 1)
            self.wake_at = min(self.deadline_ns, now + STABLE_READ_WAIT_NS)
            return [((self.only,), wire.Read(req_id=self.wait.req_id, gsn=rid.gsn))]
        return self._ask_all(now, topo)

    def _req(self) -> int:
        req = self.client.next_req()
        self.req_ids.append(req)
        return req

    def waiting_on(self) -> Sequence[str]:
        return (self.only,) if self.only is not None else tuple(self.asked)

    def _ask_all(self, now: int, topo: TopologyView) -> Sends:
        self.only = None
        self.wait = ReadWait(self._req(), self.rid.gsn, self.replicas)
        self.asked = {}
        self.wake_at = min(self.deadline_ns, now + self.client.retry_after_ns)
        return self._ask_registered(topo)

    def _ask_registered(self, topo: TopologyView) -> Sends:
        """Ask every registered replica not asked yet (at its current address)."""
        assert self.wait is not None
        new = {addr: i for i, addr in topo.replicas.get(self.rid.shard, {}).items()
               if i < self.replicas and addr not in self.asked}
        if not new:
            return []
        self.asked.update(new)
        return [(tuple(new), wire.Read(req_id=self.wait.req_id, gsn=self.rid.gsn))]

    def on_reply(self, addr: str, msg: wire.Reply, now: int, topo: TopologyView) -> Sends:
        wait = self.wait
        if wait is None or self.done:
            return []
        if self.only is not None:
            if addr != self.only:
                return []
            index = 0
        elif addr in self.asked:
            index = self.asked[addr]
        else:
            return []
        try:
            settled = wait.feed(index, msg)
        except ZiplogError as exc:
            return self.fail(exc)
        if not settled:
            return []
        self.client.learn_stable(self.rid.shard, wait.stable)
        return self._finish(wait.data)

    def on_timer(self, now: int, topo: TopologyView) -> Sends:
        if now >= self.deadline_ns:
            return self.fail(ZiplogTimeoutError(f"read of {self.rid!r} not answered in time"))
        if self.only is not None:
            return self._ask_all(now, topo)  # that replica is slow or gone: ask them all
        return self._ask_silent(now, topo)

    def _ask_silent(self, now: int, topo: TopologyView) -> Sends:
        """Ask again every registered replica whose answer has not come."""
        wait = self.wait
        assert wait is not None
        self.wake_at = min(self.deadline_ns, now + self.client.retry_after_ns)
        silent = {addr: i for i, addr in topo.replicas.get(self.rid.shard, {}).items()
                  if i < self.replicas and i not in wait.answers}
        if not silent:
            return []
        self.asked.update(silent)
        return [(tuple(silent), wire.Read(req_id=wait.req_id, gsn=self.rid.gsn))]

    def on_topology(self, now: int, topo: TopologyView) -> Sends:
        if self.done or self.only is not None or self.wait is None:
            return []
        return self._ask_registered(topo)  # a replica registered (again): it is asked too


class EachReplicaCall(Call):
    """A request every replica of some shards must answer (trim, status). It is
    idempotent, so an unanswered one is sent again every retry interval, to the
    addresses ZooKeeper holds then."""

    def __init__(self, client: ClientState, shards: list[int], make: Callable[[int], wire.Frame], deadline_ns: int,
                 what: str) -> None:
        super().__init__(deadline_ns)
        self.client = client
        self.shards = shards
        self.make = make
        self.what = what
        self.waits: dict[int, EachReplica] = {}
        self.targets: dict[int, tuple[str, ...]] = {}
        self.msg: wire.Frame | None = None
        self.retry_at = 0

    def start(self, now: int, topo: TopologyView) -> Sends:
        req = self.client.next_req()
        self.req_ids.append(req)
        self.msg = self.make(req)
        return self._send_missing(now, topo)

    def waiting_on(self) -> Sequence[str]:
        return [a for targets in self.targets.values() for a in targets]

    def _send_missing(self, now: int, topo: TopologyView) -> Sends:
        assert self.msg is not None
        out: Sends = []
        for s in self.shards:
            w = self.waits.get(s)
            if w is not None and len(w.replies) == w.n:
                continue
            addrs = topo.replica_addrs(s)
            if addrs is None:
                continue  # a replica is down right now: it may come back
            if self.targets.get(s) != tuple(addrs):
                self.targets[s] = tuple(addrs)
                self.waits[s] = EachReplica(self.msg.req_id, len(addrs))  # type: ignore[attr-defined]
            out.append((self.targets[s], self.msg))
        self.retry_at = now + self.client.retry_after_ns
        self.wake_at = min(self.retry_at, self.deadline_ns)
        return out

    def on_reply(self, addr: str, msg: wire.Reply, now: int, topo: TopologyView) -> Sends:
        if self.done:
            return []
        for s, targets in self.targets.items():
            if addr in targets:
                try:
                    self.waits[s].feed(targets.index(addr), msg)
                except ZiplogError as exc:
                    return self.fail(exc)
        if len(self.waits) == len(self.shards) and all(len(w.replies) == w.n for w in self.waits.values()):
            return self._finish({s: [self.waits[s].replies[i] for i in range(self.waits[s].n)] for s in self.shards})
        return []

    def on_timer(self, now: int, topo: TopologyView) -> Sends:
        if now >= self.deadline_ns:
            return self.fail(ZiplogTimeoutError(f"{self.what} not answered in time"))
        if now >= self.retry_at:
            return self._send_missing(now, topo)
        return []


#: status(): how long a registered replica may stay silent before it is reported unreachable
STATUS_WAIT_NS = 1_000_000_000


class ReplicaAnswer(str, enum.Enum):
    """How a replica answered status(), in its entry's ``answer``."""
    OK = "ok"                          # it answered: the entry is its status map
    UNREACHABLE = "unreachable"        # registered, silent for the whole wait
    NOT_REGISTERED = "not registered"  # ZooKeeper holds no address for it (down, restarting)
    ERROR = "error"                    # it answered with an ERROR (``error`` says which)


class StatusCall(Call):
    """``status()``: one entry for every replica the topology names, in replica order,
    whether it answers or not. A registered replica is asked (again every retry
    interval, at the address ZooKeeper holds then: STATUS is idempotent); the call ends
    once every registered replica answered, or after ``wait_ns``, when the silent ones
    are reported unreachable. A replica with no address is reported at once: a status
    is a snapshot, and waiting for a restart is the caller's choice."""

    def __init__(self, client: ClientState, deadline_ns: int, wait_ns: int = STATUS_WAIT_NS) -> None:
        super().__init__(deadline_ns)
        self.client = client
        self.wait_ns = wait_ns
        self.req = 0
        #: (shard, replica) -> its entry, once it answered
        self.entries: dict[tuple[int, int], dict[str, Any]] = {}
        #: (shard, replica) -> the address asked (what an answer must come from)
        self.asked: dict[tuple[int, int], str] = {}
        self.until = 0
        self.retry_at = 0

    def start(self, now: int, topo: TopologyView) -> Sends:
        self.req = self.client.next_req()
        self.req_ids.append(self.req)
        self.until = min(now + self.wait_ns, self.deadline_ns)
        return self._ask(now, topo)

    def _ask(self, now: int, topo: TopologyView) -> Sends:
        """Ask every registered replica that has not answered (at its current address)."""
        self.asked = {(s, i): addr for s in topo.shards() for i, addr in topo.replicas.get(s, {}).items()
                      if i < topo.replica_counts.get(s, 0) and (s, i) not in self.entries}
        if not self.asked:
            return self._finish(self._entries(topo))
        self.retry_at = now + self.client.retry_after_ns
        self.wake_at = min(self.retry_at, self.until)
        msg = wire.Status(req_id=self.req)
        return [(tuple(self.asked.values()), msg)]

    def waiting_on(self) -> Sequence[str]:
        return tuple(self.asked.values())

    def on_reply(self, addr: str, msg: wire.Reply, now: int, topo: TopologyView) -> Sends:
        if self.done or msg.req_id != self.req:
            return []
        for key, asked in list(self.asked.items()):
            if asked != addr:
                continue
            shard, replica = key
            if isinstance(msg, wire.StatusOk):
                self.entries[key] = {**msg.status, "shard": shard, "replica": replica, "addr": addr,
                                     "answer": ReplicaAnswer.OK.value}
            elif isinstance(msg, wire.Error) and msg.code == wire.E_FORBIDDEN:
                # the client's key lacks ``admin``: every replica would say the same
                return self.fail(from_reply(msg.code, msg.message))
            elif isinstance(msg, wire.Error):
                self.entries[key] = {"shard": shard, "replica": replica, "answer": ReplicaAnswer.ERROR.value,
                                     "error": f"{msg.code}: {msg.message}", "addr": addr}
            else:
                continue
            del self.asked[key]
        if not self.asked:
            return self._finish(self._entries(topo))
        return []

    def on_timer(self, now: int, topo: TopologyView) -> Sends:
        if now >= self.until:
            return self._finish(self._entries(topo))
        return self._ask(now, topo)

    def on_topology(self, now: int, topo: TopologyView) -> Sends:
        # a replica that registered (again) since: ask it at its new address
        if any(topo.replicas.get(s, {}).get(i) != a for (s, i), a in self.asked.items()) or any(
                (s, i) not in self.asked and (s, i) not in self.entries
                for s in topo.shards() for i in topo.replicas.get(s, {})):
            return self._ask(now, topo)
        return []

    def _entries(self, topo: TopologyView) -> dict[int, list[dict[str, Any]]]:
        out: dict[int, list[dict[str, Any]]] = {}
        for s in topo.shards():
            addrs = topo.replicas.get(s, {})
            row = []
            for i in range(topo.replica_counts.get(s, 0)):
                entry = self.entries.get((s, i))
                if entry is None:
                    addr = addrs.get(i)
                    entry = {"shard": s, "replica": i, "addr": addr, "answer": (
                        ReplicaAnswer.UNREACHABLE if addr is not None else ReplicaAnswer.NOT_REGISTERED).value}
                row.append(entry)
            out[s] = row
        return out


class ShardQueryCall(Call):
    """A read-only request one replica of a shard answers (RANGE, COUNT): to the primary
    first (its stable watermark is the shard's), to the next replica when one does not
    answer within the retry interval. The first answer, or an ERROR, ends it."""

    def __init__(self, client: ClientState, shard: int, make: Callable[[int], wire.Frame], deadline_ns: int,
                 what: str) -> None:
        super().__init__(deadline_ns)
        self.client = client
        self.shard = shard
        self.make = make
        self.what = what
        self.tries = 0
        self.target: str | None = None
        self.msg: wire.Frame | None = None

    def start(self, now: int, topo: TopologyView) -> Sends:
        req = self.client.next_req()
        self.req_ids.append(req)
        self.msg = self.make(req)
        return self._send(now, topo)

    def _send(self, now: int, topo: TopologyView) -> Sends:
        assert self.msg is not None
        addrs = topo.replica_addrs(self.shard) or topo.registered_addrs(self.shard)
        self.wake_at = min(now + self.client.retry_after_ns, self.deadline_ns)
        if not addrs:
            self.target = None
            return []
        self.target = addrs[self.tries % len(addrs)]
        self.tries += 1
        return [((self.target,), self.msg)]

    def waiting_on(self) -> Sequence[str]:
        return (self.target,) if self.target is not None else ()

    def on_reply(self, addr: str, msg: wire.Reply, now: int, topo: TopologyView) -> Sends:
        if self.done or addr != self.target or msg.req_id not in self.req_ids:
            return []
        if isinstance(msg, wire.Error):
            return self.fail(from_reply(msg.code, msg.message))
        return self._finish(msg)

    def on_timer(self, now: int, topo: TopologyView) -> Sends:
        if now >= self.deadline_ns:
            return self.fail(ZiplogTimeoutError(f"{self.what} on shard {self.shard} not answered in time"))
        return self._send(now, topo)
