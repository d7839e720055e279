"""A log that a flood of input cannot turn into a flood of log lines (bad frames, a
suspicion repeated every few milliseconds): per kind of line, one per interval, with how
many were not logged since."""

from __future__ import annotations

import logging

from ziplog.io.ports import Clock

#: at most one line per kind this often
INTERVAL_NS = 1_000_000_000
#: what a line quotes of the offending detail, at most
DETAIL_CHARS = 200


class ThrottledLog:
    def __init__(self, log: logging.Logger, rt: Clock, level: int = logging.WARNING,
                 interval_ns: int = INTERVAL_NS) -> None:
        self.log = log
        self.level = level
        self.rt = rt
        self.interval_ns = interval_ns
        #: kind -> (when it was last logged, how many since); kinds are a fixed set of
        #: strings in the code, so this stays small
        self._kinds: dict[str, tuple[int, int]] = {}

    def __call__(self, kind: str, detail: object) -> None:
        now = self.rt.now()
        last, quiet = self._kinds.get(kind, (-self.interval_ns, 0))
        if now - last < self.interval_ns:
            self._kinds[kind] = (last, quiet + 1)
            return
        self._kinds[kind] = (now, 0)
        text = str(detail)
        if len(text) > DETAIL_CHARS:
            text = text[:DETAIL_CHARS] + "..."
        more = f" ({quiet} more since the last line)" if quiet else ""
        self.log.log(self.level, "%s: %s%s", kind, text, more)
