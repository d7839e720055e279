"""CurveZMQ (ZeroMQ RFC 26, ZMTP's CURVE mechanism), sans I/O: the handshake's four
commands and the boxed messages that follow, byte for byte as libzmq speaks them.

Every box is NaCl's ``crypto_box`` (Curve25519, XSalsa20, Poly1305; PyNaCl over
libsodium), written as its 16-byte MAC followed by the ciphertext. Keys are 32 raw
bytes. C and S are the client's and the server's long-term key pairs (the client knows
S's public key beforehand), C' and S' the transient pairs of one connection; nonces are a
16-byte prefix that names the box's purpose and an 8-byte big-endian counter, which
rises by one with every box a side sends and must rise with every box a side accepts.

* HELLO (client, 200 bytes): ``\\x05HELLO``, version 1.0, 72 zero bytes of padding (an
  amplification guard), C', a short nonce, Box[64 zero bytes](C' -> S);
* WELCOME (server, 168 bytes): ``\\x07WELCOME``, a 16-byte long nonce, Box[S' + cookie]
  (S -> C'); the cookie is a long nonce and SecretBox[C' + s'](cookie key), so the server
  keeps no state between WELCOME and INITIATE;
* INITIATE (client): ``\\x08INITIATE``, the cookie, a short nonce, Box[C + vouch +
  metadata](C' -> S'), the vouch a long nonce and Box[C' + S](C -> S'): the client's
  long-term key is proven, and only the server learns it;
* READY (server): ``\\x05READY``, a short nonce, Box[metadata](S' -> C');
* MESSAGE (both): ``\\x07MESSAGE``, a short nonce, Box[flags + body](C' <-> S'), the
  flags byte carrying MORE (bit 0) and COMMAND (bit 1: libzmq boxes its own message
  flags, not the wire's, whose COMMAND is bit 2).

Randomness (the transient keys, the long nonces, the cookie key) is handed in as a
``random_bytes(n)`` function, as a core is handed its ``random.Random``: the driver gives
``nacl.utils.random`` (the operating system's generator); tests may give a fixed one.
Every refusal is a :class:`CurveError` whose ``reason`` says which check failed; nothing
else escapes from a peer's bytes.
"""

from __future__ import annotations

import struct
from typing import Callable

import nacl.bindings
import nacl.exceptions
import nacl.public
import nacl.secret

from ziplog.protocol.keys import CurveError

KEY_BYTES = 32
MAC_BYTES = 16
HELLO_BYTES = 200
WELCOME_BYTES = 168
#: INITIATE without metadata: the name (9), the cookie (96), a short nonce (8), the box
#: of C, the vouch's long nonce and its box (16 + 32 + 16 + 80)
INITIATE_MIN_BYTES = 257
COOKIE_BYTES = 96

_HELLO = b"\x05HELLO"
_WELCOME = b"\x07WELCOME"
_INITIATE = b"\x08INITIATE"
_READY = b"\x05READY"
_MESSAGE = b"\x07MESSAGE"
_ERROR = b"\x05ERROR"

_NONCE = struct.Struct(">Q")
#: the MORE and COMMAND bits of a box's flags byte, the only ones a box may carry
BOX_MORE = 0x01
BOX_COMMAND = 0x02
FLAG_MASK = BOX_MORE | BOX_COMMAND

RandomBytes = Callable[[int], bytes]


def public_key(secret: bytes) -> bytes:
    """The public key of a 32-byte secret key."""
    return bytes(nacl.public.PrivateKey(_key(secret, "secret key")).public_key)


def new_keypair(random_bytes: RandomBytes) -> tuple[bytes, bytes]:
    """(public, secret) from 32 bytes of ``random_bytes``."""
    secret = random_bytes(KEY_BYTES)
    return public_key(secret), secret


def _key(k: bytes, what: str) -> bytes:
    if type(k) is not bytes or len(k) != KEY_BYTES:
        raise CurveError(f"a {what} is {KEY_BYTES} bytes")
    return k


def _box(secret: bytes, peer_public: bytes) -> nacl.public.Box:
    try:
        return nacl.public.Box(nacl.public.PrivateKey(secret), nacl.public.PublicKey(peer_public))
    except (nacl.exceptions.CryptoError, ValueError, TypeError):  # a key of low order (all zeros, say)
        raise CurveError("a peer's public key is not one a box can be made with") from None


def _seal(box: nacl.public.Box | nacl.secret.SecretBox, plaintext: bytes, nonce: bytes) -> bytes:
    return bytes(box.encrypt(plaintext, nonce).ciphertext)


def _open(box: nacl.public.Box | nacl.secret.SecretBox, ciphertext: bytes, nonce: bytes, what: str) -> bytes:
    try:
        return bytes(box.decrypt(ciphertext, nonce))
    except (nacl.exceptions.CryptoError, ValueError, TypeError):
        raise CurveError(f"{what}: the box does not open") from None


def _command(body: bytes, name: bytes, what: str) -> None:
    if not body.startswith(name):
        raise CurveError(f"expected {what}, got {body[:1 + (body[0] if body else 0)]!r}")


class MessageBoxes:
    """The traffic of a connection once its handshake is done: each message frame
    sealed as a MESSAGE (:meth:`seal`) or opened from one (:meth:`open`), with the
    connection's precomputed shared key (libsodium's ``*_afternm``: the Curve25519 step
    is done once per connection, not per box)."""

    __slots__ = ("_key", "_send_prefix", "_recv_prefix", "_next_nonce", "_peer_nonce")

    def __init__(self, box: nacl.public.Box, is_server: bool, next_nonce: int, peer_nonce: int) -> None:
        self._key = box.shared_key()
        self._send_prefix = b"CurveZMQMESSAGES" if is_server else b"CurveZMQMESSAGEC"
        self._recv_prefix = b"CurveZMQMESSAGEC" if is_server else b"CurveZMQMESSAGES"
        self._next_nonce = next_nonce
        self._peer_nonce = peer_nonce

    def seal(self, body: bytes, flags: int = 0, header: Callable[[int], bytes] | None = None) -> bytes:
        """A MESSAGE carrying ``body`` with ``flags`` (MORE, COMMAND); with ``header``, the
        MESSAGE preceded by ``header(its size)`` in the same copy (a wire frame's header)."""
        short = _NONCE.pack(self._next_nonce)
        self._next_nonce += 1
        boxed = nacl.bindings.crypto_box_easy_afternm(bytes((flags & FLAG_MASK,)) + body, self._send_prefix + short,
                                                      self._key)
        if header is None:
            return b"".join((_MESSAGE, short, boxed))
        return b"".join((header(16 + len(boxed)), _MESSAGE, short, boxed))

    def open(self, frame: bytes) -> tuple[int, bytes]:
        """(flags, body) of a MESSAGE; its nonce must rise above every one opened before."""
        if len(frame) < len(_MESSAGE) + 8 + MAC_BYTES + 1 or not frame.startswith(_MESSAGE):
            _command(frame, _MESSAGE, "MESSAGE")
            raise CurveError("a MESSAGE too short to hold a box")
        short = frame[8:16]
        nonce = _NONCE.unpack(short)[0]
        if nonce <= self._peer_nonce:
            raise CurveError(f"MESSAGE nonce {nonce} does not rise above {self._peer_nonce} (a replay?)")
        try:
            plain = nacl.bindings.crypto_box_open_easy_afternm(frame[16:], self._recv_prefix + short, self._key)
        except (nacl.exceptions.CryptoError, ValueError, TypeError):
            raise CurveError("MESSAGE: the box does not open") from None
        self._peer_nonce = nonce
        return plain[0] & FLAG_MASK, plain[1:]


class CurveClient:
    """The client's side: :meth:`hello`, then :meth:`on_welcome` (its INITIATE), then
    :meth:`on_ready` (the server's metadata, and the connection's :class:`MessageBoxes`)."""

    def __init__(self, server_public: bytes, public: bytes, secret: bytes, random_bytes: RandomBytes) -> None:
        self.server_public = _key(server_public, "server's public key")
        self.public = _key(public, "public key")
        self.secret = _key(secret, "secret key")
        self.random_bytes = random_bytes
        self.t_public, self.t_secret = new_keypair(random_bytes)  # C'
        self._nonce = 1
        self._server_t_public = b""  # S'
        self._cookie = b""
        self._box: nacl.public.Box | None = None  # C' <-> S'

    def _short(self) -> bytes:
        short = _NONCE.pack(self._nonce)
        self._nonce += 1
        return short

    def hello(self) -> bytes:
        short = self._short()
        box = _seal(_box(self.t_secret, self.server_public), bytes(64), b"CurveZMQHELLO---" + short)
        return _HELLO + b"\x01\x00" + bytes(72) + self.t_public + short + box

    def on_welcome(self, body: bytes, metadata: bytes) -> bytes:
        """The server's WELCOME: the INITIATE that answers it, carrying ``metadata`` (ZMTP
        properties: Socket-Type, Identity)."""
        _command(body, _WELCOME, "WELCOME")
        if len(body) != WELCOME_BYTES:
            raise CurveError(f"a WELCOME is {WELCOME_BYTES} bytes, not {len(body)}")
        plain = _open(_box(self.t_secret, self.server_public), body[24:], b"WELCOME-" + body[8:24], "WELCOME")
        self._server_t_public, self._cookie = plain[:32], plain[32:128]
        self._box = _box(self.t_secret, self._server_t_public)
        vouch_nonce = self.random_bytes(16)
        vouch = vouch_nonce + _seal(_box(self.secret, self._server_t_public), self.t_public + self.server_public,
                                    b"VOUCH---" + vouch_nonce)
        short = self._short()
        box = _seal(self._box, self.public + vouch + metadata, b"CurveZMQINITIATE" + short)
        return _INITIATE + self._cookie + short + box

    def on_ready(self, body: bytes) -> tuple[bytes, MessageBoxes]:
        """The server's READY: its metadata, and the boxes for the traffic."""
        if body.startswith(_ERROR):
            raise CurveError(f"the server refused: {body[7:][:200]!r}")
        _command(body, _READY, "READY")
        if self._box is None:
            raise CurveError("READY before WELCOME")
        if len(body) < len(_READY) + 8 + MAC_BYTES:
            raise CurveError("a READY too short to hold a box")
        short = body[6:14]
        metadata = _open(self._box, body[14:], b"CurveZMQREADY---" + short, "READY")
        return metadata, MessageBoxes(self._box, is_server=False, next_nonce=self._nonce,
                                      peer_nonce=_NONCE.unpack(short)[0])


class CurveServer:
    """The server's side of one connection: :meth:`on_hello` (its WELCOME), then
    :meth:`on_initiate` (the client's long-term public key and metadata), then
    :meth:`ready` (its READY, and the connection's :class:`MessageBoxes`)."""

    def __init__(self, public: bytes, secret: bytes, random_bytes: RandomBytes) -> None:
        self.public = _key(public, "public key")
        self.secret = _key(secret, "secret key")
        self.random_bytes = random_bytes
        self._cookie_box = nacl.secret.SecretBox(random_bytes(nacl.secret.SecretBox.KEY_SIZE))
        self._client_t_public = b""  # C'
        self._t_public, self._t_secret = b"", b""  # S'
        self._box: nacl.public.Box | None = None  # S' <-> C'
        self._nonce = 1
        self._peer_nonce = 0
        self.client_public = b""  # C, once INITIATE vouched for it

    def on_hello(self, body: bytes) -> bytes:
        _command(body, _HELLO, "HELLO")
        if len(body) != HELLO_BYTES:
            raise CurveError(f"a HELLO is {HELLO_BYTES} bytes, not {len(body)}")
        if body[6:8] != b"\x01\x00":
            raise CurveError(f"CurveZMQ version {body[6]}.{body[7]} is not 1.0")
        if self._client_t_public:
            raise CurveError("a second HELLO")
        client_t_public, short = body[80:112], body[112:120]
        _open(_box(self.secret, client_t_public), body[120:200], b"CurveZMQHELLO---" + short, "HELLO")
        self._client_t_public = client_t_public
        self._peer_nonce = _NONCE.unpack(short)[0]
        self._t_public, self._t_secret = new_keypair(self.random_bytes)
        cookie_nonce = self.random_bytes(16)
        cookie = cookie_nonce + _seal(self._cookie_box, client_t_public + self._t_secret, b"COOKIE--" + cookie_nonce)
        welcome_nonce = self.random_bytes(16)
        box = _seal(_box(self.secret, client_t_public), self._t_public + cookie, b"WELCOME-" + welcome_nonce)
        return _WELCOME + welcome_nonce + box

    def on_initiate(self, body: bytes) -> tuple[bytes, bytes]:
        """(the client's long-term public key, its metadata), once its cookie, box and
        vouch check out."""
        _command(body, _INITIATE, "INITIATE")
        if not self._client_t_public:
            raise CurveError("INITIATE before HELLO")
        if len(body) < INITIATE_MIN_BYTES:
            raise CurveError(f"an INITIATE is at least {INITIATE_MIN_BYTES} bytes, not {len(body)}")
        cookie = body[9:105]
        plain = _open(self._cookie_box, cookie[16:], b"COOKIE--" + cookie[:16], "the INITIATE's cookie")
        if plain != self._client_t_public + self._t_secret:
            raise CurveError("the INITIATE's cookie is not this connection's")
        short = body[105:113]
        nonce = _NONCE.unpack(short)[0]
        if nonce <= self._peer_nonce:
            raise CurveError(f"INITIATE nonce {nonce} does not rise above {self._peer_nonce}")
        self._box = _box(self._t_secret, self._client_t_public)
        plain = _open(self._box, body[113:], b"CurveZMQINITIATE" + short, "INITIATE")
        client_public, vouch_nonce, vouch = plain[:32], plain[32:48], plain[48:128]
        vouched = _open(_box(self._t_secret, client_public), vouch, b"VOUCH---" + vouch_nonce, "the INITIATE's vouch")
        if vouched != self._client_t_public + self.public:
            raise CurveError("the INITIATE's vouch names another connection or server")
        self._peer_nonce = nonce
        self.client_public = client_public
        return client_public, plain[128:]

    def ready(self, metadata: bytes) -> tuple[bytes, MessageBoxes]:
        """The READY carrying ``metadata``, and the boxes for the traffic."""
        if self._box is None or not self.client_public:
            raise CurveError("READY before a good INITIATE")
        short = _NONCE.pack(self._nonce)
        self._nonce += 1
        ready = _READY + short + _seal(self._box, metadata, b"CurveZMQREADY---" + short)
        return ready, MessageBoxes(self._box, is_server=True, next_nonce=self._nonce, peer_nonce=self._peer_nonce)

    @staticmethod
    def error(reason: str) -> bytes:
        """An ERROR command (sent in clear: the handshake failed)."""
        data = reason.encode()[:255]
        return _ERROR + bytes((len(data),)) + data
