"""Revocation on real processes, the outsider's report: one storage replica of a CURVE
cluster hung (SIGSTOP) while ``ziplog client remove`` ran; woken, it served the removed
key's READ on the connection it had open and on a new one. A replica judges client keys
only under a registry lease (``tests/test_registry_lease.py``), and ``remove`` waits for
each server's confirmation or for its lease to run out."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from ziplog.protocol import frames as wire

TIMEOUT = 15.0
#: the test cluster's lease (--registry-lease-s): short, so the pause is short too
LEASE_S = 2.0


class Connection:
    """One CURVE connection to one storage replica, with a client key, kept open."""

    def __init__(self, addr: str, key_file: Path) -> None:
        from ziplog.io.keys import client_credentials
        from ziplog.io.zmq_runtime import ZmqRuntime

        self.rt = ZmqRuntime(wake=False, credentials=client_credentials(str(key_file)))
        self.got: list[bytes] = []
        self.dealer = self.rt.dealer(addr, self.got.append, "test", wire.CLIENT_REPLY_LIMIT)
        self.req = 0

    def send_read(self, gsn: int) -> int:
        self.req += 1
        self.dealer.send(wire.encode(wire.Read(req_id=self.req, gsn=gsn)))
        return self.req

    def answer(self, req: int) -> wire.Reply:
        self.rt.run_until(lambda: bool(self.got), int(TIMEOUT * 1e9))
        assert self.got, "no answer"
        reply = wire.decode_reply(self.got.pop(0))
        assert reply.req_id == req, reply
        return reply

    def read(self, gsn: int) -> wire.Reply:
        return self.answer(self.send_read(gsn))

    def read_past(self, gsn: int, passing: Callable[[wire.Error], bool]) -> wire.Reply:
        """READ ``gsn`` again while the answer is an error ``passing`` says will pass (a
        table the replica has yet to load, a lease it has yet to renew): the first other
        answer. Each ask is a round trip."""
        for _ in range(10_000):
            reply = self.read(gsn)
            if not (type(reply) is wire.Error and passing(reply)):
                return reply
        raise AssertionError(f"still {reply!r}")

    def close(self) -> None:
        self.rt.close()


def _refused(reply: wire.Reply) -> bool:
    return type(reply) is wire.Error and reply.code in (wire.E_FORBIDDEN, wire.E_REGISTRY_LAPSED)


def test_a_paused_replica_refuses_keys_removed_while_it_slept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The outsider's report: one storage replica hung (SIGSTOP) while ``ziplog client
    remove`` ran; woken, it served the removed key's READ on the open connection and on a
    new one. Now the remove that cannot wait out the replica's lease fails naming it, the
    one that can names it as unconfirmed, and the woken replica refuses both keys on both
    connections; once it has read the registry, FORBIDDEN."""
    from ziplog.io.zk_clients import ClientRegistry
    from ziplog.protocol.layout import CLIENTS_LOADED, SHARDS, dec
    from ziplog.tools import cli
    from ziplog.tools.cluster import local_cluster

    with local_cluster(shards=1, replicas=2, data_dir=tmp_path, curve=True, mms_replicas=1, fh_replicas=1,
                       server_args=["--registry-lease-s", str(LEASE_S)]) as cluster:
        with cluster.client(timeout=TIMEOUT) as member:
            seed = member.insert_after(b"seed")
        keys = {name: cluster.add_client(name, "read") for name in ("hasty", "patient")}
        zkc = cluster._zkc
        addr = dec(zkc.get(f"{SHARDS}/0/1")[0])["addr"]
        pid = cluster.servers[(0, 1)].pid

        # a connection each that stays open, served once the replica's table holds the key
        opened = {n: Connection(addr, k) for n, k in keys.items()}
        try:
            for n, conn in opened.items():
                reply = conn.read_past(seed.gsn, lambda r: r.code == wire.E_FORBIDDEN and "not registered" in r.message)
                assert type(reply) is wire.ReadOk, (n, reply)

            remove = ["client", "remove", "--zk", cluster.zk_hosts, "--cluster-key-file", str(cluster.key_file)]
            os.kill(pid, signal.SIGSTOP)
            try:
                capsys.readouterr()
                hasty_rc = cli.main([*remove, "hasty", "--timeout", "1.5"])  # shorter than the lease
                hasty = capsys.readouterr()
                patient_rc = cli.main([*remove, "patient"])
                patient = capsys.readouterr()
                # sent while it sleeps: the first thing it reads when it wakes
                asked = {n: conn.send_read(seed.gsn) for n, conn in opened.items()}
            finally:
                os.kill(pid, signal.SIGCONT)

            for n, conn in opened.items():
                reply = conn.answer(asked[n])
                assert _refused(reply), (n, "served on the open connection", reply)
            for n, k in keys.items():
                fresh = Connection(addr, k)
                try:
                    reply = fresh.read(seed.gsn)
                finally:
                    fresh.close()
                assert _refused(reply), (n, "served on a new connection", reply)

            registry = ClientRegistry(zkc, cluster.key)
            name = next(n for n in registry.loaded() if n.startswith(f"storage0.1-{pid}@"))
            assert hasty_rc == 1, hasty
            assert "did not confirm it" in hasty.err and name in hasty.err, hasty.err
            assert patient_rc == 0, patient
            assert "registry lease has run out" in patient.out and name in patient.out, patient.out

            # woken, it reads the registry (and its lease holds again: until then, each
            # ask is answered REGISTRY_LAPSED at once): the keys are not registered
            version = registry.read()[1]
            assert _wait_node(zkc, f"{CLIENTS_LOADED}/{name}", lambda v: v >= version)
            for n, conn in opened.items():
                reply = conn.read_past(seed.gsn, lambda r: r.code == wire.E_REGISTRY_LAPSED)
                assert type(reply) is wire.Error and reply.code == wire.E_FORBIDDEN, (n, reply)
                assert "not registered" in reply.message
        finally:
            for conn in opened.values():
                conn.close()


def _wait_node(zkc: Any, path: str, ok: Callable[[int], bool]) -> bool:
    """Until the confirmation node at ``path`` says a version ``ok`` takes (a watch)."""
    from ziplog.protocol.layout import dec

    done = threading.Event()

    def changed(data: bytes | None, stat: Any) -> bool | None:
        if data is not None:
            doc = dec(data)
            if isinstance(doc, dict) and ok(doc.get("version", -1)):
                done.set()
                return False  # no more calls
        return None

    zkc.DataWatch(path, changed)
    return done.wait(TIMEOUT)

