"""Containing a failure in handling one inbound message, in every driver.

Decoders are total (any bytes give a typed frame or a ``ProtocolError``), so a bad
frame earns its documented error code before any driver logic runs. What this guards
against is the rest: an exception raised while a driver or its core handles one
message that decoded. Such a message is dropped; where it has a sender, an ERROR
``INTERNAL`` goes back to it; the failure is counted per edge and logged (one line per
edge per second, with where it was raised); and the process goes on serving.

A failed assertion is not contained: an ``AssertionError`` says the process's own state
broke an invariant, which is a bug to find, not input to survive, and going on could
spread the damage (a fork of the log, a record decided twice). It propagates and stops
the process loudly; the supervisor restarts it from its disk.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any, Callable

from ziplog.io.ports import Clock, FrameHandler, RoutedHandler
from ziplog.shell.throttled_log import ThrottledLog


def where(exc: BaseException) -> str:
    """``Type: message at file:line`` of the innermost frame that raised ``exc``."""
    tb = traceback.extract_tb(exc.__traceback__)
    at = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}: {exc}{at}"


class InboundGuard:
    def __init__(self, log: logging.Logger, rt: Clock,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self._log = ThrottledLog(log, rt, logging.ERROR)
        #: edge -> inbound messages whose handling failed (a fixed set of edge names)
        self.failures: dict[str, int] = {}
        self._on_failure = on_failure

    def failed(self, edge: str, exc: Exception) -> None:
        self.failures[edge] = self.failures.get(edge, 0) + 1
        if self._on_failure is not None:
            self._on_failure(edge)
        self._log(f"handling a message on {edge} failed (message dropped, still serving)", where(exc))

    def _failed_answering(self, edge: str, exc: Exception, answer: Callable[[], None]) -> None:
        """A message's handling failed and its sender is to hear so."""
        self.failed(edge, exc)
        try:
            answer()
        except Exception as again:  # the answer itself failed: the line above says why
            self.failed(edge, again)

    def call(self, edge: str, fn: Callable[..., None], *args: Any,
             reply: Callable[..., None] | None = None) -> None:
        """``fn(*args)``, the handling of one inbound message taken later than it
        arrived, contained the same way; ``reply(exc, *args)`` answers its sender."""
        try:
            fn(*args)
        except AssertionError:
            raise
        except Exception as exc:
            if reply is None:
                self.failed(edge, exc)
            else:
                self._failed_answering(edge, exc, lambda: reply(exc, *args))

    def frames(self, edge: str, handler: FrameHandler) -> FrameHandler:
        """``handler`` for one frame at a time, contained."""
        def handle(frame: bytes) -> None:
            try:
                handler(frame)
            except AssertionError:
                raise
            except Exception as exc:
                self.failed(edge, exc)
        return handle

    def routed(self, edge: str, handler: RoutedHandler,
               reply: Callable[[bytes, bytes, Exception], None] | None = None) -> RoutedHandler:
        """``handler`` for one routed frame at a time, contained; ``reply(route, frame,
        exc)`` answers the sender of a message whose handling failed."""
        def handle(route: bytes, frame: bytes) -> None:
            try:
                handler(route, frame)
            except AssertionError:
                raise
            except Exception as exc:
                if reply is None:
                    self.failed(edge, exc)
                else:
                    self._failed_answering(edge, exc, lambda: reply(route, frame, exc))
        return handle
