"""A replicated control-plane process with one elected leader (the membership service,
the failure handler), as a driver: it contends through an :class:`ElectionPort` and is
told when it leads and when it must stop (the session is in doubt, or it stepped down).
Subclasses implement :meth:`ElectedDriver.lead_begin` and :meth:`ElectedDriver.lead_end`.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Callable, Protocol, Sequence

from ziplog.io.election import HEARTBEAT_NS
from ziplog.io.ports import Runtime, Timer
from ziplog.protocol.auth import ClusterKey


class ElectionPort(Protocol):
    def run_election(self, path: str, identifier: str, on_elected: Callable[[], None],
                     on_lost: Callable[[], None]) -> None:
        """Contend for leadership at ``path``, for good; ``on_elected`` and ``on_lost`` are
        called on the driver's runtime (``on_lost`` when the session is in doubt, or after
        :meth:`resign`). A replica that stops leading contends again."""

    def resign(self) -> None:
        """Give up leadership (and contend again)."""

    def heartbeat(self) -> None:
        """The leader is alive: called by the leading driver every ``HEARTBEAT_NS`` from
        its own loop (followers depose a leader that stops)."""

    def fence(self) -> str | None:
        """The lock this replica leads by (its election node) while it leads, else None:
        every write the leader makes in ZooKeeper checks, in the same transaction, that
        the lock is still there (a deposed leader's is gone)."""


class ElectedDriver:
    #: what the logs call this kind of replica
    kind = "replica"

    def __init__(self, rt: Runtime, election: ElectionPort, election_path: str, replica_id: int) -> None:
        self.rt = rt
        self.election = election
        self.election_path = election_path
        self.id = replica_id
        self.leading = False
        #: the lock of the current term (:meth:`ElectionPort.fence`): each of its ZooKeeper
        #: writes checks it; None while not leading, and a write without one is refused
        self.fence: str | None = None
        self.log = logging.getLogger(self.kind)
        self._beat: Timer | None = None

    def contend(self) -> None:
        self.election.run_election(self.election_path, str(self.id), self._elected, self._lost)

    def _elected(self) -> None:
        if self.leading:
            return
        self.leading = True
        self.fence = self.election.fence()
        self.log.info("%s %d is leader", self.kind, self.id)
        self._on_beat()
        self.lead_begin()

    def _on_beat(self) -> None:
        self._beat = None
        if not self.leading:
            return
        self.election.heartbeat()
        self._beat = self.rt.call_at(self.rt.now() + HEARTBEAT_NS, self._on_beat)

    def _lost(self) -> None:
        if not self.leading:
            return
        self.leading = False
        self.fence = None
        self.log.info("%s %d stops leading", self.kind, self.id)
        if self._beat is not None:
            self._beat.cancel()
            self._beat = None
        self.lead_end()

    def step_down(self, why: str) -> None:
        """Another leader exists (a version check failed): stop, and contend again."""
        self.log.warning("%s %d steps down: %s", self.kind, self.id, why)
        self._lost()
        self.election.resign()

    def lead_begin(self) -> None:
        raise NotImplementedError

    def lead_end(self) -> None:
        raise NotImplementedError


# -- the process around an elected driver (the MMS's and the failure handler's mains) ---------
def elected_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The flags every elected control-plane replica takes first: ``--zk``, ``--id`` and
    its address; :func:`parse_elected_args` adds the rest."""
    from ziplog.shell.process import add_address_arguments, add_security_arguments

    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--zk", required=True)
    ap.add_argument("--id", type=int, required=True)
    add_address_arguments(ap)
    add_security_arguments(ap)
    return ap


def parse_elected_args(ap: argparse.ArgumentParser, argv: Sequence[str] | None, role: str,
                       log_name: str) -> tuple[argparse.Namespace, ClusterKey]:
    """Add the cluster key, metrics and log flags, parse ``argv`` (with the config file's
    ``[role]``), and set up the process's logging as ``log_name`` + its id: the
    arguments and the cluster key."""
    from ziplog.shell.config import parse_args
    from ziplog.shell.logs import add_log_arguments, configure_logging
    from ziplog.shell.metrics import add_metrics_arguments
    from ziplog.shell.process import add_cluster_key_argument, check_address_arguments, load_cluster_key

    add_cluster_key_argument(ap)
    add_metrics_arguments(ap)
    add_log_arguments(ap)
    args = parse_args(ap, argv, role)
    check_address_arguments(ap, args, one_port=False)
    key = load_cluster_key(args.cluster_key_file)
    configure_logging(args, f"{log_name}{args.id}")
    return args, key


def run_elected(args: argparse.Namespace, rt: Any, driver: Any, coord: Any) -> int:
    """Start ``driver`` and its metrics endpoint, and serve until SIGTERM/SIGINT."""
    from ziplog.shell.metrics import serve_metrics
    from ziplog.shell.process import serve_forever

    driver.start()
    metrics = serve_metrics(args, driver.metrics)
    return serve_forever(rt, metrics, driver, coord)


def open_member_report(key: ClusterKey, frame: bytes, decode: Any, bad_input: Callable[..., None],
                       what: str) -> Any:
    """A report a cluster member sealed (a primary's RATE, a replica's SUSPECT), opened
    and decoded by ``decode`` (one of ``frames``' edge decoders); None, with a throttled
    line through ``bad_input``, when it is not one."""
    from ziplog.protocol import frames as wire

    try:
        return wire.open_signed(key, frame, decode)
    except wire.ProtocolError as exc:
        bad_input(f"bad {what} dropped", exc)
        return None
