"""A replicated control-plane process with one elected leader (the membership service,
the failure handler): its ZooKeeper session, the kazoo Election loop, losing leadership
with the session, and the signal handling of its ``main``. Subclasses implement
:meth:`ElectedReplica.lead`, which runs while this replica leads and returns (or raises)
to step down; it must stop once ``lost`` is set."""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

import zmq
from kazoo.protocol.states import KazooState

from ziplog.io import zk as discovery


class ElectedReplica:
    #: what the logs call this kind of replica
    kind = "replica"

    def __init__(self, zk_hosts: str, replica_id: int, election_path: str) -> None:
        self.id = replica_id
        self.election_path = election_path
        self.log = logging.getLogger(self.kind)
        self.zk = discovery.connect(zk_hosts)
        self.ctx = zmq.Context()
        self.running = True
        self.is_leader = False
        #: set when the ZooKeeper session is in doubt: stop leading until we are sure again
        self.lost = threading.Event()
        self.zk.add_listener(self._on_zk_state)

    def _on_zk_state(self, state: str) -> None:
        if state != KazooState.CONNECTED:
            self.lost.set()

    def run(self) -> None:
        election = self.zk.Election(self.election_path, identifier=str(self.id))
        while self.running:
            try:
                election.run(self._lead)
            except Exception:
                self.log.exception("election round failed")
                time.sleep(0.1)

    def _lead(self) -> None:
        self.lost.clear()
        self.is_leader = True
        self.log.info("%s %d is leader", self.kind, self.id)
        try:
            self.lead()
        finally:
            self.is_leader = False
            self.log.info("%s %d stops leading", self.kind, self.id)

    def lead(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        """Register in ZooKeeper (before :meth:`run`)."""

    def close(self) -> None:
        self.running = False
        try:
            self.zk.stop()
            self.zk.close()
        except Exception:
            pass
        self.ctx.destroy(linger=0)


def serve(replica: ElectedReplica) -> int:
    """A ``main``'s body: run until SIGTERM/SIGINT, then close."""

    def stop(signum: int, frame: Any) -> None:
        replica.running = False
        replica.lost.set()
        if not replica.is_leader:
            raise SystemExit(0)  # a follower may be blocked inside the election

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    replica.start()
    try:
        replica.run()
    finally:
        replica.close()
    return 0
