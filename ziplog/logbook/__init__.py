"""LogBook: Boki's shared-log API (tagged records in books, read_next/read_prev,
check_tail, per-book trim, aux data) on ziplog, with an IndiLog-style index tier.

The mapping: a Boki seqnum is a gsn; a metalog position is a gsn cut at or below the
stable-prefix watermark; book ids and tags travel in a versioned header in front of each
record's data; a per-book trim is a trim record in the log. ``ziplog.logbook.core`` is the
sans-I/O part (the record format, the index, the tier's cores: index node, feeder,
aggregation at one cut, an engine's cache); the tier's processes are ``python -m
ziplog.logbook.index_node``, ``ziplog.logbook.feeder`` and ``ziplog.logbook.aggregator``;
``local_logbook(cluster, index_nodes=2)`` starts them on a ``local_cluster``.
"""

from typing import Any


def __getattr__(name: str) -> Any:  # lazy: the cores stay importable without ZeroMQ or ZooKeeper
    if name in ("LogBook", "LogRecord", "Engine"):
        from ziplog.logbook import client
        return getattr(client, name)
    if name in ("local_logbook", "LocalLogBook"):  # local tooling, under the app's name
        from ziplog.tools import logbook_local
        return getattr(logbook_local, name)
    raise AttributeError(name)


__all__ = ["LogBook", "LogRecord", "Engine", "local_logbook", "LocalLogBook"]
