"""The storage replica's core, split by role: see :mod:`.core`."""

from ziplog.cores.replica.core import ReplicaCore
from ziplog.cores.replica.log import DecidedLog, stream_events
from ziplog.cores.replica.settings import ReplicaSettings

__all__ = ["DecidedLog", "ReplicaCore", "ReplicaSettings", "stream_events"]
