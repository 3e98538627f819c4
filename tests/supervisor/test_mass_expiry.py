"""Issue 26, the control-plane guard (README "Control-plane guard"): three leases expiring within
2 s are a control-plane fault at any fleet size, not 25 % of the fleet. Driven through the real core."""

from __future__ import annotations

import pytest

from controller.supervisor import detectors
from controller.supervisor.actions import Quarantine, StopAttempt
from controller.supervisor.events import NodeLost
from controller.supervisor.machine import RunState
from controller.supervisor.policy import SupervisorConfig
from runwarden.v1 import events_pb2 as E
from tests.supervisor.harness import Driver, fast


@pytest.mark.parametrize(
    ("fleet", "threshold"),
    [(2048, 3), (100, 3), (6, 3), (4, 3), (3, 2), (2, 2), (1, 2)],
)
def test_the_default_threshold_is_three_at_any_size_and_fewer_only_in_a_tiny_fleet(
    fleet: int, threshold: int
) -> None:
    assert detectors.mass_expiry_threshold(SupervisorConfig(), fleet) == threshold


def test_three_leases_within_two_seconds_on_2048_nodes_are_the_control_plane() -> None:
    d = Driver(cfg=fast(), nodes=64)
    d.start(2048)  # 64 in the attempt, the rest of the fleet spare
    d.steps(1, 5)
    victims = d.running_nodes()[:3]
    out: list = []
    for i, n in enumerate(victims):
        out += d.send(NodeLost(node=n), d.now + 0.5 * i)
    cp = d.events(E.EVENT_KIND_CONTROL_PLANE, out)
    assert cp and "3 leases expired within 2s" in cp[0].message
    assert d.sup.state is RunState.CONTROL_PLANE and not d.of(Quarantine)
    d.advance(d.cfg.control_plane_grace_s + 1)  # they never come back: relaunched, nobody blamed
    assert not d.of(Quarantine)


def test_a_mass_expiry_that_begins_with_one_lease_stops_nothing() -> None:
    """A lone lost node's peers are stopped `lost_node_hold_s` after its expiry, not at once: the
    expiries that follow inside the hold make it the control plane's fault, and the attempt runs on."""
    d = Driver(cfg=fast(), nodes=64)
    d.start(2048)
    d.steps(1, 5)
    first, *others = d.running_nodes()[:3]
    out = d.send(NodeLost(node=first))
    out += d.advance(0.6 * d.cfg.lost_node_hold_s)  # timers run: the hold has not ended
    for n in others:
        out += d.send(NodeLost(node=n), d.now + 0.1 * d.cfg.lost_node_hold_s)
    out += d.advance(2 * d.cfg.lost_node_hold_s)
    assert d.events(E.EVENT_KIND_DETECTION, out) and d.events(E.EVENT_KIND_CONTROL_PLANE, out)
    assert d.sup.state is RunState.CONTROL_PLANE and not d.of(StopAttempt) and not d.of(Quarantine)


def test_three_losses_further_apart_than_the_window_are_node_faults() -> None:
    """The control: 1.5 s apart, no 2 s window holds three: the first is a node's fault (a detection),
    and the run never pauses for the control plane."""
    d = Driver(cfg=fast(), nodes=64)
    d.start(2048)
    d.steps(1, 5)
    out: list = []
    for i, n in enumerate(d.running_nodes()[:3]):
        out += d.send(NodeLost(node=n), d.now + 1.5 * (i > 0))
    assert list(d.events(E.EVENT_KIND_DETECTION, out)[0].detection.nodes) == ["n1"]
    assert not d.events(E.EVENT_KIND_CONTROL_PLANE, out) and d.sup.state is not RunState.CONTROL_PLANE


def test_both_nodes_of_a_two_node_fleet_at_once_are_the_control_plane() -> None:
    d = Driver(cfg=fast(), nodes=2)
    d.start(2)
    d.steps(1, 5)
    out = d.send(NodeLost(node="n1"), d.now + 0.1)
    out += d.send(NodeLost(node="n2"), d.now + 0.3)
    assert d.sup.state is RunState.CONTROL_PLANE and d.events(E.EVENT_KIND_CONTROL_PLANE, out)
    assert not d.of(Quarantine)
