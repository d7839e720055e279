"""A replicated control-plane process with one elected leader (the membership service,
the failure handler), as a driver: it contends through an :class:`ElectionPort` and is
told when it leads and when it must stop (the session is in doubt, or it stepped down).
Subclasses implement :meth:`ElectedDriver.lead_begin` and :meth:`ElectedDriver.lead_end`.
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol

from ziplog.io.election import HEARTBEAT_NS
from ziplog.io.ports import Runtime, Timer


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


class ElectedDriver:
    #: what the logs call this kind of replica
    kind = "replica"

    def __init__(self, rt: Runtime, election: ElectionPort, election_path: str, replica_id: int) -> None:
        self.rt = rt
        self.election = election
        self.election_path = election_path
        self.id = replica_id
        self.leading = False
        self.log = logging.getLogger(self.kind)
        self._beat: Timer | None = None

    def contend(self) -> None:
        self.election.run_election(self.election_path, str(self.id), self._elected, self._lost)

    def _elected(self) -> None:
        if self.leading:
            return
        self.leading = True
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
