"""Frames a storage replica sent and received, by kind, in its STATUS beside the core's
counters (``sent_forward``, ``received_insert``, ...): what a benchmark divides by the
appends of a window to say what each append costs in messages, and what one shard's
traffic costs the others (NOTICEs, their no-ops' FORWARDs and PREFIXes).

A frame sent to several endpoints (a NOTICE to every replica of a shard) counts once per
endpoint: that many messages leave. The keys are the protocol's frame classes, a fixed
set, so the maps are bounded. Compiled with the storage driver (``ziplog.native``): it
counts every message of the hot path."""

from __future__ import annotations


class FrameCounts:
    def __init__(self, into: dict[str, int]) -> None:
        #: where the counts live (the core's ``driver_stats``, which STATUS reports)
        self.into = into
        self._sent_keys: dict[type, str] = {}
        self._received_keys: dict[type, str] = {}

    def sent(self, kind: type, n: int = 1) -> None:
        self._add(self._sent_keys, "sent_", kind, n)

    def received(self, kind: type) -> None:
        self._add(self._received_keys, "received_", kind, 1)

    def _add(self, keys: dict[type, str], way: str, kind: type, n: int) -> None:
        key = keys.get(kind)
        if key is None:
            key = keys[kind] = way + kind.__name__.lower()
        into = self.into
        into[key] = into.get(key, 0) + n
