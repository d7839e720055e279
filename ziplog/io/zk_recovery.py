"""The failure handler's durable recovery records in ZooKeeper, through kazoo (the
``HandlerCoordination`` port of ``failure_handler.server``).

A shard's record is ``/ziplog/recovery/<shard>``; it is written together with the
shard's ``recovering`` flag in one version-checked transaction, so a deposed leader
cannot overwrite its successor and a new leader continues from the record. ZooKeeper
limits a request to about 1 MiB, so a large record is split into chunk nodes.
"""

from __future__ import annotations

from typing import Any, Callable

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from ziplog.io import zk as discovery
from ziplog.protocol import layout

#: ZooKeeper's default limit on a request is 1 MiB: larger records are split.
CHUNK_BYTES = 512 * 1024


def read_record(zk: KazooClient, shard: int) -> tuple[dict[str, Any] | None, int]:
    """The shard's recovery record and the version of its node (-1: none yet)."""
    path = f"{layout.RECOVERY}/{shard}"
    try:
        data, stat = zk.get(path)
    except NoNodeError:
        return None, -1
    head = layout.dec(data)
    if not head:
        return None, stat.version
    if "chunks" in head:
        blob = b"".join(zk.get(f"{path}/{name}")[0] for name in head["chunks"])
        return layout.dec(blob), stat.version
    return head, stat.version


def write_record(zk: KazooClient, shard: int, record: dict[str, Any], recovering: bool, version: int) -> int:
    """Write the record and set or clear the shard's recovering flag atomically; returns
    the record node's new version. Raises BadVersionError if another leader wrote since
    ``version``.

    ZooKeeper limits a whole request (a transaction included) to about 1 MiB, so a large
    record goes first into chunk nodes no reader looks at yet; one transaction then
    points the record node at them and sets the flag; chunks of earlier versions go last."""
    path = f"{layout.RECOVERY}/{shard}"
    meta_path = f"{layout.SHARDS}/{shard}"
    blob = layout.enc(record)
    if version < 0:
        try:
            zk.create(path, b"")
        except NodeExistsError:
            raise BadVersionError(f"recovery record of shard {shard} created under us") from None
        version = 0
    names: list[str] = []
    head = blob
    if len(blob) > CHUNK_BYTES:
        tag = f"v{version + 1}"  # unique: only the writer of version+1 can commit it
        for i in range(0, len(blob), CHUNK_BYTES):
            name = f"{tag}-{i // CHUNK_BYTES}"
            try:
                zk.create(f"{path}/{name}", blob[i:i + CHUNK_BYTES])
            except NodeExistsError:  # left by a writer that failed before committing
                zk.set(f"{path}/{name}", blob[i:i + CHUNK_BYTES])
            names.append(name)
        head = layout.enc({"gen": record["gen"], "phase": record["phase"], "chunks": names})
    for _attempt in range(10):
        meta_data, meta_stat = zk.get(meta_path)
        meta = layout.dec(meta_data) or {}
        if recovering:
            meta["recovering"] = record["gen"]
        else:
            meta.pop("recovering", None)
        txn = zk.transaction()
        txn.set_data(path, head, version=version)
        txn.set_data(meta_path, layout.enc(meta), version=meta_stat.version)
        results = txn.commit()
        if not any(isinstance(r, Exception) for r in results):
            for child in zk.get_children(path):
                if child not in names:
                    zk.delete(f"{path}/{child}")
            return results[0].version
        if isinstance(results[0], BadVersionError):
            raise BadVersionError(f"recovery record of shard {shard} changed under us")
        # The shard's metadata changed (a concurrent remove): read it again.
    raise RuntimeError(f"could not write the recovery record of shard {shard}")


class KazooHandlerCoordination(discovery.ElectedSession):
    """The ``HandlerCoordination`` port on kazoo. Writes are synchronous (the handler
    does nothing else meanwhile, as before): ``on_done`` is called before
    :meth:`write_record` returns."""

    def register_fh(self, group: int, replica_id: int, addr: str) -> None:
        self.zk.ensure_path(layout.RECOVERY)
        self.keep_registered(f"{layout.FH_REPLICAS}/{group}-{replica_id}", {"pull": addr})

    def sync_records(self) -> None:
        self.zk.sync(layout.RECOVERY)

    def read_record(self, shard: int) -> tuple[dict[str, Any] | None, int]:
        return read_record(self.zk, shard)

    def write_record(self, shard: int, record: dict[str, Any], recovering: bool, version: int,
                     on_done: Callable[[int | None], None]) -> None:
        try:
            new = write_record(self.zk, shard, record, recovering, version)
        except BadVersionError:
            on_done(None)
            return
        on_done(new)
