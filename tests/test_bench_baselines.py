"""The benchmark's NOPaxos-style and Scalog-style baselines: Scalog's cut arithmetic
(pure), and both systems end to end with a blocking and a pipelining client at once;
the plain-TCP floor: its echo's framing, and its clients against real echo processes."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import threading
import time
from collections.abc import Callable, Iterator

import msgpack
import pytest
import zmq

from bench.baselines import OneShotTimer
from bench.baselines.scalog_cuts import (
    Cut,
    CutError,
    CutLog,
    SegmentOrder,
    check_advance,
    combine,
    flatten,
    interleave,
    span_of,
    total,
    unflatten,
    zero_cut,
)
from bench.systems import ClientSpec, System, make
from ziplog.tools import procs

# -- scalog_cuts -----------------------------------------------------------------------------


def test_combine_is_the_per_segment_minimum_over_the_shard() -> None:
    # The dissertation's example (3.3.1): v1 = <3, 3>, v2 = <2, 4> -> <2, 3>.
    assert combine([[[3, 3], [2, 4]]]) == ((2, 3),)
    # Two shards of different sizes: shards do not mix.
    local = [[[5, 1, 7], [4, 2, 9], [6, 0, 8]], [[3, 3], [1, 4]]]
    assert combine(local) == ((4, 0, 7), (1, 3))


def test_combine_rejects_a_vector_of_the_wrong_length() -> None:
    with pytest.raises(CutError):
        combine([[[1, 2], [1]]])


def test_interleave_orders_lower_shard_then_lower_server_first() -> None:
    prev: Cut = ((1, 0), (0, 2, 0))
    new: Cut = ((3, 1), (0, 4, 2))
    spans = [(s.shard, s.server, s.first_index, s.first_gsn, s.count) for s in interleave(prev, new)]
    # 3 records precede the step; then segment (0,0) gets 2, (0,1) 1, (1,1) 2, (1,2) 2.
    assert spans == [(0, 0, 1, 3, 2), (0, 1, 0, 5, 1), (1, 1, 2, 6, 2), (1, 2, 0, 8, 2)]
    assert span_of(prev, new, 1, 0).count == 0
    assert span_of(prev, new, 1, 2).first_gsn == 8


def test_a_cut_may_not_go_back_or_change_shape() -> None:
    with pytest.raises(CutError):
        check_advance(((2, 1),), ((1, 3),))
    with pytest.raises(CutError):
        check_advance(((2, 1),), ((2, 1), (0,)))
    assert not check_advance(((2, 1),), ((2, 1),))


def test_segment_order_refuses_a_skipped_cut() -> None:
    order = SegmentOrder((2,), 0, 1)
    order.on_cut(1, ((1, 1),))
    with pytest.raises(CutError):
        order.on_cut(3, ((2, 2),))


def _random_cut_sequence(rng: random.Random, shape: tuple[int, ...], steps: int) -> list[Cut]:
    """Local cuts of every server evolving at random (own appends, FIFO replication
    that lags), and the global cut the ordering layer derives after each step."""
    held = [[[0] * n for _ in range(n)] for n in shape]  # held[s][i][j]: server i's copy of segment j
    cuts = []
    for _ in range(steps):
        for s, n in enumerate(shape):
            for j in range(n):
                held[s][j][j] += rng.choice([0, 0, 1, 3])  # appends at segment j's own server
                for i in range(n):  # replication catches up by a random prefix
                    if i != j:
                        held[s][i][j] = rng.randint(held[s][i][j], held[s][j][j])
        cuts.append(combine(held))
    return cuts


@pytest.mark.parametrize("shape", [(1,), (2,), (3,), (2, 2), (1, 3, 2), (2, 2, 2, 2)])
def test_gsns_are_dense_unique_and_agree_everywhere(shape: tuple[int, ...]) -> None:
    """Every storage server's incremental view, the whole-sequence CutLog and the
    step-wise rule give each record the same gsn; the gsns are exactly 0..N-1; the
    per-segment order is kept; within a step the lexicographic rule holds."""
    rng = random.Random(hash(shape))
    cuts = _random_cut_sequence(rng, shape, steps=60)
    log = CutLog(shape)
    servers = {(s, i): SegmentOrder(shape, s, i) for s, n in enumerate(shape) for i in range(n)}
    number = 0
    prev = zero_cut(shape)
    by_gsn: dict[int, tuple[int, int, int]] = {}
    for cut in cuts:
        if not check_advance(prev, cut):
            continue  # the ordering layer only broadcasts cuts that advanced
        number += 1
        log.append(cut)
        step = list(interleave(prev, cut))
        for sp in step:
            for k in range(sp.count):
                assert (sp.first_gsn + k) not in by_gsn
                by_gsn[sp.first_gsn + k] = (sp.shard, sp.server, sp.first_index + k)
        keys = [(sp.shard, sp.server) for sp in step]
        assert keys == sorted(keys), "lower shard, then lower server, first"
        for (s, i), order in servers.items():
            got = order.on_cut(number, unflatten(shape, flatten(cut)))
            want = next((sp for sp in step if (sp.shard, sp.server) == (s, i)), None)
            if want is None:
                assert got.count == 0 and got.first_index == prev[s][i]
            else:
                assert got == want
        prev = cut
    n_records = total(prev)
    assert n_records > 0
    assert sorted(by_gsn) == list(range(n_records))
    for gsn, (s, i, k) in by_gsn.items():
        assert log.gsn_of(s, i, k) == gsn
        assert log.record_at(gsn) == (s, i, k)
    for s, n in enumerate(shape):  # a segment's records keep their order
        for i in range(n):
            gsns = [log.gsn_of(s, i, k) for k in range(prev[s][i])]
            assert gsns == sorted(gsns)
    with pytest.raises(KeyError):
        log.gsn_of(0, 0, prev[0][0])


def test_one_shot_timer_fires_once_per_arming() -> None:
    """The ctypes timerfd behind Scalog's report grid: readable after its deadline,
    consumed by ``fired``, re-armable."""
    timer = OneShotTimer()
    poller = zmq.Poller()
    poller.register(timer.fd, zmq.POLLIN)
    try:
        assert not timer.fired()
        for _ in range(2):
            timer.at(time.monotonic_ns() + 200_000)
            assert timer.armed
            assert poller.poll(10_000), "the timer never fired"
            assert timer.fired() and not timer.armed
            assert not timer.fired()
    finally:
        timer.close()


# -- the systems, end to end ---------------------------------------------------------------

RECORDS_SYNC = 100
RECORDS_ASYNC = 100
IN_FLIGHT = 8


@pytest.fixture(params=["nopaxos", "scalog"])
def system(request: pytest.FixtureRequest) -> Iterator[System]:
    # Scalog with two shards, so gsns interleave records of several segments.
    kw = {"shards": 2, "replicas": 2} if request.param == "scalog" else {"replicas": 3}
    with make(request.param, **kw) as s:
        yield s


def _spec(system: System, which: int) -> ClientSpec:
    """Client ``which`` (0 or 1). Scalog: client 0 writes to server 0 of shard 0, client
    1 to server 1 of shard 1, so no two clients share a segment and the gsns they get
    come from different segments and shards."""
    spec = system.client_spec(shard=which)
    if "server" in spec.params:
        spec = ClientSpec(spec.module, {**spec.params, "server": which})
    return spec


def _append_sync(system: System, out: list[int]) -> Callable[[], None]:
    def run() -> None:
        appender = _spec(system, 0).open_sync()
        try:
            for k in range(RECORDS_SYNC):
                out.append(appender.append(b"s%05d" % k + os.urandom(4090)))
        finally:
            appender.close()
    return run


async def _append_async(system: System) -> list[int]:
    """IN_FLIGHT appends outstanding at all times; the positions in issue order."""
    appender = await _spec(system, 1).open_async()
    results: dict[int, int] = {}
    counter = itertools.count()
    try:
        async def worker() -> None:
            while (k := next(counter)) < RECORDS_ASYNC:
                results[k] = await appender.append(b"a%05d" % k + os.urandom(4090))
        await asyncio.gather(*[worker() for _ in range(IN_FLIGHT)])
    finally:
        await appender.close()
    return [results[k] for k in range(RECORDS_ASYNC)]


def test_two_concurrent_clients_get_distinct_dense_positions(system: System) -> None:
    sync_positions: list[int] = []
    errors: list[BaseException] = []
    target = _append_sync(system, sync_positions)

    def guarded() -> None:
        try:
            target()
        except BaseException as e:  # surfaced below, not lost in the thread
            errors.append(e)

    t = threading.Thread(target=guarded)
    t.start()
    async_positions = asyncio.run(_append_async(system))
    t.join(timeout=60)
    assert not t.is_alive(), "the blocking client hung"
    assert not errors, errors
    system.check_alive()  # type: ignore[attr-defined]

    assert len(sync_positions) == RECORDS_SYNC and len(async_positions) == RECORDS_ASYNC
    # Per client, positions follow issue order: the blocking client appends one at a
    # time, and the pipelining one sends in issue order on one FIFO connection to the
    # component that orders (NOPaxos: the sequencer; Scalog: its storage server, whose
    # segment order the gsns keep).
    for positions in (sync_positions, async_positions):
        assert all(a < b for a, b in zip(positions, positions[1:])), positions
    everything = sync_positions + async_positions
    assert len(set(everything)) == len(everything), "a position was given twice"
    # Every acknowledged append of this run is all the log holds: the positions are
    # exactly 0..N-1 (NOPaxos: consecutive sequence numbers; Scalog: gsns are dense
    # over the ordered records, and nothing else was appended).
    assert sorted(everything) == list(range(len(everything)))
    assert system.describe()["durability"]  # while running (Scalog: asks its servers for timings)
    _check_record_files(system, len(everything))


def _check_record_files(system: System, appended: int) -> None:
    """Stop the servers (SIGTERM: each flushes its buffered records) and read their
    record files: each is a msgpack stream of (header, client frame) pairs."""
    procs.stop_many([p for p, _ in system.procs.values()])  # type: ignore[attr-defined]
    files = sorted(system.dir.glob("*.log"))  # type: ignore[attr-defined]
    headers = [_headers(f.read_bytes()) for f in files]
    if system.name == "NOPaxos-style":
        # Every replica holds a prefix of the sequence, in order; the leader and at least
        # one more (a quorum) hold all of it. The third may still have been receiving
        # the last records when it was stopped: no append waited for it.
        assert [f.name for f in files] == ["replica0.log", "replica1.log", "replica2.log"]
        for hs in headers:
            assert [h[0] for h in hs] == list(range(len(hs)))
        assert len(headers[0]) == appended
        assert sum(len(hs) == appended for hs in headers) >= 2
    else:
        # Every server holds each segment of its shard as a prefix, in segment order, and
        # both copies of every record: a record is acknowledged only once a cut covers
        # it, i.e. once every server of its shard reported holding it.
        assert len(files) == 4
        for hs in headers:
            by_origin: dict[int, list[int]] = {}
            for _, origin, index in hs:
                by_origin.setdefault(origin, []).append(index)
            for indexes in by_origin.values():
                assert indexes == list(range(len(indexes)))
        assert sum(len(hs) for hs in headers) == 2 * appended  # f+1 = 2 copies of each


def _headers(data: bytes) -> list[list[int]]:
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    items = list(unpacker)
    assert len(items) % 2 == 0
    return items[0::2]


# -- the plain-TCP floor ---------------------------------------------------------------------


def _frames(*payloads: bytes) -> bytes:
    return b"".join(len(p).to_bytes(4, "big") + p for p in payloads)


def test_complete_frames_stops_before_a_partial_frame() -> None:
    from bench.echo_server import complete_frames

    two = _frames(b"abc", b"")
    assert complete_frames(two) == len(two)
    assert complete_frames(two + b"\x00\x00") == len(two)  # a partial length
    assert complete_frames(two + _frames(b"xyz")[:-1]) == len(two)  # a partial body
    assert complete_frames(b"") == 0


class _Transport:
    def __init__(self) -> None:
        self.out = bytearray()

    def get_extra_info(self, name: str) -> None:
        return None

    def write(self, data: bytes) -> None:
        self.out += data


def test_frame_echo_sends_back_whole_frames_however_the_stream_is_cut() -> None:
    from bench.echo_server import FrameEcho

    stream = _frames(b"a" * 4096, b"b", b"c" * 100, b"")
    rng = random.Random(7)
    for _ in range(50):
        echo, transport = FrameEcho(), _Transport()
        echo.connection_made(transport)
        cuts = sorted(rng.sample(range(1, len(stream)), 5))
        ends = {0}
        for a, b in zip([0, *cuts], [*cuts, len(stream)]):
            echo.data_received(stream[a:b])
            assert stream.startswith(bytes(transport.out))
            ends.add(len(transport.out))
        assert bytes(transport.out) == stream
        assert ends <= {0, 4100, 4105, 4209, 4213}  # only ever whole frames went back


def test_floor_tcp_blocking_and_asyncio_clients_get_every_reply() -> None:
    with make("floor-tcp") as floor:
        assert floor.describe()["delays"] == 2 and len(floor.server_pids()) == 2  # type: ignore[attr-defined]
        appender = floor.client_spec().open_sync()
        try:
            assert [appender.append(os.urandom(4096)) for _ in range(50)] == list(range(1, 51))
            assert appender.append(b"") == 51  # an empty record is a frame too
            assert appender.append(os.urandom(200_000)) == 52  # more than one read, and than the buffer
        finally:
            appender.close()

        async def pipelined() -> list[int]:
            a = await floor.client_spec().open_async()
            try:
                return list(await asyncio.gather(*(a.append(os.urandom(4096)) for _ in range(200))))
            finally:
                await a.close()

        assert sorted(asyncio.run(pipelined())) == list(range(1, 201))


def test_floor_tcp_fails_instead_of_hanging_when_an_echo_process_dies() -> None:
    with make("floor-tcp") as floor:
        appender = floor.client_spec().open_sync()
        try:
            appender.append(b"x" * 4096)
            floor.procs[1].kill()  # type: ignore[attr-defined]
            floor.procs[1].wait()  # type: ignore[attr-defined]
            with pytest.raises(OSError):
                for _ in range(3):  # the first send may still be taken by the kernel
                    appender.append(b"x" * 4096)
        finally:
            appender.close()


def test_floor_tcp_without_uvloop_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from bench.systems import Unavailable

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else real(name, *a))
    system = make("floor-tcp")
    with pytest.raises(Unavailable, match="uvloop"):
        with system:
            pass
    assert system.procs == []  # type: ignore[attr-defined]


def test_floor_zmtp_blocking_and_asyncio_clients_get_every_reply() -> None:
    """The natively served ZeroMQ floor: ziplog's ZMTP on both ends, every reply back."""
    with make("floor-zmtp") as floor:
        assert floor.describe()["delays"] == 2 and len(floor.server_pids()) == 2  # type: ignore[attr-defined]
        appender = floor.client_spec().open_sync()
        try:
            assert [appender.append(os.urandom(4096)) for _ in range(50)] == list(range(1, 51))
            assert appender.append(os.urandom(200_000)) == 51
        finally:
            appender.close()

        async def pipelined() -> list[int]:
            a = await floor.client_spec().open_async()
            try:
                return list(await asyncio.gather(*(a.append(os.urandom(4096)) for _ in range(200))))
            finally:
                await a.close()

        assert sorted(asyncio.run(pipelined())) == list(range(1, 201))
