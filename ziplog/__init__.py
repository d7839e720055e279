"""ziplog: a totally ordered, sharded, replicated shared log whose writes complete
in two message delays.

    import ziplog
    with ziplog.local_cluster() as cluster, ziplog.Client(cluster.zk_hosts) as log:
        a = log.insert_after(b"hello")
        b = log.insert_after(b"world", a)      # b.gsn > a.gsn
        for rec in log.subscribe(ziplog.RID_GENESIS):
            print(rec.rid, rec.data)
"""

from ziplog.native import run_interpreted_if_asked

run_interpreted_if_asked()  # ZIPLOG_PURE=1: the compiled modules' sources, before any is imported

from ziplog.protocol.errors import (  # noqa: E402
    ClientClosedError,
    DiskFullError,
    ForbiddenError,
    LogFullError,
    NoShardAvailableError,
    NotFoundError,
    RecordTooLargeError,
    ReusedIdentityError,
    ServerError,
    TrimmedError,
    UnauthenticatedError,
    UnknownRecordError,
    ZiplogError,
    ZiplogTimeoutError,
)
from ziplog.protocol.types import RID_GENESIS, RID_RECENT, Policy, RecordId  # noqa: E402


# The package root is the facade, above every layer: it names what users import, lazily
# (importing ziplog stays cheap for servers and tools), and no module of the library
# imports it (the layers contract would see the chain up through it).
def __getattr__(name: str):
    if name in ("Client", "Subscription", "Record"):
        from ziplog.client import blocking
        return getattr(blocking, name)
    if name == "AsyncClient":
        from ziplog.client.aio import AsyncClient
        return AsyncClient
    if name in ("local_cluster", "LocalCluster"):
        from ziplog.tools import cluster
        return getattr(cluster, name)
    if name in ("local_logdb", "LocalLogDB"):
        from ziplog.tools import logdb_local
        return getattr(logdb_local, name)
    if name in ("local_logbook", "LocalLogBook"):  # also ziplog.logbook.local_logbook, its first name
        from ziplog.tools import logbook_local
        return getattr(logbook_local, name)
    raise AttributeError(name)


__all__ = [
    "Client", "AsyncClient", "Subscription", "Record", "RecordId", "RID_GENESIS", "RID_RECENT", "Policy",
    "local_cluster", "LocalCluster", "local_logdb", "LocalLogDB", "local_logbook", "LocalLogBook",
    "ZiplogError", "TrimmedError", "NotFoundError", "RecordTooLargeError",
    "UnknownRecordError", "ZiplogTimeoutError", "NoShardAvailableError", "ClientClosedError", "ServerError", "DiskFullError",
    "LogFullError", "ForbiddenError", "UnauthenticatedError", "ReusedIdentityError",
]
