"""Small address helpers shared by the agent and the controller."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True for localhost and loopback IPs (plaintext gRPC is allowed only there)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback_address(address: str) -> bool:
    """`host:port` (or `[v6]:port`) on a loopback host."""
    return is_loopback(address.rsplit(":", 1)[0])
