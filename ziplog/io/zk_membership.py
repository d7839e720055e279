"""The membership service's ``MembershipCoordination`` port (``mms.server``) on kazoo:
its registration, the committed epoch block and membership history it starts from,
and the transaction that commits a block of epochs, checking the versions it read and
the leader's own lock."""

from __future__ import annotations

import logging
from typing import Any, Callable

from kazoo.exceptions import NodeExistsError

from ziplog.cores.effects import CommitBlock
from ziplog.io.ports import Runtime
from ziplog.io.zk import ElectedSession
from ziplog.protocol import layout
from ziplog.protocol.auth import ClusterKey
from ziplog.protocol.membership import EpochState

log = logging.getLogger("mms")


class KazooMembershipCoordination(ElectedSession):
    """The ``MembershipCoordination`` port on kazoo."""

    def __init__(self, zk_hosts: str, key: ClusterKey, rt: Runtime, bind: str = "127.0.0.1",
                 advertise: str | None = None) -> None:
        super().__init__(zk_hosts, key, rt, bind, advertise)
        self.rt = rt

    def register_mms(self, replica_id: int, addrs: dict[str, str]) -> None:
        for path in (layout.EPOCH_PATH, layout.MEMBERSHIP_PATH):
            try:
                self.zk.create(path, b"", makepath=True)
            except NodeExistsError:
                pass
        self.keep_registered(f"{layout.MMS_REPLICAS}/{replica_id}", addrs)

    def read_epoch_state(self) -> EpochState:
        return read_epoch_state(self.zk)

    def commit_block(self, commit: CommitBlock, on_done: Callable[[bool], None]) -> None:
        if commit.fence is None:  # no term's lock to check: a write that would be unfenced
            self.rt.call_soon_threadsafe(lambda: on_done(False))
            return
        reply = block_transaction(self.zk, commit).commit_async()

        def answered(result: Any) -> None:
            try:
                ok = not any(isinstance(r, Exception) for r in result.get())
            except Exception:  # the session failed: as good as refused
                ok = False
            if not ok:
                log.warning("block from epoch %d refused", commit.block["epoch"])
            self.rt.call_soon_threadsafe(lambda: on_done(ok))

        reply.rawlink(answered)


def read_epoch_state(zk: Any) -> EpochState:
    zk.sync(layout.EPOCH_PATH)
    data, stat = zk.get(layout.EPOCH_PATH)
    hdata, hstat = zk.get(layout.MEMBERSHIP_PATH)
    return EpochState(layout.dec(data), stat.version, layout.dec(hdata) or [], hstat.version)


def block_transaction(zk: Any, commit: CommitBlock) -> Any:
    """The commit's transaction: the block (and history) by version, and the writer's
    lock still there (a deposed leader's is gone: its commit fails whatever it read)."""
    txn = zk.transaction()
    if commit.fence is not None:
        txn.check(commit.fence, -1)
    txn.set_data(layout.EPOCH_PATH, layout.enc(commit.block), version=commit.block_version)
    if commit.history is not None:
        txn.set_data(layout.MEMBERSHIP_PATH, layout.enc(commit.history), version=commit.history_version)
    return txn
