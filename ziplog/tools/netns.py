"""Several hosts on one Linux machine: network namespaces, each with an address of its
own, joined by veth pairs to a bridge in this namespace (which gets the subnet's first
address: this host is the operator's machine, and can reach every other one).

A cluster placed on them (:class:`NetnsPlacement`) runs as on separate machines: three
control hosts, each with a ZooKeeper node, an MMS replica and a failure handler replica;
one host per storage replica; one client host. Every process binds and advertises its
host's address, so nothing travels over loopback. Taking a host's link down partitions
it from all the others. Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and ``ip``
(iproute2); :func:`unavailable` says why not when it cannot work.

    ziplog cluster up --netns [--shards N] [--replicas N]

starts that layout in the foreground for anyone to try (Ctrl-C stops it and removes
every namespace and link).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from types import TracebackType
from typing import Iterable, Sequence

from ziplog.tools.placement import Host, Placement

#: the control hosts: a ZooKeeper node, an MMS replica and a failure handler replica each
CONTROL_HOSTS = 3
#: addresses: 10.231.<net>.0/24, the bridge .1, the hosts from .10 on
SUBNET_FMT = "10.231.{net}.{host}"
FIRST_HOST = 10
#: held while a bed picks its subnet and makes its bridge
_LOCK_FILE = "/run/ziplog-netns.lock"


class NetnsError(RuntimeError):
    """A namespace, link or address could not be made."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def unavailable() -> str | None:
    """Why network namespaces cannot be used here (None: they can)."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "not running as root (making namespaces needs CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    probe = f"zlprobe{os.getpid() % 100000}"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"the kernel refused a network namespace: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class NetnsBed:
    """Hosts named ``names``, each a network namespace with one address on a shared
    bridge; use as a context manager (everything is removed on exit, also after an
    error). ``tag`` keeps two beds on one machine apart (default: from the pid)."""

    def __init__(self, names: Sequence[str], tag: int | None = None) -> None:
        if len(set(names)) != len(names) or len(names) > 240:
            raise ValueError("host names must be distinct, at most 240")
        self.tag = (os.getpid() if tag is None else tag) % 10000
        self.net = self.tag % 250
        self.bridge = f"zlbr{self.tag}"
        self.gateway = SUBNET_FMT.format(net=self.net, host=1)
        self.hosts: dict[str, Host] = {}
        #: host name -> (namespace, this side's veth)
        self._links: dict[str, tuple[str, str]] = {}
        self._names = list(names)

    # -- making and removing ----------------------------------------------------------------------
    def __enter__(self) -> "NetnsBed":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def start(self) -> None:
        self._remove(self._names)  # what a run killed before its cleanup left behind
        with open(_LOCK_FILE, "a") as lock:
            # two beds on one machine (two `cluster up --netns`, two test workers) take
            # different subnets: the choice and the bridge that shows it, under one lock
            fcntl.flock(lock, fcntl.LOCK_EX)
            taken = _ip("-o", "-4", "addr", "show").stdout
            for _ in range(250):
                if f" {self.gateway}/" not in taken:
                    break
                self.net = (self.net + 1) % 250
                self.gateway = SUBNET_FMT.format(net=self.net, host=1)
            else:
                raise NetnsError("every 10.231.x.0/24 subnet is taken by another bed")
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self._names):
            ns, outside, inside = self._names_of(i, name)
            addr = SUBNET_FMT.format(net=self.net, host=FIRST_HOST + i)
            _ip("netns", "add", ns)
            self._links[name] = (ns, outside)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", ns)
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inside)
            _ip("-n", ns, "link", "set", inside, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.hosts[name] = Host(addr=addr, prefix=("ip", "netns", "exec", ns), name=name)

    def close(self) -> None:
        self._remove(self._names)
        self.hosts.clear()
        self._links.clear()

    def _names_of(self, i: int, name: str) -> tuple[str, str, str]:
        """(namespace, this side's veth, the namespace's veth); link names fit IFNAMSIZ."""
        return f"zl{self.tag}-{name}", f"zv{self.tag}-{i}", f"zi{self.tag}-{i}"

    def _remove(self, names: Iterable[str]) -> None:
        for i, name in enumerate(names):
            ns, outside, _ = self._names_of(i, name)
            _ip("netns", "del", ns, check=False)  # its veth end goes with it, and the pair
            _ip("link", "del", outside, check=False)
        _ip("link", "del", self.bridge, check=False)

    # -- faults -----------------------------------------------------------------------------------
    def link_down(self, name: str) -> None:
        """Cut host ``name`` off from every other host (its cable pulled)."""
        _ip("link", "set", self._links[name][1], "down")

    def link_up(self, name: str) -> None:
        _ip("link", "set", self._links[name][1], "up")


def cluster_host_names(shards: int, replicas: int) -> list[str]:
    """The hosts a :class:`NetnsPlacement` of ``shards`` x ``replicas`` needs."""
    return ([f"ctl{i}" for i in range(CONTROL_HOSTS)]
            + [f"s{s}r{r}" for s in range(shards) for r in range(replicas)] + ["client"])


class NetnsPlacement(Placement):
    """ZooKeeper node i, MMS replica i and failure handler replica i on host ``ctl<i>``;
    storage replica r of shard s on ``s<s>r<r>``."""

    def __init__(self, bed: NetnsBed) -> None:
        self.bed = bed

    def zookeeper(self, i: int) -> Host:
        return self.bed.hosts[f"ctl{i % CONTROL_HOSTS}"]

    def mms(self, i: int) -> Host:
        return self.bed.hosts[f"ctl{i % CONTROL_HOSTS}"]

    def failure_handler(self, i: int) -> Host:
        return self.bed.hosts[f"ctl{i % CONTROL_HOSTS}"]

    def server(self, shard: int, replica: int) -> Host:
        return self.bed.hosts[f"s{shard}r{replica}"]
