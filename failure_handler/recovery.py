"""The failure handler's recovery protocol (dissertation 4.2.5), sans-I/O.

:class:`RecoveryCore` takes events (a replica's suspicion, replies from replicas,
the membership history, completed durable writes, the passage of time) and hands back
what must happen as a ``Ready`` (:meth:`RecoveryCore.ready`, the vocabulary of
:mod:`ziplog.cores.effects`): frames to a replica of a shard (``ReplicaOf``
destinations) and recovery records to write durably (``WriteRecovery`` coordination
requests). The driver in ``failure_handler.server`` performs them with ZeroMQ and
ZooKeeper; the whole-system simulation runs the same driver on simulated ports.

One recovery of one shard, generation ``gen``:

1. **Suspicion and freezing.** A replica that suspects a peer sends SUSPECT. The
   handler durably claims a new generation and sends PROBE(gen) to every replica of
   the shard. A probed replica promises to store nothing new (it is *frozen*) and
   reports its state.
2. **State acquisition.** The first *qualified* replica to answer (one that holds
   every record it ever acknowledged, see ``ReplicaCore.qualified``) is the source:
   its stable point X, its decided records above X and the records it guessed and
   acknowledged are written durably, together with the shard's *recovering* flag.
   Only then is the source told ACQUIRED: from then on it answers clients for
   that state (a record it holds is kept at that gsn, any other will not be in this
   shard), which lets writers move on before recovery ends.
3. **Dropping the shard.** The flag makes the membership service leave the shard
   out of the next epoch; the committed membership history then names the last
   epoch that included it, e_last, and so the end of recovery, E = end(e_last).
4. **Roll forward.** For every replica r (restarted ones too, as they come up):
   base_r = min(r's frontier, X); everything r decided above base_r is replaced by
   the acquired records (and, below X, records fetched from a replica that has
   them), the epochs up to e_last, and no-ops up to E.
5. **Resume.** Once every replica holds exactly that, the source is told RESUME
   first: it stops answering for the recovery and hands back the records it told
   clients this shard will not hold (NOT_HELD). Every other replica is then told
   RESUME with those keys, and refuses them from then on: a copy of such an INSERT
   delayed in the network (a partition that healed) must not be placed here after
   its client moved the record to another shard. The record is marked done and the
   flag cleared, and the membership service takes the shard back under its
   original id.

A leader that takes over continues from the durable record: an acquired state is
never replaced (the source may already have answered clients for it), while a
generation that never got that far is abandoned for a new one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from ziplog.cores.effects import Outbox, Ready, ReplicaOf, WriteRecovery
from ziplog.cores.replica import stream_events
from ziplog.protocol import frames as wire
from ziplog.protocol.events import RecordEvent, record_size
from ziplog.protocol.gsna import epoch_end, epoch_of
from ziplog.protocol.membership import history_ranges

PROBING = "probing"
ACQUIRED = "acquired"
DONE = "done"


@dataclass
class HandlerSettings:
    #: Resend unanswered requests to replicas after this long.
    retry_ns: int = 20_000_000
    #: Ignore suspicions of a shard for this long after its recovery ended: reports
    #: sent before the freeze may still be on their way.
    quiet_ns: int = 500_000_000
    #: Largest batch of records fetched in one FETCH.
    fetch_bytes: int = 4 << 20
    #: An INSTALL carries at most this many bytes of records (or one larger record): a
    #: replica's ROUTER refuses larger messages, so a big roll-forward goes in parts.
    install_bytes: int = wire.INSTALL_PART_BYTES
    #: While every replica answered PROBE and none may be the source (more replicas
    #: failed than the shard tolerates), each is probed again this often: one restarted
    #: on its clean-close marker, or in step again, is then found.
    reprobe_ns: int = 1_000_000_000


@dataclass
class _Replica:
    info: dict[str, Any] | None = None  # its PROBE_OK state for this generation
    fetched: list[list[Any]] = field(default_factory=list)  # records (base, X] fetched for it
    fetch_lo: int = 0
    fetch_done: bool = False
    fetch_trim: int = 0
    installed: bool = False
    #: the next INSTALL part starts here (the replica's frontier after the last part;
    #: None: no part installed yet this generation)
    install_from: int | None = None
    resumed: bool = False
    pending: tuple[int, int] | None = None  # (req_id, op) of the request in flight
    sent_at: int = -(1 << 62)
    #: when its PROBE answer (``info``) arrived
    probed_at: int = -(1 << 62)


@dataclass
class ShardRecovery:
    shard: int
    replicas: int
    gen: int
    phase: str
    acquired: dict[str, Any] | None = None
    persisting: bool = False
    e_last: int | None = None  # last epoch that included the shard (None: not yet dropped)
    end: int = 0  # every position up to here is decided when recovery ends
    reps: dict[int, _Replica] = field(default_factory=dict)
    authority_told: bool = False
    authority_req: int | None = None
    authority_sent_at: int = -(1 << 62)
    #: who fetches for whom: req_id -> target replica
    fetch_for: dict[int, int] = field(default_factory=dict)
    #: records the source answered NOT_HELD for (from its RESUME answer; None: not yet)
    refused: list[list[int]] | None = None


class RecoveryCore:
    def __init__(self, settings: HandlerSettings | None = None) -> None:
        self.s = settings or HandlerSettings()
        self.out = Outbox()
        self.active: dict[int, ShardRecovery] = {}
        self.last_gen: dict[int, int] = {}  # shard -> highest generation claimed
        self.ended_at: dict[int, int] = {}  # shard -> when its last recovery ended
        self.history: list[list[Any]] = []
        self.replica_counts: dict[int, int] = {}
        self._req = itertools.count(1)
        self.completed: list[tuple[int, int]] = []  # (shard, gen) of every recovery it finished

    def ready(self) -> Ready:
        """The effects since the last call: requests to replicas (to :class:`ReplicaOf`
        destinations) and recovery records to write (:class:`WriteRecovery`, answered
        with :meth:`on_persisted`). The driver writes first, and sends once ZooKeeper took
        the writes: a request never leaves before the record it follows is durable."""
        return self.out.ready()

    # -- inputs ---------------------------------------------------------------------------------
    def load(self, shard: int, replicas: int, record: dict[str, Any] | None, now: int) -> None:
        """A (new) leader's view of a shard's durable recovery record."""
        self.replica_counts[shard] = replicas
        if not record:
            return
        gen = int(record["gen"])
        self.last_gen[shard] = max(self.last_gen.get(shard, -1), gen)
        phase = record["phase"]
        if phase == ACQUIRED:
            # The source may have answered clients for this state: continue with it.
            rec = ShardRecovery(shard, replicas, gen, ACQUIRED, acquired=record)
            self.active[shard] = rec
            self._advance(rec, now)
        elif phase == PROBING:
            # Nothing was acquired, nothing was promised to clients: start afresh.
            self._start(shard, now)

    def on_history(self, history: list[list[Any]], now: int) -> None:
        self.history = history
        for rec in list(self.active.values()):
            self._advance(rec, now)

    def on_suspect(self, shard: int, replica: int, now: int) -> bool:
        """A replica's suspicion; False when it names no replica of a shard this core
        handles (the report is bad input, not a suspicion)."""
        n = self.replica_counts.get(shard)
        if n is None or replica >= n:
            return False
        if shard in self.active:
            return True
        if now - self.ended_at.get(shard, -(1 << 62)) < self.s.quiet_ns:
            return True
        self._start(shard, now)
        return True

    def on_persisted(self, shard: int, gen: int, now: int) -> None:
        rec = self.active.get(shard)
        if rec is None or rec.gen != gen or not rec.persisting:
            return
        rec.persisting = False
        if rec.phase == DONE:
            del self.active[shard]
            self.ended_at[shard] = now
            self.completed.append((shard, gen))
            return
        self._advance(rec, now)

    def on_reply(self, shard: int, replica: int, msg: wire.RecoveryOk | wire.Error, now: int) -> None:
        rec = self.active.get(shard)
        if rec is None or msg.req_id is None:
            return
        req_id = msg.req_id
        ok = type(msg) is wire.RecoveryOk
        r = rec.reps.setdefault(replica, _Replica())
        if req_id == rec.authority_req:
            rec.authority_req = None
            rec.authority_told = ok
            return
        target = rec.fetch_for.pop(req_id, None)
        if target is not None:
            t = rec.reps[target]
            if isinstance(msg, wire.RecoveryOk):
                if t.pending is not None and t.pending[1] == wire.FETCH:
                    # (Only a fetch: a retried FETCH's other answer arrives after the INSTALL
                    # the first one led to, and must not cancel it.)
                    t.pending = None
                self._on_fetched(rec, target, msg.payload)
            else:
                # The holder refused (STALE: it restarted and forgot the generation, say):
                # it is probed again before anyone fetches from it, and the target's fetch
                # waits for its retry timer rather than going straight back to it.
                self._forget(rec, replica)
            self._advance(rec, now)
            return
        if r.pending is None or r.pending[0] != req_id:
            return
        op = r.pending[1]
        r.pending = None
        if not isinstance(msg, wire.RecoveryOk):
            # STALE: the replica restarted (it forgot the generation) or is ahead of this
            # step: learn its state again.
            self._forget(rec, replica)
            self._advance(rec, now)
            return
        payload = msg.payload
        if op == wire.PROBE:
            r.info = payload
            r.probed_at = now
            if payload.get("resumed"):  # a previous leader got this far
                r.installed = r.resumed = True
            else:
                r.installed = bool(payload.get("installed")) and rec.e_last is not None and payload["frontier"] == rec.end
            if rec.phase == PROBING and rec.acquired is None and payload.get("qualified") and payload.get("frozen"):
                self._acquire(rec, replica, payload)
        elif op == wire.INSTALL:
            assert payload["frontier"] <= rec.end, ("install ended beyond the recovery's end", payload, rec.end)
            if payload["frontier"] == rec.end:
                r.installed = True
            else:  # one part of several: the next starts where this one ended
                r.install_from = payload["frontier"]
        elif op == wire.RESUME:
            r.resumed = True
            if rec.acquired is not None and replica == rec.acquired["source"]:
                rec.refused = [list(k) for k in payload.get("refused", [])]
        self._advance(rec, now)

    def _forget(self, rec: ShardRecovery, replica: int) -> None:
        """What the handler knew of a replica's state this generation is void (it
        restarted, or is ahead of the step it was asked): it is probed again."""
        r = rec.reps.setdefault(replica, _Replica())
        r.info = None
        r.installed = r.resumed = False
        r.fetched, r.fetch_lo, r.fetch_done = [], 0, False
        r.install_from = None
        # Fetches for it from before are answered for a state it no longer has.
        rec.fetch_for = {q: t for q, t in rec.fetch_for.items() if t != replica}

    def tick(self, now: int) -> None:
        retry = self.s.retry_ns
        for rec in list(self.active.values()):
            self._advance(rec, now)
            if rec.persisting:
                continue
            for r in rec.reps.values():
                if r.pending is not None and now - r.sent_at >= retry:
                    # Due, and not sent again: its step is not the recovery's now (a RESUME
                    # answered by nobody while another replica, restarted, is installed
                    # again). Looked at again a retry interval from now: a deadline left
                    # in the past had the handler's loop spin without time passing.
                    r.sent_at = now

    def next_deadline(self) -> int | None:
        """When :meth:`tick` next has a request to resend (a recovery waiting for its
        record to be written resends nothing until then), or a replica to probe again."""
        best = None
        for rec in self.active.values():
            if rec.persisting:
                continue
            stuck = self._without_source(rec)
            for r in rec.reps.values():
                if r.pending is not None:
                    t = r.sent_at + self.s.retry_ns
                    best = t if best is None else min(best, t)
                elif stuck:
                    t = r.probed_at + self.s.reprobe_ns
                    best = t if best is None else min(best, t)
        return best

    def waiting_for_a_source(self) -> dict[int, str]:
        """Shards whose recovery cannot go on, and why: every replica answered PROBE and
        none holds everything it acknowledged (more replicas failed than the shard
        tolerates). Such a recovery waits, probing again, rather than lose or invent an
        acknowledged record; the shard's undecided slots hold every subscriber back."""
        out = {}
        for shard, rec in self.active.items():
            if self._without_source(rec):
                said = ", ".join(f"{i} at {r.info['frontier']}" for i, r in sorted(rec.reps.items())
                                 if r.info is not None)
                out[shard] = (f"recovery {rec.gen}: no replica can vouch for every record it acknowledged (replicas "
                              f"{said}): more failed than the shard tolerates; probing again every "
                              f"{self.s.reprobe_ns // 1_000_000} ms")
        return out

    def _without_source(self, rec: ShardRecovery) -> bool:
        return (rec.phase == PROBING and rec.acquired is None and not rec.persisting and len(rec.reps) == rec.replicas
                and all(r.info is not None for r in rec.reps.values()))

    # -- the protocol ---------------------------------------------------------------------------
    def _start(self, shard: int, now: int) -> None:
        gen = self.last_gen.get(shard, -1) + 1
        self.last_gen[shard] = gen
        rec = ShardRecovery(shard, self.replica_counts[shard], gen, PROBING)
        self.active[shard] = rec
        # Claim the generation durably first: a later leader must never reuse it.
        self._persist(rec, {"gen": gen, "phase": PROBING}, recovering=False)

    def _persist(self, rec: ShardRecovery, record: dict[str, Any], recovering: bool) -> None:
        rec.persisting = True
        self.out.coordinate.append(WriteRecovery(rec.shard, record, recovering))

    def _acquire(self, rec: ShardRecovery, replica: int, state: dict[str, Any]) -> None:
        guesses = state.get("guesses") or []
        records = state.get("records") or []
        assert all(g[0] > state["frontier"] for g in guesses), "a guess at or below the frontier"
        # The source vouches for what it holds: a stable point above its frontier (a
        # replica of a build that kept one after an install ending below it) is no
        # replica's, and fetching up to it would wait for ever.
        rec.acquired = {
            "gen": rec.gen, "phase": ACQUIRED, "source": replica, "stable": min(state["stable"], state["frontier"]),
            "frontier": state["frontier"], "records": records, "guesses": guesses,
            "membership": state.get("membership") or [],
        }
        rec.phase = ACQUIRED
        # Durable before anyone acts on it; the flag asks the MMS to drop the shard.
        self._persist(rec, rec.acquired, recovering=True)

    def _on_fetched(self, rec: ShardRecovery, target: int, payload: dict[str, Any]) -> None:
        r = rec.reps.get(target)
        if r is None or r.info is None:
            return
        # A FETCH resent while its answer was on the way is answered twice: each record
        # is kept once (answers come in gsn order, each from where the last one ended).
        got = [g for g in payload["records"] if g[0] > r.fetch_lo]
        r.fetched.extend(got)
        r.fetch_trim = max(r.fetch_trim, payload.get("trim", 0))
        if got:
            r.fetch_lo = got[-1][0]
        r.fetch_done = r.fetch_done or bool(payload["done"])

    def _last_epoch_with(self, shard: int) -> int | None:
        """The last epoch that included ``shard``, once the latest membership leaves it
        out (None while it is still a member)."""
        h = self.history
        if not h or shard in h[-1][1]:
            return None
        for i in range(len(h) - 1, -1, -1):
            if shard in h[i][1]:
                return int(h[i + 1][0]) - 1
        return -1

    def _send(self, rec: ShardRecovery, replica: int, msg: wire.RecoveryRequest, now: int) -> None:
        r = rec.reps.setdefault(replica, _Replica())
        r.pending = (msg.req_id, msg.op)
        r.sent_at = now
        self.out.send(ReplicaOf(rec.shard, replica), msg)

    def _due(self, r: _Replica, now: int) -> bool:
        return r.pending is None or now - r.sent_at >= self.s.retry_ns

    def _advance(self, rec: ShardRecovery, now: int) -> None:
        if rec.persisting:
            return
        n = rec.replicas
        for i in range(n):
            rec.reps.setdefault(i, _Replica())
        # Every replica's state for this generation (probing also freezes it); while
        # nobody may be the source, asked again from time to time (an answer of a replica
        # that can is acquired at once).
        stuck = self._without_source(rec)
        for i, r in rec.reps.items():
            if self._due(r, now) and (r.info is None or (stuck and now - r.probed_at >= self.s.reprobe_ns)):
                self._send(rec, i, wire.Probe(req_id=next(self._req), gen=rec.gen), now)
        if rec.acquired is None:
            return
        acq = rec.acquired
        if not rec.authority_told and now - rec.authority_sent_at >= self.s.retry_ns:
            src = rec.reps.get(acq["source"])
            if src is not None and src.info is not None:
                req = next(self._req)
                rec.authority_req = req
                rec.authority_sent_at = now
                self.out.send(ReplicaOf(rec.shard, acq["source"]), wire.Acquired(req_id=req, gen=rec.gen))
        if rec.e_last is None:
            rec.e_last = self._last_epoch_with(rec.shard)
            if rec.e_last is None:
                return  # the MMS has not dropped the shard yet
            # Usually the end of e_last; a shard that had already left (removed) may have
            # decided the epochs after it too, as positions that are not its own.
            top = max([acq["frontier"]] + [g[0] for g in acq["guesses"]])
            rec.end = max(epoch_end(rec.e_last) if rec.e_last >= 0 else 0, top)
        x = acq["stable"]
        for i, r in rec.reps.items():
            if r.info is None or r.installed or not self._due(r, now):
                continue
            if r.install_from is not None:
                self._install(rec, i, r, r.install_from, now)
                continue
            base = min(r.info["frontier"], x)
            if base < x and not r.fetch_done:
                self._fetch(rec, i, r, base, x, now)
                continue
            self._install(rec, i, r, base, now)
        if not all(r.installed for r in rec.reps.values()):
            return
        # The source first (again, if a previous leader resumed it: its answer names the
        # records it refused), then the others, told to refuse those records too.
        source = acq["source"]
        src = rec.reps[source]
        if rec.refused is None:
            if self._due(src, now):
                self._send(rec, source, wire.Resume(req_id=next(self._req), gen=rec.gen, stable=rec.end, refused=[]),
                           now)
            return
        refused = [(k[0], k[1]) for k in rec.refused]
        for i, r in rec.reps.items():
            if not r.resumed and self._due(r, now):
                self._send(rec, i, wire.Resume(req_id=next(self._req), gen=rec.gen, stable=rec.end, refused=refused),
                           now)
        if all(r.resumed for r in rec.reps.values()):
            rec.phase = DONE
            self._persist(rec, {"gen": rec.gen, "phase": DONE}, recovering=False)

    def _membership(self, rec: ShardRecovery) -> list[list[Any]]:
        """Members of every epoch up to ``epoch_of(end)``: from the history up to e_last
        (our copy holds every entry up to the one that dropped the shard), and beyond it
        (a shard that had left decided later epochs too) from the source, which applied
        them from the committed history; our copy may lag ZooKeeper's."""
        assert rec.e_last is not None and rec.acquired is not None
        last_epoch = epoch_of(rec.end) if rec.end > 0 else -1
        out: list[list[Any]] = ([[f, la, list(m)] for f, la, m in history_ranges(self.history, 0, min(rec.e_last, last_epoch))]
                                if rec.e_last >= 0 else [])
        for first, last, members in rec.acquired.get("membership", []):
            f, la = max(int(first), rec.e_last + 1), min(int(last), last_epoch)
            if f <= la:
                out.append([f, la, list(members)])
        covered = int(out[-1][1]) if out else -1
        assert covered >= last_epoch, ("no membership known up to the end of recovery", covered, last_epoch)
        return out

    def _fetch(self, rec: ShardRecovery, target: int, r: _Replica, base: int, x: int, now: int) -> None:
        """Ask a replica that decided up to X for the records target lacks below X."""
        assert r.info is not None
        holders = [i for i, o in rec.reps.items() if o.info is not None and o.info["frontier"] >= x and i != target]
        if not holders:
            # Nobody up holds them yet (a holder restarted, or more than f failures so far):
            # nothing is in flight for the target, which waits for a holder's PROBE answer
            # (a fetch left pending kept a deadline in the past: the loop spun on it).
            r.pending = None
            return
        src = rec.acquired["source"] if rec.acquired and rec.acquired["source"] in holders else holders[0]
        lo = max(base, r.fetch_lo)
        req = next(self._req)
        rec.fetch_for[req] = target
        self.out.send(ReplicaOf(rec.shard, src), wire.Fetch(req_id=req, gen=rec.gen, lo=lo, hi=x, max_bytes=self.s.fetch_bytes))
        r.sent_at = now  # the target waits on this fetch: its retry timer runs
        r.pending = (-1, wire.FETCH)

    def _install(self, rec: ShardRecovery, i: int, r: _Replica, base: int, now: int) -> None:
        assert r.info is not None and rec.acquired is not None and rec.e_last is not None
        acq = rec.acquired
        x = acq["stable"]
        below = [g for g in r.fetched if base < g[0] <= x]
        above = [g for g in acq["records"] if g[0] > x] + acq["guesses"]
        records = sorted((RecordEvent(int(g[0]), 0, int(g[1]), int(g[2]), bytes(g[3])) for g in below + above
                          if g[0] > base), key=lambda r: r.gsn)
        assert all(a.gsn < b.gsn for a, b in zip(records, records[1:])), "two records at one gsn"
        keys = [(r.client_id, r.seq) for r in records]
        assert len(set(keys)) == len(keys), "a record twice in the recovered state"
        # This part: records up to install_bytes (at least one), ending with the last of
        # them unless they are all the rest (then at the recovery's end).
        size, n = 0, 0
        for rec_ev in records:
            size += record_size(rec_ev.data)
            if n and size > self.s.install_bytes:
                break
            n += 1
        part, end = records[:n], rec.end
        membership = self._membership(rec)
        if n < len(records):
            end = part[-1].gsn
            last = epoch_of(end)
            membership = [[f, min(la, last), m] for f, la, m in membership if f <= last]
        known = epoch_of(base) if base > 0 else -1
        events = list(stream_events(part, membership, known))
        trim = max(r.info.get("trim", 0), r.fetch_trim)
        self._send(rec, i, wire.Install(req_id=next(self._req), gen=rec.gen, base=base, trim=trim, events=events,
                                        end=end), now)
