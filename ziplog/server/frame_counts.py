"""Frames a storage replica sent and received, by kind, in its STATUS beside the core's
counters (``sent_forward``, ``received_insert``, ...): what a benchmark divides by the
appends of a window to say what each append costs in messages, and what one shard's
traffic costs the others (NOTICEs, their no-ops' FORWARDs and PREFIXes).

A frame sent to several endpoints (a NOTICE to every replica of a shard) counts once per
endpoint: that many messages leave. The keys are the protocol's frame classes, a fixed
set, so the map is bounded."""

from __future__ import annotations


class FrameCounts:
    def __init__(self, into: dict[str, int]) -> None:
        #: where the counts live (the core's ``driver_stats``, which STATUS reports)
        self.into = into
        self._keys: dict[tuple[str, type], str] = {}

    def _key(self, way: str, kind: type) -> str:
        key = self._keys.get((way, kind))
        if key is None:
            key = self._keys[(way, kind)] = f"{way}_{kind.__name__.lower()}"
        return key

    def sent(self, kind: type, n: int = 1) -> None:
        into, key = self.into, self._key("sent", kind)
        into[key] = into.get(key, 0) + n

    def received(self, kind: type) -> None:
        into, key = self.into, self._key("received", kind)
        into[key] = into.get(key, 0) + 1

