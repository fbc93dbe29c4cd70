"""Which network interface owns an address, and which local address reaches a peer.

A job's traffic must stay on the addresses the job uses: gloo and NCCL pick their interface from
``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``, SageMaker scripts read ``network_interface_name``,
and hostnames are never trusted to resolve (on many machines a host's own name resolves to
127.0.0.1). Addresses are read from the kernel with ``getifaddrs``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import socket
from functools import lru_cache

from dtrain.errors import ConfigError


class _SockAddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort)]


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [
    ("next", ctypes.POINTER(_IfAddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.POINTER(_SockAddr)),
    ("netmask", ctypes.POINTER(_SockAddr)),
    ("broadcast", ctypes.POINTER(_SockAddr)),
    ("data", ctypes.c_void_p),
]


def interface_addresses() -> list[tuple[str, str]]:
    """``(interface, address)`` for every IPv4 and IPv6 address of this machine's interfaces."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    found = []
    try:
        entry = head
        while entry:
            item = entry.contents
            if item.addr:
                family = item.addr.contents.family
                start = ctypes.addressof(item.addr.contents)
                if family == socket.AF_INET:  # sockaddr_in: family, port, address
                    raw = ctypes.string_at(start + 4, 4)
                    found.append((item.name.decode(), socket.inet_ntop(family, raw)))
                elif family == socket.AF_INET6:  # sockaddr_in6: family, port, flow, address
                    raw = ctypes.string_at(start + 8, 16)
                    found.append((item.name.decode(), socket.inet_ntop(family, raw)))
            entry = item.next
    finally:
        libc.freeifaddrs(head)
    return found


def interface_of(address: str) -> str | None:
    """The interface that holds ``address`` on this machine, or None if none does."""
    wanted = ipaddress.ip_address(address)
    for interface, owned in interface_addresses():
        if ipaddress.ip_address(owned.split("%")[0]) == wanted:
            return interface
    return None


@lru_cache(maxsize=64)
def route_source(peer: str) -> str:
    """The local address this machine sends from to reach ``peer`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))
        return probe.getsockname()[0]


def parse_endpoint(key: str, text: str) -> tuple[str, int]:
    """``ADDR:PORT`` (IPv6 as ``[ADDR]:PORT``) with a literal address: hostnames are refused."""
    host, separator, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    allowed = "ADDRESS:PORT with a numeric IP address (hostnames are not resolved), port 1-65535"
    if not separator or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(key, text, allowed)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(key, text, allowed) from None
    return host, int(port)


def format_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
