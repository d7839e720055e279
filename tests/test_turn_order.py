"""Inserts that reach the replicas in one turn are taken in the order of the clients'
send stamps, and answered in one frame per client (real cores, the wire codec between
them). Two concurrent inserts read in
opposite orders by the primary and the backup are two slow-path inserts when each
replica takes them as they came; taken in stamp order, both replicas place them alike
and both take the fast path. Without stamps (0: a client that sends none) arrival order
decides, as before."""

from __future__ import annotations

import random

from tests.harness import ShardHarness
from ziplog.cores.client.calls import InsertCall
from ziplog.cores.client.state import ClientState
from ziplog.cores.client.waits import InsertWait
from ziplog.cores.replica.core import coalesce_acks
from ziplog.protocol import frames as wire
from ziplog.protocol.gsna import epoch_of
from ziplog.protocol.topology import TopologyView
from ziplog.protocol.types import Policy

S = 1_000_000_000


def _serving() -> ShardHarness:
    h = ShardHarness()
    h.B.connect_primary(0)
    h.pump()
    h.next_epoch()
    return h


def _two_clients_crossed(stamps: tuple[int, int]) -> tuple[ShardHarness, list[InsertWait]]:
    """Client 7's insert and client 8's, stamped ``stamps``: the primary reads 7's first,
    the backup 8's, each in one turn."""
    h = _serving()
    first = wire.Insert(req_id=1, client_id=7, seq=1, after=0, data=b"seven", stamp=stamps[0])
    second = wire.Insert(req_id=2, client_id=8, seq=1, after=0, data=b"eight", stamp=stamps[1])
    h.turn(h.P, [first, second])
    h.turn(h.B, [second, first])
    h.pump()
    waits = [InsertWait(1, 2), InsertWait(2, 2)]
    for w in waits:
        assert any(w.feed(i, m) for i, m in h.replies(w.req_id)), "settled"
    return h, waits


def test_crossed_inserts_take_the_fast_path_in_stamp_order() -> None:
    h, waits = _two_clients_crossed((100, 200))
    assert all(w.fast for w in waits), "both replicas took the two inserts in stamp order"
    assert waits[0].decided is not None and waits[1].decided is not None
    assert waits[0].decided < waits[1].decided, "the earlier stamp has the lower gsn"
    assert h.B.stats["confirmed_guesses"] == 2 and h.B.stats["reacks"] == 0


def test_a_later_stamp_read_first_is_still_placed_second() -> None:
    h, waits = _two_clients_crossed((300, 200))
    assert all(w.fast for w in waits)
    assert waits[1].decided is not None and waits[0].decided is not None
    assert waits[1].decided < waits[0].decided


def test_without_stamps_arrival_order_decides_and_crossed_inserts_are_slow() -> None:
    """What stamps fix (the test above would pass vacuously if crossing did no harm)."""
    h, waits = _two_clients_crossed((0, 0))
    assert not any(w.fast for w in waits), "the backup guessed each record the other's slot"
    assert h.B.stats["wrong_guesses_ahead"] + h.B.stats["guesses_displaced"] >= 2
    assert [w.decided for w in waits] == sorted(w.decided for w in waits if w.decided is not None), \
        "the primary placed them as they came"


def test_a_flood_of_inserts_in_one_turn_is_taken_in_bounded_batches() -> None:
    """The inserts a core holds for one turn are bounded: past ``max_turn_inserts`` the
    held batch is taken at once, in stamp order, and the rest wait for the turn's end."""
    h = ShardHarness({"max_turn_inserts": 4})
    h.B.connect_primary(0)
    h.pump()
    h.next_epoch()
    P = h.P
    msgs = [wire.Insert(req_id=i, client_id=i, seq=1, after=0, data=b"r", stamp=10 - i) for i in range(1, 7)]
    for m in msgs:
        P.on_request(b"client", wire.decode_request(wire.encode(m)), h.now)
        assert len(P.held) < 4
    (batch,) = [m for _, m in P.ready().messages if isinstance(m, wire.Acks)]
    assert [a.req_id for a in batch.acks] == [4, 3, 2, 1], "the first four, by stamp, as the fourth arrived"
    assert [m.req_id if isinstance(m, wire.Insert) else m for _, m in P.take_ordered()] == [6, 5]


def test_a_client_stamps_each_insert_with_its_send_time_on_the_wall_clock() -> None:
    """The stamp is the call's monotonic ``now`` moved onto the wall clock (clients on
    other hosts share that one, to within their clock sync); a resend keeps it."""
    state = ClientState(1, Policy.fixed(0), random.Random(1), 10 * S, wall_offset_ns=1_700_000_000 * S)
    topo = TopologyView()
    topo.replicas = {0: {0: "tcp://p:1", 1: "tcp://b:1"}}
    topo.replica_counts = {0: 2}
    topo.history = [[0, [0]]]
    topo.changed()
    call = InsertCall(state, b"r", 0, None, 5 * S)
    (_, msg), = call.start(2 * S, topo)
    assert isinstance(msg, wire.Insert) and msg.stamp == 1_700_000_002 * S
    resent = call.on_timer(2 * S + state.retry_after_ns, topo)
    assert resent and all(m.stamp == msg.stamp for _, m in resent)


def test_a_turns_acks_to_one_client_leave_in_one_frame() -> None:
    """Three inserts of one client read in one turn: one ACKS frame from each replica,
    each holding the three ACKs in the order they were taken; another client's single
    ACK stays an ACK frame. The client sees the same answers either way."""
    h = _serving()
    mine = [wire.Insert(req_id=i, client_id=7, seq=i, after=0, data=b"m", stamp=10 * i) for i in (1, 2, 3)]
    other = wire.Insert(req_id=9, client_id=8, seq=1, after=0, data=b"o", stamp=15)
    for core in (h.P, h.B):
        for m in [*mine, other]:
            route = b"client" if m.client_id == 7 else b"other"
            core.on_request(route, wire.decode_request(wire.encode(m)), h.now)
        core.end_input(h.now)
        sent = [(dest, wire.decode_reply(wire.encode(msg))) for dest, msg in core.ready().messages
                if dest in (b"client", b"other")]
        assert [type(m) for _, m in sent] == [wire.Acks, wire.Ack], sent
        (_, batch), (to_other, single) = sent
        assert isinstance(batch, wire.Acks) and [a.req_id for a in batch.acks] == [1, 2, 3]
        assert to_other == b"other" and isinstance(single, wire.Ack) and single.req_id == 9
    h.pump()


def test_coalescing_leaves_a_batch_with_one_ack_per_route_as_it_is() -> None:
    msgs = [(b"a", wire.Ack(req_id=1, gsn=5, replica=0, stable=0, decided=True, final=False)),
            (b"b", wire.Ack(req_id=2, gsn=6, replica=0, stable=0, decided=True, final=False)),
            (b"a", wire.Error(req_id=3, code=wire.E_TOO_LARGE, message="no"))]
    assert coalesce_acks(list(msgs)) == msgs


def test_an_epoch_broadcast_is_taken_in_stamp_order_with_the_turns_inserts() -> None:
    """The primary reads the next epoch's broadcast before two inserts, the backup after
    them (each in one turn); stamped between the two inserts, it ends the epoch after the
    first on both replicas: the first is placed in the old epoch, the second in the new,
    and both take the fast path. Taken as read, the replicas would differ on both."""
    h = _serving()
    old = h.epoch
    nxt = h.config(old + 1, (0,))
    h.now += 1_000  # the broadcast arrives now: its stamp (the harness's wall clock is its own)
    a = wire.Insert(req_id=1, client_id=7, seq=1, after=0, data=b"a", stamp=h.now - 100)
    b = wire.Insert(req_id=2, client_id=8, seq=1, after=0, data=b"b", stamp=h.now + 100)
    for core, order in ((h.P, ["epoch", a, b]), (h.B, [a, b, "epoch"])):
        for item in order:
            if item == "epoch":
                core.hold_epoch(nxt, h.now)
            else:
                assert isinstance(item, wire.Insert)
                core.on_request(b"client", wire.decode_request(wire.encode(item)), h.now)
        core.end_input(h.now)
    h.pump()
    waits = [InsertWait(1, 2), InsertWait(2, 2)]
    for w in waits:
        assert any(w.feed(i, m) for i, m in h.replies(w.req_id))
    assert all(w.fast for w in waits)
    assert [epoch_of(w.decided) for w in waits if w.decided is not None] == [old, old + 1]


def _epoch_read_a_turn_late(settings: dict[str, bool]) -> tuple[int, list[InsertWait]]:
    """The membership service sends the next epoch at T; insert ``a`` was sent before T,
    ``b`` after. The primary reads the broadcast at once, in the turn that brings both
    inserts; the backup reads all three half a millisecond later (a process serving
    several replicas may come to the broadcast a turn after its peer does)."""
    h = ShardHarness(settings)
    h.B.connect_primary(0)
    h.pump()
    h.next_epoch()
    old = h.epoch
    nxt = h.config(old + 1, (0,))
    sent = h.now + 1_000
    a = wire.Insert(req_id=1, client_id=7, seq=1, after=0, data=b"a", stamp=sent - 100)
    b = wire.Insert(req_id=2, client_id=8, seq=1, after=0, data=b"b", stamp=sent + 100)
    for core, read_at in ((h.P, sent + 50), (h.B, sent + 500_000)):
        core.hold_epoch(nxt, read_at, sent)
        for ins in (a, b):
            core.on_request(b"client", wire.decode_request(wire.encode(ins)), read_at)
        core.end_input(read_at)
    h.now = sent + 500_000
    h.pump()
    waits = [InsertWait(1, 2), InsertWait(2, 2)]
    for w in waits:
        assert any(w.feed(i, m) for i, m in h.replies(w.req_id)), "settled"
    assert [epoch_of(w.decided) for w in waits if w.decided is not None] == [old, old + 1], \
        "the primary took the epoch between the two inserts"
    return h.B.stats["wrong_guesses_epoch"], waits


def test_an_epoch_read_a_turn_late_is_taken_where_its_sender_stamped_it() -> None:
    """With the sender's stamp both replicas put ``b`` in the new epoch: both inserts
    take the fast path, though the backup read the broadcast after its peer."""
    wrong, waits = _epoch_read_a_turn_late({})
    assert all(w.fast for w in waits) and wrong == 0


def test_an_epoch_taken_where_it_was_read_costs_the_late_reader_a_guess() -> None:
    """What the sender's stamp fixes (the test above would pass vacuously if reading late
    did no harm): taken at its arrival, the backup's broadcast sorts after both inserts
    and it guesses ``b`` in the old epoch, a slow-path insert."""
    wrong, waits = _epoch_read_a_turn_late({"epoch_stamp_sent": False})
    assert waits[0].fast and not waits[1].fast and wrong == 1


def test_two_broadcasts_read_in_one_turn_keep_their_order_whatever_their_stamps() -> None:
    """A new leader whose clock runs behind the old one's: its broadcast carries an
    earlier stamp than the one before it, and is still taken after it."""
    h = _serving()
    old = h.epoch
    first, second = h.config(old + 1, (0,)), h.config(old + 2, (0,))
    h.P.hold_epoch(first, h.now, 5_000)
    h.P.hold_epoch(second, h.now, 4_000)
    assert [item.config.epoch for _, item in h.P.take_ordered()] == [old + 1, old + 2]  # type: ignore[union-attr]
