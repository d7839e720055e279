"""What ZooKeeper shows and takes from a session without the cluster's secret, on a real
ensemble configured as the local cluster's and a deployment's are: the root and
ZooKeeper's own nodes take new nodes from members only; the failure handler's recovery
records (a recovery's acquired state holds record bytes) are members-only, READ
included, and hold no record byte in clear: the records are sealed under the cluster's
recovery key, and a record altered in ZooKeeper, moved to another shard, or read with
another key does not open; and only the four-letter words ``srvr`` and ``ruok`` answer."""

from __future__ import annotations

import itertools
from typing import Any, Iterator

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError
from kazoo.security import make_acl

from tests.zookeeper import open_nodes, require_zookeeper, running_ensemble
from ziplog.io import zk as discovery
from ziplog.io import zk_recovery
from ziplog.io.zk_recovery import KazooHandlerCoordination
from ziplog.protocol import layout
from ziplog.protocol.auth import ClusterKey
from ziplog.tools.zk_ensemble import ZooKeeperEnsemble, four_letter_word

require_zookeeper()

KEY = ClusterKey(b"the cluster's secret, for this module")
_shards = itertools.count(100)


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeperEnsemble]:
    yield from running_ensemble(tmp_path_factory, 1)


@pytest.fixture
def anonymous(ensemble: ZooKeeperEnsemble) -> Iterator[KazooClient]:
    """A session without the cluster's secret (a client's, or an outsider's)."""
    zk = discovery.connect(ensemble.hosts)
    try:
        yield zk
    finally:
        discovery.stop(zk)


@pytest.fixture
def handler(ensemble: ZooKeeperEnsemble) -> Iterator[KazooHandlerCoordination]:
    """A failure handler replica's ZooKeeper port, registered as the replica does when it
    starts (it does not contend: nothing here needs a runtime)."""
    port = KazooHandlerCoordination(ensemble.hosts, KEY, rt=None)
    try:
        port.register_fh(0, 0, "tcp://127.0.0.1:1")
        yield port
    finally:
        port.close()


def new_shard(port: KazooHandlerCoordination) -> int:
    shard = next(_shards)
    port.zk.create(f"{layout.SHARDS}/{shard}", layout.enc({"replicas": 2}), makepath=True)
    return shard


def acquired(gen: int, records: int, record_bytes: int) -> dict[str, Any]:
    """An acquired state as the handler's core builds it: ``[gsn, client, seq, data]``
    records and guesses, each data a text that names it (found if stored in clear)."""
    def data(kind: str, i: int) -> bytes:
        return (b"%s-%d-" % (kind.encode(), i)).ljust(record_bytes, b"#")
    return {"gen": gen, "phase": "acquired", "source": 1, "stable": 10, "frontier": 10 + records,
            "records": [[11 + i, 7, i, data("record", i)] for i in range(records)],
            "guesses": [[20 + records + i, 8, i, data("guess", i)] for i in range(2)],
            "membership": []}


def write(port: KazooHandlerCoordination, shard: int, record: dict[str, Any], version: int = -1) -> int:
    """As the handler's leader writes: checking a lock node it holds (its term's fence)."""
    lock = port.zk.create("/fh-lock-", b"", ephemeral=True, sequence=True)
    done: list[int | None] = []
    port.write_record(shard, record, True, version, done.append, fence=lock)
    assert done and done[0] is not None, "the write was refused"
    return done[0]


def stored_bytes(zk: KazooClient, shard: int) -> bytes:
    """Everything ZooKeeper holds for the shard's record: its node and its chunks."""
    path = f"{layout.RECOVERY}/{shard}"
    return zk.get(path)[0] + b"".join(zk.get(f"{path}/{c}")[0] for c in sorted(zk.get_children(path)))


def test_only_srvr_and_ruok_answer(ensemble: ZooKeeperEnsemble) -> None:
    host, port = ensemble.node_hosts(0).rsplit(":", 1)
    assert four_letter_word(host, int(port), "ruok") == "imok"
    assert "Mode: " in (four_letter_word(host, int(port), "srvr") or "")
    for word, tells in (("dump", "Sessions"), ("envi", "java.version"), ("cons", "queued="),
                        ("mntr", "zk_version"), ("conf", "dataDir"), ("stat", "Clients:"), ("wchc", "/")):
        reply = four_letter_word(host, int(port), word) or ""
        assert reply == "" or "not in the whitelist" in reply, f"{word} answered: {reply[:200]!r}"
        assert tells not in reply


def test_the_root_takes_new_nodes_from_members_only(ensemble: ZooKeeperEnsemble, anonymous: KazooClient) -> None:
    member = discovery.connect(ensemble.hosts, key=KEY)  # as every cluster process connects
    try:
        member.ensure_path(layout.SHARDS)
        acl, stat = member.get_acls("/")
        assert acl == discovery.cluster_acl(KEY)
        for path in ("/junk", "/zookeeper/junk", "/zookeeper/quota/junk"):
            with pytest.raises(NoAuthError):
                anonymous.create(path, b"x" * 1000)
        with pytest.raises(NoAuthError):
            anonymous.delete(layout.ROOT, recursive=True)
        assert "ziplog" in anonymous.get_children("/")  # anyone still reads the layout
        assert anonymous.get_children(layout.ROOT)
        member.create("/by-a-member", b"")
        member.delete("/by-a-member")
        again = discovery.connect(ensemble.hosts, key=KEY)  # idempotent: nothing changes
        discovery.stop(again)
        assert member.get_acls("/")[1].aversion == stat.aversion
    finally:
        discovery.stop(member)


def test_locking_a_root_keeps_an_operators_entries(ensemble: ZooKeeperEnsemble, anonymous: KazooClient) -> None:
    """A chroot the operator made, open to anyone and with an entry of their own: the
    cluster takes creating away from anyone, and keeps the operator's entry."""
    chroot = "/operators-chroot"
    mine = make_acl("ip", "127.0.0.2", all=True)
    operator = KazooClient(hosts=ensemble.hosts, auth_data=[KEY.zk_auth])  # may create at the root
    operator.start()
    try:
        operator.create(chroot, b"", acl=[make_acl("world", "anyone", all=True), mine])
    finally:
        operator.stop()
        operator.close()
    member = discovery.connect(ensemble.hosts + chroot, key=KEY)
    try:
        acl = member.get_acls("/")[0]
        assert sorted(acl) == sorted(discovery.cluster_acl(KEY) + [mine])
        with pytest.raises(NoAuthError):
            anonymous.create(f"{chroot}/junk", b"")
    finally:
        discovery.stop(member)


def test_recovery_records_are_members_only(handler: KazooHandlerCoordination, anonymous: KazooClient) -> None:
    small, large = new_shard(handler), new_shard(handler)
    write(handler, small, acquired(1, 3, 100))
    write(handler, large, acquired(1, 400, 4096))  # chunked
    chunks = handler.zk.get_children(f"{layout.RECOVERY}/{large}")
    assert chunks
    for path in (layout.RECOVERY, f"{layout.RECOVERY}/{small}", f"{layout.RECOVERY}/{large}",
                 f"{layout.RECOVERY}/{large}/{chunks[0]}"):
        with pytest.raises(NoAuthError):
            anonymous.get(path)
        with pytest.raises(NoAuthError):
            anonymous.get_children(path)
        assert handler.zk.get_acls(path)[0] == discovery.members_acl(KEY)
    assert open_nodes(handler.zk, KEY.zk_digest_id, layout.ROOT) == []


def test_records_an_earlier_build_left_readable_become_members_only(ensemble: ZooKeeperEnsemble,
                                                                   anonymous: KazooClient) -> None:
    """A record node with the cluster's usual ACL (anyone reads) is made members-only by
    the next failure handler replica that starts."""
    member = discovery.connect(ensemble.hosts, key=KEY)
    try:
        member.ensure_path(layout.RECOVERY)
        shard = next(_shards)
        member.create(f"{layout.RECOVERY}/{shard}/v1-0", b"old", makepath=True)  # the session's ACL
        member.set_acls(layout.RECOVERY, discovery.cluster_acl(KEY))
    finally:
        discovery.stop(member)
    port = KazooHandlerCoordination(ensemble.hosts, KEY, rt=None)
    try:
        port.register_fh(0, 1, "tcp://127.0.0.1:1")
        for path in (layout.RECOVERY, f"{layout.RECOVERY}/{shard}", f"{layout.RECOVERY}/{shard}/v1-0"):
            with pytest.raises(NoAuthError):
                anonymous.get(path)
    finally:
        port.close()


@pytest.mark.parametrize("records,record_bytes", [(3, 100), (400, 4096)], ids=["one-node", "chunked"])
def test_a_record_round_trips_sealed(handler: KazooHandlerCoordination, records: int, record_bytes: int) -> None:
    shard = new_shard(handler)
    record = acquired(4, records, record_bytes)
    v = write(handler, shard, record)
    assert handler.read_record(shard) == (record, v)
    raw = stored_bytes(handler.zk, shard)
    assert (len(handler.zk.get_children(f"{layout.RECOVERY}/{shard}")) > 1) == (records > 3)
    for r in record["records"] + record["guesses"]:
        assert r[3][:12] not in raw, f"record bytes {r[3][:12]!r} stored in clear"
    head = layout.dec(handler.zk.get(f"{layout.RECOVERY}/{shard}")[0])
    assert (head["gen"], head["phase"]) == (4, "acquired")  # readable: the replicas read the generation
    done = {"gen": 4, "phase": "done"}
    v = write(handler, shard, done, v)
    assert handler.read_record(shard) == (done, v)
    assert handler.zk.get_children(f"{layout.RECOVERY}/{shard}") == []


def test_a_record_that_does_not_open_is_an_error(handler: KazooHandlerCoordination) -> None:
    shard, other = new_shard(handler), new_shard(handler)
    path = f"{layout.RECOVERY}/{shard}"
    write(handler, shard, acquired(2, 3, 64))
    data, _ = handler.zk.get(path)
    # a byte flipped near the end of what is stored (inside the sealed state)
    handler.zk.set(path, data[:-20] + bytes([data[-20] ^ 1]) + data[-19:])
    with pytest.raises(Exception, match="does not open") as err:
        handler.read_record(shard)
    assert type(err.value).__name__ == "SealedRecordError"
    handler.zk.set(path, data)
    assert handler.read_record(shard)[0] == acquired(2, 3, 64)
    # a byte flipped in a chunk of a large record
    large = new_shard(handler)
    write(handler, large, acquired(2, 400, 4096))
    chunk = f"{layout.RECOVERY}/{large}/{sorted(handler.zk.get_children(f'{layout.RECOVERY}/{large}'))[-1]}"
    part = handler.zk.get(chunk)[0]
    handler.zk.set(chunk, part[:100] + bytes([part[100] ^ 1]) + part[101:])
    with pytest.raises(zk_recovery.SealedRecordError, match="does not open"):
        handler.read_record(large)
    # another cluster's key
    with pytest.raises(zk_recovery.SealedRecordError, match="does not open"):
        zk_recovery.read_record(handler.zk, ClusterKey(b"another cluster's secret"), shard)
    # the same state moved to another shard
    write(handler, other, {"gen": 2, "phase": "probing"})
    handler.zk.set(f"{layout.RECOVERY}/{other}", data)
    with pytest.raises(zk_recovery.SealedRecordError, match=f"sealed for .* \\({shard}, 2\\)"):
        handler.read_record(other)


def test_a_registry_made_first_leaves_the_layout_readable(ensemble: ZooKeeperEnsemble) -> None:
    """``ziplog client add`` before any cluster process ran: the registry node is
    members-only, and ``/ziplog``, made on the way, is readable by anyone as ever."""
    from ziplog.io.zk_clients import ClientRegistry
    from ziplog.protocol.keys import Right

    chroot = "/registry-first"
    member = discovery.connect(ensemble.hosts, key=KEY)
    try:
        member.create(chroot, b"")
    finally:
        discovery.stop(member)
    member = discovery.connect(ensemble.hosts + chroot, key=KEY)
    reader = discovery.connect(ensemble.hosts + chroot)
    try:
        ClientRegistry(member, KEY).add("alice", bytes(32), frozenset({Right.READ}))
        ClientRegistry(member, KEY).confirm_loaded("kv-1@here", 1)
        assert "clients" in reader.get_children(layout.ROOT)
        for path in (layout.CLIENTS, layout.CLIENTS_LOADED):
            with pytest.raises(NoAuthError):
                reader.get(path)
        assert open_nodes(member, KEY.zk_digest_id) == []
    finally:
        discovery.stop(reader)
        discovery.stop(member)


def test_a_recovery_record_is_written_only_under_its_writers_lock(handler: KazooHandlerCoordination) -> None:
    """A failure handler leader's write checks its lock node in the same transaction: one
    deposed (its node deleted) while its loop stalled writes nothing, even at the version
    it read, and a write that names no lock is refused before it leaves."""
    shard = new_shard(handler)
    version = write(handler, shard, {"gen": 0, "phase": "probing"})
    lock = handler.zk.create("/fh-lock-", b"", ephemeral=True, sequence=True)
    handler.zk.delete(lock)  # deposed
    done: list[int | None] = []
    handler.write_record(shard, {"gen": 1, "phase": "probing"}, False, version, done.append, fence=lock)
    handler.write_record(shard, {"gen": 1, "phase": "probing"}, False, version, done.append)
    assert done == [None, None]
    record, still = handler.read_record(shard)
    assert record == {"gen": 0, "phase": "probing"} and still == version
    fresh = new_shard(handler)
    handler.write_record(fresh, {"gen": 0, "phase": "probing"}, False, -1, done.append, fence=lock)
    assert done[-1] is None and handler.read_record(fresh) == (None, -1), "nor creates the record"
