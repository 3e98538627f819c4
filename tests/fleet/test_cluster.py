"""A FleetCluster: etcd, the controller and three agents, each on its own network-namespace host,
every listener off loopback on mTLS. It comes up, every agent registers in etcd advertising its
host's address, preflight over mTLS passes, and the controller's status shows the nodes."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runwarden.v1 import events_pb2
from testbed.fleet import Fleet, netns_pids
from testbed.fleet_cluster import AGENT_PORT, ClusterSpec, FleetCluster

E = events_pb2
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
NODES = 3


@pytest.fixture(scope="module")
def cluster(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FleetCluster, float]]:
    made = FleetCluster(
        fleet,
        tmp_path_factory.mktemp("fleet") / "cluster",
        ClusterSpec(warm_workers=False, active=NODES, spares=0),
    )
    t0 = time.monotonic()
    try:
        made.start()
        made.wait_registered(timeout_s=60)
        yield made, t0
    finally:
        made.stop()
    left = {name: netns_pids(host.netns) for name, host in made.hosts.items()}
    assert all(not pids for pids in left.values()), f"stop() left processes: {left}"


def _tail(cluster: FleetCluster) -> str:
    return cluster.controller_log()[-3000:]


def test_parts_run_on_their_own_hosts(cluster: tuple[FleetCluster, float]) -> None:
    c, _ = cluster
    assert c.etcd is not None and c.controller is not None
    assert c.etcd.pid in netns_pids(c.etcd_host.netns)
    assert c.controller.pid in netns_pids(c.controller_host.netns)
    addresses = {c.etcd_host.address, c.controller_host.address}
    for node in c.nodes:
        host = c.host(node)
        assert c.agents[node].pid in netns_pids(host.netns)
        addresses.add(host.address)
    assert len(addresses) == NODES + 2, "every part has its own host address"


def test_every_agent_registers_in_etcd(cluster: tuple[FleetCluster, float]) -> None:
    c, t0 = cluster
    startup_s = time.monotonic() - t0
    assert c.registered_nodes() == set(c.nodes)
    print(f"fleet cluster: etcd + controller + {NODES} agents registered {startup_s:.1f} s after start")
    assert startup_s < 60


def test_agents_listen_with_tls_on_their_host_address(cluster: tuple[FleetCluster, float]) -> None:
    c, _ = cluster
    probe = (
        "import socket, ssl, sys, json\n"
        "ctx = ssl.create_default_context(cafile=sys.argv[1])\n"
        "with socket.create_connection((sys.argv[2], int(sys.argv[3])), timeout=5) as raw:\n"
        "    with ctx.wrap_socket(raw, server_hostname=sys.argv[2]) as tls:\n"
        "        print(json.dumps(tls.getpeercert()['subjectAltName']))\n"
    )
    for node in c.nodes:
        address = c.host(node).address
        # from the controller's host, verified against the cluster CA, by the agent's IP address
        out = c.controller_host.run(
            [sys.executable, "-c", probe, str(c.certs_dir / "ca.pem"), address, str(AGENT_PORT)], timeout=30
        )
        assert out.returncode == 0, out.stderr
        assert ["IP Address", address] in json.loads(out.stdout)


def test_preflight_over_mtls_passes_and_status_shows_the_nodes(cluster: tuple[FleetCluster, float]) -> None:
    c, t0 = cluster
    passed = c.wait_for_event(
        E.EVENT_KIND_PREFLIGHT_RESULT,
        0,
        45,
        pred=lambda e: e.preflight.summary.passed and e.preflight.summary.pass_count == NODES,
    )
    assert passed is not None, _tail(c)
    preflight_s = time.monotonic() - t0
    # The controller hears the summary over the RPC stream; the agent re-puts its node record
    # (with last_preflight) on its next tick, so the view catches up a moment later.
    deadline = time.monotonic() + 30

    def settled(view: dict[str, dict]) -> bool:
        return view.keys() == set(c.nodes) and all(
            v.get("last_preflight", {}).get("passed") is True for v in view.values()
        )

    while not settled(view := c.nodes_view()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for node in c.nodes:
        seen = view[node]
        assert seen["alive"] is True
        assert seen["address"] == f"{c.host(node).address}:{AGENT_PORT}", seen
        assert seen["last_preflight"]["passed"] is True, seen
    while set(c.status().get("nodes", [])) != set(c.nodes) and time.monotonic() < deadline:
        time.sleep(0.5)
    status = c.status()
    assert set(status.get("nodes", [])) == set(c.nodes), (status, _tail(c))
    print(f"fleet cluster: preflight passed on {NODES} nodes {preflight_s:.1f} s after the cluster's start")


def test_the_run_directory_is_shared(cluster: tuple[FleetCluster, float]) -> None:
    c, _ = cluster
    marker = Path(c.root) / "shared-marker"
    out = c.host(c.nodes[0]).run(["sh", "-c", f"echo written-on-{c.nodes[0]} > {marker}"], check=True)
    assert out.returncode == 0
    assert (
        c.host(c.nodes[-1]).run(["cat", str(marker)], check=True).stdout.strip() == f"written-on-{c.nodes[0]}"
    )
