"""Addresses: 'HOST:PORT' as people write them, 'tcp://HOST:PORT' endpoints as sockets name them.

Pure string work, shared by every transport (the in-process one names its endpoints the same way, so that
settings and assignments carry the same addresses whichever transport runs them).
"""

from __future__ import annotations

import ipaddress
import socket

from primaplug.core.errors import ConfigError

# hosts that mean "every interface" when bound: a connection to any host on that port reaches the socket
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "*", ""})


def split_address(address: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """'HOST:PORT', ':PORT' or 'PORT' -> (host, port)."""
    host, _, port = address.rpartition(":")
    try:
        return (host.strip("[]") or default_host), int(port)
    except ValueError:
        raise ConfigError(f"'{address}' is not HOST:PORT") from None


def endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def parse_endpoint(address: str) -> tuple[str, int]:
    """'tcp://HOST:PORT' (or a bare 'HOST:PORT') -> (host, port); the inverse of endpoint()."""
    return split_address(address.removeprefix("tcp://"))


def is_loopback(host: str) -> bool:
    """Whether the host is this machine's loopback (an IPv6 address may come in brackets; a name is resolved)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except OSError:
            return False


def on_every_interface(address: str) -> bool:
    """Whether a socket's endpoint is bound on every interface (0.0.0.0): it names no address to connect to."""
    return parse_endpoint(address)[0] in WILDCARD_HOSTS


def reachable(address: str, host: str) -> str:
    """A socket's endpoint as a peer connects to it: one bound on every interface takes `host`, an address of its
    machine that the peer reaches."""
    return endpoint(host, parse_endpoint(address)[1]) if on_every_interface(address) else address


def source_address(host: str) -> str:
    """This machine's address on the route to `host`, the one a connection to it comes from (a UDP socket's connect
    only picks the route: nothing is sent)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return str(s.getsockname()[0])
    except OSError as e:
        raise ConfigError(f"cannot find this machine's address on the way to {host}: {e}") from None
