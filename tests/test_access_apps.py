"""The apps inherit CURVE and rights: on a cluster that speaks CURVE, its LogDB processes
and LogBook index tier (started with the cluster's flags) serve clients that give a key
file with ``append`` and ``read``: a LogDB transaction commits and reads back, a LogBook
appends, reads by tag through the tier, and a key without ``append`` is refused its
commit and its append (typed, nothing written). Each app server judges its own requests
by the registry too: a key without ``read`` reads nothing through them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

import ziplog
from ziplog.logbook import LogBook, local_logbook
from ziplog.logdb import LogDB
from ziplog.protocol.errors import ForbiddenError
from ziplog.tools import cli
from ziplog.tools.logdb_local import local_logdb

TIMEOUT = 15.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ziplog.LocalCluster]:
    with ziplog.local_cluster(shards=1, replicas=2, data_dir=tmp_path_factory.mktemp("apps"), curve=True,
                              mms_replicas=1, fh_replicas=1) as c:
        yield c


def test_logdb_with_a_client_key(cluster: ziplog.LocalCluster) -> None:
    with local_logdb(cluster, coordinators=1, kv_shards=1):
        writer = cluster.add_client("ledger", "append,read")
        reader = cluster.add_client("auditor", "read")
        with LogDB(cluster.zk_hosts, timeout=TIMEOUT, key_file=str(writer)) as db:
            with db.transaction() as t:
                t.put(b"alice", b"100")
            assert db.get(b"alice") == b"100"
        with LogDB(cluster.zk_hosts, timeout=TIMEOUT, key_file=str(reader)) as db:
            assert db.get(b"alice") == b"100"
            with pytest.raises(ForbiddenError, match="lacks the 'append' right"):
                with db.transaction() as t:
                    t.put(b"alice", b"0")
            assert db.get(b"alice") == b"100"


def test_logbook_with_a_client_key(cluster: ziplog.LocalCluster) -> None:
    with local_logbook(cluster, index_nodes=1):
        key = cluster.add_client("book", "append,read")
        lb = LogBook(cluster.zk_hosts, 7, timeout=TIMEOUT, key_file=str(key))
        try:
            seq = lb.append(b"entry", tags=["t"])
            got = lb.read_next(0, "t")
            assert got is not None and got.data == b"entry" and got.seqnum == seq
        finally:
            lb.close()
        reader = cluster.add_client("book-reader", "read")
        lb = LogBook(cluster.zk_hosts, 7, timeout=TIMEOUT, key_file=str(reader))
        try:
            with pytest.raises(ForbiddenError):
                lb.append(b"not allowed", tags=["t"])
            got = lb.read_next(seq + 1, "t")
            assert got is None
        finally:
            lb.close()


def _registered_addrs(cluster: ziplog.LocalCluster, path: str) -> list[str]:
    from ziplog.protocol.layout import dec
    zkc = cluster._zkc
    return [dec(zkc.get(f"{path}/{kid}")[0])["addr"] for kid in sorted(zkc.get_children(path))]


def test_every_app_server_refuses_a_read_to_a_key_without_the_right(cluster: ziplog.LocalCluster,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Every app server a client reaches judges each request by the registry, as a storage
    replica does: a key without ``read``, and a removed one, are answered FORBIDDEN by
    LogDB's coordinator (Latest: where a key's last write is) and KV shard (KvGet: its
    value), and by LogBook's index node and aggregator (Lookup: which gsns hold a tag);
    a key with ``read`` is answered. Raw frames over CURVE, so no storage replica's check
    comes first. ``ziplog client remove`` returns once every app server confirmed the
    removal (the key is refused by each at once), and fails naming a stopped one."""
    import os
    import signal
    import time

    from ziplog.io.keys import client_credentials
    from ziplog.io.zk_logbook import AGGREGATORS, NODES
    from ziplog.io.zk_logdb import db_path
    from ziplog.io.zmq_runtime import round_trip
    from ziplog.logbook.core import frames as bf
    from ziplog.logdb.core import frames as df

    with local_logdb(cluster, coordinators=1, kv_shards=1), local_logbook(cluster, index_nodes=1) as tier:
        writer = cluster.add_client("writes-only", "append")
        removed = cluster.add_client("removed", "read")
        cluster.remove_client("removed")
        reader = cluster.add_client("reads", "read")  # last: a table that has it has every change above
        asks: list[tuple[str, bytes, Callable[[bytes], object], type]] = [
            (addr, df.encode(df.Latest(req=5, key=b"k")), df.decode_answer, df.LatestIs)
                for addr in _registered_addrs(cluster, f"{db_path('default')}/coordinators")]
        asks += [(addr, df.encode(df.KvGet(req=5, key=b"k")), df.decode_answer, df.KvValue)
                 for addr in _registered_addrs(cluster, f"{db_path('default')}/kv")]
        lookup = bf.encode(bf.Lookup(req=5, how=bf.NEXT, book=7, tag=None, seqnum=0, cut=0, exact=False))
        asks += [(addr, lookup, bf.decode_answer, bf.Found)
                 for path in (NODES, AGGREGATORS) for addr in _registered_addrs(cluster, path)]
        assert len(asks) == 4, asks

        def ask(addr: str, frame: bytes, decode: Callable[[bytes], object], key: Path) -> Any:
            got = round_trip(addr, frame, 10_000_000_000, 1 << 20, client_credentials(str(key)))
            assert got is not None, f"{addr} did not answer"
            return decode(got)

        def until_answered(key: Path) -> None:
            for addr, frame, decode, answered in asks:
                deadline = time.monotonic() + 30
                while True:  # until this server's table has the registry's last change
                    got = ask(addr, frame, decode, key)
                    if type(got) is answered:
                        break
                    assert getattr(got, "code", None) == "FORBIDDEN" and time.monotonic() < deadline, (addr, got)
                    time.sleep(0.05)

        until_answered(reader)
        for addr, frame, decode, answered in asks:
            for key, who in ((writer, "writes-only"), (removed, None)):
                got = ask(addr, frame, decode, key)
                assert getattr(got, "code", None) == "FORBIDDEN" and getattr(got, "req", None) == 5, (addr, got)
                wanted = "lacks the 'read' right" if who else "not registered"
                assert wanted in got.message, (addr, got)

        # the command line's remove waits for every app server's confirmation
        remove = ["client", "remove", "--zk", cluster.zk_hosts, "--cluster-key-file", str(cluster.key_file)]
        late = cluster.add_client("late", "read")
        until_answered(late)
        node = tier.node_pid(0)
        os.kill(node, signal.SIGSTOP)
        try:
            assert cli.main([*remove, "late", "--timeout", "2"]) == 1
        finally:
            os.kill(node, signal.SIGCONT)
        err = capsys.readouterr().err
        assert "did not confirm it" in err and "logbook-index0" in err, err
        later = cluster.add_client("later", "read")
        until_answered(later)
        assert cli.main([*remove, "later"]) == 0
        for addr, frame, decode, _ in asks:  # at once: no server still takes the key
            got = ask(addr, frame, decode, later)
            assert getattr(got, "code", None) == "FORBIDDEN" and "not registered" in got.message, (addr, got)


def test_a_server_confirms_the_latest_registry_version_and_again_on_a_new_session() -> None:
    import queue

    from ziplog.shell.rights import LoadConfirmer

    writes: "queue.Queue[tuple[str, int]]" = queue.Queue()

    class Registry:
        fail = True

        def confirm_loaded(self, server: str, version: int, lease_ms: int | None = None) -> None:
            if self.fail:  # ZooKeeper away once: tried again
                self.fail = False
                raise ConnectionError("no session")
            writes.put((server, version))

    confirmer = LoadConfirmer(Registry(), "kv-0")
    confirmer.loaded(3)
    assert writes.get(timeout=TIMEOUT) == ("kv-0", 3)
    confirmer.loaded(2)  # an older load: nothing to say
    confirmer.loaded(5)
    assert writes.get(timeout=TIMEOUT) == ("kv-0", 5)
    confirmer.again()  # a new session lost the node: the latest version again
    assert writes.get(timeout=TIMEOUT) == ("kv-0", 5)
    assert writes.empty()
