"""Cluster membership as a credential (pure): one secret, shared by every cluster process
(storage replicas, membership service, failure handler, operators' tools), from which
four keys are derived:

* the **frame key**: frames that carry authority (a peer's HELLO and PREFIX, the failure
  handler's PROBE, ACQUIRED, FETCH, INSTALL and RESUME, a replica's SUSPECT and RATE)
  travel sealed in a SIGNED envelope whose MAC is BLAKE2b-256 of the inner frame in its
  keyed mode (RFC 7693; libsodium's ``crypto_generichash`` with a key) under this key,
  and the receiving edge accepts them in no other form;
* the **ZooKeeper digest**: the cluster's sessions authenticate with it, and every node
  they create is readable by anyone and writable only by that digest, so a client (which
  has no secret) reads the topology and cannot rewrite membership, registrations or
  recovery records (the client key registry and the recovery records are not even
  readable but by that digest; the root takes new nodes only from it);
* the **CURVE server key pair** (:meth:`ClusterKey.curve_server`), which every cluster
  process serves and connects with when its connections speak CURVE
  (:mod:`ziplog.protocol.keys`);
* the **recovery key**: the record bytes of a failure recovery's acquired state are
  sealed under it (XSalsa20-Poly1305) before they are written to ZooKeeper
  (:mod:`ziplog.io.zk_recovery`), so they are never there in clear, and a record that
  was altered, or sealed by another cluster, does not open.

Why a MAC per authority frame besides CURVE: CURVE says which key opened a connection,
not that a frame carries a member's authority on every path (NULL clusters, libzmq
sockets, a frame relayed); the MAC does, under a microsecond for a small frame (keyed
BLAKE2b; HMAC-SHA256 costs three times as much in Python).
Replies and broadcasts (ACK, FORWARD, EPOCH, RECOVERY_OK) arrive on connections the
receiver opened to an address it read from ZooKeeper, which only members can write, so
they are not sealed. What a MAC does not give: secrecy, or protection against a replay
of a captured frame by someone who can read cluster traffic (recovery frames name a
generation the failure handler committed in ZooKeeper, so replaying an old one earns
STALE); CURVE gives both (the default off loopback). ZooKeeper's own traffic is not
encrypted: run the ensemble on a network only the cluster can read.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

from ziplog.protocol.keys import KeyPair

#: the ZooKeeper digest user every cluster session authenticates as
ZK_USER = "ziplog-cluster"
MAC_BYTES = 32
#: a secret shorter than this is refused (it would be guessable)
MIN_SECRET_BYTES = 16


class ClusterKey:
    """The keys derived from a cluster's secret."""

    __slots__ = ("frame_key", "zk_password", "recovery_key", "_curve_secret")

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"a cluster secret needs at least {MIN_SECRET_BYTES} bytes")
        self.frame_key = hashlib.sha256(b"ziplog frame key\0" + secret).digest()
        self.zk_password = hashlib.sha256(b"ziplog zookeeper digest\0" + secret).hexdigest()
        #: the 32-byte SecretBox key that seals a recovery's acquired records in ZooKeeper
        self.recovery_key = hashlib.sha256(b"ziplog recovery key\0" + secret).digest()
        self._curve_secret = hashlib.sha256(b"ziplog curve server key\0" + secret).digest()

    def curve_server(self) -> KeyPair:
        """The cluster's CURVE server key pair (see :mod:`ziplog.protocol.keys` for why one
        pair serves every server): any 32 bytes are a Curve25519 secret key."""
        from ziplog.protocol.curve import public_key  # its crypto loads only when asked for

        return KeyPair(public_key(self._curve_secret), self._curve_secret)

    def mac(self, frame: bytes) -> bytes:
        return hashlib.blake2b(frame, key=self.frame_key, digest_size=MAC_BYTES).digest()

    def verify(self, frame: bytes, mac: bytes) -> bool:
        return hmac.compare_digest(self.mac(frame), mac)

    @property
    def zk_auth(self) -> tuple[str, str]:
        """kazoo's ``auth_data`` entry for this cluster's digest."""
        return ("digest", f"{ZK_USER}:{self.zk_password}")

    @property
    def zk_digest_id(self) -> str:
        """The ACL id ZooKeeper stores for that digest (``user:base64(sha1(user:password))``)."""
        raw = hashlib.sha1(f"{ZK_USER}:{self.zk_password}".encode()).digest()
        return f"{ZK_USER}:{base64.b64encode(raw).decode()}"

    def __repr__(self) -> str:
        return "ClusterKey(<secret>)"
