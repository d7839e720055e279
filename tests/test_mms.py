"""Membership service: epochs are in ZooKeeper before they are broadcast, and a new
leader continues the sequence without contradicting the old one."""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Callable, Iterator

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

import ziplog
from mms.planner import EpochPlanner, PlannerSettings
from mms.sequencer import EpochSequencer
from ziplog.cores.effects import CommitBlock
from ziplog.io.zk_membership import block_transaction, read_epoch_state
from ziplog.io import zk as discovery
from ziplog.protocol import frames as wire
from ziplog.protocol import layout, membership
from ziplog.protocol.epoch_feed import EpochFeed
from ziplog.protocol.gsna import EpochConfig
from ziplog.tools import procs


@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=2, replicas=2) as c:
        yield c


class Listener:
    """A SUB socket on every MMS replica's PUB, recording every broadcast."""

    def __init__(self, cluster: ziplog.LocalCluster) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        for info in cluster.topology.mms.values():
            self.sub.connect(info["pub"])
        self.seen: dict[int, tuple[Any, Any]] = {}
        self.order: list[int] = []
        self.feed = EpochFeed()
        #: the leader the last broadcast named
        self.leaders: list[int | None] = []

    def take(self) -> EpochConfig | None:
        """The next broadcast's configuration (None: an EPOCH_SAME whose base was sent
        before this listener connected)."""
        msg = wire.decode_epoch(self.sub.recv())
        cfg = self.feed.on_message(msg)
        if not isinstance(cfg, EpochConfig):
            return None
        self.leaders.append(msg.leader)
        return cfg

    def pump(self, until: float) -> None:
        while time.monotonic() < until:
            if self.sub.poll(50) and (got := self.take()) is not None:
                e, cfg = got.epoch, (got.shards, got.rates)
                assert self.seen.setdefault(e, cfg) == cfg, f"epoch {e} broadcast with two configs"
                self.order.append(e)

    def pump_until(self, done: Any, timeout: float = 60.0) -> None:
        """Record broadcasts until ``done()`` (an idle cluster's epochs are long)."""
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"broadcasts stopped: {self.order[-5:]}"
            self.pump(time.monotonic() + 0.05)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def leader_id(cluster: ziplog.LocalCluster) -> int:
    zk = cluster._zkc
    contenders = zk.Election(layout.MMS_ELECTION).contenders()
    assert contenders
    return int(contenders[0])


def test_broadcast_epochs_are_committed_first(cluster: ziplog.LocalCluster) -> None:
    lis = Listener(cluster)
    try:
        lis.pump_until(lambda: len(lis.order) > 10)
        data, _ = cluster._zkc.get(layout.EPOCH_PATH)
        block = layout.dec(data)
        # every broadcast epoch so far is at or below the committed block's end
        assert max(lis.order) <= block["last"]
        assert all(b > a for a, b in zip(lis.order, lis.order[1:])), "epochs strictly increase"
    finally:
        lis.close()


def test_new_leader_continues_without_contradiction(cluster: ziplog.LocalCluster) -> None:
    lis = Listener(cluster)
    try:
        lis.pump_until(lambda: len(lis.order) > 0)
        old = leader_id(cluster)
        before = max(lis.order)
        procs.kill(cluster.mms[old])  # SIGKILL the leader
        with cluster.client() as c:
            rid = c.insert_after(b"during failover")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (not lis.order or max(lis.order) < before + 20):
                lis.pump(time.monotonic() + 0.2)
            assert max(lis.order) >= before + 20, "epochs did not continue after the leader died"
            assert leader_id(cluster) != old
            after = c.insert_after(b"after failover", rid)
            assert after.gsn > rid.gsn
            assert c.read_record(after) == b"after failover"
        # restart the killed replica as an operator would; it joins as a follower
        cluster._spawn_mms(old)
    finally:
        lis.close()


def test_rates_go_to_the_leader_the_broadcasts_name_and_to_the_next_one(cluster: ziplog.LocalCluster) -> None:
    """Primaries report per change to the leader EPOCH names: the broadcast rates leave
    the planner's default (no report: 2000/s) for what the shards report, and after the
    leader is killed, load reaches the new leader's plan through reports sent to it."""
    default_rate = PlannerSettings().default_rate
    lis = Listener(cluster)
    leaders: list[int | None] = []
    rates: list[tuple[int, ...]] = []

    def pump(done: Callable[[], bool], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"leaders {leaders[-3:]}, rates {rates[-3:]}"
            if lis.sub.poll(50) and (got := lis.take()) is not None:
                leaders.append(lis.leaders[-1])
                rates.append(got.rates)

    try:
        old = leader_id(cluster)
        pump(lambda: len(rates) > 0 and leaders[-1] == old and all(r != default_rate for r in rates[-1]))
        procs.kill(cluster.mms[old])
        with cluster.client() as c:
            rid = c.insert_after(b"load")
            pump(lambda: bool(leaders) and leaders[-1] not in (None, old))
            new = leaders[-1]
            assert new == leader_id(cluster)
            quiet = rates[-1]
            # load: the shards' reports (busy, a rate above the idle one) reach the
            # new leader, whose next block plans with them
            deadline = time.monotonic() + 60
            while not (leaders[-1] == new and max(rates[-1]) > max(quiet)):
                assert time.monotonic() < deadline, f"no reported load in the plan: {rates[-3:]}, idle {quiet}"
                for _ in range(50):
                    rid = c.insert_after(b"load", rid)
                while lis.sub.poll(0):
                    if (got := lis.take()) is not None:
                        leaders.append(lis.leaders[-1])
                        rates.append(got.rates)
    finally:
        lis.close()
        cluster._spawn_mms(old)


def test_planner_uses_reported_rates() -> None:
    p = EpochPlanner(PlannerSettings(default_rate=1000, min_rate=10))
    cfg, hist = p.plan([0, 1])
    assert cfg.epoch == 0 and cfg.shards == (0, 1) and cfg.rates == (1000, 1000) and hist == [[0, [0, 1]]]
    p.committed(cfg, hist)
    p.on_rate(0, 5000)  # the primary's smoothed rate: the planner takes it as it is
    cfg, hist = p.plan([0, 1])
    assert cfg.epoch == 1 and cfg.rates == (5000, 1000) and hist is None
    p.committed(cfg, hist)
    p.remove(1)
    # A removed shard drains first: the lowest rate for drain_epochs, then it leaves.
    for e in range(2, 2 + p.settings.drain_epochs):
        cfg, hist = p.plan([0, 1])
        assert cfg.epoch == e and cfg.shards == (0, 1) and cfg.rates[1] == 1 and hist is None
        p.committed(cfg, hist)
    cfg, hist = p.plan([0, 1])
    e = 2 + p.settings.drain_epochs
    assert cfg.shards == (0,) and hist == [[0, [0, 1]], [e, [0]]]
    assert isinstance(cfg, EpochConfig)


# Hypothesis warns when the global random state moves while it draws: here kazoo's
# threads, left by this module's ZooKeeper tests, draw their retry jitter from it; the
# strategies themselves use none.
@pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["rate", "join", "recover", "heal", "remove", "plan"]),
                          st.integers(0, 11), st.integers(0, 5000)), max_size=60))
def test_a_plan_at_an_unchanged_generation_is_the_full_plan(steps: list[tuple[str, int, int]]) -> None:
    """The planner's cheap path (the last members, changed rates patched in) plans what
    a full plan of the same inputs plans, epoch after epoch."""
    settings_ = PlannerSettings(default_rate=1000, min_rate=10, drain_epochs=2)
    fast, full = EpochPlanner(settings_), EpochPlanner(settings_)
    ready, recovering, generation = {0, 1, 2}, set(), 0
    for kind, shard, value in steps + [("plan", 0, 0)]:
        if kind == "rate":
            fast.on_rate(shard, value)
            full.on_rate(shard, value)
        elif kind in ("join", "recover", "heal", "remove"):
            generation += 1  # every topology change moves the generation
            if kind == "join":
                ready.add(shard)
            elif kind == "recover":
                recovering.add(shard)
            elif kind == "heal":
                recovering.discard(shard)
            else:
                fast.remove(shard)
                full.remove(shard)
        else:
            a, ha = fast.plan(sorted(ready), sorted(recovering), generation)
            b, hb = full.plan(sorted(ready), sorted(recovering))
            assert (a, ha) == (b, hb)
            fast.committed(a, ha)
            full.committed(b, hb)


def test_drain_ends_at_marks_the_epoch_a_removed_shard_leaves() -> None:
    p = EpochPlanner(PlannerSettings(drain_epochs=3))
    cfg, hist = p.plan([0, 1])
    p.committed(cfg, hist)  # epoch 0
    assert not any(p.drain_ends_at(e) for e in range(10))
    p.remove(1)  # seen while planning epoch 1: drains 1..3, gone at 4
    assert [e for e in range(10) if p.drain_ends_at(e)] == [4]


def test_epoch_config_at_restates_without_validating(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = EpochConfig(3, (1, 4, 9), (10, 20, 30))
    assert cfg.at(3) is cfg
    validations: list[EpochConfig] = []
    original = EpochConfig.__post_init__

    def validating(self: EpochConfig) -> None:
        validations.append(self)
        original(self)

    monkeypatch.setattr(EpochConfig, "__post_init__", validating)
    later = cfg.at(7)
    assert validations == [], "at() must not validate again: the leader restates a config every epoch"
    assert later == EpochConfig(7, (1, 4, 9), (10, 20, 30)) and later.base == EpochConfig(7, (1,), (1,)).base
    assert hash(later) == hash(EpochConfig(7, (1, 4, 9), (10, 20, 30)))
    with pytest.raises(AssertionError):
        cfg.at(-1)


def test_a_backlog_of_reports_is_read_a_bounded_batch_per_turn() -> None:
    """A backlog of RATE reports is read a bounded batch at a time (the runtime's
    DRAIN_LIMIT per socket per turn), so it cannot keep the leader from its timers."""
    from ziplog.io.zmq_runtime import DRAIN_LIMIT, ZmqRuntime

    rt = ZmqRuntime()
    try:
        planner = EpochPlanner(PlannerSettings())
        turns: list[int] = []

        def on_rate(frame: bytes) -> None:
            for r in wire.decode_rate(frame).reports:
                planner.on_rate(r.shard, r.rate)

        pull = rt.puller(on_rate)
        push = rt.pusher(pull.addr)
        rt.at_turn_end(lambda: turns.append(len(planner.rates)))
        n = 2 * DRAIN_LIMIT + 100
        for s in range(n):
            assert push.send(wire.encode(wire.Rate(reports=[wire.RateEntry(shard=s, epoch=0, rate=5000, busy=True)])))
        assert rt.run_until(lambda: len(planner.rates) == n, 10_000_000_000)
        steps = [b - a for a, b in zip([0] + turns, turns)]
        assert max(steps) <= DRAIN_LIMIT and len([x for x in steps if x]) >= 3, steps
        assert planner.rates == {s: 5000 for s in range(n)}
    finally:
        rt.close()


# -- the leader's sequence of epochs, stepped by hand against a real ZooKeeper ---------------

_namespaces = itertools.count()


@pytest.fixture
def zk_ns(cluster: ziplog.LocalCluster) -> Iterator[KazooClient]:
    """A fresh ZooKeeper namespace on the cluster's ensemble, set up as an MMS replica's
    ``start`` leaves it: nothing committed yet."""
    root = f"/mms-sequencer-{next(_namespaces)}"
    cluster._zkc.ensure_path(root)
    zk = discovery.connect(cluster.zk_hosts + root, key=cluster.key)  # a member: it writes
    try:
        for path in (layout.EPOCH_PATH, layout.MEMBERSHIP_PATH):
            zk.create(path, b"", makepath=True)
        yield zk
    finally:
        discovery.stop(zk)


def register_shard(zk: KazooClient, shard: int) -> None:
    """As a one-replica storage server registers (one transaction: no half-registered view)."""
    zk.ensure_path(layout.SHARDS)
    txn = zk.transaction()
    txn.create(f"{layout.SHARDS}/{shard}", layout.enc({"replicas": 1}))
    txn.create(f"{layout.SHARDS}/{shard}/0", layout.enc({"addr": "tcp://127.0.0.1:1", "pid": 0}), ephemeral=True)
    assert not any(isinstance(r, Exception) for r in txn.commit())


def set_shard_meta(zk: KazooClient, shard: int, **extra: Any) -> None:
    zk.set(f"{layout.SHARDS}/{shard}", layout.enc({"replicas": 1, **extra}))


def await_view(topo: discovery.Topology, predicate: Callable[[], bool]) -> None:
    assert topo.wait(predicate, 20), "the topology did not show the change"


class SteppedLeader:
    """An ``EpochSequencer`` stepped as ``MembershipReplica.lead`` steps it, minus the
    clock, recording the epochs at which it planned."""

    def __init__(self, zk: KazooClient, topo: discovery.Topology) -> None:
        self.zk, self.topo = zk, topo
        self.seq = EpochSequencer(read_epoch_state(zk), topo, PlannerSettings(), epochs_per_commit=10)
        self.feed = EpochFeed()  # a subscriber that hears every broadcast
        self.planned_at: list[int] = []
        plan = self.seq.planner.plan

        def counted(*args: Any, **kw: Any) -> Any:
            self.planned_at.append(self.seq.next_epoch)
            return plan(*args, **kw)

        self.seq.planner.plan = counted  # type: ignore[method-assign]

    def prepare(self) -> None:
        """As the driver prepares: the commit the sequencer asks for, performed and answered."""
        for commit in self.seq.prepare().coordinate:
            assert isinstance(commit, CommitBlock)
            results = block_transaction(self.zk, commit).commit()
            assert self.seq.on_commit_result(not any(isinstance(r, Exception) for r in results))

    def step(self) -> tuple[int, tuple[int, ...]]:
        """Prepare and 'broadcast' the next epoch: its number and members."""
        self.prepare()
        return self.broadcast()

    def broadcast(self) -> tuple[int, tuple[int, ...]]:
        e = self.seq.next_epoch
        cfg = self.seq.config()
        base = self.seq.same_as()
        enc = wire.EpochEncoder()
        frame = enc.encode(cfg.epoch, cfg.shards, cfg.rates) if base is None else enc.encode_same(cfg.epoch, base)
        heard = self.feed.on_message(wire.decode_epoch(frame))
        assert isinstance(heard, EpochConfig) and heard.epoch == e, (e, base, heard)
        # The invariant: what is broadcast is already committed, block and history.
        block = layout.dec(self.zk.get(layout.EPOCH_PATH)[0])
        assert block["epoch"] <= e <= block["last"], (e, block)
        assert (block["shards"], block["rates"]) == (list(heard.shards), list(heard.rates)), (e, block, heard)
        history = layout.dec(self.zk.get(layout.MEMBERSHIP_PATH)[0])
        assert membership.members_in_history(history, e) == heard.shards
        self.seq.advance()
        return e, heard.shards

    def run_to(self, epoch: int) -> dict[int, tuple[int, ...]]:
        """Step up to (not including) ``epoch``: members per epoch."""
        out = {}
        while self.seq.next_epoch < epoch:
            e, members = self.step()
            out[e] = members
        return out

    def own_commit_seen(self) -> None:
        """Our membership commit comes back through the topology's watch (one more
        change, so one more plan): wait for it so the plans are deterministic."""
        await_view(self.topo, lambda: self.topo.history == self.seq.planner.history)


def test_leader_plans_only_when_something_can_change(zk_ns: KazooClient) -> None:
    register_shard(zk_ns, 0)
    register_shard(zk_ns, 1)
    topo = discovery.Topology(zk_ns)
    await_view(topo, lambda: topo.shard_complete(0) and topo.shard_complete(1))
    lead = SteppedLeader(zk_ns, topo)

    # The first block's commit is asked for; nothing goes out until it is answered.
    commit, = lead.seq.prepare().coordinate
    assert isinstance(commit, CommitBlock)
    assert lead.seq.committing and not lead.seq.ready()
    with pytest.raises(AssertionError, match="committed"):
        lead.seq.config()
    assert lead.seq.on_commit_result(not any(isinstance(r, Exception)
                                             for r in block_transaction(zk_ns, commit).commit()))
    assert lead.broadcast() == (0, (0, 1))

    # Quiet: a plan per block (every 10 epochs), not one per epoch ...
    lead.own_commit_seen()
    lead.run_to(2)
    readiness_checks: list[int] = []
    complete = topo.shard_complete

    def checked(shard: int) -> bool:
        readiness_checks.append(shard)
        return complete(shard)

    topo.shard_complete = checked  # type: ignore[method-assign]
    quiet = lead.run_to(35)
    assert set(quiet.values()) == {(0, 1)}
    assert lead.planned_at == [0, 1, 10, 20, 30], f"planned at {lead.planned_at} (generation {topo.generation})"
    # ... and those plans reuse the ready list: the topology did not change.
    assert readiness_checks == []

    # A shard registers mid-block: planned at the next epoch, in that epoch's broadcast.
    register_shard(zk_ns, 2)
    await_view(topo, lambda: topo.shard_complete(2))
    del lead.planned_at[:]
    assert lead.step() == (35, (0, 1, 2))
    assert layout.dec(zk_ns.get(layout.EPOCH_PATH)[0])["epoch"] == 35, "a new block from epoch 35"
    lead.own_commit_seen()
    assert set(lead.run_to(50).values()) == {(0, 1, 2)}
    assert lead.planned_at == [35, 36, 45]

    # Failure recovery takes a shard out at once and brings it back when it ends.
    set_shard_meta(zk_ns, 1, recovering=1)
    await_view(topo, lambda: 1 in topo.recovering)
    assert lead.step() == (50, (0, 2))
    lead.own_commit_seen()
    lead.run_to(53)
    set_shard_meta(zk_ns, 1)
    await_view(topo, lambda: 1 not in topo.recovering)
    del lead.planned_at[:]
    assert lead.step() == (53, (0, 1, 2))
    lead.own_commit_seen()
    lead.run_to(58)
    assert lead.planned_at == [53, 54]

    # A removed shard drains three epochs (no event marks their end), then leaves.
    set_shard_meta(zk_ns, 0, removed=True)
    await_view(topo, lambda: 0 in topo.removed)
    del lead.planned_at[:]
    draining = lead.run_to(61)
    assert draining == {58: (0, 1, 2), 59: (0, 1, 2), 60: (0, 1, 2)}
    assert lead.step() == (61, (1, 2))
    lead.own_commit_seen()
    assert set(lead.run_to(70).values()) == {(1, 2)}
    assert lead.planned_at == [58, 61, 62], "planned at the removal, at the drain's end, at our commit's echo"


def test_new_leader_honours_the_committed_block(zk_ns: KazooClient) -> None:
    register_shard(zk_ns, 0)
    topo = discovery.Topology(zk_ns)
    await_view(topo, lambda: topo.shard_complete(0))
    old = SteppedLeader(zk_ns, topo)
    old.run_to(13)  # block 10..19 committed, 13 not yet broadcast
    version = zk_ns.exists(layout.EPOCH_PATH).version

    # Meanwhile a shard registers; a new leader takes over from ZooKeeper.
    register_shard(zk_ns, 1)
    await_view(topo, lambda: topo.shard_complete(1))
    new = SteppedLeader(zk_ns, topo)
    # It leaves the block another leader may have broadcast in part as committed, and
    # broadcasts none of it: its first broadcast is the epoch after it, in a block it
    # committed first (the change taken up there), so its first act is a write that any
    # commit of the deposed leader's must follow.
    assert new.seq.next_epoch == 20 and not new.seq.ready()
    assert new.step() == (20, (0, 1))
    assert zk_ns.exists(layout.EPOCH_PATH).version == version + 1  # its own block, before its first broadcast
    assert new.planned_at == [20]

    # The deposed leader sees the new shard too; its commit is refused and it steps
    # down instead of broadcasting epoch 13 with a config nobody committed.
    assert old.seq.next_epoch == 13 and old.seq.needs_plan()
    commit, = old.seq.prepare().coordinate
    assert isinstance(commit, CommitBlock)
    results = block_transaction(zk_ns, commit).commit()
    assert not old.seq.on_commit_result(not any(isinstance(r, Exception) for r in results)), \
        "a deposed leader's block commit must be refused"


def test_a_deposed_leaders_commit_fails_on_its_lock_whatever_versions_it_read(zk_ns: KazooClient) -> None:
    """A leader's commit checks its own election node in the same transaction: one
    deposed while its loop stalled (the node deleted) cannot commit, even with the
    versions ZooKeeper still holds (nobody wrote since it read them)."""
    register_shard(zk_ns, 0)
    topo = discovery.Topology(zk_ns)
    await_view(topo, lambda: topo.shard_complete(0))
    lead = SteppedLeader(zk_ns, topo)
    lead.run_to(3)
    lock = zk_ns.create("/lock-", b"", sequence=True, ephemeral=True)
    set_shard_meta(zk_ns, 0, recovering=0)
    await_view(topo, lambda: 0 in topo.recovering)
    commit, = lead.seq.prepare().coordinate
    assert isinstance(commit, CommitBlock) and commit.fence is None  # the driver names the lock
    zk_ns.delete(lock)  # deposed
    results = block_transaction(zk_ns, dataclasses.replace(commit, fence=lock)).commit()
    assert isinstance(results[0], NoNodeError) and not lead.seq.on_commit_result(False)
    held = zk_ns.create("/lock-", b"", sequence=True, ephemeral=True)
    again = SteppedLeader(zk_ns, topo)
    commit, = again.seq.prepare().coordinate
    assert isinstance(commit, CommitBlock)
    results = block_transaction(zk_ns, dataclasses.replace(commit, fence=held)).commit()
    assert not any(isinstance(r, Exception) for r in results), results


def test_change_seen_while_waiting_takes_effect_at_once(zk_ns: KazooClient) -> None:
    """``lead`` prepares an epoch right after the previous broadcast and, if the
    topology moves while it waits for the deadline, prepares it again."""
    register_shard(zk_ns, 0)
    topo = discovery.Topology(zk_ns)
    await_view(topo, lambda: topo.shard_complete(0))
    lead = SteppedLeader(zk_ns, topo)
    lead.run_to(13)
    lead.own_commit_seen()

    # Mid-block: the second preparation cuts the block at the epoch about to go out.
    lead.prepare()
    register_shard(zk_ns, 1)
    await_view(topo, lambda: topo.shard_complete(1))
    assert lead.seq.topology_moved()
    assert lead.step() == (13, (0, 1))
    lead.own_commit_seen()
    lead.run_to(23)

    # At a block's first epoch, committed already: the change waits one epoch, even
    # though the topology does not move again.
    assert lead.seq.block_due()
    lead.prepare()
    assert layout.dec(zk_ns.get(layout.EPOCH_PATH)[0])["epoch"] == 23
    register_shard(zk_ns, 2)
    await_view(topo, lambda: topo.shard_complete(2))
    assert lead.seq.topology_moved()
    assert lead.step() == (23, (0, 1))
    assert not lead.seq.topology_moved()
    assert lead.step() == (24, (0, 1, 2))


def test_an_idle_cluster_s_epochs_lengthen_and_the_first_records_shorten_them() -> None:
    from mms.sequencer import LEADER_GRACE_EPOCHS, EpochSequencer
    from ziplog.protocol.membership import EpochState
    from ziplog.protocol.topology import TopologyView
    topo = TopologyView()
    topo.replica_counts = {0: 2, 1: 2}
    seq = EpochSequencer(EpochState(None, 0, [], 0), topo, PlannerSettings(), 10)
    base, cap = 10_000_000, 200_000_000
    assert seq.interval_ns(base, cap) == base  # the first look: the topology is news
    seq.next_epoch = LEADER_GRACE_EPOCHS - 1  # a new leader counts every shard busy a while
    assert seq.interval_ns(base, cap) == base
    seq.next_epoch += 1
    assert seq.interval_ns(base, cap) == 2 * base  # no shard said it is busy: doubling...
    seq.next_epoch += 1
    assert seq.interval_ns(base, cap) == 4 * base
    seq.next_epoch += 10
    assert seq.interval_ns(base, cap) == cap  # ... up to the cap
    assert seq.on_rate(0, 300, True)  # shard 0 took records
    assert seq.interval_ns(base, cap) == base
    assert seq.on_rate(1, 900, True) and seq.on_rate(0, 200, False)
    assert seq.interval_ns(base, cap) == base  # shard 1 is still busy
    assert not seq.on_rate(7, 100, True)  # an unknown shard changes nothing
    assert seq.on_rate(1, 450, False)
    seq.next_epoch += 1
    assert seq.interval_ns(base, cap) == 2 * base  # every shard idle: the quiet starts anew
    assert seq.on_rate(1, 450, True)
    del topo.replica_counts[1]
    topo.changed()  # a shard goes, busy: back to the base at once...
    assert seq.interval_ns(base, cap) == base
    seq.next_epoch += 1
    assert seq.interval_ns(base, cap) == 2 * base  # ... and the gone shard counts busy no more
    assert seq.busy == set()
    assert seq.interval_ns(base, base) == base  # lengthening off
