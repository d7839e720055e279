"""A rolling restart of a local cluster: every process stopped gracefully (SIGTERM) and
started again, one at a time, the next only once the last is back at work:

1. ZooKeeper nodes (of the cluster's own ensemble), followers first and the leader last;
   back: serving in the quorum.
2. MMS replicas, then failure handler replicas, the leader of each last; back:
   registered again in ZooKeeper under a new session.
3. Storage replicas, shard by shard, backups first and the primary last; back:
   registered again under a new session and answering status as a member of a shard
   that takes inserts again (live, its primary serving, every backup in step). It
   returns once every shard is so. A process serving replicas of several shards (a process
   per CPU) is restarted once, and is back when every replica in it is.

What an operator does by hand on a real cluster (``docs/DEPLOY.md``) in the same order,
with ``ziplog status`` as the check between steps."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ziplog.protocol import layout
from ziplog.tools import procs
from ziplog.tools.zk_ensemble import ZooKeeperEnsemble
from ziplog.io.election import election_leader

#: how often a restarted process is asked whether it is back (ZooKeeper has no event for
#: a status answer)
POLL_S = 0.05


@dataclass
class Restart:
    """One process restarted: what, and when it was stopped and was back."""

    kind: str  # "zookeeper", "mms", "failure_handler", "storage"
    name: str
    stopped_at: float  # time.monotonic()
    back_at: float


def _owner(zk: Any, path: str) -> int | None:
    stat = zk.exists(path)
    return None if stat is None else int(stat.ephemeralOwner)


def _wait(what: str, done: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not back after {timeout:.0f} s")
        time.sleep(POLL_S)


def _leader_last(ids: list[int], leader: int | None) -> list[int]:
    return sorted(ids, key=lambda i: (i == leader, i))


def rolling_restart(cluster: Any, timeout: float = 60.0,
                    on_restart: Callable[[Restart], None] | None = None) -> list[Restart]:
    """Restart every process of ``cluster`` (a :class:`ziplog.LocalCluster`) one at a
    time; what was restarted, in order. Call it from a thread that outlives the cluster's
    processes (they die with the thread that started them)."""
    zk = cluster._zkc
    done: list[Restart] = []

    def note(kind: str, name: str, stopped_at: float) -> None:
        r = Restart(kind, name, stopped_at, time.monotonic())
        done.append(r)
        if on_restart is not None:
            on_restart(r)

    # -- ZooKeeper (an ensemble of the cluster's own: a shared one is not its to restart) --------
    ensemble = cluster.zk
    if isinstance(ensemble, ZooKeeperEnsemble):
        for i in _leader_last(list(range(ensemble.size)), ensemble.leader()):
            t = time.monotonic()
            ensemble.stop_node(i)
            ensemble.start_node(i)
            ensemble.wait_for_mode(i, timeout)
            _wait(f"the quorum after ZooKeeper node {i}", lambda: ensemble.leader() is not None, timeout)
            note("zookeeper", f"zk{i}", t)

    # -- the control plane -------------------------------------------------------------------------
    for kind, by_id, spawn, election, node_of in (
            ("mms", cluster.mms, cluster._spawn_mms, layout.MMS_ELECTION, lambda i: f"{layout.MMS_REPLICAS}/{i}"),
            ("failure_handler", cluster.fh, cluster._spawn_fh, layout.fh_election_path(0),
             lambda i: f"{layout.FH_REPLICAS}/0-{i}")):
        for i in _leader_last(sorted(by_id), election_leader(zk, election)):
            path = node_of(i)
            before = _owner(zk, path)
            t = time.monotonic()
            procs.stop(by_id[i])
            spawn(i)
            _wait(f"{kind} replica {i}", lambda: _owner(zk, path) not in (None, before), timeout)
            note(kind, f"{kind}{i}", t)

    # -- storage replicas --------------------------------------------------------------------------
    from ziplog.client.blocking import Client
    with Client(cluster.zk_hosts) as client:
        restarted: set[tuple[int, int]] = set()
        for shard in list(cluster.shard_ids):
            for replica in sorted(range(cluster.replicas), key=lambda r: (r == 0, r)):
                if (shard, replica) in restarted:
                    continue  # its process, serving several shards, was restarted already
                group = cluster.process_group(shard, replica)
                owners = {key: _owner(zk, _replica_path(*key)) for key in group}
                t = time.monotonic()
                cluster.restart_replica(shard, replica)
                for key in group:
                    _wait(f"shard {key[0]} replica {key[1]}",
                          lambda: _owner(zk, _replica_path(*key)) not in (None, owners[key])
                          and _serving(client, *key), timeout)
                restarted.update(group)
                note("storage", "+".join(f"shard{s}-replica{r}" for s, r in group), t)
        # Done only once every shard serves (a shard restarted early may have been
        # recovered since, say): an insert right after this returns finds them all.
        for shard in list(cluster.shard_ids):
            _wait(f"shard {shard}", lambda: _serving(client, shard, 0), timeout)
    return done


def _replica_path(shard: int, replica: int) -> str:
    return f"{layout.SHARDS}/{shard}/{replica}"


def _serving(client: Any, shard: int, replica: int) -> bool:
    """The replica answers status as a member of its shard, and the shard takes inserts:
    it is live, its primary serves (not starting: it decides again) and every backup is
    in step with it."""
    if shard not in client.live_shards():
        return False
    entries = client.status(wait=1.0).get(shard, [])
    if len(entries) <= replica or not entries:
        return False
    for i, e in enumerate(entries):
        if e.get("answer") != "ok" or e.get("frozen"):
            return False
        if i == 0 and e.get("state") != "serving":
            return False
        if i > 0 and (not e.get("qualified") or e.get("link") != "in_step"):
            return False
    return True
