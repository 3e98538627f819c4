"""Issue 26 on a real multi-host network: a host cut off from etcd *only* fences itself.

A FleetCluster (etcd, a controller, 2 active agents and a spare, each on its own network-namespace
host, mTLS everywhere) trains; then node rank 1's host loses its route to etcd (a blackhole route on
both ends: `iptables` is not installed and `netem` does not work here) while its fabric link to the
peers stays up. The peers still answer it, but they keep renewing their leases while it cannot, so
it fences within TTL + a peer's keepalive interval + the vouch's re-ask + its timeout + the time
its own keeper gets to renew once the peers do + the stop grace; the controller replaces it with the spare. Before issue 26 a peer answering a TCP connect was
enough to keep the ranks running beside the replacement attempt.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from nodeagent.daemon.agent import PEER_ASK_TIMEOUT_S
from nodeagent.daemon.liveness import RECOVERY_TTLS
from runwarden.v1 import events_pb2
from testbed.fleet import Fleet, Host, default_prefix, netns_pids, sweep_orphans
from testbed.fleet import available as fleet_available
from testbed.fleet_cluster import AGENT_PORT, ETCD_CLIENT_PORT, ClusterSpec, FleetCluster

E = events_pb2
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TTL_S = 2.0
STOP_GRACE_S = 5.0  # the test agents' stop_grace_s (testbed.fleet_cluster.agent_settings)
# the fence's bound after the cut: the lease runs out within TTL of its last renewal; a peer renews
# within TTL/3 after that, the vouch asks again every TTL/6 and waits up to its timeout; this host's
# keeper gets RECOVERY_TTLS x TTL to renew too; then the ranks get TERM and, after the grace, KILL.
# MARGIN_S: two loaded cores' scheduling and the reaping.
MARGIN_S = 2.0
FENCE_BOUND_S = (
    TTL_S + TTL_S / 3 + TTL_S / 6 + PEER_ASK_TIMEOUT_S + RECOVERY_TTLS * TTL_S + STOP_GRACE_S + MARGIN_S
)


def _blackhole(host: Host, address: str, action: str) -> None:
    subprocess.run(
        ["ip", "-n", host.netns, "route", action, "blackhole", f"{address}/32"],
        check=True,
        capture_output=True,
        timeout=10,
    )


def _workers_on(cluster: FleetCluster, node: str) -> list[int]:
    agent = cluster.agents[node].pid
    return [p for p in netns_pids(cluster.host(node).netns) if p != agent]


def _launch_nodes(cluster: FleetCluster) -> list[str]:
    launches = [e for e in cluster.events() if e.kind == E.EVENT_KIND_LAUNCH]
    return list(launches[-1].launch.nodes) if launches else []


def test_a_host_cut_off_from_etcd_alone_fences_while_its_peers_answer(tmp_path: Path) -> None:
    ok, reason = fleet_available()
    if not ok:
        pytest.skip(f"skipped: no network namespaces ({reason})")
    sweep_orphans()
    spec = ClusterSpec(
        warm_workers=False, active=2, spares=1, lease_ttl_s=TTL_S, policy={"stop_grace_s": STOP_GRACE_S}
    )
    with Fleet(default_prefix()) as fleet, FleetCluster(fleet, tmp_path / "cluster", spec) as cluster:
        first = cluster.wait_for_event(E.EVENT_KIND_FIRST_STEP, 0, 180)
        assert first is not None, cluster.controller_log()[-3000:]
        peer, victim = _launch_nodes(cluster)
        victim_host, etcd_host = cluster.host(victim), cluster.etcd_host
        assert _workers_on(cluster, victim) and _workers_on(cluster, peer)
        mark = cluster.events()[-1].seq

        _blackhole(victim_host, etcd_host.address, "add")
        _blackhole(etcd_host, victim_host.address, "add")
        cut_at = time.monotonic()
        try:
            # the cut is etcd's alone: the victim still reaches its peer's agent, not etcd
            assert victim_host.connects(cluster.host(peer).address, AGENT_PORT)
            assert not victim_host.connects(etcd_host.address, ETCD_CLIENT_PORT, timeout_s=0.5)
            deadline = cut_at + FENCE_BOUND_S + 5.0
            while _workers_on(cluster, victim) and time.monotonic() < deadline:
                time.sleep(0.1)
            fenced_after = time.monotonic() - cut_at
            print(f"\nthe etcd-only cut host's ranks ended {fenced_after:.2f} s after the cut")
            log = cluster.agent_log(victim)
            assert _workers_on(cluster, victim) == [], (
                f"still running after {fenced_after:.1f} s\n{log[-3000:]}"
            )
            assert fenced_after <= FENCE_BOUND_S, log[-3000:]
            # the peers answered, and their renewals are what fenced it (not the no-peer path)
            assert "renewed its lease" in log and "this host is cut off from it" in log, log[-3000:]
            assert "self-fencing" in log
            assert "self-fencing" not in cluster.agent_log(peer)  # the peer reaches etcd: no fence there
            # the controller replaced it with the spare: training goes on without the cut host
            again = cluster.wait_for_event(E.EVENT_KIND_FIRST_STEP, mark, 180)
            assert again is not None, cluster.controller_log()[-3000:]
            assert victim not in _launch_nodes(cluster)
        finally:
            _blackhole(victim_host, etcd_host.address, "del")
            _blackhole(etcd_host, victim_host.address, "del")
