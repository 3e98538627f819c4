"""Small address helpers shared by the agent and the controller: loopback tests, a port to listen on."""

from __future__ import annotations

import ipaddress
import os
import random
import socket
import threading
from pathlib import Path


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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host`` (another process may still take it: retry on clash).

    Chosen below the kernel's ephemeral range: a port from ``bind(0)`` lies in the range every
    outgoing connection takes its source port from, so on a busy machine some other process's
    connect can hold it before our server binds it (torchrun's rendezvous store failed so in CI).
    A process hands out each port once (until it has handed out half the range), so two servers it
    starts one after the other never get the same port before the first has bound it."""
    low, high = _listen_port_range()
    if high - low >= 1024:
        with _ports_lock:
            if len(_ports_handed_out) > (high - low) // 2:
                _ports_handed_out.clear()
            for _ in range(256):
                port = _port_choice.randrange(low, high)
                if port not in _ports_handed_out and _bindable(host, port):
                    _ports_handed_out.add(port)
                    return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# Above Ray's default worker ports (10002-19999), below the ephemeral range's usual start.
_LISTEN_PORT_LOW = 20000
_ports_handed_out: set[int] = set()
_ports_lock = threading.Lock()
_port_choice = random.Random()  # seeded from the OS: two processes pick apart
os.register_at_fork(after_in_child=_port_choice.seed)  # a forked child too


def _listen_port_range() -> tuple[int, int]:
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    return _LISTEN_PORT_LOW, ephemeral_low


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
