"""The client core without I/O: shard choice, and the insert call's state machine."""

from __future__ import annotations

import random

from ziplog.cores.client.calls import InsertCall, InsertState, ReadCall, StatusCall
from ziplog.cores.client.state import AVOID_NS, RETRY_AFTER_NS, ClientState
from ziplog.protocol import frames as wire
from ziplog.protocol.errors import NoShardAvailableError, UnknownRecordError
from ziplog.protocol.topology import TopologyView
from ziplog.protocol.types import Policy, RecordId

S = 1_000_000_000


def _client(policy: Policy) -> ClientState:
    return ClientState(1, policy, random.Random(5), 5 * S)


def _topology(live: list[int], replicas: int = 2) -> TopologyView:
    topo = TopologyView()
    topo.replica_counts = {s: replicas for s in live}
    topo.replicas = {s: {r: f"tcp://s{s}r{r}" for r in range(replicas)} for s in live}
    topo.history = [[0, list(live)]]
    return topo


def test_a_fixed_policy_keeps_its_shard_while_it_is_avoided() -> None:
    # One insert unanswered for a while marks its shard avoided; a client pinned to that
    # shard must keep inserting there, not fail with "shard is not live".
    c = _client(Policy.fixed(0))
    c.avoid(0, now=100 * S)
    assert c.choose_shard([0, 1], None, b"x", set(), now=100 * S + S // 2) == 0


def test_a_fixed_policy_gives_up_its_shard_when_it_refused() -> None:
    c = _client(Policy.fixed(0))
    assert c.choose_shard([0, 1], None, b"x", {0}, now=0) is None


def test_a_random_policy_moves_off_an_avoided_shard_until_it_heals() -> None:
    c = _client(Policy.random())
    c.avoid(0, now=100 * S)
    assert {c.choose_shard([0, 1], None, b"x", set(), now=100 * S + S // 2) for _ in range(50)} == {1}
    assert 0 in {c.choose_shard([0, 1], None, b"x", set(), now=100 * S + AVOID_NS) for _ in range(200)}


def _ack(req: int, gsn: int, replica: int, decided: bool) -> wire.Ack:
    return wire.Ack(req_id=req, gsn=gsn, replica=replica, stable=0, decided=decided, final=False)


def test_an_insert_is_done_when_every_replica_agrees_and_resends_otherwise() -> None:
    c, topo = _client(Policy.fixed(0)), _topology([0])
    call = InsertCall(c, b"data", 5, None, 10 * S)
    (addrs, msg), = call.start(0, topo)
    assert addrs == ("tcp://s0r0", "tcp://s0r1") and isinstance(msg, wire.Insert) and msg.after == 5
    assert call.wake_at == RETRY_AFTER_NS
    assert call.on_reply("tcp://s0r0", _ack(msg.req_id, 9, 0, True), 1, topo) == [] and not call.done
    # unanswered by the backup: the identical frame again, to both
    (addrs2, again), = call.on_timer(RETRY_AFTER_NS, topo)
    assert again is msg and addrs2 == addrs and c.stats["retries"] == 1
    call.on_reply("tcp://s0r1", _ack(msg.req_id, 9, 1, False), RETRY_AFTER_NS + 1, topo)
    assert call.done and call.result() == RecordId(9, 0) and call.state is InsertState.DONE


def test_a_pinned_insert_waits_for_its_shard_and_fails_at_the_deadline() -> None:
    c, topo = _client(Policy.fixed(3)), _topology([0])
    topo.replica_counts = {0: 2, 3: 2}  # shard 3 exists, but is not live now
    call = InsertCall(c, b"data", 0, None, 2 * S)
    assert call.start(0, topo) == [] and call.state is InsertState.WAITING_FOR_SHARD and call.wake_at == 2 * S
    call.on_timer(2 * S, topo)
    assert call.done and isinstance(call.error, NoShardAvailableError)


def _status_ok(req: int, shard: int, replica: int) -> wire.StatusOk:
    return wire.StatusOk(req_id=req, status={"shard": shard, "replica": replica, "frontier": 7})


def test_status_lists_every_replica_the_topology_names_answered_or_not() -> None:
    c, topo = _client(Policy.random()), _topology([0, 1])
    del topo.replicas[1][1]  # shard 1's backup is not registered (restarting)
    call = StatusCall(c, 10 * S, wait_ns=S)
    (addrs, msg), = call.start(0, topo)
    assert sorted(addrs) == ["tcp://s0r0", "tcp://s0r1", "tcp://s1r0"] and isinstance(msg, wire.Status)
    call.on_reply("tcp://s0r0", _status_ok(msg.req_id, 0, 0), 1, topo)
    call.on_reply("tcp://s1r0", _status_ok(msg.req_id, 1, 0), 1, topo)
    call.on_reply("tcp://s1r0", _status_ok(msg.req_id + 1, 1, 0), 1, topo)  # another request's answer: ignored
    # s0r1 is silent: asked again every retry interval, then reported unreachable
    (again, msg2), = call.on_timer(RETRY_AFTER_NS, topo)
    assert again == ("tcp://s0r1",) and msg2.req_id == msg.req_id and not call.done
    call.on_timer(S, topo)
    assert call.done
    st = call.result()
    assert [[r["answer"] for r in st[s]] for s in (0, 1)] == [["ok", "unreachable"], ["ok", "not registered"]]
    assert st[0][0]["frontier"] == 7 and st[0][1]["addr"] == "tcp://s0r1" and st[1][1]["addr"] is None


def test_status_asks_a_replica_that_registers_while_it_waits_and_ends_when_all_answered() -> None:
    c, topo = _client(Policy.random()), _topology([0])
    gone = topo.replicas[0].pop(1)
    call = StatusCall(c, 10 * S, wait_ns=S)
    (_, msg), = call.start(0, topo)
    call.on_reply("tcp://s0r0", _status_ok(msg.req_id, 0, 0), 1, topo)
    assert call.done and call.result()[0][1]["answer"] == "not registered"  # a snapshot: not waited for
    call = StatusCall(c, 10 * S, wait_ns=S)
    (_, msg), = call.start(0, topo)
    topo.replicas[0][1] = gone
    (addrs, _), = call.on_topology(2, topo)
    assert addrs == ("tcp://s0r0", "tcp://s0r1")
    call.on_reply("tcp://s0r1", wire.Error(req_id=msg.req_id, code=wire.E_OVERLOADED, message="busy"), 3, topo)
    call.on_reply("tcp://s0r0", _status_ok(msg.req_id, 0, 0), 3, topo)
    assert call.done and [r["answer"] for r in call.result()[0]] == ["ok", "error"]


def test_a_read_during_a_replica_restart_asks_the_registered_replicas_then_the_one_that_returns() -> None:
    c, topo = _client(Policy.random()), _topology([0])
    backup = topo.replicas[0].pop(1)  # restarting: not registered
    call = ReadCall(c, RecordId(9, 0), 10 * S)
    (addrs, msg), = call.start(0, topo)
    assert addrs == ("tcp://s0r0",) and not call.done
    # the primary's answer is not stable yet: it takes every replica's, so the call waits
    call.on_reply("tcp://s0r0", wire.ReadOk(req_id=msg.req_id, gsn=9, data=b"r", stable=5), 1, topo)
    assert not call.done
    topo.replicas[0][1] = backup
    (again, msg2), = call.on_topology(2, topo)
    assert again == ("tcp://s0r1",) and msg2.req_id == msg.req_id
    call.on_reply("tcp://s0r1", wire.ReadOk(req_id=msg.req_id, gsn=9, data=b"r", stable=5), 3, topo)
    assert call.done and call.result() == b"r"
    # a stable answer from the registered replica settles it alone
    topo.replicas[0].pop(1)
    call = ReadCall(c, RecordId(9, 0), 10 * S)
    (_, msg), = call.start(0, topo)
    call.on_reply("tcp://s0r0", wire.ReadOk(req_id=msg.req_id, gsn=9, data=b"r", stable=9), 1, topo)
    assert call.done and call.result() == b"r"
    # a shard ZooKeeper never heard of fails at once
    call = ReadCall(c, RecordId(9, 4), 10 * S)
    assert call.start(0, topo) == [] and isinstance(call.error, UnknownRecordError)


def test_a_read_asks_again_the_replicas_whose_answer_was_lost() -> None:
    """A request or answer lost (a replica restarted on the same address while the read
    waited) would leave a read that needs every replica's answer waiting out its whole
    deadline: the silent replicas are asked again every retry interval."""
    c, topo = _client(Policy.random()), _topology([0])
    call = ReadCall(c, RecordId(9, 0), 10 * S)
    (addrs, msg), = call.start(0, topo)
    assert addrs == ("tcp://s0r0", "tcp://s0r1")
    call.on_reply("tcp://s0r0", wire.ReadOk(req_id=msg.req_id, gsn=9, data=b"r", stable=5), 1, topo)
    assert not call.done and call.wake_at is not None and call.wake_at < 10 * S
    (again, msg2), = call.on_timer(call.wake_at, topo)
    assert again == ("tcp://s0r1",) and msg2 == msg  # the same request: only the silent replica
    call.on_reply("tcp://s0r1", wire.ReadOk(req_id=msg.req_id, gsn=9, data=b"r", stable=5), call.wake_at + 1, topo)
    assert call.done and call.result() == b"r"
