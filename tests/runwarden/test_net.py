"""Address helpers: loopback tests and the port a server is about to listen on."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from runwarden import net


def test_loopback_hosts_and_addresses() -> None:
    assert net.is_loopback("localhost") and net.is_loopback("127.0.0.2") and net.is_loopback("[::1]")
    assert not net.is_loopback("10.0.0.1") and not net.is_loopback("node-3")
    assert net.is_loopback_address("127.0.0.1:2379") and not net.is_loopback_address("10.0.0.1:2379")


def test_a_free_port_is_outside_the_ephemeral_range_bindable_and_not_handed_out_twice() -> None:
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [net.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= port < ephemeral_low for port in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))


def test_a_port_in_use_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # The random choice lands first on a port another socket listens on, then on a free one.
    with socket.socket() as taken, socket.socket() as spare:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        spare.bind(("127.0.0.1", 0))
        spare_port = spare.getsockname()[1]
        choices = iter([taken.getsockname()[1], spare_port])
        spare.close()
        monkeypatch.setattr(net, "_listen_port_range", lambda: (1024, 65536))
        monkeypatch.setattr(net._port_choice, "randrange", lambda low, high: next(choices))
        assert net.free_port() == spare_port


def test_a_narrow_range_falls_back_to_the_kernels_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(net, "_listen_port_range", lambda: (20000, 20010))
    port = net.free_port()
    assert not 20000 <= port < 20010
