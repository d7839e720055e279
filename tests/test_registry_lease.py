"""Revocation fails closed: a server judges client keys only under a registry lease
(``ziplog.protocol.access.RegistryLease``, kept by ``ziplog.shell.rights.LeaseKeeper``),
and ``ziplog client remove`` returns only once every server registered under
``/ziplog/clients-loaded`` confirmed the removal or its lease has certainly run out.

The lease, the table's refusal, a storage replica's subscriptions at a lapse, the
keeper's renewals and the remover's vouching, on fake clocks; ``tests/test_revocation.py``
runs it on real processes."""

from __future__ import annotations

import queue
from typing import Any, Callable

import pytest

from ziplog.io.zk_clients import LeaseEvidenceError, Loaded
from ziplog.protocol import frames as wire
from ziplog.protocol.access import LAPSED, AccessTable, RegistryLease
from ziplog.protocol.keys import ClientEntry, Right
from ziplog.server.client_rights import ClientRights
from ziplog.shell.rights import LeaseKeeper, RouterRights
from ziplog.tools.cli_clients import lease_runs_out_s, vouch_removal

MEMBER = b"m" * 32
ALICE = b"a" * 32
S = 1_000_000_000


class Clock:
    def __init__(self, now: int = 1_000 * S) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def test_a_lease_runs_from_the_start_of_a_check_that_saw_what_the_table_holds() -> None:
    clock = Clock()
    lease = RegistryLease(2 * S, clock)
    assert not lease.holds()  # never held before a renewal
    started = clock.now
    clock.now += S // 2  # the check took half a second
    assert not lease.renew(started, seen=4, held=3)  # the table is behind what was seen: no evidence
    assert not lease.holds()
    assert lease.renew(started, seen=3, held=3)
    assert lease.holds()
    clock.now = started + 2 * S - 1
    assert lease.holds()
    clock.now = started + 2 * S  # from the check's start, not its end
    assert not lease.holds()
    assert lease.renew(started + S, seen=2, held=3)  # an older version seen: the table is as recent
    assert lease.holds()
    assert lease.renew(started, seen=3, held=3)  # a later renewal never shortens it
    assert lease.until == started + 3 * S
    lease.drop()
    assert not lease.holds()
    with pytest.raises(ValueError):
        RegistryLease(0, clock)


def test_a_lapsed_table_judges_no_client_key() -> None:
    clock = Clock()
    table = AccessTable(MEMBER, RegistryLease(S, clock))
    table.load([ClientEntry("alice", ALICE, frozenset({Right.READ}))], 1)
    table.lease.renew(clock.now, 1, table.version)  # type: ignore[union-attr]
    assert table.lapse_refusal(ALICE, Right.READ) is None
    assert table.refusal_for(ALICE, Right.READ) is None
    clock.now += S
    assert table.lapse_refusal(ALICE, Right.READ) == LAPSED
    assert table.lapse_refusal(ALICE, Right.APPEND) == LAPSED  # before the rights: nothing is judged
    assert table.lapse_refusal(b"x" * 32, Right.READ) == LAPSED
    assert table.lapse_refusal(MEMBER, Right.READ) is None  # the cluster's own key owes nothing to the registry
    assert table.lapse_refusal(ALICE, None) is None  # nor a request that needs no right
    assert table.lapse_refusal(None, Right.READ) is None  # no key: FORBIDDEN, as ever
    assert AccessTable(MEMBER).lapse_refusal(ALICE, Right.READ) is None  # no lease kept

    rights = RouterRights(table, {wire.Read: Right.READ, wire.Status: Right.ADMIN})
    rights.peer_key = lambda route: {b"a": ALICE, b"m": MEMBER}.get(route)
    got = rights.refusal(b"a", wire.Read(req_id=1, gsn=1))
    assert got is not None and got.lapsed and got.why == LAPSED
    assert rights.refusal(b"m", wire.Read(req_id=1, gsn=1)) is None
    table.lease.renew(clock.now, 1, table.version)  # type: ignore[union-attr]
    assert rights.refusal(b"a", wire.Read(req_id=1, gsn=1)) is None
    got = rights.refusal(b"a", wire.Status(req_id=2))
    assert got is not None and not got.lapsed and "lacks the 'admin' right" in got.why
    assert rights.refused == 2


class _Fanout:
    def __init__(self, subs: list[tuple[bytes, int]]) -> None:
        self.subs = dict.fromkeys(subs)

    def on_unsubscribe(self, route: bytes, msg: wire.Unsubscribe) -> None:
        del self.subs[(route, msg.sub_id)]


class _Core:
    def __init__(self, subs: list[tuple[bytes, int]]) -> None:
        self.driver_stats: dict[str, int] = {}
        self.fanout = _Fanout(subs)
        self.errors: list[tuple[bytes, int | None, str]] = []

    def error(self, route: bytes, req_id: int | None, code: str, message: str) -> None:
        self.errors.append((route, req_id, code))


class _Router:
    @staticmethod
    def peer_key(route: bytes) -> bytes | None:
        return {b"a": ALICE, b"m": MEMBER}.get(route)


def test_a_replica_refuses_requests_and_ends_client_subscriptions_while_its_lease_lapses() -> None:
    clock = Clock()
    table = AccessTable(MEMBER, RegistryLease(S, clock))
    table.load([ClientEntry("alice", ALICE, frozenset({Right.READ}))], 1)
    table.lease.renew(clock.now, 1, 1)  # type: ignore[union-attr]
    core = _Core([(b"a", 7), (b"m", 8)])
    refused: dict[str, int] = {}
    rights = ClientRights(table, core, _Router(), refused)  # type: ignore[arg-type]
    read = wire.Read(req_id=3, gsn=1)
    rights.check(b"a", read)  # held: judged, and alice may read
    rights.at_turn()
    assert len(core.fanout.subs) == 2 and not core.errors
    clock.now += S
    with pytest.raises(wire.ProtocolError) as lapsed:
        rights.check(b"a", read)
    assert (lapsed.value.code, lapsed.value.req_id) == (wire.E_REGISTRY_LAPSED, 3)
    rights.check(b"m", read)  # a member is not held up
    rights.at_turn()  # alice's subscription ends; the member's goes on
    assert list(core.fanout.subs) == [(b"m", 8)]
    assert core.errors == [(b"a", 7, wire.E_REGISTRY_LAPSED)] and refused == {wire.E_REGISTRY_LAPSED: 1}
    rights.at_turn()  # once per lapse
    assert len(core.errors) == 1
    table.lease.renew(clock.now, 1, 1)  # type: ignore[union-attr]
    rights.check(b"a", read)
    rights.at_turn()


class FakeRegistry:
    """What a LeaseKeeper asks of ZooKeeper; each ``current`` waits for the test's answer."""

    def __init__(self, entries: list[ClientEntry], version: int) -> None:
        self.entries, self.version = entries, version
        self.answers: "queue.Queue[Exception | None]" = queue.Queue()
        self.asked: "queue.Queue[int]" = queue.Queue()
        self.confirmed: "queue.Queue[tuple[int, int | None]]" = queue.Queue()
        self.watchers: list[Callable[[list[ClientEntry], int], None]] = []
        self.lost: list[Callable[[], None]] = []
        self.running = True
        self.first = True

    def confirm_loaded(self, server: str, version: int, lease_ms: int | None = None) -> None:
        self.confirmed.put((version, lease_ms))

    def current(self, server: str, held: int) -> tuple[int, list[ClientEntry] | None]:
        if self.first:  # the keeper's start, on the test's thread
            self.first = False
        else:
            self.asked.put(held)
            problem = self.answers.get(timeout=10)
            if problem is not None:
                raise problem
        return self.version, (list(self.entries) if self.version > held else None)

    def on_connected(self, call: Callable[[], None]) -> None:
        pass

    def on_lost(self, call: Callable[[], None]) -> None:
        self.lost.append(call)

    def watch(self, on_change: Callable[[list[ClientEntry], int], None]) -> None:
        self.watchers.append(on_change)

    def serving(self) -> bool:
        return self.running


class FakeRuntime:
    """Hands what other threads post to the test, which runs it as the loop would."""

    def __init__(self) -> None:
        self.posted: "queue.Queue[Callable[[], None]]" = queue.Queue()

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        self.posted.put(fn)

    def run_next(self) -> None:
        self.posted.get(timeout=10)()


def test_the_keeper_renews_after_each_check_and_loads_a_newer_registry_first() -> None:
    clock = Clock()
    lease = RegistryLease(10 * S, clock)  # checks every 2 s of real time, unless told sooner
    registry = FakeRegistry([ClientEntry("alice", ALICE, frozenset({Right.READ}))], 4)
    rt = FakeRuntime()
    loads: list[int] = []
    keeper = LeaseKeeper(registry, rt, lambda entries, version: loads.append(version), "storage0.1", lease)
    try:
        keeper.start()
        assert registry.confirmed.get(timeout=10) == (-1, 10_000)  # the node, before the first check
        assert loads == [4] and lease.holds() and lease.until == clock.now + 10 * S
        assert registry.confirmed.get(timeout=10) == (4, 10_000)
        clock.now += 10 * S
        assert not lease.holds()  # paused past it: lapsed

        keeper.soon()
        assert registry.asked.get(timeout=10) == 4
        registry.answers.put(ConnectionError("ZooKeeper away"))  # a failed check renews nothing
        keeper.soon()
        assert registry.asked.get(timeout=10) == 4
        assert rt.posted.empty() and not lease.holds()
        registry.version = 6  # the registry changed meanwhile: loaded before the renewal
        check_started = clock.now
        registry.answers.put(None)
        clock.now += S
        rt.run_next()
        assert loads == [4, 6] and keeper.held == 6
        assert lease.holds() and lease.until == check_started + 10 * S
        assert registry.confirmed.get(timeout=10) == (6, 10_000)

        registry.watchers[0]([], 5)  # an older version, late: ignored
        rt.run_next()
        assert loads == [4, 6]
        keeper.soon()
        assert registry.asked.get(timeout=10) == 6
        registry.answers.put(LeaseEvidenceError("the node is another session's"))
        for call in registry.lost:  # the session expired: no lease at once
            call()
        rt.run_next()
        assert not lease.holds()
    finally:
        registry.running = False
        keeper.soon()
        registry.answers.put(None)


class FakeLoaded:
    def __init__(self, clock: list[float], said: Callable[[float], dict[str, Loaded]]) -> None:
        self.clock = clock
        self.said = said

    def loaded(self) -> dict[str, Loaded]:
        return self.said(self.clock[0])


def _vouch(said: Callable[[float], dict[str, Loaded]], timeout: float) -> tuple[Any, float]:
    clock = [100.0]

    def pause(s: float) -> None:
        clock[0] += s

    got = vouch_removal(FakeLoaded(clock, said), 7, 100.0, timeout, clock=lambda: clock[0], pause=pause)
    return got, clock[0] - 100.0


def test_remove_vouches_by_confirmation_or_by_a_lease_certainly_run_out() -> None:
    lease = lease_runs_out_s(2000)
    assert lease == pytest.approx(2 * 1.1 + 0.5)
    # everyone confirms at once
    got, took = _vouch(lambda t: {"a": Loaded(7, 2000), "b": Loaded(8, None)}, 30)
    assert (got.confirmed, got.lapsed, got.unknown, took) == (["a", "b"], [], [], 0)
    # one confirms a second later; one never does but keeps a lease: vouched once it ran out
    got, took = _vouch(lambda t: {"late": Loaded(7 if t >= 101 else 6, 2000), "paused": Loaded(6, 2000)}, 30)
    assert (got.confirmed, got.lapsed, got.unknown) == (["late"], ["paused"], [])
    assert lease <= took < lease + 0.1
    # a server that keeps no lease (an earlier build), or said nothing readable, must confirm
    got, took = _vouch(lambda t: {"old": Loaded(6, None), "junk": Loaded(-1, None)}, 5)
    assert (got.confirmed, got.lapsed, got.unknown) == ([], [], ["junk", "old"]) and took >= 5
    # a timeout shorter than the lease: not vouched for
    got, _ = _vouch(lambda t: {"paused": Loaded(6, 2000)}, 1)
    assert got.unknown == ["paused"]
    # a server whose node went (its session ended) is not waited for
    got, took = _vouch(lambda t: {"gone": Loaded(6, 2000)} if t < 100.5 else {}, 30)
    assert got == ([], [], []) and took < lease
