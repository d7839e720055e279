from __future__ import annotations

import os
import sys
import threading
from typing import Iterator

import pytest

# Tests import `tests.sim` and the packages from the checkout.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_sessionstart(session: pytest.Session) -> None:
    """The tests run the compiled hot path (``ziplog/native.py``) as ``make setup`` built
    it: a source edited since is compiled again first, never tested stale. With
    ZIPLOG_PURE=1 they run the sources."""
    if os.environ.get("ZIPLOG_PURE") != "1" and "PYTEST_XDIST_WORKER" not in os.environ:
        # (built once, by the process that hands tests to the workers, before they start)
        from ziplog.tools.build_native import main as build_native
        build_native([])


@pytest.fixture(autouse=True, scope="session")
def shared_zookeeper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One ZooKeeper ensemble for the session (per worker process), which every
    LocalCluster uses under a root of its own unless it asks for its own ensemble (a
    test that kills or cuts ZooKeeper nodes does): three JVMs per cluster cost more CPU
    than the rest of a small cluster."""
    from ziplog.tools import cluster
    from ziplog.tools.zk_ensemble import ZooKeeperEnsemble

    with ZooKeeperEnsemble(tmp_path_factory.mktemp("shared-zookeeper"), size=3) as ensemble:
        cluster.SHARED_ZOOKEEPER = ensemble.hosts
        try:
            yield ensemble.hosts
        finally:
            cluster.SHARED_ZOOKEEPER = None


@pytest.fixture
def one_cpu() -> Iterator[int]:
    """This thread kept on one CPU (restored after): a test shares it with a process it
    starts, pinned there too."""
    before = os.sched_getaffinity(0)
    cpu = min(before)
    os.sched_setaffinity(0, {cpu})
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, before)


@pytest.fixture(autouse=True, scope="module")
def no_zookeeper_session_outlives_its_module():
    """Every kazoo client a test module starts is stopped by the end of the module (its
    fixtures' teardown included): one left running keeps reconnecting to an ensemble
    that is gone, and holds the process's exit."""
    before = {t.ident for t in threading.enumerate()}
    yield
    left = []
    for t in threading.enumerate():
        if t.ident not in before and t.name.endswith("(zk_loop)"):
            t.join(10)  # a stopped session's loop ends just after stop() returns
            if t.is_alive():
                left.append(t.name)
    assert not left, f"ZooKeeper sessions still running after the module: {left}"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--reverse", action="store_true",
                     help="run the collected tests in reverse order (to find order dependences)")


#: The modules that take longest, longest first (measured, two workers): the workers
#: take whole modules in collection order as each frees up, so the long ones go first
#: and the short ones fill in at the end, where one long module left last would keep one
#: worker busy alone for its whole length. The two Spark modules, which mostly wait on
#: the JVM's triggers and timers, are kept apart, each beside modules that compute.
LONGEST_FIRST = (
    "test_spark_stop.py", "test_logbook_sim.py", "test_system_sim.py", "test_spark.py", "test_failures.py",
    "test_logdb_sim.py", "test_decoders_total.py", "test_rolling_restart.py", "test_cli.py",
    "test_process_per_cpu.py", "test_shard_sim.py", "test_replica_restart.py", "test_partitions.py",
    "test_fuzz_cluster.py", "test_native.py", "test_three_replicas.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--reverse"):
        items.reverse()
        return
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
