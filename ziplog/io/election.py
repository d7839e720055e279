"""The ``ElectionPort`` on kazoo, with failover in well under a second when a leader's
process dies.

Contenders queue in a kazoo ``Election`` (sequential ephemeral nodes; the lowest leads).
Waiting for a dead leader's session to expire would take the session timeout (10 s).
Instead the next contender in line watches the leader two ways:

* **its process**: the leader listens on a port of its own for its term and names it
  in a beat node beside the election (``<path>-beat/<its lock node>``); the next
  contender holds a connection there, and when the leader's process dies its kernel
  ends that connection (:mod:`ziplog.io.death_watch`): the follower deposes it at once;
* **its loop**: the leader rewrites its beat node every ``HEARTBEAT_NS`` (the driver
  calls :meth:`Election.heartbeat` from its loop, so a leader whose loop is stuck stops
  beating, as does one cut off from ZooKeeper or whose machine died); a leader whose
  beat did not change for ``SILENCE_NS`` is deposed. One cut off from its follower
  alone keeps beating through ZooKeeper, and keeps its place.

Deposing is one transaction that deletes the leader's lock node and its beat and checks
the beat's version the follower saw (a leader that just beat keeps both); the next
contender then leads at once. The beat is a node of its own because kazoo's lock recipe
watches the lock node ahead of it: rewriting the lock node itself woke every waiting
contender's recipe (three ZooKeeper reads) on every beat. Every beat is a write that
every ZooKeeper node logs and fsyncs: with a death seen at once, the beats only have to
catch the rarer stuck leader (or one cut off from ZooKeeper, or whose machine died), so
they come once a second, not five times
(an idle cluster's ZooKeeper spent most of its CPU on them).

Deposing is safe even when the old leader is alive but slow: it learns it was deposed
from its next heartbeat (its node is gone) and stops, and until then every decision
either leader acts on is in ZooKeeper first, in a transaction that checks the writer's
own lock node (:meth:`Election.fence`) beside the versions it read (the MMS's epoch
blocks, the failure handler's recovery records): a deposed leader's node is gone, so the
slow one's next write fails and it steps down, whatever its versions say (a leader that
wakes from a long stall may run a timer before its heartbeat's answer tells it it lost).
Nothing here decides anything a driver acts on; it only moves the leadership sooner.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any, Callable

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NoNodeError
from kazoo.protocol.states import KazooState

from ziplog.io.death_watch import DeathWatch, DeathWatchListener, parse_beat

log = logging.getLogger("ziplog.election")

#: how often a leader rewrites its beat node (each is a ZooKeeper write: every node of
#: the ensemble logs and fsyncs it; beats every 100 ms cost the one-client insert p50
#: about 15% on two cores). A dead leader's process is seen at once without them.
HEARTBEAT_NS = 1_000_000_000
#: a leader whose beat did not change for this long is deposed (four missed beats: a
#: loaded machine's pauses do not depose a live leader); this is how long a stuck leader,
#: one cut off from ZooKeeper or one whose machine died keeps its place
SILENCE_NS = 4_000_000_000
#: how often a follower's clock looks at what the watch last saw (no ZooKeeper request)
WATCH_EVERY_S = 0.1
#: ... and when there is nothing to judge (we lead, or watch nobody): it looks again this often
LOOK_EVERY_S = 1.0

_CONTENDER = re.compile(r"__lock__(\d{10})$")


class Election:
    """A thread contends with a kazoo ``Election``; while this replica leads, that thread
    waits until the driver resigns, the session is in doubt, or the replica is deposed
    (then the driver is told to stop at once). Another thread, while it follows, deposes
    a silent leader. ``on_elected``/``on_lost`` run on the driver's runtime."""

    def __init__(self, zk: KazooClient, rt: Any, bind: str = "127.0.0.1", advertise: str | None = None) -> None:
        self.zk = zk
        self.rt = rt
        #: where a leader's death-watch port listens, and the host it names for others
        self._bind = bind
        self._advertise = advertise
        self._end_term = threading.Event()
        self._closed = threading.Event()
        #: wakes the leader-watch thread: the leader it watches changed, or we close
        self._kick = threading.Event()
        self._on_lost: Callable[[], None] | None = None
        self._path = ""
        #: this replica's lock node while it leads, and its beat node (heartbeats rewrite it)
        self._own: str | None = None
        self._own_beat = ""
        #: what our beat node holds while we lead (our death-watch port and token, or
        #: our identifier when we could not listen)
        self._beat_data = b""
        self._identifier = b""
        self._election: Any = None
        self._lock = threading.Lock()
        #: the leader's node, and (its version, when we saw it change) from its watch
        self._leader: str | None = None
        self._leader_seen: tuple[int, int] | None = None
        #: our connection to the leader's death-watch port, and whether it saw it die
        self._death_watch: DeathWatch | None = None
        self._leader_died = False
        #: set while we hold a death watch on the leader we would follow (for tests and
        #: diagnostics: until then only the beats can depose it)
        self.watching_leader = threading.Event()
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
            beat = self._beat_of(f"{path}/{node}")
            try:
                listener: DeathWatchListener | None = DeathWatchListener(self._bind, self._advertise)
            except OSError as exc:  # the followers fall back on the beats
                log.warning("cannot listen for the followers' death watch (%s): they go by the beats", exc)
                listener = None
            try:
                self._beat_data = listener.data if listener is not None else self._identifier
                try:
                    self.zk.create(beat, self._beat_data, ephemeral=True)
                except KazooException:
                    return  # not connected (or not ours to create): contend again
                self._own, self._own_beat = f"{path}/{node}", beat
                self.rt.call_soon_threadsafe(on_elected)
                self._end_term.wait()
                self._own = None
                try:
                    self.zk.delete(beat)
                except KazooException:
                    pass  # deposed (it is gone), or the session is: it goes with it
            finally:
                if listener is not None:
                    listener.close()

        def contend() -> None:
            while not self._closed.is_set():
                try:
                    election.run(lead)
                except Exception:
                    if not self._closed.is_set():
                        log.exception("election round failed")
                    self._closed.wait(0.1)

        threading.Thread(target=contend, name=f"election-{path}", daemon=True).start()
        self.zk.ensure_path(path)
        self.zk.ensure_path(path + "-beat")
        self.zk.ChildrenWatch(path, self._on_contenders)
        threading.Thread(target=self._watch_leader, name=f"leader-watch-{path}", daemon=True).start()

    # -- the leader's side ----------------------------------------------------------------------
    def _beat_of(self, lock_node: str) -> str:
        return f"{self._path}-beat/{lock_node.rsplit('/', 1)[1]}"

    def fence(self) -> str | None:
        """Our lock node while we lead (None otherwise): a leader's write in ZooKeeper
        checks it in the same transaction (a deposed leader's node is deleted; lock nodes
        are sequential, so a new term's is another)."""
        return self._own

    def heartbeat(self) -> None:
        """Called by the leading driver every HEARTBEAT_NS: rewrite our beat node, if our
        lock node is still there. If either is gone, we were deposed (or our session
        ended): stop leading."""
        own = self._own
        if own is None:
            return
        try:
            t = self.zk.transaction()
            t.check(own, -1)
            t.set_data(self._own_beat, self._beat_data)
            reply = t.commit_async()
        except KazooException:
            return  # not connected: the state listener ends the term
        reply.rawlink(lambda r: self._beat_answered(own, r))

    def _beat_answered(self, own: str, reply: Any) -> None:
        try:
            results = reply.get()
        except Exception:
            return  # the connection is in doubt: the state listener decides
        if any(isinstance(r, NoNodeError) for r in results) and self._own == own:
            log.warning("our leader node %s is gone: deposed as silent; stop leading", own)
            self._lose()

    # -- the followers' side ---------------------------------------------------------------------
    # Watches, not polling: a ChildrenWatch names the leader's node (it fires when a
    # contender comes or goes) and, on the next contender in line only, a DataWatch on
    # its beat node fires on every heartbeat. The thread below only reads the clock; its one
    # ZooKeeper request is the deposing delete.
    def _on_contenders(self, children: list[str]) -> bool:
        if self._closed.is_set():
            return False
        contenders = sorted((m.group(1), c) for c in children if (m := _CONTENDER.search(c)))
        mine = self._election.lock.node if self._election is not None else None
        # Only the next in line watches the leader (it is who takes over): one watch per
        # heartbeat, whatever the number of replicas.
        next_in_line = len(contenders) > 1 and contenders[1][1] == mine
        leader = f"{self._path}/{contenders[0][1]}" if contenders and next_in_line else None
        with self._lock:
            if leader == self._leader:
                return True
            self._leader, self._leader_seen = leader, None
            self._leader_died = False
            watch, self._death_watch = self._death_watch, None
            self.watching_leader.clear()
        if watch is not None:
            watch.stop()
        self._kick.set()
        if leader is not None:
            self.zk.DataWatch(self._beat_of(leader), self._leader_watcher(leader))
        return True

    def _leader_watcher(self, leader: str) -> Callable[[Any, Any], bool]:
        # kazoo counts a watcher's parameters: the node is bound by a closure
        def watch(data: Any, stat: Any) -> bool:
            with self._lock:
                if self._leader != leader:
                    return False  # not the leader any more: stop watching its beat
                if stat is not None:
                    self._leader_seen = (stat.version, time.monotonic_ns())
                    self._watch_death(leader, data)
                elif self._leader_seen is None:
                    # No beat yet (it is made just after the lock is won): a leader that
                    # never makes one is as silent as one that stopped.
                    self._leader_seen = (-1, time.monotonic_ns())
            return True
        return watch

    def _watch_death(self, leader: str, data: Any) -> None:
        """Hold a connection to the death-watch port the leader's beat names (one per
        leader: every beat rewrites the same data). Called with ``self._lock`` held."""
        beat = parse_beat(data)
        if beat is None or (self._death_watch is not None and self._death_watch.addr == beat):
            return
        if self._death_watch is not None:
            self._death_watch.stop()
            self.watching_leader.clear()

        def died() -> None:
            with self._lock:
                if self._leader != leader:
                    return
                self._leader_died = True
                self.watching_leader.clear()
            self._kick.set()

        def watching() -> None:
            with self._lock:
                if self._leader == leader:
                    self.watching_leader.set()
        self._death_watch = DeathWatch(*beat, on_death=died, on_watching=watching)

    def _watch_leader(self) -> None:
        # The thread sleeps until something could be judged: the end of the silence the
        # leader's last heartbeat allows, a change of contenders (kicked), or a second; an
        # idle follower wakes about once a silence, not ten times a second.
        wait_s = WATCH_EVERY_S
        while True:
            self._kick.wait(wait_s)
            self._kick.clear()
            if self._closed.is_set():
                return
            wait_s = LOOK_EVERY_S
            if self._own is not None or self.zk.state != KazooState.CONNECTED:
                continue
            with self._lock:
                leader, seen, died = self._leader, self._leader_seen, self._leader_died
            if leader is None:
                # Our own node may have appeared after the last change to the contenders
                # (the watch fired before we knew its name): look again now and then.
                try:
                    self._on_contenders(self.zk.get_children(self._path))
                except KazooException:
                    pass
                continue
            mine = self._election.lock.node if self._election is not None else None
            if seen is None:
                wait_s = WATCH_EVERY_S  # its first heartbeat is due
                continue
            if mine is not None and leader.endswith("/" + mine):
                continue
            version, since = seen
            now = time.monotonic_ns()
            if not died and now - since < SILENCE_NS:
                wait_s = max(WATCH_EVERY_S, (since + SILENCE_NS - now) / 1e9)
                continue
            if died:
                wait_s = WATCH_EVERY_S  # until the deposing goes through (the watch may lag a beat)
            with self._lock:
                if self._leader_seen == seen:
                    self._leader_seen = (version, now)  # one try per silence, not one per look
            try:
                t = self.zk.transaction()
                if version >= 0:
                    t.check(self._beat_of(leader), version)
                    t.delete(self._beat_of(leader))
                t.delete(leader)
                results = t.commit()
            except KazooException:
                continue  # we cannot reach ZooKeeper well: judge nobody
            if any(isinstance(r, Exception) for r in results):
                continue  # it beat just now, or it is gone already
            if died:
                log.warning("leader node %s: its process is gone (its death watch closed): deposed", leader)
            else:
                log.warning("leader node %s silent for %d ms: deposed", leader, (now - since) // 1_000_000)

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
        with self._lock:
            watch, self._death_watch = self._death_watch, None
        if watch is not None:
            watch.stop()
        self._kick.set()
        self._own = None
        self._end_term.set()


def election_leader(zkc: Any, election: str) -> int | None:
    """The id of the process leading ``election`` (the first contender), if any: what an
    operator's tool asks (a driver learns it from its own :class:`Election`)."""
    contenders = zkc.Election(election).contenders()
    return int(contenders[0]) if contenders else None
