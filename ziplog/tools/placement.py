"""Where the processes of a local cluster run: on loopback (the default), or each on a
host of its own (a Linux network namespace with its own address, see
:mod:`ziplog.tools.netns`), as on several machines."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    """A place to run a process: the address it binds (and advertises) and the command
    prefix that puts it there (``ip netns exec NAME``; none on this host)."""

    addr: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()
    name: str = "localhost"

    def wrap(self, argv: list[str]) -> list[str]:
        return [*self.prefix, *argv]

    def bind_args(self) -> list[str]:
        """A server's flags to listen on this host's address (and register it)."""
        return [] if self.addr == LOOPBACK.addr else ["--bind", self.addr]


LOOPBACK = Host()


class Placement:
    """Which host each process of a cluster runs on: everything on loopback here; a
    test bed of namespaces gives each role its own hosts."""

    def zookeeper(self, i: int) -> Host:
        return LOOPBACK

    def mms(self, i: int) -> Host:
        return LOOPBACK

    def failure_handler(self, i: int) -> Host:
        return LOOPBACK

    def server(self, shard: int, replica: int) -> Host:
        return LOOPBACK
