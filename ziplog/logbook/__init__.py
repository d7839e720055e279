"""LogBook: Boki's shared-log API (tagged records in books, read_next/read_prev,
check_tail, per-book trim, aux data) on ziplog, with an IndiLog-style index tier.

The mapping: a Boki seqnum is a gsn; a metalog position is a gsn cut at or below the
stable-prefix watermark; book ids and tags travel in a versioned header in front of each
record's data; a per-book trim is a trim record in the log. ``ziplog.logbook.core`` is the
sans-I/O part (the record format, an index node's core, the aggregation of answers at one
cut).
"""

from typing import Any


def __getattr__(name: str) -> Any:  # lazy: the cores stay importable without ZeroMQ or ZooKeeper
    if name in ("LogBook", "LogRecord", "Engine"):
        from ziplog.logbook import client
        return getattr(client, name)
    raise AttributeError(name)


__all__ = ["LogBook", "LogRecord", "Engine"]
