"""LogDB (dissertation 4.3): serializable OCC transactions whose commit records the log
orders, committed writes applied exactly once to key-value shards.

    import ziplog
    from ziplog.logdb import LogDB, TransactionAborted
    with ziplog.local_cluster() as cluster, ziplog.local_logdb(cluster) as ldb, LogDB(ldb.zk_hosts) as db:
        db.run(lambda t: t.put(b"alice", b"100"))
        print(db.get(b"alice"))

``ziplog.logdb.core`` is the sans-I/O part (the record format, the deterministic
validation, the coordinator's, KV shard's and transaction's cores); the processes are
``python -m ziplog.logdb.coordinator`` and ``python -m ziplog.logdb.kvshard``; the
local tooling that starts them (``ziplog.local_logdb``) is ``ziplog.tools.logdb_local``.
"""

from typing import Any

from ziplog.logdb.core.records import TransactionAborted
from ziplog.logdb.core.transaction import LogDBError, OutcomeUnknownError


def __getattr__(name: str) -> Any:  # lazy: the cores stay importable without ZeroMQ or ZooKeeper
    if name in ("LogDB", "AsyncLogDB", "Txn", "AsyncTxn"):
        from ziplog.logdb import client
        return getattr(client, name)
    raise AttributeError(name)


__all__ = ["LogDB", "AsyncLogDB", "Txn", "AsyncTxn", "TransactionAborted", "LogDBError", "OutcomeUnknownError"]
