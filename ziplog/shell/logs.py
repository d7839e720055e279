"""How server processes log: one line per event, as text for people or as JSON for
machines (``--log-format json``: one object per line with ``ts``, ``level``,
``process``, ``logger``, ``msg`` and, for an error with a traceback, ``exc``)."""

from __future__ import annotations

import argparse
import json
import logging
import time

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")


def add_log_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--log-format", choices=FORMATS, default="text",
                    help="text (one line per event) or json (one JSON object per line)")
    ap.add_argument("--log-level", choices=LEVELS, default="info")


class JsonLines(logging.Formatter):
    """A record as one line of JSON; a traceback goes in ``exc``, newlines escaped."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "process": self.process,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class OneLine(logging.Formatter):
    """Text, one line per event: a traceback is folded into the line (`` | `` between its
    lines), so that a line-oriented reader never takes its lines for events."""

    def __init__(self, process: str) -> None:
        super().__init__(f"%(asctime)s {process} %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\n", " | ")


def configure_logging(args: argparse.Namespace, process: str) -> None:
    """Log to stderr as ``args.log_format`` says, at ``args.log_level``; ``process`` names
    this process in every line (``storage shard 0 replica 1``, ``mms 2``, ...)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines(process) if args.log_format == "json" else OneLine(process))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(args.log_level.upper())
