"""A ZooKeeper ensemble for tests that need one without a whole ziplog cluster."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from ziplog.tools.zk_ensemble import (
    ZooKeeperEnsemble,
    ZooKeeperNotInstalled,
    find_java,
    find_zookeeper_classpath,
)


def require_zookeeper() -> None:
    """Skip the calling test module where ZooKeeper or Java is not installed."""
    try:
        find_zookeeper_classpath()
        find_java()
    except ZooKeeperNotInstalled as e:  # pragma: no cover - depends on the machine
        pytest.skip(str(e), allow_module_level=True)


def running_ensemble(tmp_path_factory: pytest.TempPathFactory, size: int) -> Iterator[ZooKeeperEnsemble]:
    """A started ensemble of ``size`` nodes (no fsync per write), stopped after: the body
    of a module fixture (``yield from running_ensemble(tmp_path_factory, 3)``)."""
    with ZooKeeperEnsemble(tmp_path_factory.mktemp("zk"), size=size, force_sync=False) as ens:
        yield ens


def open_nodes(zk: Any, cluster_digest_id: str, top: str = "/") -> list[str]:
    """Every node from ``top`` down (read through a member's session ``zk``, which reads
    the members-only ones too) whose ACL lets anyone but the cluster's digest do more
    than read it, or read it at all under ``/ziplog/recovery`` and the client key
    registry: ``"path: acl"`` for each."""
    from kazoo.exceptions import NoNodeError
    from kazoo.security import Permissions

    from ziplog.protocol import layout

    members_only = (layout.RECOVERY, layout.CLIENTS, layout.CLIENTS_LOADED)
    found: list[str] = []
    todo = [top]
    while todo:
        path = todo.pop()
        try:
            acl, _ = zk.get_acls(path)
            kids = zk.get_children(path)
        except NoNodeError:  # an ephemeral node gone meanwhile
            continue
        secret = any(path == p or path.startswith(p + "/") for p in members_only)
        if any((entry.id.scheme, entry.id.id) != ("digest", cluster_digest_id)
               and (secret or entry.perms & ~Permissions.READ) for entry in acl):
            found.append(f"{path}: {acl}")
        todo += [f"{path.rstrip('/')}/{k}" for k in kids]
    return found
