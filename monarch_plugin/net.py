"""Addresses on the job's network: a host agent's address read and checked, whether an address means every
interface, and which of this machine's addresses routes to a host. Used by the settings' checks, the host agent,
the hosts' admission and the doctor; it knows nothing of them.
"""

from __future__ import annotations

import ipaddress
import re
import socket

from monarch_plugin.errors import ConfigError

__all__ = ["parse_host", "route_address", "wildcard"]

_HOST = re.compile(r"tcp://(?P<ip>[0-9.]+|\[[0-9a-fA-F:]+\]):(?P<port>[0-9]+)")


def parse_host(address: str) -> tuple[str, int]:
    """(IP, port) of a host agent address `tcp://IP:PORT`; ConfigError naming the form otherwise."""
    match = _HOST.fullmatch(address.strip())
    if match is None or not 0 < int(match["port"]) < 65536:
        raise ConfigError(
            f"`hosts`: {address!r} is not a host agent address: write tcp://IP:PORT, the address the agent was "
            "started with (`monarch-plugin host --address tcp://IP:PORT`)", "hosts"
        )
    ip = match["ip"].strip("[]")
    if ip in ("0.0.0.0", "::"):
        raise ConfigError(f"`hosts`: {address!r} is a wildcard address: give the host's own IP", "hosts")
    return ip, int(match["port"])


def wildcard(address: str) -> bool:
    """Whether `address` (an IP, or a name) means every interface of the machine."""
    text = address.strip().strip("[]")
    if text in ("", "*"):
        return True
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        try:  # the short forms C's resolver takes too: "0", "0.0"
            return socket.inet_aton(text) == bytes(4)
        except OSError:
            return False  # a host name: it resolves to an address of its own
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_unspecified or bool(mapped and mapped.is_unspecified)


def route_address(host: str) -> str:
    """This machine's address on the interface that routes to the host agent `host` (no packet is sent)."""
    ip, port = parse_host(host)
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, port))
        except OSError as e:
            raise ConfigError(f"`hosts`: no route from this machine to {host} ({e}): set `store_host` to this "
                              "machine's address on the network the hosts share", "store_host") from e
        return s.getsockname()[0]
