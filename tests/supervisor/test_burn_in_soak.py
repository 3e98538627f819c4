"""The burn-in's link stage (controller/supervisor/soak.py): a node that passed its node-local burn-in
soaks an all-reduce with idle neighbours before it returns to the pool; a slow link keeps it out."""

from __future__ import annotations

import pytest

from controller.supervisor.actions import MeasureBandwidth, Release, RunPreflight
from controller.supervisor.events import (
    ActionFailed,
    BandwidthMeasured,
    EvidenceObserved,
    NodeJoined,
    NodeLost,
    OperatorRelease,
    PreflightResult,
)
from controller.supervisor.policy import SupervisorConfig
from controller.supervisor.pool import PoolState
from runwarden.v1 import common_pb2
from runwarden.v1 import events_pb2 as E
from tests.supervisor.harness import Driver, Item, fast


def burned_in(**cfg: object) -> tuple[Driver, list[Item]]:
    """n2 held on a fatal Xid, repaired, its node-local burn-in passed; n4 and n5 idle spares."""
    d = Driver(cfg=fast(**cfg), nodes=2)
    d.start(5)  # n1, n2 active; n3, n4, n5 spares
    xid = common_pb2.Evidence(
        node="n2", kind=common_pb2.EVIDENCE_KIND_XID, severity=common_pb2.SEVERITY_FATAL, detail="Xid 79"
    )
    d.send(EvidenceObserved(evidence=xid))
    d.exit_all(code=-9)
    d.advance(5)
    d.answer_preflight()  # the next attempt: n1 and the spare n3
    d.send(OperatorRelease(node="n2", reason="repaired: GPU reseated"))
    out = d.send(PreflightResult(node="n2", passed=True, mode="burn_in", duration_s=3000.0))
    return d, out


def answer(d: Driver, soak: MeasureBandwidth, **figures: float) -> list[Item]:
    return d.send(
        BandwidthMeasured(
            nodes=soak.nodes,
            set_gbps=min(figures.values(), default=0.0),
            per_node_gbps=tuple((n, figures[n]) for n in soak.nodes if n in figures),
            duration_s=40.0,
            detail="nccl, 4 MiB x 50",
        )
    )


def test_a_node_local_pass_soaks_with_the_best_idle_spares_before_it_returns() -> None:
    d, out = burned_in()
    [soak] = d.of(MeasureBandwidth, out)
    assert soak.purpose == "burn_in" and soak.nodes == ("n2", "n4", "n5")
    assert soak.iterations == SupervisorConfig().burn_in_soak_iterations == 50
    assert soak.timeout_s == 300.0
    assert d.sup.pool.get("n2").state == PoolState.BURN_IN and not d.of(Release, out)
    [started] = d.events(E.EVENT_KIND_PREFLIGHT_RESULT, out)
    assert (
        "node-local stages passed; all-reduce soak with n4, n5 (50 all-reduces per group)" in started.message
    )
    out = answer(d, soak, n2=9.5, n4=10.0, n5=10.5)
    assert d.sup.pool.get("n2").state == PoolState.SPARE
    assert [r.node for r in d.of(Release, out)] == ["n2"]
    verdict = d.events(E.EVENT_KIND_PREFLIGHT_RESULT, out)[0]
    assert "all-reduce soak passed; best pair per node: n2 9.5, n4 10, n5 10.5" in verdict.message
    assert "floor 10.5 GB/s (median of the neighbours) x 0.5" in verdict.message


def test_a_slow_link_fails_the_soak_and_the_node_stays_out() -> None:
    d, out = burned_in()
    [soak] = d.of(MeasureBandwidth, out)
    out = answer(d, soak, n2=2.0, n4=10.0, n5=11.0)
    node = d.sup.pool.get("n2")
    assert node.state == PoolState.QUARANTINED and not d.of(Release, out)
    assert "burn_in.neighbour_soak" in node.reason
    messages = [e.message for e in d.events(E.EVENT_KIND_PREFLIGHT_RESULT, out)]
    assert any("all-reduce soak failed: 2 GB/s below 5.5 GB/s" in m for m in messages), messages
    assert any("burn-in of n2: failed (0/1 in a row); failed burn_in.neighbour_soak" in m for m in messages)


def test_a_configured_floor_is_the_reference_and_a_pair_that_carried_nothing_fails() -> None:
    d, out = burned_in(bandwidth_floor_gbps=20.0)
    [soak] = d.of(MeasureBandwidth, out)
    answer(d, soak, n2=12.0, n4=30.0, n5=30.0)  # 12 >= 0.5 x 20 (the neighbours' median would say 15)
    assert d.sup.pool.get("n2").state == PoolState.SPARE
    d, out = burned_in()
    [soak] = d.of(MeasureBandwidth, out)
    out = answer(d, soak, n2=0.0, n4=10.0, n5=10.0)
    assert d.sup.pool.get("n2").state == PoolState.QUARANTINED
    assert any(
        "all-reduce soak failed: no all-reduce ran" in e.message
        for e in d.events(E.EVENT_KIND_PREFLIGHT_RESULT, out)
    )


def test_no_answer_in_time_or_a_shell_that_cannot_measure_releases_on_the_node_local_stages() -> None:
    d, out = burned_in()
    [soak] = d.of(MeasureBandwidth, out)
    out = d.advance(301.0)
    assert d.sup.pool.get("n2").state == PoolState.SPARE and [r.node for r in d.of(Release, out)] == ["n2"]
    assert any(
        "no soak answer within 300s" in e.message for e in d.events(E.EVENT_KIND_PREFLIGHT_RESULT, out)
    )
    out = answer(d, soak, n2=0.0, n4=1.0, n5=1.0)  # the late answer decides nothing now
    assert d.sup.pool.get("n2").state == PoolState.SPARE and not d.of(Release, out)
    d, out = burned_in()
    [soak] = d.of(MeasureBandwidth, out)
    out = d.send(ActionFailed(action=soak, temporary=True, reason="no all-reduce could run"))
    assert d.sup.pool.get("n2").state == PoolState.SPARE
    assert any("soak could not run" in e.message for e in d.events(E.EVENT_KIND_PREFLIGHT_RESULT, out))


def test_a_node_with_no_figure_is_not_judged_and_the_soak_can_be_off() -> None:
    d, out = burned_in()
    [soak] = d.of(MeasureBandwidth, out)
    out = answer(d, soak, n4=10.0, n5=10.0)  # n2's agent refused its pairs: no figure
    assert d.sup.pool.get("n2").state == PoolState.SPARE
    assert any("soak gave n2 no figure" in e.message for e in d.events(E.EVENT_KIND_PREFLIGHT_RESULT, out))
    off, _ = burned_in(burn_in_soak_neighbours=0)
    assert not [a for a in off.actions if isinstance(a, MeasureBandwidth)]
    assert off.sup.pool.get("n2").state == PoolState.SPARE  # off: the node-local stages decide


@pytest.mark.parametrize(("key", "value"), [("burn_in_soak_neighbours", -1), ("burn_in_soak_iterations", 0)])
def test_soak_policy_validation(key: str, value: int) -> None:
    with pytest.raises(ValueError, match=key):
        SupervisorConfig(**{key: value})


def test_a_node_lost_mid_soak_is_not_released_by_the_soaks_deadline() -> None:
    d, out = burned_in()
    [soak] = d.of(MeasureBandwidth, out)
    d.send(NodeLost(node="n2"))
    out = d.advance(301.0)  # the soak's deadline passes while n2 is dead
    assert not d.of(Release, out) and d.sup.pool.get("n2").state == PoolState.BURN_IN
    assert not any("no soak answer" in e.message for e in d.events(E.EVENT_KIND_PREFLIGHT_RESULT, out))
    assert not d.of(Release, answer(d, soak, n2=10.0, n4=10.0, n5=10.0))  # a late answer decides nothing
    out = d.send(NodeJoined(node="n2"))  # back: its burn-in starts afresh
    assert [r.nodes for r in d.of(RunPreflight, out) if r.purpose == "burn_in"] == [("n2",)]


def test_a_node_quarantined_again_mid_soak_is_not_released_by_its_verdict() -> None:
    d, out = burned_in()
    [soak] = d.of(MeasureBandwidth, out)
    ecc = common_pb2.Evidence(
        node="n2",
        kind=common_pb2.EVIDENCE_KIND_ECC_UNCORRECTABLE,
        severity=common_pb2.SEVERITY_FATAL,
        detail="1 uncorrectable ECC error",
    )
    d.send(EvidenceObserved(evidence=ecc))
    assert d.sup.pool.get("n2").state == PoolState.HELD
    out = answer(d, soak, n2=10.0, n4=10.0, n5=10.0) + d.advance(301.0)
    assert not d.of(Release, out) and d.sup.pool.get("n2").state == PoolState.HELD
