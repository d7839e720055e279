"""Index nodes answer lookups with their entries' records (core level): the feeder sends
each entry's record of at most ``record_max`` bytes with it, in Feeds of at most
FEED_RECORD_BYTES of records; a node keeps them within its bytes, lowest gsns out first,
answers a lookup that asks with its hit's record, refuses a Feed whose records are not
its entries', and forgets them with its index. The whole tier under faults is checked
by ``tests/sim/logbook.py``; real processes by ``tests/test_logbook_tier.py``."""

from __future__ import annotations

from ziplog.logbook.core import frames as f
from ziplog.logbook.core import records as r
from ziplog.logbook.core.feeder import FeederCore
from ziplog.logbook.core.kept import PER_RECORD, KeptRecords
from ziplog.logbook.core.node import NodeCore
from ziplog.protocol.gsna import epoch_base

E = epoch_base(1)


def _entry(gsn: int, data: bytes, tag: int = 5) -> tuple[int, int, bytes]:
    return gsn, 0, r.encode(r.entry(1, data, [tag]))


def _fed(feeder: FeederCore, batch: list[tuple[int, int, bytes]], position: int) -> list[f.Feed]:
    return [frame for _, frame in feeder.on_batch(batch, position, 0) if type(frame) is f.Feed]


def _started_feeder(record_max: int = f.RECORD_IN_ANSWER_MAX, keeps: int = 1 << 20) -> FeederCore:
    feeder = FeederCore([(0, 1)], 0, record_max=record_max)
    feeder.on_nodes({0: "n0"}, 0)
    feeder.on_state(f.NodeState(req=0, node=0, watermark=0, floor=0, size=0, keeps=keeps), 0)
    assert feeder.start() == 0
    return feeder


def _lookup(node: NodeCore, seqnum: int, record: bool = True) -> f.Found:
    (_, ans), = node.on_lookup(b"r", f.Lookup(req=1, how=f.NEXT, book=1, tag=5, seqnum=seqnum, cut=0,
                                              record=record), 0)
    assert type(ans) is f.Found
    return ans


def test_a_node_answers_a_lookup_that_asks_with_its_hits_record() -> None:
    feeder, node = _started_feeder(), NodeCore(0)
    batch = [_entry(E + 1, b"one"), _entry(E + 2, b"two"), (E + 3, 0, b"not logbook's")]
    for feed in _fed(feeder, batch, E + 3):
        node.on_feed(b"feeder", feed, 0)
    assert len(node.kept) == 2 and node.status(0).kept == 2
    ans = _lookup(node, E + 2)
    assert (ans.gsn, ans.record) == (E + 2, batch[1][2])  # the record as the log holds it
    assert _lookup(node, E + 2, record=False).record is None  # not asked: not sent
    assert _lookup(node, E + 4).record is None and not _lookup(node, E + 4).found


def test_big_records_stay_in_the_log_and_a_feed_holds_at_most_its_record_bytes() -> None:
    feeder = _started_feeder(record_max=1000)
    size = len(_entry(0, bytes(580))[2])  # records that fill FEED_RECORD_BYTES, and some more
    n = f.FEED_RECORD_BYTES // size + 10
    batch = [_entry(E + i, bytes(580)) for i in range(1, n + 1)] + [_entry(E + n + 1, bytes(2000))]
    feeds = _fed(feeder, batch, E + n + 1)
    assert len(feeds) == 2
    assert all(sum(len(d) for _, d in feed.records) <= f.FEED_RECORD_BYTES for feed in feeds)
    assert sum(len(feed.entries) for feed in feeds) == n + 1
    assert sum(len(feed.records) for feed in feeds) == n  # not the 2 KiB one
    assert feeds[0].watermark == feeds[1].from_gsn and feeds[1].watermark == E + n + 1
    node = NodeCore(0)
    for feed in feeds:
        (_, fed), = node.on_feed(b"feeder", feed, 0)
        assert type(fed) is f.Fed and fed.accepted
    assert _lookup(node, E + n + 1).record is None and _lookup(node, E + n).record is not None
    assert _started_feeder(record_max=0).on_batch(batch[:3], E + 3, 0)[0][1].records == []  # type: ignore[union-attr]


def test_a_node_that_keeps_no_records_is_sent_none() -> None:
    batch = [_entry(E + 1, b"one"), _entry(E + 2, b"two")]
    node = NodeCore(0, keep_bytes=0)
    assert node.status(0).keeps == 0 and NodeCore(0).status(0).keeps > 0
    feeds = _fed(_started_feeder(keeps=node.status(0).keeps), batch, E + 2)
    assert [len(feed.entries) for feed in feeds] == [2] and feeds[0].records == []


def test_a_node_keeps_its_bytes_and_drops_the_lowest_gsns_first() -> None:
    kept = KeptRecords(max_bytes=3 * (100 + PER_RECORD))
    for gsn in range(1, 6):
        kept.add(gsn, bytes(100))
    assert [kept.get(g) is not None for g in range(1, 6)] == [False, False, True, True, True]
    assert kept.bytes == 3 * (100 + PER_RECORD)
    kept.add(6, bytes(10_000))  # bigger than the whole budget: not kept, nothing evicted
    assert kept.get(6) is None and len(kept) == 3
    assert len(KeptRecords(0)) == 0


def test_a_node_refuses_records_that_are_not_its_feeds_entries() -> None:
    node = NodeCore(0)
    entries: list[f.FedEntry] = [(E + 1, 0, 1, (5,))]
    for records, why in (([(E + 2, b"x")], "records must be of the feed's entries"),
                         ([(E + 1, b"x"), (E + 1, b"y")], "gsns increasing")):
        feed = f.Feed(gen=0, from_gsn=0, watermark=E + 2, history=[(0, 1)], entries=entries, trims=[],
                      records=records)
        (_, ans), = node.on_feed(b"feeder", feed, 0)
        assert type(ans) is f.Failed and ans.code == f.BAD_FEED and why in ans.message
    assert len(node.kept) == 0 and node.watermark == 0


def test_a_node_that_forgets_its_index_forgets_its_records() -> None:
    node = NodeCore(0)
    feed = f.Feed(gen=0, from_gsn=0, watermark=E + 1, history=[(0, 1)], entries=[(E + 1, 0, 1, (5,))], trims=[],
                  records=[(E + 1, b"kept")])
    node.on_feed(b"feeder", feed, 0)
    assert _lookup(node, 0).record == b"kept"
    # a step adding a node from epoch 1, which this node indexed the old way
    grown = f.Feed(gen=0, from_gsn=E + 1, watermark=E + 1, history=[(0, 1), (1, 2)], entries=[], trims=[])
    node.on_feed(b"feeder", grown, 0)
    assert node.resets == 1 and len(node.kept) == 0


def test_an_engine_answers_from_its_kept_records_in_every_mode() -> None:
    from ziplog.logbook.client import EngineState
    from ziplog.logbook.core import session as s
    from ziplog.logbook.core.index import Hit, HitRecord
    for mode in ("local", "tier"):
        for record_bytes in (1 << 20, 0):
            engine = EngineState(1.0, 10, record_bytes=record_bytes)
            start = engine.start_at(E, mode, 100)
            gsn, _, data = _entry(E + 1, b"one")
            assert gsn >= start
            engine.feed(gsn, 0, data)
            engine.on_watermark(gsn)
            if engine.cache is not None:  # a tier answer taught the cache the book's trim point
                engine.cache.learn(1, 5, "next", 0, E, None, 0)
            got = engine.answer(s.Lookup("next", 1, 5, E + 1, E))
            assert got is not None
            assert got[1] == (HitRecord(gsn, 0, data) if record_bytes else Hit(gsn, 0)), (mode, record_bytes)
