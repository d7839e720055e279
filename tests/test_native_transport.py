"""Storage servers serving ZeroMQ natively (``--transport native``, the default: ROUTER
and DEALER as plain sockets in the server's own loop, ZMTP spoken by ziplog's codec),
on real processes, behind pyzmq clients (the asyncio client) and native ones (the
blocking client): inserts, reads, subscribers that agree, ``insert_many``, a primary
SIGKILLed and started again (its backup's native DEALER reconnects; nothing acknowledged
lost or duplicated); a native ROUTER refusing junk; and libzmq on both ends still
available (``--transport zmq``, ``ZIPLOG_TRANSPORT=zmq``)."""

from __future__ import annotations

from typing import Iterator

import pytest

import ziplog
import ziplog.aio


@pytest.fixture(scope="module")
def cluster() -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=2, replicas=2, server_args=["--transport", "native"]) as c:
        yield c


def _payloads(cluster: ziplog.LocalCluster, end: int) -> list[bytes]:
    with ziplog.Client(cluster.zk_hosts) as c, c.subscribe(ziplog.RID_GENESIS, end=end) as sub:
        return [rec.data for rec in sub]


def test_clients_insert_read_and_subscribe_through_native_servers(cluster: ziplog.LocalCluster) -> None:
    with ziplog.Client(cluster.zk_hosts) as c:
        prev = ziplog.RID_GENESIS
        mine = []
        for i in range(300):
            prev = c.insert_after(b"n-%04d" % i, prev)
            mine.append(prev)
        assert c.read_record(mine[123]) == b"n-0123"
        many = c.insert_many([b"m-%04d" % i for i in range(500)])

    async def main() -> ziplog.RecordId:
        async with ziplog.AsyncClient(cluster.zk_hosts) as ac:
            rid = await ac.insert_after(b"async")
            assert await ac.read_record(rid) == b"async"
            return rid

    arid = ziplog.aio.run(main())
    end = max(prev.gsn, arid.gsn, *(r.gsn for r in many))
    first, second = _payloads(cluster, end), _payloads(cluster, end)
    assert first == second  # two subscribers, the same records in the same order
    ours = [p for p in first if p[:2] in (b"n-", b"m-")]
    assert sorted(ours) == sorted([b"n-%04d" % i for i in range(300)] + [b"m-%04d" % i for i in range(500)])
    assert [p for p in first if p.startswith(b"n-")] == [b"n-%04d" % i for i in range(300)]  # each after the last


def test_a_primary_killed_and_restarted_behind_native_links(cluster: ziplog.LocalCluster) -> None:
    with ziplog.Client(cluster.zk_hosts, policy=ziplog.Policy.fixed(0)) as c:
        before = [c.insert_after(b"k-%04d" % i) for i in range(100)]
        cluster.kill_replica(0, 0)
        cluster.restart_replica(0, 0)
        # pinned: refused while the primary restarts, each waits and goes to shard 0 again
        after = [c.insert_after(b"k-%04d" % i) for i in range(100, 200)]
        assert {r.shard for r in after} == {0}
    # shard 0 serves again (its backup's native DEALER reconnected to the new primary); a
    # pinned insert refused while the primary restarts waits and goes to it again
    with ziplog.Client(cluster.zk_hosts, policy=ziplog.Policy.fixed(0)) as pinned:
        back = pinned.insert_after(b"k-back")
        assert back.shard == 0
    end = max(r.gsn for r in [*before, *after, back])
    got = [p for p in _payloads(cluster, end) if p.startswith(b"k-")]
    assert sorted(got) == sorted([b"k-%04d" % i for i in range(200)] + [b"k-back"])  # every acknowledged record, once


def test_a_native_router_in_the_poll_loop_serves_pyzmq_and_refuses_bad_peers() -> None:
    """``ZmqRuntime(native=True)``'s ROUTER: a pyzmq DEALER's frames come in as turns and
    answers go back; a frame over the limit closes only that peer's connection (refused
    from its header); a peer that does not speak ZMTP is closed; others go on."""
    import socket

    import zmq

    from ziplog.io.zmq_runtime import ZmqRuntime

    rt = ZmqRuntime(native=True, wake=False)
    ctx = zmq.Context()
    got: list[tuple[bytes, bytes]] = []

    def on_frame(route: bytes, frame: bytes) -> None:
        got.append((route, frame))
        router.send_to(route, b"re:" + frame)

    try:
        router = rt.router(on_frame, lambda route, parts: None, max_bytes=1 << 16)
        good = ctx.socket(zmq.DEALER)
        good.setsockopt(zmq.LINGER, 0)
        good.connect(router.addr)
        good.send(b"hello")
        assert rt.run_until(lambda: len(got) == 1, 10_000_000_000)
        assert good.poll(10_000) and good.recv() == b"re:hello"
        raw = socket.create_connection(("127.0.0.1", int(router.addr.rsplit(":", 1)[1])))
        raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(64))
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.setsockopt(zmq.RECONNECT_IVL, -1)  # once closed, it stays away
        big.connect(router.addr)
        big.send(b"x" * (1 << 17))  # over the limit
        rt.run_until(lambda: len(router.conns) == 1 and all(c.route for c in router.conns), 10_000_000_000)
        assert len(router.conns) == 1  # the bad greeting and the big frame's connections are gone
        good.send(b"again")
        assert rt.run_until(lambda: len(got) == 2, 10_000_000_000)
        assert good.poll(10_000) and good.recv() == b"re:again"
        raw.close()
        for s in (good, big):
            s.close(0)
    finally:
        rt.close()
        ctx.term()


def test_large_answers_leave_beside_their_headers_whole_and_in_order() -> None:
    """Frames of ``GATHER_BYTES`` and more leave as header and body side by side (one
    ``sendmsg``, no joined copy): sent from a handler (held back until its chunk is
    done), sent at once, and sent while the peer reads nothing, so that the kernel takes
    part of one and the rest waits; a pyzmq DEALER (the reference) receives every frame
    whole and in order, small ones between them too."""
    import time

    import zmq

    from ziplog.io.zmq_runtime import ZmqRuntime
    from ziplog.io.zmtp_poll import GATHER_BYTES

    def frame(i: int, size: int) -> bytes:
        return (b"%06d:" % i) * (size // 7 + 1)

    rt = ZmqRuntime(native=True, wake=False)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    routes: list[bytes] = []

    def on_frame(route: bytes, _: bytes) -> None:  # answered from the handler: held back until the chunk is done
        routes.append(route)
        router.send_to(route, frame(0, GATHER_BYTES))

    try:
        router = rt.router(on_frame, lambda route, parts: None)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 2)  # it stops reading its socket after two messages
        dealer.connect(router.addr)
        dealer.send(b"hello")
        assert rt.run_until(lambda: bool(routes), 10_000_000_000)
        sent = [frame(i, 64 << 10 if i % 3 else 100) for i in range(1, 200)]  # 8 MiB: more than the kernel holds
        for fr in sent:
            assert router.send_to(routes[0], fr)
        [conn] = router.conns
        assert conn.out  # part of it waits for the socket
        got: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(got) < len(sent) + 1 and time.monotonic() < deadline:
            rt.run_once(0)  # writes more as the socket drains
            while dealer.poll(10):
                got.append(dealer.recv())
        assert got == [frame(0, GATHER_BYTES)] + sent
    finally:
        dealer.close(0)
        rt.close()
        ctx.term()


def test_the_asyncio_runtimes_native_router_is_bound_at_once_and_serves_pyzmq() -> None:
    """``AsyncioRuntime(native=True)``'s ROUTER (the LogDB and LogBook processes'): its
    address is known, and a connection accepted by the kernel, before the loop turns;
    a pyzmq DEALER's one-part messages are turns of ``on_frame`` and are answered, a
    multipart one a turn of ``on_multipart`` with its part count; a frame over the limit
    closes only that peer; closing the runtime stops listening."""
    import asyncio
    import socket

    import zmq
    import zmq.asyncio

    from ziplog.io.asyncio_runtime import AsyncioRuntime

    async def main() -> None:
        rt = AsyncioRuntime(native=True)
        frames: list[bytes] = []
        multi: list[int] = []

        def on_frame(route: bytes, frame: bytes) -> None:
            frames.append(frame)
            router.send_to(route, b"re:" + frame)

        router = rt.router(on_frame, lambda route, parts: multi.append(parts), max_bytes=1 << 16)
        port = int(router.addr.rsplit(":", 1)[1])
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # listening before any turn
        ctx = zmq.asyncio.Context()
        try:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(router.addr)
            await dealer.send(b"hello")
            assert await asyncio.wait_for(dealer.recv(), 10) == b"re:hello"
            await dealer.send_multipart([b"a", b"b", b"c"])
            big = ctx.socket(zmq.DEALER)
            big.setsockopt(zmq.LINGER, 0)
            big.setsockopt(zmq.RECONNECT_IVL, -1)
            big.connect(router.addr)
            await big.send(b"x" * (1 << 17))  # over the limit: that peer is closed
            await dealer.send(b"again")
            assert await asyncio.wait_for(dealer.recv(), 10) == b"re:again"
            assert frames == [b"hello", b"again"] and multi == [3]
            for sock in (dealer, big):
                sock.close(0)
        finally:
            await rt.aclose()
            ctx.term()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=5)

    asyncio.run(main())


def test_answers_to_one_chunk_leave_together_and_a_nested_turn_is_not_starved() -> None:
    """What the messages of one received chunk send is held per peer and leaves when
    the chunk is handled (every answer arrives, in order); a handler that makes a
    blocking request of its own (a nested turn) gets its answer: held writes leave
    before any poll."""
    import threading

    import zmq

    from ziplog.io.zmq_runtime import ZmqRuntime

    rt = ZmqRuntime(native=True, wake=False)
    ctx = zmq.Context()
    echo = ctx.socket(zmq.ROUTER)
    echo.setsockopt(zmq.LINGER, 0)
    port = echo.bind_to_random_port("tcp://127.0.0.1")
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    replies: list[bytes] = []
    nested: list[bytes] = []
    try:
        side = rt.dealer(f"tcp://127.0.0.1:{port}", replies.append)

        def on_frame(route: bytes, frame: bytes) -> None:
            if frame == b"nested":
                # a blocking call made inside a handler: its request must leave now
                side.send(b"ask")
                assert rt.run_until(lambda: bool(replies), 10_000_000_000), "the nested request was held back"
                nested.append(replies[-1])
            router.send_to(route, b"re:" + frame)

        router = rt.router(on_frame, lambda route, parts: None)
        client.connect(router.addr)
        for i in range(200):  # sent at once: they arrive in a few chunks
            client.send(b"%d" % i)
        answers: list[bytes] = []
        while len(answers) < 200:
            rt.run_once(10)
            while client.poll(0):
                answers.append(client.recv())
        assert answers == [b"re:%d" % i for i in range(200)]

        stop = threading.Event()

        def serve_echo() -> None:
            while not stop.is_set():
                if echo.poll(5):
                    route, frame = echo.recv_multipart()
                    echo.send_multipart([route, b"echo:" + frame])

        t = threading.Thread(target=serve_echo)
        t.start()
        try:
            client.send(b"nested")
            assert rt.run_until(lambda: bool(nested), 20_000_000_000)
            assert nested == [b"echo:ask"]
            assert client.poll(10_000) and client.recv() == b"re:nested"
        finally:
            stop.set()
            t.join()
    finally:
        rt.close()
        client.close(0)
        echo.close(0)
        ctx.term()


def test_a_native_sub_hears_every_pyzmq_publisher_and_one_that_restarts() -> None:
    """``ZmqRuntime(native=True)``'s SUB (the storage server's epoch broadcasts): it
    subscribes to everything on each publisher it is given, hears both, and hears a
    publisher bound again at the same address after the first one closed (its link
    reconnects and subscribes again). No libzmq socket is left in the poll set, so the
    loop waits in one ``poll`` system call."""
    import zmq

    from tests.zmq_ports import bind_again
    from ziplog.io.zmq_runtime import ZmqRuntime

    rt = ZmqRuntime(native=True, wake=False)
    ctx = zmq.Context()
    pubs: list[zmq.Socket] = []

    def publisher(port: int = 0) -> tuple[zmq.Socket, str]:
        pub = ctx.socket(zmq.PUB)
        pubs.append(pub)  # closed at the end whatever happens (else ctx.term() waits for it)
        pub.setsockopt(zmq.LINGER, 0)
        if port:
            bind_again(pub, port, between=lambda: rt.run_once(10))
        else:
            port = pub.bind_to_random_port("tcp://127.0.0.1")
        return pub, f"tcp://127.0.0.1:{port}"

    got: list[bytes] = []

    def hear(pub: zmq.Socket, tag: bytes) -> None:
        # a PUB drops what it sends before the subscription arrives: send until heard
        for i in range(1000):
            pub.send(tag + b"%d" % i)
            if rt.run_until(lambda: any(g.startswith(tag) for g in got), 20_000_000):
                return
        raise AssertionError(f"nothing from publisher {tag!r}")

    try:
        first, first_addr = publisher()
        second, second_addr = publisher()
        sub = rt.subscriber(first_addr, got.append)
        sub.connect(second_addr)
        sub.connect(second_addr)  # once per address
        assert len(sub.links) == 2
        assert rt._zmq_polled == 0
        hear(first, b"a")
        hear(second, b"b")
        first.close(0)
        again, _ = publisher(int(first_addr.rsplit(":", 1)[1]))
        hear(again, b"c")
        with pytest.raises(NotImplementedError):
            sub.send(b"x")
        sub.close()
        assert not rt._fds  # every link's socket left the loop
    finally:
        rt.close()
        for pub in pubs:
            pub.close(0)
        ctx.term()


#: poll and ppoll on x86-64 and arm64 (/proc/<tid>/syscall names the call by number)
_POLL_CALLS = {"x86_64": {"7", "271"}, "aarch64": {"73"}}


def _in_poll(tid: int) -> bool:
    """Thread ``tid`` of this process is blocked in poll/ppoll (a call handed over
    before that would be run by the turn without any wake-up: a test of the wake-up
    that could not fail)."""
    import platform

    calls = _POLL_CALLS.get(platform.machine())
    assert calls is not None, f"no poll system call numbers for {platform.machine()}"
    with open(f"/proc/self/task/{tid}/syscall") as f:
        return f.read().split(" ", 1)[0] in calls


def test_another_threads_call_wakes_a_loop_waiting_on_file_descriptors_only() -> None:
    """A loop whose poll set holds no libzmq socket waits in ``select.poll``; a call
    handed over by another thread ends that wait (through the wake-up pipe) and runs
    in the loop's thread."""
    import threading
    import time

    from ziplog.io.zmq_runtime import ZmqRuntime

    rt = ZmqRuntime(native=True)
    ran: list[int] = []
    loop_thread = threading.get_native_id()

    def hand_over() -> None:
        while not _in_poll(loop_thread):  # not before the loop's thread waits in its poll
            time.sleep(0.001)
        rt.call_soon_threadsafe(lambda: ran.append(threading.get_ident()))

    try:
        assert rt._zmq_polled == 0
        t = threading.Thread(target=hand_over)
        t.start()
        rt.run_once(3_600_000)  # an hour's wait: only the pipe's byte ends it
        t.join()
        assert ran == [threading.get_ident()]
    finally:
        rt.close()


@pytest.mark.parametrize("transport", ["native", "zmq"])
def test_a_moving_topology_ends_a_blocking_clients_wait_at_once(cluster: ziplog.LocalCluster,
                                                               monkeypatch: pytest.MonkeyPatch, transport: str) -> None:
    """ZooKeeper's thread tells a blocking client that the topology moved (a replica
    restarted at a new address) while a call of the client waits on its replicas: the
    wait ends then and the driver hears of it in the loop's thread, rather than when the
    poll times out (with libzmq the poll is narrowed to what the call waits on; the
    wake-up pipe is in it too)."""
    import threading
    import time

    monkeypatch.setenv("ZIPLOG_TRANSPORT", transport)
    with ziplog.Client(cluster.zk_hosts, policy=ziplog.Policy.fixed(0)) as c:
        c.insert_after(b"connected")
        assert c._rt.native == (transport == "native")
        while c._rt._next_timer() is not None:  # the call's resend timer, left to lapse:
            c._rt.run_once(1000)  # then nothing but a wake-up ends the loop's wait
        focus = list(c._driver.conns.values())
        loop_thread = threading.get_native_id()
        heard: list[int] = []

        def zookeeper_says_it_moved() -> None:
            while not _in_poll(loop_thread):  # not before the loop's thread waits in its poll
                time.sleep(0.001)
            c.topology.changed()

        c.topology.on_change(lambda: c._rt.call_soon_threadsafe(lambda: heard.append(threading.get_ident())))
        t = threading.Thread(target=zookeeper_says_it_moved)
        t.start()
        while not heard:  # (a turn may end on a late reply first)
            c._rt.run_once(3_600_000, focus)  # an hour's wait: only the wake-up ends it
        t.join()
        assert heard == [threading.get_ident()]


def test_a_native_blocking_client_against_native_servers(cluster: ziplog.LocalCluster,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ends native (``ZIPLOG_TRANSPORT=native`` for the client too): no libzmq socket
    on the insert path at all."""
    monkeypatch.setenv("ZIPLOG_TRANSPORT", "native")
    with ziplog.Client(cluster.zk_hosts) as c:
        assert c._rt.native
        prev = ziplog.RID_GENESIS
        for i in range(200):
            prev = c.insert_after(b"b-%04d" % i, prev)
        assert c.read_record(prev) == b"b-0199"
        rids = c.insert_many([b"bm-%04d" % i for i in range(300)])
        with c.subscribe(ziplog.RID_GENESIS, end=max(prev.gsn, *(r.gsn for r in rids))) as sub:
            got = [rec.data for rec in sub if rec.data[:2] == b"b-" or rec.data[:3] == b"bm-"]
    assert [g for g in got if g[:2] == b"b-"] == [b"b-%04d" % i for i in range(200)]
    assert sorted(g for g in got if g[:3] == b"bm-") == [b"bm-%04d" % i for i in range(300)]


def test_libzmq_stays_available_on_both_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--transport zmq`` and ``ZIPLOG_TRANSPORT=zmq``: the libzmq path, end to end."""
    monkeypatch.setenv("ZIPLOG_TRANSPORT", "zmq")
    with ziplog.local_cluster(shards=1, replicas=2, server_args=["--transport", "zmq"]) as c, \
            ziplog.Client(c.zk_hosts) as client:
        assert not client._rt.native
        a = client.insert_after(b"one")
        b = client.insert_after(b"two", a)
        assert b.gsn > a.gsn and client.read_record(b) == b"two"
        with client.subscribe(ziplog.RID_GENESIS, end=b.gsn) as sub:
            assert [rec.data for rec in sub] == [b"one", b"two"]
