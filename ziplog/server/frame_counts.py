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
        key = self._sent_keys.get(kind)
        if key is None:
            key = self._sent_keys[kind] = "sent_" + kind.__name__.lower()
        into = self.into
        into[key] = into.get(key, 0) + n

    def received(self, kind: type) -> None:
        key = self._received_keys.get(kind)
        if key is None:
            key = self._received_keys[kind] = "received_" + kind.__name__.lower()
        into = self.into
        into[key] = into.get(key, 0) + 1
