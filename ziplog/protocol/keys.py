"""What a process brings to CURVE (pure data; the crypto is :mod:`ziplog.protocol.curve`'s,
the files and ZooKeeper nodes :mod:`ziplog.io.keys`'s).

A cluster's servers (storage replicas, MMS, failure handlers, the LogDB and LogBook
processes) answer with one server key pair derived from the cluster's secret
(:meth:`ziplog.protocol.auth.ClusterKey.curve_server`): whoever holds the secret is a
member already (it seals authority frames and writes ZooKeeper), so a key per server
would protect nothing the secret does not, and a client needs one public key, which its
key file carries, not a lookup per server that an attacker on the path to ZooKeeper
could answer. A client connects with its own key pair, registered with its rights
(``ziplog client add``); a member connects with the server pair, which every server
takes as a member's.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

KEY_BYTES = 32


class CurveError(ValueError):
    """A peer's bytes failed a check of the CURVE handshake or of a box: the connection
    ends. (Here, not beside the crypto in :mod:`ziplog.protocol.curve`: the ZMTP codec
    catches it on every boxed frame without loading the crypto until it is used.)"""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Right(str, Enum):
    """What a client key may do; a request needs the right of its operation."""

    APPEND = "append"  # INSERT (and a LogDB commit, a LogBook append)
    READ = "read"  # READ, SUBSCRIBE and what keeps a subscription going
    TRIM = "trim"  # TRIM
    ADMIN = "admin"  # STATUS, policies, the operator verbs


ALL_RIGHTS: frozenset[Right] = frozenset(Right)


def parse_rights(text: str) -> frozenset[Right]:
    """``"append,read"`` -> the rights; ``"all"`` -> every right; ValueError for others."""
    words = [w.strip().lower() for w in text.split(",") if w.strip()]
    if words == ["all"]:
        return ALL_RIGHTS
    try:
        return frozenset(Right(w) for w in words)
    except ValueError:
        raise ValueError(f"rights are a comma-separated subset of {', '.join(r.value for r in Right)} "
                         f"(or 'all'), not {text!r}") from None


@dataclass(frozen=True, slots=True)
class KeyPair:
    """A Curve25519 key pair, 32 raw bytes each."""

    public: bytes
    secret: bytes

    def __post_init__(self) -> None:
        if len(self.public) != KEY_BYTES or len(self.secret) != KEY_BYTES:
            raise ValueError(f"a Curve key is {KEY_BYTES} bytes")

    def __repr__(self) -> str:
        return f"KeyPair(public={self.public.hex()[:16]}..., secret=<hidden>)"


@dataclass(frozen=True, slots=True)
class Credentials:
    """A process's CURVE keys: ``server`` answers its ROUTERs' (and PUB's, PULL's)
    connections (servers only), ``client`` opens its connections to ``server_public``."""

    client: KeyPair
    server_public: bytes
    server: KeyPair | None = None

    def __post_init__(self) -> None:
        if len(self.server_public) != KEY_BYTES:
            raise ValueError(f"a Curve key is {KEY_BYTES} bytes")

    @classmethod
    def member(cls, server: KeyPair) -> "Credentials":
        """A cluster process's: it serves with the cluster's pair and connects with it."""
        return cls(client=server, server_public=server.public, server=server)


@dataclass(frozen=True, slots=True)
class ClientEntry:
    """A registered client key: its name, its public key, its rights."""

    name: str
    public: bytes
    rights: frozenset[Right]
