"""LogDB (dissertation 4.3): serializable OCC transactions whose commit records the log
orders, committed writes applied exactly once to key-value shards.

``ziplog.logdb.core`` is the sans-I/O part: the record format and the deterministic
validation every replayer runs (the coordinator and each KV shard reach the same
decisions from the same log prefix).
"""

from ziplog.logdb.core.records import TransactionAborted

__all__ = ["TransactionAborted"]
