"""A storage replica whose ZooKeeper session expires while the process lives (it was
cut off longer than the session timeout: here it is paused, SIGSTOP, for longer than
that): once it runs again it gets a new session, registers itself again, and its shard
takes new inserts and serves a new subscription from genesis; nothing acknowledged is
lost. Before, its entry was created once at start and never again: the shard dropped
out of every client's live list for good."""

from __future__ import annotations

import os
import signal
from typing import Iterator

import pytest

import ziplog
from tests.load import RegistrationWatch, pinned_inserts_then_read_all
from ziplog.protocol import layout
from ziplog.protocol.types import Policy

#: the storage replicas' ZooKeeper session timeout (``io.zk.connect``), plus margin
PAUSE_S = 14.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ziplog.LocalCluster]:
    # in pytest's temporary directory: the processes' logs outlive a failure
    with ziplog.local_cluster(shards=2, replicas=2, data_dir=tmp_path_factory.mktemp("expiry")) as c:
        yield c


def test_a_replica_whose_session_expired_registers_again(cluster: ziplog.LocalCluster) -> None:
    shard, replica = 1, 1
    node = f"{layout.SHARDS}/{shard}/{replica}"
    zk = cluster._zkc
    acked: dict[ziplog.RecordId, bytes] = {}
    with cluster.client(timeout=60, policy=Policy.fixed(shard)) as pinned:
        for n in range(20):
            rid = pinned.insert_after(f"before-{n}".encode())
            acked[rid] = f"before-{n}".encode()
        proc = cluster.servers[(shard, replica)]
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            registration = RegistrationWatch(zk, node)
            # the session expires while the process is stopped: its node goes
            assert registration.gone.wait(PAUSE_S + 20), "the paused replica's session did not expire"
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert registration.back.wait(60), "the replica did not register again after its session expired"
        assert proc.poll() is None, "the replica exited instead of carrying on"
        assert not [r for r in cluster.restarts if r[1:] == (shard, replica)], "it was restarted, not renewed"
        # the shard takes new records again, and a new subscription sees everything
        pinned_inserts_then_read_all(pinned, shard, "after-", acked,
                                     "the subscription stalled: {missing} records missing")
    log = (cluster.logs / f"shard{shard}-replica{replica}.log").read_text(errors="replace")
    assert "registered" in log and "again" in log
    assert not [p.name for p in cluster.logs.glob("*.log") if "Traceback" in p.read_text(errors="replace")]
