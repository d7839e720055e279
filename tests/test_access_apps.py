"""The apps inherit CURVE and rights: on a cluster that speaks CURVE, its LogDB processes
and LogBook index tier (started with the cluster's flags) serve clients that give a key
file with ``append`` and ``read``: a LogDB transaction commits and reads back, a LogBook
appends, reads by tag through the tier, and a key without ``append`` is refused its
commit and its append (typed, nothing written)."""

from __future__ import annotations

from typing import Iterator

import pytest

import ziplog
from ziplog.logbook import LogBook, local_logbook
from ziplog.logdb import LogDB
from ziplog.protocol.errors import ForbiddenError
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
