"""Typed exceptions: everything the client raises derives from :class:`ZiplogError`."""

from __future__ import annotations

from ziplog.protocol import frames as wire
from ziplog.protocol.types import RecordId


class ZiplogError(Exception):
    """Base class of every ziplog error."""


class TrimmedError(ZiplogError):
    """The record lies below the trim point: it has been deleted."""


class NotFoundError(ZiplogError):
    """No record at that position (a no-op, or a gsn the shard does not own)."""


class RecordTooLargeError(ZiplogError):
    """The record exceeds the server's size limit."""


class UnknownRecordError(ZiplogError):
    """The record id names a shard or position the log does not know."""


class ZiplogTimeoutError(ZiplogError, TimeoutError):
    """The operation did not complete in time."""


class DiskFullError(ZiplogError):
    """The shard cannot write its disk (full, or failing) and takes no new records until
    it can; inserts under a policy that may choose go to other shards instead."""


class LogFullError(ZiplogError):
    """The shard holds its limit of records in memory (``--max-log-memory-mb``) and takes
    no new records until a trim frees some; inserts under a policy that may choose go to
    other shards instead."""


class NoShardAvailableError(ZiplogError):
    """No live shard accepts inserts (or the policy names one that does not)."""


class ReusedIdentityError(ZiplogError):
    """An InsertAfter's ``(client_id, seq)`` is already in the log at a gsn not above the
    rid it was sent after: the same identity was inserted before after another rid (a
    retry, or a re-run of a job, that reused the identity), and a replica answered the
    duplicate with the gsn it gave then. The record is in the log once, at ``rid``; it is
    not placed again. ``after_gsn`` is the gsn the call asked to follow."""

    def __init__(self, client_id: int, seq: int, rid: RecordId, after_gsn: int) -> None:
        super().__init__(
            f"the record (client id {client_id}, seq {seq}) is already in the log at gsn {rid.gsn} "
            f"(shard {rid.shard}), which is not above the requested rid {after_gsn}: the same identity was "
            f"inserted before with a different after (a retry with a reused identity)")
        self.client_id = client_id
        self.seq = seq
        self.rid = rid
        self.after_gsn = after_gsn

    def __reduce__(self) -> tuple[type, tuple[int, int, RecordId, int]]:
        return type(self), (self.client_id, self.seq, self.rid, self.after_gsn)


class ClientClosedError(ZiplogError):
    """The client (or subscription) was closed."""


class ForbiddenError(ZiplogError):
    """The client's key lacks the right the operation needs, or is not registered (a
    revoked key included): nothing of the request took effect."""


class UnauthenticatedError(ZiplogError):
    """The server refused the connection's handshake: it needs a client key (CURVE) the
    client did not give, or the client's key file names another cluster's server key;
    or, for a cluster frame, it was not sealed by a member."""


class ServerError(ZiplogError):
    """A server answered with an error the client does not map to a narrower type."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


_BY_CODE: dict[str, type[ZiplogError]] = {
    wire.E_TRIMMED: TrimmedError,
    wire.E_NOT_FOUND: NotFoundError,
    wire.E_TOO_LARGE: RecordTooLargeError,
    wire.E_UNKNOWN_RID: UnknownRecordError,
    wire.E_TIMEOUT: ZiplogTimeoutError,
    wire.E_DISK_FULL: DiskFullError,
    wire.E_LOG_FULL: LogFullError,
    wire.E_FORBIDDEN: ForbiddenError,
    wire.E_UNAUTHENTICATED: UnauthenticatedError,
}


def from_reply(code: str, message: str) -> ZiplogError:
    """The exception for an ERROR frame."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return ServerError(code, message)
    return cls(f"{code}: {message}")
