"""The client core without I/O: shard choice, and the insert call's state machine."""

from __future__ import annotations

import pickle
import random
from typing import Any

import pytest

import ziplog
from ziplog.cores.client.calls import InsertCall, InsertState, ReadCall, StatusCall
from ziplog.cores.client.state import AVOID_NS, RETRY_AFTER_NS, ClientState
from ziplog.protocol import frames as wire
from ziplog.protocol.errors import NoShardAvailableError, UnknownRecordError, ZiplogError, ZiplogTimeoutError
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
    # unanswered by the backup: the same record again, to both, under a new request id
    (addrs2, again), = call.on_timer(RETRY_AFTER_NS, topo)
    assert isinstance(again, wire.Insert) and again.req_id != msg.req_id and addrs2 == addrs
    assert (again.client_id, again.seq, again.after, again.data, again.stamp) == (
        msg.client_id, msg.seq, msg.after, msg.data, msg.stamp) and c.stats["retries"] == 1
    # the primary's ACK of the first round still counts; the backup's answer completes it
    call.on_reply("tcp://s0r1", _ack(again.req_id, 9, 1, False), RETRY_AFTER_NS + 1, topo)
    assert call.done and call.result() == RecordId(9, 0) and call.state is InsertState.DONE


def _error(req: int, code: str) -> wire.Error:
    return wire.Error(req_id=req, code=code, message=code)


def test_a_refusal_counts_only_in_reply_to_the_latest_resend() -> None:
    """Formerly system seed 2028715: a primary refused a record (its disk was full), lost
    power and came back on the same address, which parked the client's resend and decided
    it later; the backup's NO_GUESS to that resend, taken with the refusal the previous
    incarnation gave, moved the record to another shard (stored twice). Refusals and
    "no copy" answers are one process's promises: they count only in reply to the
    latest round, each resend being one under a new request id."""
    c, topo = _client(Policy.random()), _topology([0, 1])
    call = InsertCall(c, b"data", 0, None, 30 * S)
    (_, first), = call.start(0, topo)
    assert isinstance(first, wire.Insert) and call.wake_at is not None
    primary, backup = call.targets
    assert call.on_reply(primary, _error(first.req_id, wire.E_DISK_FULL), 1, topo) == []
    (_, second), = call.on_timer(call.wake_at, topo)  # the backup's answer is lost; the primary restarts
    assert isinstance(second, wire.Insert) and second.req_id != first.req_id
    # the new incarnation parks the resend (no answer yet); the backup holds no copy
    assert call.on_reply(backup, _error(second.req_id, wire.E_NO_GUESS), 2, topo) == [] and not call.done
    # a late copy of the first round's refusal, or of the backup's first answer, does not count either
    assert call.on_reply(primary, _error(first.req_id, wire.E_DISK_FULL), 3, topo) == []
    assert call.on_reply(backup, _error(first.req_id, wire.E_NO_GUESS), 3, topo) == []
    assert call.state is InsertState.SENT and c.stats["redirects"] == 0, "moved on another process's word"
    # the restarted primary decides it: the backup's ACK completes it on this shard
    call.on_reply(primary, _ack(second.req_id, 44, 0, True), 4, topo)
    call.on_reply(backup, _ack(second.req_id, 44, 1, True), 5, topo)
    assert call.done and call.result() == RecordId(44, call.shard)


def test_a_refusal_and_no_copy_in_one_round_move_the_record() -> None:
    c, topo = _client(Policy.random()), _topology([0, 1])
    call = InsertCall(c, b"data", 0, None, 30 * S)
    (addrs, first), = call.start(0, topo)
    assert isinstance(first, wire.Insert) and call.wake_at is not None
    primary, backup = call.targets
    call.on_reply(primary, _error(first.req_id, wire.E_NOT_MEMBER), 1, topo)
    (_, second), = call.on_timer(call.wake_at, topo)
    assert isinstance(second, wire.Insert)
    call.on_reply(primary, _error(second.req_id, wire.E_NOT_MEMBER), 2, topo)
    (moved_to, moved), = call.on_reply(backup, _error(second.req_id, wire.E_NO_GUESS), 3, topo)
    assert isinstance(moved, wire.Insert) and moved.seq == first.seq and moved_to != addrs
    assert c.stats["redirects"] == 1


def test_a_pinned_insert_waits_for_its_shard_and_fails_at_the_deadline() -> None:
    c, topo = _client(Policy.fixed(3)), _topology([0])
    topo.replica_counts = {0: 2, 3: 2}  # shard 3 exists, but is not live now
    call = InsertCall(c, b"data", 0, None, 2 * S)
    assert call.start(0, topo) == [] and call.state is InsertState.WAITING_FOR_SHARD and call.wake_at == 2 * S
    call.on_timer(2 * S, topo)
    assert call.done and isinstance(call.error, NoShardAvailableError)


def _refused(call: InsertCall, msg: wire.Insert, code: str, topo: TopologyView, now: int,
             shard: int = 0) -> list[Any]:
    """The primary refuses ``msg`` with ``code`` and the backup holds no copy: what the
    call sends then."""
    call.on_reply(f"tcp://s{shard}r0", wire.Error(req_id=msg.req_id, code=code, message=f"{code} here"), now, topo)
    return list(call.on_reply(f"tcp://s{shard}r1", wire.Error(req_id=msg.req_id, code=wire.E_NO_GUESS, message="no"),
                              now, topo))


@pytest.mark.parametrize("policy", [Policy.fixed(0), Policy.random()])
def test_an_insert_whose_epoch_did_not_come_in_time_is_tried_again_under_a_new_id(policy: Policy) -> None:
    # The primary parked it for an epoch that did not come (the membership service
    # stalled) and refused it for good; the backup holds no copy. The call's deadline
    # is far: after a pause the record goes again, under a new id, and is placed.
    c, topo = _client(policy), _topology([0])
    call = InsertCall(c, b"data", 0, None, 30 * S)
    (_, first), = call.start(0, topo)
    assert isinstance(first, wire.Insert)
    assert _refused(call, first, wire.E_TIMEOUT, topo, 2 * S) == []
    assert not call.done and call.state is InsertState.WAITING_FOR_SHARD
    assert call.wake_at == 2 * S + RETRY_AFTER_NS
    (addrs, again), = call.on_timer(call.wake_at, topo)
    assert isinstance(again, wire.Insert) and addrs == ("tcp://s0r0", "tcp://s0r1")
    assert again.seq != first.seq and again.client_id == first.client_id and again.data == b"data"
    call.on_reply("tcp://s0r0", _ack(again.req_id, 9, 0, True), 3 * S, topo)
    call.on_reply("tcp://s0r1", _ack(again.req_id, 9, 1, False), 3 * S, topo)
    assert call.done and call.result() == RecordId(9, 0)


def test_an_insert_that_keeps_waiting_in_vain_ends_at_its_deadline_with_the_refusal() -> None:
    # Each primary parks it 2 s and refuses it: the other shard is tried under the same
    # id, then both again under a new one after a pause, until the deadline passes.
    c, topo = _client(Policy.random()), _topology([0, 1])
    call = InsertCall(c, b"data", 0, None, 8 * S + RETRY_AFTER_NS * 3 // 2)
    sends: list[Any] = list(call.start(0, topo))
    now, tried = 0, []
    while not call.done:
        if not sends:
            assert call.wake_at is not None
            now = call.wake_at
            sends = list(call.on_timer(now, topo))
            continue
        (addrs, msg), = sends
        assert isinstance(msg, wire.Insert)
        tried.append((addrs[0], msg.seq))
        now += 2 * S
        assert now < call.deadline_ns
        sends = _refused(call, msg, wire.E_TIMEOUT, topo, now, shard=int(addrs[0][len("tcp://s")]))
    assert now == call.deadline_ns
    assert isinstance(call.error, ZiplogTimeoutError) and "TIMEOUT here" in str(call.error)
    assert len(tried) == 4
    assert {a for a, _ in tried[:2]} == {a for a, _ in tried[2:]} == {"tcp://s0r0", "tcp://s1r0"}
    assert tried[0][1] == tried[1][1] != tried[2][1] == tried[3][1]


def test_an_insert_while_no_shard_is_live_waits_for_one_and_is_placed() -> None:
    """A restart of a process serving a replica of every shard (or a view that has not
    seen the registrations yet): nothing is live for a moment. The insert waits for
    ZooKeeper to show a shard, within its deadline, and goes there."""
    c, topo = _client(Policy.random()), _topology([0, 1])
    topo.replicas = {0: {0: "tcp://s0r0"}, 1: {1: "tcp://s1r1"}}  # one replica of each is restarting
    call = InsertCall(c, b"data", 0, None, 30 * S)
    assert call.start(0, topo) == [] and call.state is InsertState.WAITING_FOR_SHARD and call.wake_at == 30 * S
    back = _topology([0, 1])
    (addrs, msg), = call.on_topology(S, back)
    assert isinstance(msg, wire.Insert) and isinstance(addrs, tuple) and addrs[0] in ("tcp://s0r0", "tcp://s1r0")
    shard = int(addrs[0][len("tcp://s")])
    call.on_reply(f"tcp://s{shard}r0", _ack(msg.req_id, 9, 0, True), 2 * S, back)
    call.on_reply(f"tcp://s{shard}r1", _ack(msg.req_id, 9, 1, False), 2 * S, back)
    assert call.done and call.result() == RecordId(9, shard)


def test_an_insert_no_shard_takes_ends_at_its_deadline() -> None:
    c, topo = _client(Policy.random()), _topology([0])
    topo.replicas = {0: {1: "tcp://s0r1"}}
    call = InsertCall(c, b"data", 0, None, 2 * S)
    assert call.start(0, topo) == [] and call.state is InsertState.WAITING_FOR_SHARD
    call.on_timer(2 * S, topo)
    assert call.done and isinstance(call.error, NoShardAvailableError)


def test_an_insert_every_live_shard_refused_for_now_goes_again_under_a_new_id() -> None:
    """Both shards refuse it (a primary restarting: NOT_READY) and hold no copy: after a
    retry interval every shard is tried again, under a new id, and it is placed."""
    c, topo = _client(Policy.random()), _topology([0, 1])
    call = InsertCall(c, b"data", 0, None, 30 * S)
    (addrs, first), = call.start(0, topo)
    assert isinstance(first, wire.Insert) and isinstance(addrs, tuple)
    shard = int(str(addrs[0])[len("tcp://s")])
    (addrs2, second), = _refused(call, first, wire.E_NOT_READY, topo, S, shard=shard)
    assert isinstance(second, wire.Insert) and second.seq == first.seq and isinstance(addrs2, tuple)
    other = int(addrs2[0][len("tcp://s")])
    assert other != shard
    assert _refused(call, second, wire.E_NOT_READY, topo, S, shard=other) == []
    assert call.state is InsertState.WAITING_FOR_SHARD and call.wake_at == S + RETRY_AFTER_NS
    (_, third), = call.on_timer(call.wake_at, topo)
    assert isinstance(third, wire.Insert) and third.seq != first.seq


def test_a_full_primary_still_ends_an_insert_at_once() -> None:
    c, topo = _client(Policy.fixed(0)), _topology([0])
    call = InsertCall(c, b"data", 0, None, 30 * S)
    (_, msg), = call.start(0, topo)
    assert isinstance(msg, wire.Insert)
    _refused(call, msg, wire.E_OVERLOADED, topo, S)
    assert call.done and call.error is not None and "OVERLOADED here" in str(call.error)


@pytest.mark.parametrize("replicas,final,gsn", [(1, False, 300), (2, False, 300), (2, True, 300), (1, False, 500)])
def test_a_duplicate_placed_at_or_below_the_rid_fails_the_call_typed(replicas: int, final: bool, gsn: int) -> None:
    """A Spark task run again under the same identity, on a shard of one replica that
    lost part of the first run: the row before this one was placed anew (gsn 500), and
    the replica answers this row's (client id, seq) with the gsn the first run got (300,
    or the rid itself). A remote answer never trips an assertion: the call fails with a
    typed error that names the record where it is."""
    c, topo = _client(Policy.fixed(0)), _topology([0], replicas)
    call = InsertCall(c, b"data", 500, None, 30 * S)
    (_, msg), = call.start(0, topo)
    assert isinstance(msg, wire.Insert) and msg.after == 500
    for r, addr in enumerate(call.targets):
        call.on_reply(addr, wire.Ack(req_id=msg.req_id, gsn=gsn, replica=r, stable=0, decided=True, final=final), 1,
                      topo)
        if final:
            break  # a recovery's final answer settles the insert alone
    assert call.done and call.state is InsertState.DONE and call.wake_at is None
    error = call.error
    assert isinstance(error, ziplog.ReusedIdentityError) and isinstance(error, ZiplogError), repr(error)
    assert (error.client_id, error.seq, error.rid, error.after_gsn) == (c.client_id, msg.seq, RecordId(gsn, 0), 500)
    assert (f"(client id {c.client_id}, seq {msg.seq}) is already in the log at gsn {gsn} (shard 0), which is not "
            "above the requested rid 500") in str(error) and "reused identity" in str(error)
    with pytest.raises(ziplog.ReusedIdentityError):
        call.result()
    again = pickle.loads(pickle.dumps(error))  # it crosses process boundaries whole
    assert type(again) is type(error) and str(again) == str(error) and again.rid == error.rid
    assert c.stats["fast_path"] == c.stats["slow_path"] == 0  # no insert of this call succeeded


def test_an_insert_answered_with_gsn_zero_fails_the_call() -> None:
    c, topo = _client(Policy.fixed(0)), _topology([0], 1)
    call = InsertCall(c, b"data", 0, None, 30 * S)
    (_, msg), = call.start(0, topo)
    assert isinstance(msg, wire.Insert)
    call.on_reply(call.targets[0], _ack(msg.req_id, 0, 0, True), 1, topo)
    assert call.done and isinstance(call.error, ZiplogError) and "names no record" in str(call.error)


def _status_ok(req: int, shard: int, replica: int) -> wire.StatusOk:
    return wire.StatusOk(req_id=req, status={"shard": shard, "replica": replica, "frontier": 7})


def test_status_lists_every_replica_the_topology_names_answered_or_not() -> None:
    c, topo = _client(Policy.random()), _topology([0, 1])
    del topo.replicas[1][1]  # shard 1's backup is not registered (restarting)
    call = StatusCall(c, 10 * S, wait_ns=S)
    (addrs, msg), = call.start(0, topo)
    assert isinstance(addrs, tuple)
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


def test_a_status_reply_naming_no_stable_point_counts_as_zero_for_a_recent_subscription() -> None:
    """A subscription from RID_RECENT starts just past the lowest stable point the
    replicas report; a STATUS reply without one (another build, a malformed reply) used
    to stop the positioning on a KeyError: it counts as 0 (never above what is stable)."""
    from ziplog.client.driver import _stable_of

    assert _stable_of({"stable": 7}) == 7
    assert _stable_of({}) == 0
    assert _stable_of({"stable": "7"}) == 0
    assert _stable_of({"stable": -1}) == 0
    assert _stable_of(None) == 0
