"""A ZooKeeper ensemble for tests that need one without a whole ziplog cluster."""

from __future__ import annotations

from typing import Iterator

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
