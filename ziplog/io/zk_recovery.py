"""The failure handler's durable recovery records in ZooKeeper, through kazoo (the
``HandlerCoordination`` port of ``failure_handler.server``).

A shard's record is ``/ziplog/recovery/<shard>``; it is written together with the
shard's ``recovering`` flag in one version-checked transaction, so a deposed leader
cannot overwrite its successor and a new leader continues from the record. ZooKeeper
limits a request to about 1 MiB, so a large record is split into chunk nodes.

An acquired state holds the bytes of the records above the source's stable point: it
must be in ZooKeeper (the cluster's only quorum-replicated store) before anyone acts on
it, and outlive replica failures and the handler's leader changes, but no record byte
may be read there by anyone else. So every node under ``/ziplog/recovery`` is
members-only, READ included (:func:`ziplog.io.zk.members_acl`), and the record fields
that carry record bytes (``records``, ``guesses``) are sealed here, in the adapter (the
handler's core sees plain records), under the cluster's recovery key: the stored map
keeps every other field readable and holds instead ``"sealed"``: a 24-byte random nonce
followed by NaCl ``crypto_secretbox`` (XSalsa20-Poly1305: a 16-byte MAC, then the
ciphertext) of the msgpack map ``{"shard", "gen", "records", "guesses"}``. The shard and
generation inside must be the node's own: a sealed state moved to another shard or
generation does not open either. A record that does not open is an error
(:class:`SealedRecordError`), never an empty state.
"""

from __future__ import annotations

from typing import Any, Callable

import nacl.exceptions
import nacl.secret
from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from ziplog.io import zk as discovery
from ziplog.protocol import layout
from ziplog.protocol.auth import ClusterKey

#: ZooKeeper's default limit on a request is 1 MiB: larger records are split (the
#: limit applies to the bytes stored, sealed).
CHUNK_BYTES = 512 * 1024
#: the record fields that carry record bytes: stored sealed, in the field ``"sealed"``
SEALED_FIELDS = ("records", "guesses")


class SealedRecordError(RuntimeError):
    """A recovery record whose sealed state does not open: sealed under another cluster
    key, altered in ZooKeeper, or moved from another shard or generation."""


def seal(key: ClusterKey, shard: int, record: dict[str, Any]) -> dict[str, Any]:
    """What is stored for ``record``: its fields that carry record bytes sealed."""
    stored = {k: v for k, v in record.items() if k not in SEALED_FIELDS}
    if any(f in record for f in SEALED_FIELDS):
        inner = {"shard": shard, "gen": record.get("gen"), **{f: record[f] for f in SEALED_FIELDS if f in record}}
        stored["sealed"] = bytes(nacl.secret.SecretBox(key.recovery_key).encrypt(layout.enc(inner)))
    return stored


def unseal(key: ClusterKey, shard: int, stored: dict[str, Any]) -> dict[str, Any]:
    """The record ``stored`` holds (a record without ``"sealed"``, one with no record
    bytes or one an earlier build wrote, is as stored); SealedRecordError when its
    sealed state does not open."""
    if "sealed" not in stored:
        return stored
    record = {k: v for k, v in stored.items() if k != "sealed"}
    sealed = stored["sealed"]
    what = f"the recovery record of shard {shard} (generation {record.get('gen')!r})"
    if type(sealed) is not bytes:
        raise SealedRecordError(f"{what} holds a sealed state that is not bytes")
    try:
        inner = layout.dec(nacl.secret.SecretBox(key.recovery_key).decrypt(sealed))
    except (nacl.exceptions.CryptoError, ValueError, TypeError):
        raise SealedRecordError(f"{what} does not open: sealed under another cluster key, or altered in "
                                "ZooKeeper") from None
    if not isinstance(inner, dict) or inner.get("shard") != shard or inner.get("gen") != record.get("gen"):
        got = (inner.get("shard"), inner.get("gen")) if isinstance(inner, dict) else None
        raise SealedRecordError(f"{what} holds a state sealed for (shard, generation) {got}")
    record.update({f: inner[f] for f in SEALED_FIELDS if f in inner})
    return record


def secure_records(zk: KazooClient, key: ClusterKey) -> None:
    """Make ``/ziplog/recovery`` members-only if it is missing, and every node under it
    members-only if an earlier build left it readable by anyone."""
    zk.ensure_path(layout.ROOT)  # the session's own ACL: anyone reads the layout
    acl = discovery.members_acl(key)
    try:
        zk.create(layout.RECOVERY, b"", acl=acl)
    except NodeExistsError:
        pass
    paths = [layout.RECOVERY]
    for shard in zk.get_children(layout.RECOVERY):
        paths.append(f"{layout.RECOVERY}/{shard}")
        try:
            paths += [f"{layout.RECOVERY}/{shard}/{chunk}" for chunk in zk.get_children(paths[-1])]
        except NoNodeError:
            pass
    for path in paths:
        try:
            have, stat = zk.get_acls(path)
            if have != acl:
                zk.set_acls(path, acl, version=stat.aversion)
        except (NoNodeError, BadVersionError):
            pass  # gone, or another handler replica changed it meanwhile


def read_record(zk: KazooClient, key: ClusterKey, shard: int) -> tuple[dict[str, Any] | None, int]:
    """The shard's recovery record (opened) and the version of its node (-1: none yet);
    SealedRecordError when it does not open."""
    path = f"{layout.RECOVERY}/{shard}"
    try:
        data, stat = zk.get(path)
    except NoNodeError:
        return None, -1
    head = _decode(shard, data)
    if not head:
        return None, stat.version
    if "chunks" in head:
        stored = _decode(shard, b"".join(zk.get(f"{path}/{name}")[0] for name in head["chunks"]))
        if stored is None:
            raise SealedRecordError(f"the recovery record of shard {shard} names chunks that hold nothing")
        return unseal(key, shard, stored), stat.version
    return unseal(key, shard, head), stat.version


def _decode(shard: int, data: bytes) -> dict[str, Any] | None:
    """A stored record's map (None: empty); SealedRecordError when it is not one."""
    try:
        stored = layout.dec(data)
    except Exception:  # msgpack raises several types on junk
        stored = False
    if stored is None or isinstance(stored, dict):
        return stored
    raise SealedRecordError(f"the recovery record of shard {shard} is not a msgpack map: altered in ZooKeeper")


def write_record(zk: KazooClient, key: ClusterKey, shard: int, record: dict[str, Any], recovering: bool,
                 version: int, fence: str | None = None) -> int:
    """Write the record (sealed) and set or clear the shard's recovering flag atomically;
    returns the record node's new version. Raises BadVersionError if another leader
    wrote since ``version``, or (with ``fence``, the writer's lock node) if the writer was
    deposed: the same transaction checks that its lock is still there.

    ZooKeeper limits a whole request (a transaction included) to about 1 MiB, so a large
    record goes first into chunk nodes no reader looks at yet; one transaction then
    points the record node at them and sets the flag; chunks of earlier versions go last."""
    path = f"{layout.RECOVERY}/{shard}"
    meta_path = f"{layout.SHARDS}/{shard}"
    acl = discovery.members_acl(key)
    blob = layout.enc(seal(key, shard, record))
    if version < 0:
        try:
            try:
                _create_fenced(zk, path, acl, fence)
            except NoNodeError:  # no /ziplog/recovery yet (or the writer's lock is gone)
                secure_records(zk, key)
                _create_fenced(zk, path, acl, fence)
        except (NodeExistsError, NoNodeError):
            raise BadVersionError(f"recovery record of shard {shard} created under us, or its writer was deposed") \
                from None
        version = 0
    names: list[str] = []
    head = blob
    if len(blob) > CHUNK_BYTES:
        tag = f"v{version + 1}"  # unique: only the writer of version+1 can commit it
        for i in range(0, len(blob), CHUNK_BYTES):
            name = f"{tag}-{i // CHUNK_BYTES}"
            try:
                zk.create(f"{path}/{name}", blob[i:i + CHUNK_BYTES], acl=acl)
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
        if fence is not None:
            txn.check(fence, -1)
        txn.set_data(path, head, version=version)
        txn.set_data(meta_path, layout.enc(meta), version=meta_stat.version)
        results = txn.commit()
        if fence is not None:
            if isinstance(results[0], Exception):
                raise BadVersionError(f"the writer of shard {shard}'s recovery record was deposed (its lock is gone)")
            results = results[1:]
        if not any(isinstance(r, Exception) for r in results):
            for child in zk.get_children(path):
                if child not in names:
                    zk.delete(f"{path}/{child}")
            return results[0].version
        if isinstance(results[0], BadVersionError):
            raise BadVersionError(f"recovery record of shard {shard} changed under us")
        # The shard's metadata changed (a concurrent remove): read it again.
    raise RuntimeError(f"could not write the recovery record of shard {shard}")


def _create_fenced(zk: KazooClient, path: str, acl: Any, fence: str | None) -> None:
    """Create the (empty) record node, in one transaction with the check of the writer's
    lock when there is one; NodeExistsError or NoNodeError as a plain create raises."""
    if fence is None:
        zk.create(path, b"", acl=acl)
        return
    txn = zk.transaction()
    txn.check(fence, -1)
    txn.create(path, b"", acl=acl)
    results = txn.commit()
    for r in results:
        if isinstance(r, Exception):
            raise r


class KazooHandlerCoordination(discovery.ElectedSession):
    """The ``HandlerCoordination`` port on kazoo. Writes are synchronous (the handler
    does nothing else meanwhile, as before): ``on_done`` is called before
    :meth:`write_record` returns."""

    def register_fh(self, group: int, replica_id: int, addr: str) -> None:
        secure_records(self.zk, self.key)
        self.keep_registered(f"{layout.FH_REPLICAS}/{group}-{replica_id}", {"pull": addr})

    def sync_records(self) -> None:
        self.zk.sync(layout.RECOVERY)

    def read_record(self, shard: int) -> tuple[dict[str, Any] | None, int]:
        return read_record(self.zk, self.key, shard)

    def write_record(self, shard: int, record: dict[str, Any], recovering: bool, version: int,
                     on_done: Callable[[int | None], None], fence: str | None = None) -> None:
        if fence is None:  # no term's lock to check: a write that would be unfenced
            on_done(None)
            return
        try:
            new = write_record(self.zk, self.key, shard, record, recovering, version, fence)
        except BadVersionError:
            on_done(None)
            return
        on_done(new)
