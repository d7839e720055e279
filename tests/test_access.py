"""Keys and rights on real processes: a cluster that speaks CURVE (``local_cluster(curve=True)``:
storage replicas, MMS and failure handlers with ``--curve``), clients without a key, with
a key it never registered, with a key file naming another cluster's server, and with each
single right, against INSERT, READ, SUBSCRIBE, TRIM, STATUS and the operator verbs: every
refusal typed, nothing changed (the replicas' records and trim points, read as the
cluster); a key removed while its subscription runs ends that subscription with
FORBIDDEN, and its next request is refused; refusals counted where the operator looks."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from ziplog.client.blocking import Client
from ziplog.io.keys import new_keypair, write_key_file
from ziplog.protocol.errors import ForbiddenError, UnauthenticatedError
from ziplog.protocol.types import RID_GENESIS, RecordId
from ziplog.tools import cli
from ziplog.tools.cluster import LocalCluster, local_cluster

TIMEOUT = 10.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(shards=1, replicas=2, data_dir=tmp_path_factory.mktemp("curve"), curve=True) as c:
        yield c


@pytest.fixture(scope="module")
def seeded(cluster: LocalCluster) -> RecordId:
    """A record the cluster itself wrote (its own key holds every right)."""
    with cluster.client(timeout=TIMEOUT) as member:
        return member.insert_after(b"seed")  # type: ignore[no-any-return]


def facts(cluster: LocalCluster) -> list[tuple[int, int, int]]:
    """What a refused request must not change: each replica's (records, trim point,
    subscriptions), read as the cluster (the frontier moves with the epochs)."""
    with cluster.client(timeout=TIMEOUT) as member:
        st = member.status()
    return [(r["records"], r["trim_point"], r["subscriptions"]) for row in st.values() for r in row]


def ops(c: Client, seeded: RecordId) -> dict[str, Callable[[], Any]]:
    def subscribe() -> Any:
        with c.subscribe(RID_GENESIS) as sub:
            return sub.next(timeout=TIMEOUT)

    return {
        "append": lambda: c.insert_after(b"by a client"),
        "read": lambda: c.read_record(seeded),
        "subscribe": subscribe,
        "trim": lambda: c.trim(RecordId(seeded.gsn, seeded.shard)),
        "admin": lambda: c.status(),
    }


OP_RIGHT = {"append": "append", "read": "read", "subscribe": "read", "trim": "trim", "admin": "admin"}


@pytest.mark.parametrize("right", ["append", "read", "trim", "admin"])
def test_each_single_right(cluster: LocalCluster, seeded: RecordId, right: str) -> None:
    key = cluster.add_client(f"only-{right}", right)
    with Client(cluster.zk_hosts, key_file=str(key), timeout=TIMEOUT) as c:
        for op, call in ops(c, seeded).items():
            if OP_RIGHT[op] == right:
                if op != "trim":  # a trim would delete the seed the others read: it is run last, below
                    assert call() is not None or op == "trim"
                continue
            before = facts(cluster)
            with pytest.raises(ForbiddenError, match=f"lacks the '{OP_RIGHT[op]}' right"):
                call()
            assert facts(cluster) == before, f"a refused {op} changed something"


def test_no_key_and_a_wrong_server_key_are_refused_at_the_handshake(cluster: LocalCluster, seeded: RecordId,
                                                                     tmp_path: Path) -> None:
    stranger = new_keypair()
    wrong_server = tmp_path / "wrong-server.key"
    write_key_file(str(wrong_server), "lost", stranger, new_keypair().public)
    for key_file in (None, str(wrong_server)):
        with Client(cluster.zk_hosts, timeout=TIMEOUT, key_file=key_file) as c:
            for op, call in ops(c, seeded).items():
                if op == "admin":
                    continue  # status reports per replica; covered by the wrong-key test
                before = facts(cluster)
                with pytest.raises(UnauthenticatedError, match="refused the connection"):
                    call()
                assert facts(cluster) == before


def test_an_unregistered_key_is_forbidden_everything(cluster: LocalCluster, seeded: RecordId, tmp_path: Path) -> None:
    unknown = tmp_path / "unknown.key"
    write_key_file(str(unknown), "nobody", new_keypair(), cluster.key.curve_server().public)
    with Client(cluster.zk_hosts, key_file=str(unknown), timeout=TIMEOUT) as c:
        for op, call in ops(c, seeded).items():
            before = facts(cluster)
            with pytest.raises(ForbiddenError, match="not registered"):
                call()
            assert facts(cluster) == before


def test_revocation_ends_a_running_subscription(cluster: LocalCluster, seeded: RecordId) -> None:
    key = cluster.add_client("reader", "read,append")
    with Client(cluster.zk_hosts, key_file=str(key), timeout=TIMEOUT) as c:
        sub = c.subscribe(RID_GENESIS)
        try:
            assert sub.next(timeout=TIMEOUT) is not None
            version = cluster.remove_client("reader")
            _wait_applied(cluster, version)
            with pytest.raises(ForbiddenError):
                for _ in range(1000):
                    if sub.next(timeout=TIMEOUT) is None:
                        break
            with pytest.raises(ForbiddenError, match="not registered"):
                c.insert_after(b"after revocation")
        finally:
            sub.close()


def _wait_applied(cluster: LocalCluster, version: int) -> None:
    """Until every storage process confirmed registry ``version`` (``ziplog client remove``'s wait)."""
    import time

    from ziplog.io.zk_clients import ClientRegistry
    from ziplog.tools.cli_clients import vouch_removal
    vouched = vouch_removal(ClientRegistry(cluster._zkc, cluster.key), version, time.monotonic(), TIMEOUT)
    assert vouched.confirmed and not vouched.lapsed and not vouched.unknown, vouched


def test_refusals_are_counted(cluster: LocalCluster, seeded: RecordId) -> None:
    key = cluster.add_client("counted", "append")
    with Client(cluster.zk_hosts, key_file=str(key), timeout=TIMEOUT) as c:
        with pytest.raises(ForbiddenError):
            c.read_record(seeded)
    with cluster.client(timeout=TIMEOUT) as member:
        st = member.status()
    assert sum(r["forbidden"] for row in st.values() for r in row) >= 1


def test_operator_verbs_need_the_cluster_key(cluster: LocalCluster, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A client key is no cluster key: registry verbs refuse without it (and with another
    cluster's), and with it they work, the list showing what was added."""
    monkeypatch.delenv("ZIPLOG_CLUSTER_KEY_FILE", raising=False)
    other = tmp_path / "other.key"
    assert cli.main(["keygen", str(other)]) == 0
    for args in ([], ["--cluster-key-file", str(other)]):
        with pytest.raises(SystemExit, match="no cluster key") if not args else contextlib.nullcontext():
            rc = cli.main(["client", "list", "--zk", cluster.zk_hosts, *args])
            assert rc == 1
        capsys.readouterr()
    out_key = tmp_path / "ops.key"
    assert cli.main(["client", "add", "ops", "--rights", "admin", "--out", str(out_key), "--zk", cluster.zk_hosts,
                     "--cluster-key-file", str(cluster.key_file)]) == 0
    assert cli.main(["client", "list", "--zk", cluster.zk_hosts, "--cluster-key-file", str(cluster.key_file)]) == 0
    listing = capsys.readouterr().out
    assert "ops" in listing and "admin" in listing
    server_key = listing.split("server key: ")[1].split()[0]
    # a client's own key pair, registered by its public key
    own = tmp_path / "own.key"
    assert cli.main(["keygen", "--client", str(own), f"--server-key={server_key}"]) == 0
    public = capsys.readouterr().out.split("--public-key=")[1].split()[0]
    assert cli.main(["client", "add", "own", "--rights", "read", f"--public-key={public}", "--zk", cluster.zk_hosts,
                     "--cluster-key-file", str(cluster.key_file)]) == 0
    with Client(cluster.zk_hosts, key_file=str(own), timeout=TIMEOUT) as c:
        with pytest.raises(ForbiddenError, match="client 'own' lacks the 'append' right"):
            c.insert_after(b"read only")
    with Client(cluster.zk_hosts, key_file=str(out_key), timeout=TIMEOUT) as c:
        assert c.status()  # admin: STATUS works
        with pytest.raises(ForbiddenError):
            c.insert_after(b"no append")
    assert cli.main(["client", "remove", "ops", "--zk", cluster.zk_hosts,
                     "--cluster-key-file", str(cluster.key_file)]) == 0
    with Client(cluster.zk_hosts, key_file=str(out_key), timeout=TIMEOUT) as c:
        with pytest.raises(ForbiddenError, match="not registered"):
            c.status()


def test_the_trim_right_trims(cluster: LocalCluster) -> None:
    """Last: it deletes records below a point."""
    with cluster.client(timeout=TIMEOUT) as member:
        first = member.insert_after(b"to be trimmed")
        member.insert_after(b"kept", first)
    key = cluster.add_client("trimmer", "trim")
    with Client(cluster.zk_hosts, key_file=str(key), timeout=TIMEOUT) as c:
        c.trim(RecordId(first.gsn + 1, first.shard))
    with cluster.client(timeout=TIMEOUT) as member:
        from ziplog.protocol.errors import TrimmedError
        with pytest.raises(TrimmedError):
            member.read_record(first)
