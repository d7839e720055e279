"""What the blocking and the asyncio clients share beyond the driver: identity, policy,
counters, and what a client learned of the shards' stable watermarks."""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from ziplog.client.driver import ClientDriver, SubscriptionDriver
from ziplog.cores.client.state import ClientState
from ziplog.protocol.types import Policy


#: inserts in flight at most in one ``insert_many`` (bounds the driver's calls)
INSERT_WINDOW = 256


def payloads_of(records: Sequence[bytes]) -> list[bytes]:
    """``insert_many``'s records as bytes (TypeError: one is not bytes)."""
    out = []
    for data in records:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError("every record must be bytes")
        out.append(bytes(data))
    return out


def new_client_id() -> int:
    """A random 63-bit id: resends and redirects of one insert carry it."""
    return int.from_bytes(os.urandom(8), "big") >> 1


class ClientBase:
    _state: ClientState
    _rt: Any
    _driver: Any

    @property
    def runtime(self) -> Any:
        """The runtime this client's driver runs on (a ``ZmqRuntime`` for ``Client``, an
        ``AsyncioRuntime`` for ``AsyncClient``): drivers built on this client, such as
        LogDB's, run on it too."""
        return self._rt

    @property
    def driver(self) -> ClientDriver:
        """This client's driver (for drivers built on it: their log operations go here)."""
        assert self._driver is not None, "the client is not connected"
        return self._driver  # type: ignore[no-any-return]

    @property
    def client_id(self) -> int:
        return self._state.client_id

    @property
    def stats(self) -> dict[str, int]:
        """Inserts on the fast and slow paths, resends and redirects so far."""
        return self._state.stats

    def set_policy(self, policy: Policy) -> None:
        """Choose which shard inserts go to: Policy.random() (default), Policy.fixed(s),
        Policy.by_key()."""
        if not isinstance(policy, Policy):
            raise TypeError("policy must be a ziplog.Policy")
        self._state.policy = policy

    def known_stable(self, shard: int) -> int:
        """The highest stable watermark of ``shard`` this client has seen in a reply: a
        read of a gsn at or below it needs one replica's answer."""
        return self._state.stable.get(shard, 0)


class SubscriptionBase:
    _sub: SubscriptionDriver
    #: the last gsn this subscription returns (None: it goes on forever)
    end: int | None = None

    @property
    def ended(self) -> bool:
        """Every record up to ``end`` has been returned: the subscription is over."""
        end = self.end
        if end is None:
            return False
        core = self._sub.core
        return core.position >= end and not core.has_record_upto(end)

    @property
    def position(self) -> int:
        """Every record with a gsn up to this one has been returned, and no record can
        appear at or below it later (it moves every epoch, also when the log is idle)."""
        return self._sub.core.position

    @property
    def buffered(self) -> int:
        """Records received and not yet handed to the application."""
        return self._sub.core.buffered

    @property
    def buffered_bytes(self) -> int:
        """Their bytes: bounded by the credit this subscription grants each shard."""
        return self._sub.core.buffered_bytes

    def observe_batches(self, fn: Callable[[int, list[int], int, int], None] | None) -> None:
        """A diagnostic hook: ``fn(shard, gsns, delivered_before, delivered_after)`` after
        each batch a shard sends (its records' gsns, and how far the merge could deliver
        before and after it)."""
        self._sub.core.observer = fn
