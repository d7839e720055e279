"""Forward by reference without I/O: a FORWARD names a large record by key, size and
digest, and the backup takes the bytes the client's INSERT brought it. A FORWARD that
outruns the INSERT waits for it (those after it wait behind it); one that waits in
vain (the INSERT was lost, or brought other bytes under the same key) is dropped and
the backup asks for a catch-up, which carries the data: it never stores bytes the
primary did not decide. Small records, and every record with the
setting off (the default), go by value."""

from __future__ import annotations

from typing import Any

from tests.harness import ShardHarness
from ziplog.cores.replica.received import ReceivedData
from ziplog.protocol import frames as wire
from ziplog.protocol.events import RecordEvent, RecordRefEvent, record_digest

BIG = bytes(range(256)) * 16  # 4 KiB


class Harness(ShardHarness):
    def __init__(self, settings: dict[str, Any] | None = None, replicas: int = 2) -> None:
        super().__init__({"forward_by_reference": True, **(settings or {})}, replicas=replicas)
        for r in range(1, replicas):
            self.cores[r].connect_primary(0)  # type: ignore[union-attr]
        self.pump()
        self.next_epoch()

    def forwarded(self) -> list[object]:
        """Every record event the primary forwarded (catch-ups too), in order."""
        return [ev for i, _, m in self.sent if i == 0 and isinstance(m, wire.Forward) for ev in m.body.events
                if isinstance(ev, (RecordEvent, RecordRefEvent))]


def _gsn(h: ShardHarness, seq: int) -> int:
    acks = [m for i, m in h.replies(seq) if i == 0 and isinstance(m, wire.Ack)]
    assert acks, "the primary decided the record"
    return acks[0].gsn


def test_a_large_record_goes_by_reference_and_the_backup_stores_the_clients_bytes() -> None:
    h = Harness(replicas=3)
    h.insert(1, BIG, to=(0, 1, 2))
    h.pump()
    g = _gsn(h, 1)
    evs = h.forwarded()
    assert len(evs) == 2 and evs[0] == evs[1], "one FORWARD to each backup"
    ev = evs[0]
    assert isinstance(ev, RecordRefEvent) and ev.size == len(BIG) and ev.digest == record_digest(BIG)
    fwd = next(m for i, _, m in h.sent if i == 0 and isinstance(m, wire.Forward) and m.body.events
               and isinstance(m.body.events[0], RecordRefEvent))
    assert len(wire.encode(fwd)) < 200, "the FORWARD does not carry the 4 KiB"
    for r in (1, 2):
        core = h.cores[r]
        assert core is not None
        assert core.log.records[g].data == BIG and core.frontier == h.P.frontier
        assert core.stats["reference_misses"] == 0
        assert len(core.role.received) == 0, "the bytes are let go once applied"  # type: ignore[union-attr]
    assert h.P.stable >= g


def test_a_forward_that_outruns_the_insert_waits_for_it_and_those_after_it_wait_in_order() -> None:
    h = Harness()
    h.insert(1, BIG, to=(0,))  # decided and forwarded before the INSERT reaches the backup
    h.pump()
    g1 = _gsn(h, 1)
    assert g1 not in h.B.log.records and len(h.B.role.waiting.waiting) == 1  # type: ignore[union-attr]
    h.insert(2, BIG[::-1], to=(0,))
    h.pump()
    assert len(h.B.role.waiting.waiting) == 2, "the next FORWARD waits behind it"  # type: ignore[union-attr]
    h.insert(1, BIG, to=(1,))  # the INSERT arrives: the first applies, the second waits for its own
    assert g1 in h.B.log.records and len(h.B.role.waiting.waiting) == 1  # type: ignore[union-attr]
    h.insert(2, BIG[::-1], to=(1,))
    h.pump()
    assert h.B.log.records[_gsn(h, 2)].data == BIG[::-1] and h.B.frontier == h.P.frontier
    assert h.B.stats["reference_misses"] == 0 and [type(ev) for ev in h.forwarded()] == [RecordRefEvent] * 2


def test_a_backup_that_never_got_the_insert_catches_up_with_the_data() -> None:
    h = Harness()
    h.insert(1, BIG, to=(0,))  # the INSERT to the backup is lost
    h.pump()
    g = _gsn(h, 1)
    assert h.B.stats["reference_misses"] == 0, "it waits for the INSERT first"
    assert h.B.next_deadline(h.now) == h.now + h.B.s.reference_wait_ns
    h.tick(h.B.s.reference_wait_ns)
    assert h.B.stats["reference_misses"] == 1
    assert h.B.log.records[g].data == BIG and h.B.frontier == h.P.frontier
    kinds = [type(ev) for ev in h.forwarded()]
    assert kinds == [RecordRefEvent, RecordEvent], "the reference, then the catch-up's record with its data"
    # in step again: the next large record goes by reference and applies
    h.insert(2, BIG[::-1])
    h.pump()
    assert h.B.log.records[_gsn(h, 2)].data == BIG[::-1] and h.B.stats["reference_misses"] == 1


def test_other_bytes_under_the_same_key_never_reach_the_backups_log() -> None:
    h = Harness()
    h.insert(1, BIG, to=(0,))
    h.insert(1, BIG[:-1] + b"?", to=(1,))  # a client that sent the backup other bytes
    h.pump()
    h.tick(h.B.s.reference_wait_ns)
    g = _gsn(h, 1)
    assert h.B.stats["reference_misses"] == 1
    assert h.B.log.records[g].data == BIG, "the primary's bytes, by the catch-up"


def test_too_many_forwards_waiting_are_dropped_for_a_catch_up() -> None:
    h = Harness({"max_waiting_forwards": 2})
    for seq in (1, 2, 3):
        h.insert(seq, BIG, to=(0,))
        h.pump()
    assert h.B.stats["reference_misses"] == 1 and not h.B.role.waiting.waiting  # type: ignore[union-attr]
    assert [h.B.log.records[_gsn(h, seq)].data for seq in (1, 2, 3)] == [BIG] * 3
    assert h.B.frontier == h.P.frontier


def test_an_insert_read_in_the_forwards_turn_resolves_it() -> None:
    """The driver reads a turn's frames one by one and takes the inserts only once the
    input is read: a FORWARD read after the INSERT in the same turn finds its bytes."""
    h = Harness()
    h.insert(1, BIG, to=(0,))
    h.P.flush(h.now)
    fwd = next(m for d, m in h.P.ready().messages if isinstance(m, wire.Forward))
    msg = wire.Insert(req_id=1, client_id=7, seq=1, after=0, data=BIG)
    h.B.on_request(b"client", wire.decode_request(wire.encode(msg)), h.now)
    h.B.on_forward(wire.decode_from_primary(wire.encode(fwd)), h.now)  # type: ignore[arg-type]
    h.B.end_input(h.now)
    g = h.P.log.gsns[-1]
    assert h.B.stats["reference_misses"] == 0 and h.B.log.records[g].data == BIG
    assert h.B.frontier == h.P.frontier


def test_small_records_and_the_setting_off_go_by_value() -> None:
    h = Harness()
    h.insert(1, b"small")
    h.pump()
    off = Harness({"forward_by_reference": False})
    off.insert(1, BIG)
    off.pump()
    for hh, data in ((h, b"small"), (off, BIG)):
        (ev,) = hh.forwarded()
        assert isinstance(ev, RecordEvent) and ev.data == data
        assert hh.B.log.records[ev.gsn].data == data
    assert len(off.B.role.received) == 0, "a backup with the setting off keeps no insert data"  # type: ignore[union-attr]


def test_the_received_data_is_bounded_by_bytes_and_by_age() -> None:
    rd = ReceivedData(min_bytes=10, ttl_ns=100, max_bytes=25, interval_ns=1)
    rd.add((1, 1), b"short", 0)
    assert len(rd) == 0, "below min_bytes: it goes by value"
    rd.add((1, 2), b"a" * 10, 0)
    rd.add((1, 3), b"b" * 10, 50)
    rd.add((1, 4), b"c" * 10, 60)  # 30 bytes > 25: the oldest goes
    assert len(rd) == 2 and rd.bytes == 20
    assert rd.resolve([RecordRefEvent(5, 0, 1, 2, 10, record_digest(b"a" * 10))]) is None
    (ev,) = rd.resolve([RecordRefEvent(5, 0, 1, 3, 10, record_digest(b"b" * 10))]) or []
    assert isinstance(ev, RecordEvent) and ev.data == b"b" * 10
    assert rd.resolve([RecordRefEvent(5, 0, 1, 3, 9, record_digest(b"b" * 10))]) is None, "the size must match"
    rd.add((1, 3), b"d" * 12, 70)  # a resend under the key replaces the bytes
    assert rd.bytes == 22
    assert rd.next_prune() == 161
    rd.prune(161)
    assert len(rd) == 1 and rd.bytes == 12
    rd.prune(171 + 1)
    assert len(rd) == 0 and rd.bytes == 0 and rd.next_prune() is None


def test_a_real_cluster_forwarding_by_reference_serves_every_record_from_its_backup() -> None:
    """Real processes, 4 KiB records from concurrent inserts: the lone backup (which
    subscriptions read the shard from) holds every record's bytes, whether its FORWARD
    named them or a catch-up after a miss carried them."""
    import threading

    import ziplog

    with ziplog.local_cluster(shards=1, replicas=2, server_args=["--forward-by-reference"]) as cluster:
        written: dict[int, bytes] = {}
        lock = threading.Lock()

        def writer(w: int) -> None:
            with cluster.client() as c:
                for i in range(25):
                    data = (b"%d/%d:" % (w, i)) * 400
                    rid = c.insert_after(data)
                    with lock:
                        written[rid.gsn] = data

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(written) == 100
        with cluster.client() as c:
            got = {r.rid.gsn: r.data for r in c.subscribe(end=max(written)) if r.rid.gsn in written}
            backup = next(r for rs in c.status().values() for r in rs if r["replica"] == 1)
        assert got == written
        assert backup["records"] >= 100 and backup["frontier"] >= max(written)
        print(f"reference misses at the backup: {backup['reference_misses']}")
