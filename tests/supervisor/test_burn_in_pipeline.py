"""The core's side of the burn-in pipeline: a repaired node's burn-in is RunPreflight(mode="burn_in")
within the policy's burn-in timeout; one burn-in whose every stage passed returns it to the spare
pool, a failed stage keeps it out; the policy's validation of the burn-in mode."""

from __future__ import annotations

import pytest

from controller.supervisor.actions import PersistNode, Quarantine, Release, RunPreflight
from controller.supervisor.events import (
    ActionFailed,
    EvidenceObserved,
    NodeClaimed,
    NodeJoined,
    NodeLost,
    OperatorRelease,
    PreflightResult,
    StoreListed,
)
from controller.supervisor.policy import SupervisorConfig
from controller.supervisor.pool import PoolState
from runwarden.v1 import common_pb2
from runwarden.v1 import events_pb2 as E
from tests.supervisor.harness import Driver, Item, fast


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


# --- issue 26: no strike without evidence about the node ----------------------------------------


def burn_ins(d: Driver, out: list[Item], node: str = "n2") -> list[RunPreflight]:
    return [r for r in d.of(RunPreflight, out) if r.purpose == "burn_in" and node in r.nodes]


def released_for_burn_in() -> Driver:
    d = held_for_repair()
    assert burn_ins(d, d.send(OperatorRelease(node="n2", reason="repaired: GPU reseated")))
    return d


def inconclusive(node: str = "n2") -> PreflightResult:
    return PreflightResult(
        node=node, passed=False, mode="burn_in", inconclusive_checks=("burn_in.allreduce",), duration_s=3000.0
    )


def test_an_inconclusive_burn_in_is_no_strike_and_runs_again_after_a_backoff_not_at_once() -> None:
    d = released_for_burn_in()
    before = d.sup.pool.get("n2").view()
    out = d.send(inconclusive())
    node = d.sup.pool.get("n2")
    assert node.state == PoolState.BURN_IN and not burn_ins(d, out) and not d.of(Quarantine, out)
    # Neither a rejection nor a failure on its record, and it does not wait for a repair.
    assert (node.preflight_rejections, node.failure_times, node.awaiting_repair_since) == (
        before.preflight_rejections,
        list(before.failure_times),
        0.0,
    )
    [logged] = d.events(E.EVENT_KIND_PREFLIGHT_RESULT, out)
    assert "burn-in of n2: inconclusive (burn_in.allreduce could not tell" in logged.message
    assert "no strike; again in 60s (1 in a row without a verdict)" in logged.message
    assert not burn_ins(d, d.advance(59.0))  # the backoff is a timer, not a loop
    [again] = burn_ins(d, d.advance(2.0))
    assert again.mode == "burn_in"
    out = d.send(inconclusive())
    assert (
        "again in 120s (2 in a row without a verdict)"
        in d.events(E.EVENT_KIND_PREFLIGHT_RESULT, out)[0].message
    )
    assert not burn_ins(d, d.advance(119.0)) and burn_ins(d, d.advance(2.0))
    out = d.send(PreflightResult(node="n2", passed=True, mode="burn_in"))
    assert d.sup.pool.get("n2").state == PoolState.SPARE and [r.node for r in d.of(Release, out)] == ["n2"]


def test_a_burn_in_the_agent_cannot_run_now_is_asked_again_after_the_backoff() -> None:
    # a new leader asks for a burn-in the previous leader's request still runs on the agent
    d = released_for_burn_in()
    asked = burn_ins(d, d.actions)[-1]
    out = d.send(
        ActionFailed(
            action=asked,
            node="n2",
            temporary=False,
            reason="ABORTED: a preflight is already running on this node",
        )
    )
    assert d.sup.pool.get("n2").state == PoolState.BURN_IN and not d.of(Quarantine, out)
    [logged] = d.events(E.EVENT_KIND_CONTROL_PLANE, out)
    assert "the node stays out until its burn-in can run (asked again in 60s)" in logged.message
    assert not burn_ins(d, d.advance(59.0))
    [again] = burn_ins(d, d.advance(2.0))
    assert again.mode == "burn_in"
    out = d.send(PreflightResult(node="n2", passed=True, mode="burn_in"))
    assert d.sup.pool.get("n2").state == PoolState.SPARE and [r.node for r in d.of(Release, out)] == ["n2"]


def test_an_inconclusive_check_with_a_failed_one_is_a_failure() -> None:
    d = released_for_burn_in()
    d.send(
        PreflightResult(
            node="n2",
            passed=False,
            mode="burn_in",
            failed_checks=("burn_in.memory",),
            inconclusive_checks=("burn_in.allreduce",),
        )
    )
    assert (
        d.sup.pool.get("n2").state == PoolState.QUARANTINED and d.sup.pool.get("n2").preflight_rejections == 1
    )
    with pytest.raises(ValueError, match="no pass"):
        PreflightResult(node="n2", passed=True, inconclusive_checks=("burn_in.allreduce",))


def failed_burn_in() -> tuple[Driver, list[Item]]:
    d = released_for_burn_in()
    out = d.send(PreflightResult(node="n2", passed=False, mode="burn_in", failed_checks=("burn_in.memory",)))
    assert d.sup.pool.get("n2").state == PoolState.QUARANTINED
    return d, out


def snapshot(d: Driver) -> StoreListed:
    pool = d.sup.pool.nodes
    return StoreListed(
        alive={n: 1 for n, p in pool.items() if p.alive},
        records=tuple(p.view() for p in pool.values()),
        attempt=d.sup.attempt,
        attempt_nodes=tuple(d.sup.current_nodes),
    )


def test_a_failed_burn_in_waits_for_a_repair_and_a_relist_does_not_run_it_again() -> None:
    d, out = failed_burn_in()
    assert any(
        "n2: failed (0/1 in a row); failed burn_in.memory; it waits for a repair" in e.message
        for e in d.events(E.EVENT_KIND_PREFLIGHT_RESULT, out)
    )
    [persisted] = [a.record for a in d.of(PersistNode, out) if a.record.node == "n2"]
    assert persisted.awaiting_repair_since == d.now  # durable: the store says it waits
    assert not burn_ins(d, d.send(snapshot(d)))  # a relist (a watch gap)
    assert not burn_ins(d, d.advance(3600.0))
    # A new leader: a fresh core built from what the store holds does not burn it in either.
    fresh = Driver(cfg=fast(), nodes=2, now=d.now)
    out = fresh.send(snapshot(d))
    assert fresh.sup.pool.get("n2").state == PoolState.QUARANTINED and not burn_ins(fresh, out)
    # Its claim given back by another run, with the record: still waiting.
    other = Driver(cfg=fast(), nodes=2, now=d.now)
    other.send(snapshot(d))
    back = other.send(NodeClaimed(node="n2", record=persisted))
    assert not burn_ins(other, back)


def test_a_new_lease_or_an_operators_repair_ends_the_wait() -> None:
    d, _ = failed_burn_in()
    d.send(NodeLost(node="n2"))
    out = d.send(NodeJoined(node="n2"))  # it rebooted: a new lease
    assert burn_ins(d, out) and d.sup.pool.get("n2").state == PoolState.BURN_IN
    assert any(
        "registered again after its failed burn-in" in e.message for e in d.events(E.EVENT_KIND_RELEASE, out)
    )
    assert d.sup.pool.get("n2").awaiting_repair_since == 0.0
    d, _ = failed_burn_in()
    out = d.send(OperatorRelease(node="n2", reason="repaired: DIMM replaced"))
    assert burn_ins(d, out) and d.sup.pool.get("n2").state == PoolState.BURN_IN


def test_a_later_quarantine_is_burned_in_as_any_despite_an_old_failed_burn_in() -> None:
    d, _ = failed_burn_in()
    node = d.sup.pool.get("n2")
    assert d.sup.pool.awaits_repair(node)
    node.failure_times.append(d.now + 10.0)  # struck again later (the stale wait of an earlier round)
    assert not d.sup.pool.awaits_repair(node)
