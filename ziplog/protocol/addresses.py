"""Endpoint addresses, ``tcp://host:port`` (``tcp://[v6]:port`` for IPv6), and the
difference between where a process binds and what it advertises.

A process binds a host (an interface's address, or a wildcard: every interface) and
registers in ZooKeeper the address others should dial: the advertised one. Binding a
wildcard with nothing advertised would register an address nobody can dial, so that is
refused; a specific bind host is advertised as it is unless told otherwise (behind NAT or
a proxy the two differ)."""

from __future__ import annotations

import ipaddress

from ziplog.protocol.zmtp import parse_endpoint

WILDCARDS = frozenset(("0.0.0.0", "::", "*", ""))


class AddressError(ValueError):
    """An address that cannot be bound, advertised or dialled."""


def is_ipv6(host: str) -> bool:
    return ":" in host


def is_wildcard(host: str) -> bool:
    return host.strip("[]") in WILDCARDS


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address, or ``localhost``) is the loopback interface only:
    a wildcard is every interface, so it is not."""
    bare = host.strip("[]")
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def tcp_addr(host: str, port: int) -> str:
    """``tcp://host:port``, the host bracketed when it is an IPv6 address."""
    host = host.strip("[]")
    return f"tcp://[{host}]:{port}" if is_ipv6(host) else f"tcp://{host}:{port}"


def parse_host_port(text: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` (a bare IPv6 address has no
    port): ``(host, port or None)``."""
    text = text.strip()
    if not text:
        raise AddressError("an empty address")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise AddressError(f"unbalanced brackets in {text!r}")
        if not rest:
            return host, None
        if not rest.startswith(":") or not rest[1:].isdigit():
            raise AddressError(f"not [host]:port: {text!r}")
        return host, int(rest[1:])
    if text.count(":") == 1:
        host, port = text.split(":")
        if not port.isdigit() or not host:
            raise AddressError(f"not host:port: {text!r}")
        return host, int(port)
    return text, None  # a name, an IPv4 address, or a bare IPv6 address


def check_bind_host(host: str) -> str:
    """A host a socket can bind: an IP address (IPv4 or IPv6) or a wildcard; names are
    refused (which of a name's addresses would be bound is not the operator's choice)."""
    h = host.strip("[]")
    if is_wildcard(h):
        return "::" if is_ipv6(h) else "0.0.0.0"
    try:
        ipaddress.ip_address(h)
    except ValueError:
        raise AddressError(f"bind to an IP address (or 0.0.0.0 / ::), not {host!r}") from None
    return h


def advertised(bound: str, advertise: str | None) -> str:
    """What a process bound at ``bound`` (``tcp://host:port``) registers for others to
    dial: ``bound`` itself, or ``advertise`` (a host, or host:port) in its place."""
    if advertise is None and not bound.startswith("tcp://"):
        return bound  # another transport's address (the simulation's): nothing to translate
    try:
        host, port = parse_endpoint(bound)
    except ValueError as exc:
        raise AddressError(str(exc)) from None
    if advertise is None:
        if is_wildcard(host):
            raise AddressError(f"bound to every interface ({bound}): say which address to advertise (--advertise)")
        return bound
    a_host, a_port = parse_host_port(advertise)
    if is_wildcard(a_host):
        raise AddressError(f"cannot advertise a wildcard address: {advertise!r}")
    return tcp_addr(a_host, a_port if a_port is not None else port)
