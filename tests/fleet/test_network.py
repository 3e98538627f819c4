"""The fleet's network: hosts reach each other by TCP on their own addresses, each loopback is its
own, a partition cuts a host off while its processes keep running, a slow link is slower."""

from __future__ import annotations

import json
import time

import pytest

from testbed import fleet as F
from testbed.fleet import Fleet, Host
from tests.fleet.conftest import start_server

ECHO_PORT = 7000
SINK_PORT = 7001
BULK_BYTES = 4 << 20


@pytest.fixture(scope="module")
def pair(fleet: Fleet) -> tuple[Host, Host]:
    return fleet.add_host("a"), fleet.add_host("b")


def test_hosts_have_their_own_address_and_interface(pair: tuple[Host, Host]) -> None:
    a, b = pair
    assert a.address != b.address
    for host in pair:
        assert host.address.startswith("198.18.0.") and host.ifname == "eth0"
        shown = host.run(["ip", "-o", "-4", "addr", "show"], check=True).stdout
        assert f"inet {host.address}/24" in shown and "inet 127.0.0.1/8" in shown
        assert sorted(line.split()[1] for line in shown.splitlines()) == ["eth0", "lo"]


def test_two_hosts_reach_each_other_by_tcp_and_loopback_is_their_own(pair, nettool) -> None:
    a, b = pair
    server = start_server(a, "echo", ECHO_PORT)
    across = nettool(b, "echo", a.address, ECHO_PORT, "hello from b")
    assert across.returncode == 0 and across.stdout.strip() == "hello from b", across.stderr
    own = nettool(a, "echo", "127.0.0.1", ECHO_PORT, "loop")
    assert own.returncode == 0 and own.stdout.strip() == "loop"
    # b's 127.0.0.1 is b's: nothing listens there
    theirs = nettool(b, "echo", "127.0.0.1", ECHO_PORT, "loop")
    assert theirs.returncode == 1 and "refused" in theirs.stderr
    F.kill(server)
    server.wait()


def test_partition_cuts_the_host_off_while_its_processes_run_and_heal_restores(pair, nettool) -> None:
    a, b = pair
    server = start_server(a, "echo", ECHO_PORT)
    assert nettool(b, "echo", a.address, ECHO_PORT, "before").returncode == 0
    F.partition(a)
    try:
        cut = nettool(b, "echo", a.address, ECHO_PORT, "during")
        assert cut.returncode == 1, cut.stdout
        assert server.poll() is None, "a partition must not stop the host's processes"
        inside = nettool(a, "echo", a.address, ECHO_PORT, "inside")  # the host still reaches itself
        assert inside.returncode == 0 and inside.stdout.strip() == "inside"
    finally:
        F.heal(a)
    after = nettool(b, "echo", a.address, ECHO_PORT, "after")
    assert after.returncode == 0 and after.stdout.strip() == "after", after.stderr
    assert server.poll() is None
    F.kill(server)
    server.wait()


def _throughput(nettool, sender: Host, receiver: Host) -> float:
    out = nettool(sender, "send", receiver.address, SINK_PORT, BULK_BYTES)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["bytes"] == BULK_BYTES
    return BULK_BYTES / result["seconds"]


@pytest.mark.slow
def test_slow_makes_a_bulk_transfer_measurably_slower(pair, nettool) -> None:
    a, b = pair
    server = start_server(a, "sink", SINK_PORT)
    fast = _throughput(nettool, b, a)
    F.slow(a, rate="10mbit")
    try:
        t0 = time.monotonic()
        slowed = _throughput(nettool, b, a)
        elapsed = time.monotonic() - t0
    finally:
        F.unslow(a)
    restored = _throughput(nettool, b, a)
    ratio = fast / slowed
    print(
        f"4 MiB: {fast / 1e6:.1f} MB/s unshaped, {slowed / 1e6:.2f} MB/s through tbf 10mbit "
        f"({elapsed:.1f} s), {restored / 1e6:.1f} MB/s after unslow; ratio {ratio:.0f}"
    )
    assert ratio > 10, f"tbf 10mbit should be far slower than a veth: {fast:.0f} vs {slowed:.0f} B/s"
    assert restored / slowed > 10, "unslow should restore the link's speed"
    F.kill(server)
    server.wait()
