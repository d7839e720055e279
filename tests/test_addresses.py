"""Bind and advertised addresses: the rules (pure), and a cluster whose processes bind
wildcards and IPv6 and register what they advertise, on real processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ziplog
from ziplog import RID_GENESIS
from ziplog.protocol import layout
from ziplog.protocol.addresses import AddressError, advertised, check_bind_host, parse_host_port, tcp_addr
from ziplog.protocol.zmtp import parse_endpoint


@pytest.mark.parametrize("host,port,addr", [
    ("127.0.0.1", 5, "tcp://127.0.0.1:5"), ("::1", 7, "tcp://[::1]:7"), ("[fe80::1]", 9, "tcp://[fe80::1]:9"),
    ("10.1.2.3", 65535, "tcp://10.1.2.3:65535")])
def test_tcp_addresses_round_trip(host: str, port: int, addr: str) -> None:
    assert tcp_addr(host, port) == addr
    assert parse_endpoint(addr) == (host.strip("[]"), port)


def test_what_is_advertised() -> None:
    assert advertised("tcp://10.0.0.5:7000", None) == "tcp://10.0.0.5:7000"
    assert advertised("tcp://0.0.0.0:7000", "10.0.0.5") == "tcp://10.0.0.5:7000"
    assert advertised("tcp://0.0.0.0:7000", "host-a.example:9000") == "tcp://host-a.example:9000"
    assert advertised("tcp://[::]:7000", "fd00::5") == "tcp://[fd00::5]:7000"
    assert advertised("tcp://[::]:7000", "[fd00::5]:8000") == "tcp://[fd00::5]:8000"
    with pytest.raises(AddressError, match="--advertise"):
        advertised("tcp://0.0.0.0:7000", None)  # nobody can dial 0.0.0.0
    with pytest.raises(AddressError, match="wildcard"):
        advertised("tcp://10.0.0.5:7000", "0.0.0.0")


def test_bind_hosts_and_host_ports() -> None:
    assert check_bind_host("0.0.0.0") == "0.0.0.0"
    assert check_bind_host("::") == "::"
    assert check_bind_host("[::1]") == "::1"
    for bad in ("localhost", "10.0.0", "fe80::zz"):
        with pytest.raises(AddressError):
            check_bind_host(bad)
    assert parse_host_port("h:1") == ("h", 1)
    assert parse_host_port("[::1]:2") == ("::1", 2)
    assert parse_host_port("::1") == ("::1", None)
    assert parse_host_port("[::1]") == ("::1", None)
    for bad in ("", "h:x", "[::1", "[::1]x", ":5"):
        with pytest.raises(AddressError):
            parse_host_port(bad)


@pytest.mark.parametrize("module", ["ziplog.server", "mms.server", "failure_handler.server",
                                    "ziplog.logdb.kvshard", "ziplog.logbook.index_node"])
def test_a_wildcard_bind_without_an_advertised_address_is_a_usage_error(module: str) -> None:
    """Refused before anything is bound or registered, with the flag to use named."""
    argv = {"ziplog.server": ["--shard", "0", "--replica", "0"], "mms.server": ["--id", "0"],
            "failure_handler.server": ["--id", "0"], "ziplog.logdb.kvshard": ["--index", "0", "--shards", "1",
                                                                             "--data-dir", "/nonexistent"],
            "ziplog.logbook.index_node": ["--node", "0"]}[module]
    done = subprocess.run([sys.executable, "-m", module, "--zk", "127.0.0.1:9", *argv, "--bind", "0.0.0.0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--advertise" in done.stderr, done.stderr


def test_a_cluster_bound_to_wildcards_and_ipv6_registers_and_serves_what_it_advertises() -> None:
    """Storage replicas bind every IPv6 interface and advertise ::1; the MMS binds ::1
    (libzmq's PUB and PULL over IPv6); the failure handlers bind 0.0.0.0 and advertise
    127.0.0.3. Replicas, clients and the control plane dial what is registered. A
    wildcard is not loopback, so the replicas and handlers would speak CURVE by default:
    the whole cluster does (``curve=True``; one mechanism per cluster), over IPv6 too."""
    with ziplog.local_cluster(shards=1, replicas=2, server_args=["--bind", "::", "--advertise", "::1"],
                              mms_args=["--bind", "::1"], fh_args=["--bind", "0.0.0.0", "--advertise", "127.0.0.3"],
                              mms_replicas=1, fh_replicas=1, curve=True) as cluster:
        with cluster.client() as c:
            addrs = c.topology.replica_addrs(0)
            assert addrs is not None and all(a.startswith("tcp://[::1]:") for a in addrs), addrs
            rids = [c.insert_after(b"v6-%d" % i) for i in range(50)]
            with c.subscribe(RID_GENESIS, end=max(r.gsn for r in rids)) as sub:
                got = [r.data for r in sub if r.data.startswith(b"v6-")]
            assert got == [b"v6-%d" % i for i in sorted(range(50), key=lambda i: rids[i].gsn)]
        zk = cluster._zkc
        mms = [zk.get(f"{layout.MMS_REPLICAS}/{child}")[0] for child in zk.get_children(layout.MMS_REPLICAS)]
        assert mms and all(m.count(b"tcp://[::1]:") == 2 for m in mms), mms
        fh = [zk.get(f"{layout.FH_REPLICAS}/{child}")[0] for child in zk.get_children(layout.FH_REPLICAS)]
        assert fh and all(b"tcp://127.0.0.3:" in m for m in fh), fh
