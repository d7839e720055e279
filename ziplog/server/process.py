"""What every server process's ``main`` ends with: run the runtime until SIGTERM/SIGINT,
then close what it runs."""

from __future__ import annotations

import signal
from typing import Any, Protocol


class _Closable(Protocol):
    def close(self) -> None: ...


class _Loop(_Closable, Protocol):
    def run_forever(self) -> None: ...

    def stop(self) -> None: ...


def serve_forever(rt: _Loop, *parts: _Closable) -> int:
    """A process ``main``'s body: run ``rt`` until SIGTERM/SIGINT, then close ``parts`` (in
    order) and the runtime."""

    def on_signal(signum: int, frame: Any) -> None:
        rt.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        rt.run_forever()
    finally:
        for part in parts:
            part.close()
        rt.close()
    return 0
