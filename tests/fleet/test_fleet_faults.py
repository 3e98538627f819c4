"""Issue 15 on a real multi-host network: a host partitioned mid-run, a slow link caught by the
bandwidth gate, and the leader controller partitioned from etcd.

One FleetCluster (etcd, a leader and a standby controller, 4 active + 2 spare agents, each on its
own network-namespace host, mTLS everywhere, the bandwidth gate on) is shared by the module; the
scenario runs once, in order, and each test checks one part of what the event log and the hosts
show. The loss of the whole run still equals an uninterrupted run of the same seed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from runwarden.eventlog import LogEntry, read_events
from runwarden.v1 import events_pb2
from testbed.fleet import (
    Fleet,
    default_prefix,
    heal,
    netns_pids,
    partition,
    slow,
    sweep_orphans,
    unslow,
)
from testbed.fleet import available as fleet_available
from testbed.fleet_cluster import ClusterSpec, FleetCluster
from testbed.wait import wait_until
from tests.e2e.five_faults import assert_losses_equal_an_uninterrupted_run

E = events_pb2
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
TTL_S = 2.0
STOP_GRACE_S = 5.0


@dataclass
class Scenario:
    cluster: FleetCluster
    events: list[LogEntry] = field(default_factory=list)
    marks: dict[str, float] = field(default_factory=dict)
    seqs: dict[str, int] = field(default_factory=dict)
    nodes: dict[str, str] = field(default_factory=dict)
    notes: dict[str, object] = field(default_factory=dict)


def _launch_nodes(cluster: FleetCluster) -> list[str]:
    for ev in reversed(cluster.events()):
        if ev.kind == E.EVENT_KIND_LAUNCH:
            return list(ev.launch.nodes)
    return []


def _last_seq(cluster: FleetCluster) -> int:
    evs = cluster.events()
    return evs[-1].seq if evs else 0


def _workers_on(cluster: FleetCluster, node: str) -> list[int]:
    """PIDs on the node's host other than its agent: the attempt's ranks and their launcher."""
    agent = cluster.agents[node].pid
    return [p for p in netns_pids(cluster.host(node).netns) if p != agent]


def _first_step_after(cluster: FleetCluster, seq: int, timeout_s: float = 120.0) -> LogEntry:
    ev = cluster.wait_for_event(E.EVENT_KIND_FIRST_STEP, seq, timeout_s)
    assert ev is not None, cluster.controller_log()[-3000:]
    return ev


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    ok, reason = fleet_available()
    if not ok:
        pytest.skip(f"skipped: no network namespaces ({reason})")
    sweep_orphans()
    root = tmp_path_factory.mktemp("fleet-faults")
    spec = ClusterSpec(
        warm_workers=False,
        lease_ttl_s=TTL_S,
        policy={"bandwidth_gate": True, "bandwidth_gate_timeout_s": 45.0, "stop_grace_s": STOP_GRACE_S},
    )
    with Fleet(default_prefix()) as fleet:
        cluster = FleetCluster(fleet, root / "cluster", spec, standby=True)
        sc = Scenario(cluster=cluster)
        try:
            cluster.start()
            first = _first_step_after(cluster, 0, 150)
            # steady training before the first fault: a checkpoint committed after the first step
            commit = cluster.wait_for_event(E.EVENT_KIND_CHECKPOINT_COMMIT, first.seq, 120)
            assert commit is not None, cluster.controller_log()[-3000:]
            # 1. A host partitioned mid-run (node rank 1): its agent fences itself; a spare replaces it.
            victim = _launch_nodes(cluster)[1]
            sc.nodes["partitioned"] = victim
            sc.seqs["partition"] = _last_seq(cluster)
            sc.marks["partition"] = time.time()
            t0 = time.monotonic()
            partition(cluster.host(victim))
            deadline = t0 + TTL_S + STOP_GRACE_S + 5.0
            while _workers_on(cluster, victim) and time.monotonic() < deadline:
                time.sleep(0.2)
            sc.notes["fenced_after_s"] = time.monotonic() - t0
            sc.notes["workers_left"] = _workers_on(cluster, victim)
            _first_step_after(cluster, sc.seqs["partition"])
            heal(cluster.host(victim))
            sc.seqs["healed"] = _last_seq(cluster)
            released = cluster.wait_for_event(
                E.EVENT_KIND_RELEASE, sc.seqs["healed"], 120, lambda e: e.release.node == victim
            )
            sc.notes["released"] = released is not None
            # 2. A slow link on a node of the attempt, then a relaunch: the gate swaps it out.
            nodes = _launch_nodes(cluster)
            slowed = nodes[2]
            sc.nodes["slowed"] = slowed
            slow(cluster.host(slowed), "50mbit")
            sc.seqs["slow"] = _last_seq(cluster)
            out = cluster.ctl("chaos", nodes[0], "kill-rank")
            assert out.returncode == 0, out.stderr
            _first_step_after(cluster, sc.seqs["slow"], 180)
            unslow(cluster.host(slowed))
            # 3. The leader controller partitioned from etcd (and everything): the standby takes over.
            leader = cluster.leader()
            assert leader, "no controller leads"
            other = "controller-b" if leader == "controller-a" else "controller-a"
            sc.nodes["leader"] = leader
            sc.seqs["leader"] = _last_seq(cluster)
            sc.marks["leader"] = time.time()
            partition(cluster.controller_host_of(leader))
            took = cluster.wait_for_event(
                E.EVENT_KIND_CONTROL_PLANE, sc.seqs["leader"], TTL_S + 10.0,
                lambda e: "reconciled from the store" in e.message,
            )  # fmt: skip
            sc.notes["standby_took_over_s"] = (took.ts - sc.marks["leader"]) if took else None
            with contextlib.suppress(AssertionError):  # the test below says what was seen
                wait_until(lambda: cluster.leader() == other, 30, f"{other} to lead in the controllers' logs")
            sc.notes["new_leader"] = cluster.leader()
            heal(cluster.controller_host_of(leader))
            # the healed controller is back in the election (a standby now) before the run is stopped
            wait_until(
                lambda: leader in cluster.contenders(),
                60,
                f"{leader} to campaign again after the heal",
                interval_s=0.5,
                detail=lambda: cluster.controller_log(leader)[-3000:],
            )
            cluster.ctl("stop", spec.run, "--reason", "test finished", host=cluster.controller_host_of(other))
            cluster.wait_for_event(E.EVENT_KIND_RUN_END, 0, 90)
        finally:
            cluster.stop()
        read = read_events(cluster.event_log)
        assert not read.errors and read.torn_tail is None
        sc.events = read.entries
        gate = [e for e in sc.events if "bandwidth gate on" in e.message]
        print(f"\nfleet faults: partitioned host fenced after {sc.notes['fenced_after_s']:.2f}s; "
              f"standby took over {sc.notes['standby_took_over_s']}s after the leader's partition; "
              f"{len(gate)} gate runs: " + " | ".join(e.message for e in gate))  # fmt: skip
        yield sc


def _between(sc: Scenario, start: str, end: str | None) -> list[LogEntry]:
    lo = sc.seqs[start]
    hi = sc.seqs[end] if end else 10**12
    return [e for e in sc.events if lo < e.seq <= hi]


def test_a_partitioned_host_is_detected_blamed_replaced_and_fences_itself(scenario: Scenario) -> None:
    victim = scenario.nodes["partitioned"]
    window = _between(scenario, "partition", "healed")
    det = next(e for e in window if e.kind == E.EVENT_KIND_DETECTION)
    assert det.detection.detector == E.DETECTOR_NODE_LOST and det.detection.nodes == [victim], det.message
    assert det.ts - scenario.marks["partition"] <= TTL_S + 1.0, "detected within TTL + 1 s"
    att = next(e for e in window if e.kind == E.EVENT_KIND_ATTRIBUTION)
    assert att.attribution.suspects[0].node == victim, att.message
    launch = next(e for e in window if e.kind == E.EVENT_KIND_LAUNCH)
    assert victim not in launch.launch.nodes
    assert scenario.notes["workers_left"] == [], "the partitioned host's agent did not stop its ranks"
    assert float(scenario.notes["fenced_after_s"]) <= TTL_S + STOP_GRACE_S + 2.0


def test_after_healing_the_host_returns_only_through_burn_in(scenario: Scenario) -> None:
    victim = scenario.nodes["partitioned"]
    assert scenario.notes["released"], f"{victim} did not pass burn-in and return to the pool"
    after = _between(scenario, "healed", None)
    burn = [
        e for e in after if e.kind == E.EVENT_KIND_PREFLIGHT_RESULT and f"burn-in of {victim}" in e.message
    ]
    assert burn, "no burn-in after the host came back"


def test_the_bandwidth_gate_swaps_out_the_slow_host(scenario: Scenario) -> None:
    slowed = scenario.nodes["slowed"]
    window = _between(scenario, "slow", "leader")
    gate = [e for e in window if e.kind == E.EVENT_KIND_PREFLIGHT_RESULT and "bandwidth gate on" in e.message]
    assert gate, "the gate did not run before the relaunch"
    # the slowed host is below the floor (on 2 loaded cores a healthy one can be too: it is then
    # swapped out as well, which the gate is allowed to do; the slowed one must never pass)
    assert f"bandwidth:{slowed}" in gate[0].preflight.summary.failed_checks, gate[0].message
    q = [e for e in window if e.kind == E.EVENT_KIND_QUARANTINE and e.quarantine.node == slowed]
    assert q and "bandwidth gate" in q[0].quarantine.reason
    launch = next(e for e in window if e.kind == E.EVENT_KIND_LAUNCH)
    assert slowed not in launch.launch.nodes
    assert any(e.kind == E.EVENT_KIND_SPARE_TAKEN for e in window)


def test_the_standby_takes_over_from_a_partitioned_leader_without_a_double_launch(scenario: Scenario) -> None:
    assert scenario.notes["new_leader"] not in ("", scenario.nodes["leader"])
    took = scenario.notes["standby_took_over_s"]
    assert took is not None and float(took) <= TTL_S + 2.0, took
    attempts = [e.attempt for e in scenario.events if e.kind == E.EVENT_KIND_LAUNCH]
    assert attempts == sorted(set(attempts)), f"double launch: {attempts}"
    seqs = [e.seq for e in scenario.events]
    assert seqs == list(range(1, len(seqs) + 1)), "the event log has a duplicated or missing line"


def test_no_checkpoint_of_a_fenced_attempt_is_resumed_from_and_the_loss_is_unchanged(
    scenario: Scenario, tmp_path: Path
) -> None:
    committed: set[int] = set()
    for ev in scenario.events:
        if ev.kind == E.EVENT_KIND_CHECKPOINT_COMMIT:
            committed.add(ev.step)
        elif ev.kind == E.EVENT_KIND_LAUNCH and ev.launch.resume_step >= 0:
            assert ev.launch.resume_step in committed
    assert_losses_equal_an_uninterrupted_run(scenario.cluster, tmp_path)
