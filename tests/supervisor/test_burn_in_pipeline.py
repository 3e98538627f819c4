"""The core's side of the burn-in pipeline: a repaired node's burn-in is RunPreflight(mode="burn_in")
within the policy's burn-in timeout; one burn-in whose every stage passed returns it to the spare
pool, a failed stage keeps it out; the policy's validation of the burn-in mode."""

from __future__ import annotations

import pytest

from controller.supervisor.actions import Release, RunPreflight
from controller.supervisor.events import EvidenceObserved, OperatorRelease, PreflightResult
from controller.supervisor.policy import SupervisorConfig
from controller.supervisor.pool import PoolState
from runwarden.v1 import common_pb2
from runwarden.v1 import events_pb2 as E
from tests.supervisor.harness import Driver, fast


def held_for_repair() -> Driver:
    d = Driver(cfg=fast(), nodes=2)  # the default burn-in policy: mode burn_in, one pass
    d.start(3)  # n1, n2 active; n3 spare
    xid = common_pb2.Evidence(
        node="n2", kind=common_pb2.EVIDENCE_KIND_XID, severity=common_pb2.SEVERITY_FATAL, detail="Xid 79"
    )
    out = d.send(EvidenceObserved(evidence=xid)) + d.exit_all(code=-9) + d.advance(5)
    assert d.sup.pool.get("n2").state == PoolState.HELD
    assert not [r for r in d.of(RunPreflight, out) if r.purpose == "burn_in"]
    d.answer_preflight()  # the next attempt, with the spare
    return d


def test_after_repaired_the_burn_in_is_the_pipeline_and_every_stage_passing_returns_it_to_the_pool() -> None:
    d = held_for_repair()
    out = d.send(OperatorRelease(node="n2", reason="repaired: GPU reseated"))
    [burn] = d.of(RunPreflight, out)
    assert burn.purpose == "burn_in" and burn.mode == "burn_in" and burn.nodes == ("n2",)
    assert burn.timeout_s == SupervisorConfig().burn_in_timeout_s == 4000.0  # above the node's 3600 s budget
    assert d.sup.pool.get("n2").state == PoolState.BURN_IN
    out = d.send(PreflightResult(node="n2", passed=True, mode="burn_in", duration_s=3100.0))
    assert d.sup.pool.get("n2").state == PoolState.SPARE
    assert [r.node for r in d.of(Release, out)] == ["n2"]
    [release] = d.events(E.EVENT_KIND_RELEASE, out)
    assert "n2 returns to the spare pool: passed 1 burn-in pass in a row" in release.message


def test_a_failed_burn_in_stage_keeps_the_node_out_and_names_the_stage() -> None:
    d = held_for_repair()
    d.send(OperatorRelease(node="n2", reason="repaired"))
    out = d.send(PreflightResult(node="n2", passed=False, mode="burn_in", failed_checks=("burn_in.memory",)))
    node = d.sup.pool.get("n2")
    assert node.state != PoolState.SPARE and not d.of(Release, out)
    assert "burn_in.memory" in node.reason
    [result] = d.events(E.EVENT_KIND_PREFLIGHT_RESULT, out)
    assert "burn-in of n2: failed" in result.message and "burn_in.memory" in result.message


def test_burn_in_policy_defaults_and_validation() -> None:
    cfg = SupervisorConfig()
    assert (cfg.burn_in_mode, cfg.burn_in_passes) == ("burn_in", 1)
    for mode in ("full", "quick"):
        assert SupervisorConfig(burn_in_mode=mode).burn_in_mode == mode  # the old per-attempt burn-in
    with pytest.raises(ValueError, match="burn_in_mode: must be 'burn_in', 'full' or 'quick', got 'burnin'"):
        SupervisorConfig(burn_in_mode="burnin")
    with pytest.raises(ValueError, match="preflight_mode: must be 'quick' or 'full'"):
        SupervisorConfig(preflight_mode="burn_in")  # a per-attempt preflight of an hour: no
    with pytest.raises(ValueError, match="burn_in_timeout_s"):
        SupervisorConfig(burn_in_timeout_s=-1.0)
