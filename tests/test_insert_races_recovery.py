"""An insert in flight while its shard is frozen for recovery and resumed: the client
must read the primary's late ACK even after the shard said FROZEN, for both clients.

The two replicas are scripted ROUTER sockets registered in a real ZooKeeper, so the
order of events is fixed: the primary and the backup answer FROZEN; the backup keeps
answering FROZEN to resends; only after the client resent twice (it is in its frozen,
quick-resend state) does the primary send its decision, once, unasked; then the backup
acks the resends with the same gsn. A client that stopped listening to the primary
once it said FROZEN never settles the insert and times out, though the record is in
the log (an application retry would store it twice).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Iterator

import pytest
import zmq

from tests.zookeeper import require_zookeeper, running_ensemble
from ziplog.aio import AsyncClient
from ziplog.client.blocking import Client
from ziplog.io import zk as discovery
from ziplog.protocol import frames as wire
from ziplog.protocol import layout
from ziplog.protocol.types import Policy, RecordId
from ziplog.tools.zk_ensemble import ZooKeeperEnsemble

require_zookeeper()

DECIDED_GSN = 4242
#: the client's whole-call deadline: far above the script's few resends, so a client
#: that reads the decision settles long before it, and one that does not times out
CLIENT_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeperEnsemble]:
    yield from running_ensemble(tmp_path_factory, 1)


class ScriptedShard:
    """Shard 0 with two scripted replicas (replica 0 the primary), registered in ZooKeeper."""

    def __init__(self, hosts: str) -> None:
        self.ctx = zmq.Context()
        self.sockets = [self.ctx.socket(zmq.ROUTER) for _ in range(2)]
        self.addrs = []
        for s in self.sockets:
            s.linger = 0
            port = s.bind_to_random_port("tcp://127.0.0.1")
            self.addrs.append(f"tcp://127.0.0.1:{port}")
        self.zk = discovery.connect(hosts)
        self.zk.create(layout.MEMBERSHIP_PATH, layout.enc([[0, [0]]]), makepath=True)
        self.zk.create(f"{layout.SHARDS}/0", layout.enc({"replicas": 2}), makepath=True)
        for i, addr in enumerate(self.addrs):
            discovery.register(self.zk, f"{layout.SHARDS}/0/{i}", {"addr": addr})
        self.inserts = [0, 0]  # INSERT frames each replica received
        self.inserted: set[tuple[int, int]] = set()  # (client id, seq) of every INSERT seen
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self._script()
        except BaseException as exc:  # surfaced by close()
            self.error = exc

    def _recv(self, poller: zmq.Poller) -> tuple[int, bytes, wire.Insert] | None:
        while not self.stop.is_set():
            for sock, _ in poller.poll(50):
                ident, frame = sock.recv_multipart()
                msg = wire.decode_request(frame)
                assert isinstance(msg, wire.Insert), msg
                i = self.sockets.index(sock)
                self.inserts[i] += 1
                self.inserted.add((msg.client_id, msg.seq))
                return i, ident, msg
        return None

    def _send(self, i: int, ident: bytes, msg: wire.Frame) -> None:
        self.sockets[i].send_multipart([ident, wire.encode(msg)])

    def _script(self) -> None:
        poller = zmq.Poller()
        for s in self.sockets:
            poller.register(s, zmq.POLLIN)
        frozen = lambda m: wire.Error(req_id=m.req_id, code=wire.E_FROZEN, message="frozen for recovery")  # noqa: E731
        primary: tuple[bytes, wire.Insert] | None = None
        backup_resends = 0
        decided = False
        while (got := self._recv(poller)) is not None:
            i, ident, msg = got
            if i == 0:
                if primary is None:
                    primary = (ident, msg)
                    self._send(0, ident, frozen(msg))
                # later copies at the primary go unanswered: its one decision comes below
                continue
            if not decided:
                self._send(1, ident, frozen(msg))
                backup_resends += 1
                if backup_resends >= 3 and primary is not None:
                    # resumed: the primary decides the parked insert and says so once
                    p_ident, p_msg = primary
                    self._send(0, p_ident, wire.Ack(req_id=p_msg.req_id, gsn=DECIDED_GSN, replica=0, stable=0,
                                                     decided=True, final=False))
                    decided = True
                continue
            self._send(1, ident, wire.Ack(req_id=msg.req_id, gsn=DECIDED_GSN, replica=1, stable=0,
                                          decided=False, final=False))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        discovery.stop(self.zk)
        self.ctx.destroy(linger=0)
        if self.error is not None:
            raise self.error


@pytest.fixture
def shard(ensemble: ZooKeeperEnsemble, request: pytest.FixtureRequest) -> Iterator[ScriptedShard]:
    chroot = f"/race-{request.node.name.replace('[', '-').rstrip(']')}"
    admin = discovery.connect(ensemble.hosts)
    try:
        admin.ensure_path(chroot)
    finally:
        discovery.stop(admin)
    s = ScriptedShard(ensemble.hosts + chroot)
    s.hosts = ensemble.hosts + chroot  # type: ignore[attr-defined]
    try:
        yield s
    finally:
        s.close()


def check(shard: ScriptedShard, rid: RecordId) -> None:
    assert rid == RecordId(DECIDED_GSN, 0)
    assert shard.inserts[1] >= 4, "the backup was asked again while the shard was frozen"
    assert len(shard.inserted) == 1, "one record, never moved elsewhere"


def test_blocking_client_reads_the_primarys_ack_after_frozen(shard: ScriptedShard) -> None:
    client = Client(shard.hosts, timeout=CLIENT_TIMEOUT_S, policy=Policy.fixed(0))  # type: ignore[attr-defined]
    try:
        rid = client.insert_after(b"raced a recovery")
    finally:
        client.close()
    check(shard, rid)


def test_async_client_reads_the_primarys_ack_after_frozen(shard: ScriptedShard) -> None:
    async def go() -> Any:
        client = await AsyncClient.connect(shard.hosts, timeout=CLIENT_TIMEOUT_S,  # type: ignore[attr-defined]
                                           policy=Policy.fixed(0))
        try:
            return await client.insert_after(b"raced a recovery")
        finally:
            await client.close()

    check(shard, asyncio.run(go()))


def test_a_client_that_ignores_the_primary_after_frozen_would_time_out(shard: ScriptedShard) -> None:
    """The script is a real trap: the same insert, with the primary's answers after its
    FROZEN dropped on the client's side, does not settle."""
    client = Client(shard.hosts, timeout=3.0, policy=Policy.fixed(0))  # type: ignore[attr-defined]
    driver = client._driver
    real = driver.reply_handler
    primary = shard.addrs[0]
    seen_frozen: list[bytes] = []

    def on_reply(addr: str, frame: bytes) -> None:
        if addr == primary:
            if seen_frozen:
                return  # the old bug: replica 0 not read once it said FROZEN
            seen_frozen.append(frame)
        real(addr, frame)

    driver.reply_handler = on_reply
    try:
        with pytest.raises(Exception) as info:
            client.insert_after(b"raced a recovery")
    finally:
        client.close()
    assert type(info.value).__name__ == "ZiplogTimeoutError"
