"""CURVE keys on disk and on the wire's endpoints: key files (a client's, a cluster's
server pair), and the :class:`~ziplog.protocol.zmtp.CurveKeys` each endpoint's codec is
given, with the operating system's random generator.

A key file is TOML, written readable by its owner only::

    # a ziplog client key: whoever holds this file acts with its rights
    name = "alice"
    public = "<40 Z85 characters>"    # ZeroMQ's key text (RFC 32), as zmq.curve_keypair gives
    secret = "<40 Z85 characters>"
    server = "<40 Z85 characters>"    # the cluster's server public key

libzmq takes the same Z85 texts (``curve_publickey``, ``curve_secretkey``,
``curve_serverkey``), so a pyzmq client can use a key file as it is.
"""

from __future__ import annotations

import os
import tomllib

from zmq.utils import z85

from ziplog.protocol import curve
from ziplog.protocol.keys import KEY_BYTES, Credentials, KeyPair
from ziplog.protocol.zmtp import CurveKeys


#: where a client finds its key file when none is named
CLIENT_KEY_ENV = "ZIPLOG_CLIENT_KEY_FILE"


class KeyFileError(ValueError):
    """A key file that cannot be read or does not hold keys."""


def client_credentials(key_file: str | os.PathLike[str] | None) -> Credentials | None:
    """A client's CURVE credentials from ``key_file``, or the file ``$ZIPLOG_CLIENT_KEY_FILE``
    names; None (NULL: a loopback cluster without CURVE) when neither is given."""
    path = os.fspath(key_file) if key_file is not None else os.environ.get(CLIENT_KEY_ENV)
    if not path:
        return None
    return read_key_file(path)[1]


def server_keys(credentials: Credentials | None) -> CurveKeys | None:
    """The CURVE keys a bound endpoint answers with (None: NULL)."""
    if credentials is None:
        return None
    assert credentials.server is not None, "a bound endpoint under CURVE needs the server's key pair"
    return CurveKeys(credentials.server.public, credentials.server.secret, os.urandom)


def client_keys(credentials: Credentials | None) -> CurveKeys | None:
    """The CURVE keys a connecting endpoint opens with (None: NULL)."""
    if credentials is None:
        return None
    return CurveKeys(credentials.client.public, credentials.client.secret, os.urandom, credentials.server_public)


def new_keypair() -> KeyPair:
    public, secret = curve.new_keypair(os.urandom)
    return KeyPair(public, secret)


def z85_text(key: bytes) -> str:
    return z85.encode(key).decode("ascii")


def z85_key(text: str, what: str = "key") -> bytes:
    """A 40-character Z85 text -> its 32 bytes (KeyFileError otherwise)."""
    try:
        raw = z85.decode(text.encode("ascii"))
    except (ValueError, UnicodeEncodeError, KeyError, IndexError, TypeError):
        raise KeyFileError(f"the {what} is not Z85 text") from None
    if len(raw) != KEY_BYTES:
        raise KeyFileError(f"the {what} is {len(raw)} bytes, not {KEY_BYTES}")
    return raw


def write_key_file(path: str, name: str, pair: KeyPair, server_public: bytes) -> None:
    """Write a client's key file (mode 0600; an existing file is replaced)."""
    text = ("# a ziplog client key: whoever holds this file acts with its rights\n"
            f"name = {_toml_string(name)}\n"
            f'public = "{z85_text(pair.public)}"\n'
            f'secret = "{z85_text(pair.secret)}"\n'
            f'server = "{z85_text(server_public)}"\n')
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def read_key_file(path: str) -> tuple[str, Credentials]:
    """(the key's name, the credentials a client connects with) from a key file."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise KeyFileError(f"key file {path} is not TOML: {exc}") from None
    fields = {}
    for field in ("public", "secret", "server"):
        value = doc.get(field)
        if not isinstance(value, str):
            raise KeyFileError(f"key file {path} has no {field} key")
        fields[field] = z85_key(value, f"{field} key in {path}")
    name = doc.get("name", "")
    pair = KeyPair(fields["public"], fields["secret"])
    if curve.public_key(pair.secret) != pair.public:
        raise KeyFileError(f"key file {path}: the public key is not the secret key's")
    return str(name), Credentials(client=pair, server_public=fields["server"])


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
