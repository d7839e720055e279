"""Where everything is written in ZooKeeper (all values msgpack)::

    /ziplog/epoch                     committed block {epoch, last, shards, rates}:
                                      epochs epoch..last all have this config
    /ziplog/membership                history [[first_epoch, members], ...]
    /ziplog/mms/election              leader election (kazoo Election)
    /ziplog/mms/replicas/<id>         ephemeral {pub, pull} addresses of an MMS replica
    /ziplog/shards/<shard>            {replicas: n[, removed: true][, recovering: gen]}  (persistent)
    /ziplog/recovery/<shard>          the failure handler's durable record {gen, phase, ...}
                                      (members only, read included; its record bytes
                                      sealed: io.zk_recovery)
    /ziplog/recovery/<shard>/<chunk>  its chunks when it is large (named in the record)
    /ziplog/fh/election[-<group>]     failure handler leader election (per group)
    /ziplog/fh/replicas/<group>-<id>  ephemeral {pull} address of a failure handler replica
    /ziplog/shards/<shard>/<replica>  ephemeral {addr, pid}  (the replica is up; 0 is the primary)

Every process finds every address here; nothing is configured by hand. This module is
the layout only (pure): :mod:`ziplog.io.zk` reads and watches it through kazoo.
"""

from __future__ import annotations

from typing import Any

import msgpack

ROOT = "/ziplog"
EPOCH_PATH = f"{ROOT}/epoch"
MEMBERSHIP_PATH = f"{ROOT}/membership"
MMS_ELECTION = f"{ROOT}/mms/election"
MMS_REPLICAS = f"{ROOT}/mms/replicas"
SHARDS = f"{ROOT}/shards"
RECOVERY = f"{ROOT}/recovery"
FH_ROOT = f"{ROOT}/fh"
FH_REPLICAS = f"{FH_ROOT}/replicas"
#: the client key registry: {name: {"public": 32 bytes, "rights": [str]}}, readable
#: and writable by members only (``io.zk_clients``)
CLIENTS = f"{ROOT}/clients"
#: each app server's confirmation of the registry version its table holds:
#: ``<role>-<pid>@<host>`` = {"version": int}, ephemeral, members only
CLIENTS_LOADED = f"{ROOT}/clients-loaded"


def fh_election_path(group: int = 0) -> str:
    """The failure handler group's leader election."""
    return f"{FH_ROOT}/election" if group == 0 else f"{FH_ROOT}/election-{group}"


def enc(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def dec(data: bytes | None) -> Any:
    if not data:
        return None
    return msgpack.unpackb(data, raw=False, strict_map_key=False)
