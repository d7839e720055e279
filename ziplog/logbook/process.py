"""What the index tier's processes (the feeder, an index node, the aggregator) share
around their drivers: their common flags, and a process's start and end."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import Any, AsyncIterator, NamedTuple, Sequence


class TierProcess(NamedTuple):
    """A started tier process: its cluster key, its ZooKeeper session (the tier's nodes
    made if missing), the event SIGTERM or SIGINT sets, and its runtime."""

    key: Any
    session: Any
    stop: asyncio.Event
    rt: Any


def parse_tier_args(ap: argparse.ArgumentParser, argv: Sequence[str] | None, role: str, serves: bool) -> argparse.Namespace:
    """Add the flags every tier process takes (and, for one that ``serves`` a ROUTER,
    its address) to ``ap``, then parse ``argv`` with the config file's ``[role]``."""
    from ziplog.shell.config import parse_args
    from ziplog.shell.logs import add_log_arguments
    from ziplog.shell.process import (
        add_address_arguments,
        add_cluster_key_argument,
        add_security_arguments,
        check_address_arguments,
    )

    if serves:
        add_address_arguments(ap, port_help="port (0: any free one)")
    add_cluster_key_argument(ap)
    add_security_arguments(ap)
    add_log_arguments(ap)
    args = parse_args(ap, argv, role)
    if serves:
        check_address_arguments(ap, args)
    return args


@contextlib.asynccontextmanager
async def tier_process(args: argparse.Namespace) -> AsyncIterator[TierProcess]:
    """Start a tier process (:class:`TierProcess`); on the way out its runtime closes,
    then its session."""
    from ziplog.io import zk
    from ziplog.io.asyncio_runtime import AsyncioRuntime
    from ziplog.io.zk_logbook import ensure_tier
    from ziplog.io.zmtp_poll import native_transport_wanted
    from ziplog.shell.process import load_cluster_key, member_credentials, stop_event

    key = load_cluster_key(args.cluster_key_file)
    session = zk.Session(args.zk, key)
    stop = stop_event()
    credentials = member_credentials(args, key)
    rt = AsyncioRuntime(asyncio.get_running_loop(), native=native_transport_wanted() or credentials is not None,
                        credentials=credentials)
    try:
        ensure_tier(session.zk)
        yield TierProcess(key, session, stop, rt)
    finally:
        await rt.aclose()
        session.close()
