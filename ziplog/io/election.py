"""The ``ElectionPort`` on kazoo, with failover in well under a second.

Contenders queue in a kazoo ``Election`` (sequential ephemeral nodes; the lowest leads).
Waiting for a dead leader's session to expire would take the session timeout (10 s):
instead the leader proves it is alive by rewriting its own node every
``HEARTBEAT_NS`` (the driver calls :meth:`Election.heartbeat` from its loop, so a
leader whose loop is stuck stops too), and every follower watches the leader's node:
one that did not change for ``SILENCE_NS`` is deleted, with the version the follower
saw (a leader that just beat keeps its node), and the next contender leads at once.

Deposing is safe even when the old leader is alive but slow: it learns it was deposed
from its next heartbeat (its node is gone) and stops, and until then every decision
either leader acts on is in ZooKeeper first behind a version check (the MMS's epoch
blocks, the failure handler's recovery records), so the slow one's next write fails and
it steps down. Nothing here decides anything a driver acts on; it only moves the
leadership sooner.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any, Callable

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, KazooException, NoNodeError
from kazoo.protocol.states import KazooState

log = logging.getLogger("ziplog.election")

#: how often a leader rewrites its node
HEARTBEAT_NS = 100_000_000
#: a leader whose node did not change for this long is deposed (eight missed beats: a
#: loaded machine's pauses do not depose a live leader, and a dead one is replaced
#: within about a second of its death)
SILENCE_NS = 800_000_000
#: how often a follower looks at the leader's node
WATCH_EVERY_S = 0.1

_CONTENDER = re.compile(r"__lock__(\d{10})$")


class Election:
    """A thread contends with a kazoo ``Election``; while this replica leads, that thread
    waits until the driver resigns, the session is in doubt, or the replica is deposed
    (then the driver is told to stop at once). Another thread, while it follows, deposes
    a silent leader. ``on_elected``/``on_lost`` run on the driver's runtime."""

    def __init__(self, zk: KazooClient, rt: Any) -> None:
        self.zk = zk
        self.rt = rt
        self._end_term = threading.Event()
        self._closed = threading.Event()
        self._on_lost: Callable[[], None] | None = None
        self._path = ""
        #: this replica's node while it leads (its heartbeats rewrite it)
        self._own: str | None = None
        self._identifier = b""
        self._election: Any = None
        self.deposed = 0  # leaders this replica deposed
        zk.add_listener(self._on_state)

    def run_election(self, path: str, identifier: str, on_elected: Callable[[], None],
                     on_lost: Callable[[], None]) -> None:
        self._on_lost = on_lost
        self._path = path
        self._identifier = identifier.encode()
        election = self._election = self.zk.Election(path, identifier=identifier)

        def lead() -> None:
            self._end_term.clear()
            node = election.lock.node
            self._own = f"{path}/{node}" if node else None
            self.rt.call_soon_threadsafe(on_elected)
            self._end_term.wait()
            self._own = None

        def contend() -> None:
            while not self._closed.is_set():
                try:
                    election.run(lead)
                except Exception:
                    if not self._closed.is_set():
                        log.exception("election round failed")
                    self._closed.wait(0.1)

        threading.Thread(target=contend, name=f"election-{path}", daemon=True).start()
        threading.Thread(target=self._watch_leader, name=f"leader-watch-{path}", daemon=True).start()

    # -- the leader's side ----------------------------------------------------------------------
    def heartbeat(self) -> None:
        """Called by the leading driver every HEARTBEAT_NS: rewrite our node. If it is gone,
        we were deposed (or our session ended): stop leading."""
        own = self._own
        if own is None:
            return
        try:
            reply = self.zk.set_async(own, self._identifier)
        except KazooException:
            return  # not connected: the state listener ends the term
        reply.rawlink(lambda r: self._beat_answered(own, r))

    def _beat_answered(self, own: str, reply: Any) -> None:
        try:
            reply.get()
        except NoNodeError:
            if self._own == own:
                log.warning("our leader node %s is gone: deposed as silent; stop leading", own)
                self._lose()
        except Exception:
            pass  # the connection is in doubt: the state listener decides

    # -- the followers' side ---------------------------------------------------------------------
    def _watch_leader(self) -> None:
        seen: tuple[str, int] | None = None
        since = time.monotonic_ns()
        while not self._closed.wait(WATCH_EVERY_S):
            if self._own is not None or self.zk.state != KazooState.CONNECTED:
                seen = None
                continue
            try:
                leader = self._leader_node()
                mine = self._election.lock.node if self._election is not None else None
                if leader is None or (mine is not None and leader.endswith("/" + mine)):
                    seen = None
                    continue
                _, stat = self.zk.get(leader)
            except NoNodeError:
                seen = None
                continue
            except KazooException:
                seen = None  # we cannot see ZooKeeper well: judge nobody
                continue
            now = time.monotonic_ns()
            if seen != (leader, stat.version):
                seen, since = (leader, stat.version), now
                continue
            if now - since < SILENCE_NS:
                continue
            try:
                self.zk.delete(leader, version=stat.version)
            except (BadVersionError, NoNodeError):
                pass  # it beat just now, or it is gone already
            except KazooException:
                pass
            else:
                self.deposed += 1
                log.warning("leader node %s silent for %d ms: deposed", leader, (now - since) // 1_000_000)
            seen = None

    def _leader_node(self) -> str | None:
        children = self.zk.get_children(self._path)
        contenders = [(m.group(1), c) for c in children if (m := _CONTENDER.search(c))]
        if not contenders:
            return None
        return f"{self._path}/{min(contenders)[1]}"

    # -- either side -----------------------------------------------------------------------------
    def _lose(self) -> None:
        self._own = None
        self._end_term.set()
        if self._on_lost is not None:
            self.rt.call_soon_threadsafe(self._on_lost)

    def _on_state(self, state: str) -> None:
        if state != KazooState.CONNECTED:
            self._lose()

    def resign(self) -> None:
        self._own = None
        self._end_term.set()

    def close(self) -> None:
        self._closed.set()
        self._own = None
        self._end_term.set()
