"""A subscription moves off a replica that fell silent (the subscription core, no
network): a shard that sends nothing for SUB_SILENCE_NS while it has credit to send
with is read from its next replica, even while the other shards' records pile up
behind it in the merge (they wait for its progress); a shard whose quiet its spent
credit explains is left where it is, or every move would grant it credit anew and the
buffer would grow without bound."""

from __future__ import annotations

from ziplog.cores.client.subscription import SUB_CREDIT_BYTES, SUB_RECONNECT_NS, SUB_SILENCE_NS, SubscriptionCore
from ziplog.cores.effects import Close, Open
from ziplog.protocol import frames as wire
from ziplog.protocol.topology import TopologyView

ADDRS = {0: ("tcp://a0", "tcp://a1"), 1: ("tcp://b0", "tcp://b1")}
RECORD = 64 << 10


def _topology() -> TopologyView:
    topo = TopologyView()
    topo.replicas = {s: dict(enumerate(addrs)) for s, addrs in ADDRS.items()}
    topo.replica_counts = {s: len(addrs) for s, addrs in ADDRS.items()}
    topo.changed()
    return topo


def _opens(effects: list) -> dict[int, str]:
    return {stream.shard: item.addr for stream, item in effects if type(item) is Open}


def _blocked_behind_shard_0(held_by_shard_1: int) -> tuple[SubscriptionCore, TopologyView, int]:
    """Both shards read from their backups; shard 0 showed progress up to gsn 2 and then
    fell silent, shard 1 sent ``held_by_shard_1`` bytes of records above it, which wait
    in the merge for shard 0."""
    topo = _topology()
    core = SubscriptionCore(1, 1, explicit=False)
    now = 10**12
    assert _opens(core.start(now, topo)) == {0: "tcp://a1", 1: "tcp://b1"}
    epochs: list[tuple[int, int, tuple[int, ...]]] = [(0, 0, (0, 1))]
    core.on_frame(0, wire.SubBatch(sub_id=1, records=[(1, b"x")], epochs=epochs, progress=2), topo)
    records = [(10 + 2 * i, bytes(RECORD)) for i in range(held_by_shard_1 // RECORD)]
    core.on_frame(1, wire.SubBatch(sub_id=1, records=records, epochs=epochs, progress=records[-1][0]), topo)
    assert core.pop()[0] is not None and core.pop()[0] is None, "shard 1's records wait for shard 0"
    return core, topo, now


def _look_for(core: SubscriptionCore, topo: TopologyView, now: int, ns: int) -> tuple[list, int]:
    """The reader keeps reading (its timer turns every SUB_RECONNECT_NS) for ``ns``."""
    effects: list = []
    end = now + ns
    while now < end:
        now += SUB_RECONNECT_NS
        effects += core.on_timer(now, topo)
    return effects, now


def test_a_silent_shard_is_left_for_its_next_replica_while_the_others_records_wait_for_it() -> None:
    core, topo, now = _blocked_behind_shard_0(SUB_CREDIT_BYTES * 3 // 4)  # most of shard 1's credit
    assert core.merge is not None and core.merge.buffered_bytes > SUB_CREDIT_BYTES // 2
    effects, now = _look_for(core, topo, now, 2 * SUB_SILENCE_NS)
    assert _opens(effects) == {0: "tcp://a0"}, "shard 0 moved; shard 1's quiet is its spent credit"
    assert any(stream.shard == 0 and type(item) is Close for stream, item in effects)
    resub = [item for stream, item in effects if stream.shard == 0 and type(item) is wire.Subscribe]
    assert [s.from_gsn for s in resub] == [3], "from just past what shard 0 showed"


def test_nothing_moves_while_the_reader_holds_the_records_back() -> None:
    """The reader is behind: records are ready and it does not take them, so every
    server waits for credit and no quiet connection says anything."""
    topo = _topology()
    core = SubscriptionCore(1, 1, explicit=False)
    now = 10**12
    core.start(now, topo)
    epochs: list[tuple[int, int, tuple[int, ...]]] = [(0, 0, (0, 1))]
    n = SUB_CREDIT_BYTES * 3 // 4 // RECORD
    core.on_frame(0, wire.SubBatch(sub_id=1, records=[(1 + 2 * i, bytes(RECORD)) for i in range(n)], epochs=epochs,
                                   progress=2 * n + 2), topo)
    core.on_frame(1, wire.SubBatch(sub_id=1, records=[(2 + 2 * i, bytes(RECORD)) for i in range(n)], epochs=epochs,
                                   progress=2 * n + 2), topo)
    effects, now = _look_for(core, topo, now, 3 * SUB_SILENCE_NS)
    assert _opens(effects) == {}


def test_a_silent_replica_that_is_its_shards_only_one_is_subscribed_again_on_a_new_connection() -> None:
    """One replica per shard, restarted on a fixed port: its address does not change, so
    nothing in ZooKeeper says the subscription moved, and the new process knows nothing
    of it. Silence is what tells: a new connection to the same address subscribes again
    from just past what the shard sent."""
    topo = TopologyView()
    topo.replicas = {0: {0: "tcp://only"}}
    topo.replica_counts = {0: 1}
    topo.changed()
    core = SubscriptionCore(1, 1, explicit=False)
    now = 10**12
    assert _opens(core.start(now, topo)) == {0: "tcp://only"}
    core.on_frame(0, wire.SubBatch(sub_id=1, records=[(1, b"x")], epochs=[(0, 0, (0,))], progress=2), topo)
    assert core.pop()[0] is not None
    effects, now = _look_for(core, topo, now, 2 * SUB_SILENCE_NS)
    assert _opens(effects) == {0: "tcp://only"}
    assert [type(item) for _, item in effects if type(item) in (Close, Open, wire.Subscribe)][:3] == [
        Close, Open, wire.Subscribe]
    resub = [item for _, item in effects if type(item) is wire.Subscribe]
    assert resub and resub[0].from_gsn == 3
    # and it stays subscribed there: a batch from the new connection is taken
    core.on_frame(0, wire.SubBatch(sub_id=1, records=[(3, b"y")], epochs=[], progress=4), topo)
    assert core.pop()[0] == (3, 0, b"y")
