"""The first-order model of lost time, and the Young/Daly checkpoint interval: what the simulator is
checked against where the model's assumptions hold (tests/sim/test_model_agreement.py), and the
"model" column of `controllerctl simulate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from controller.sim.scenario import Cause, Policy, Scenario
from controller.supervisor.detectors import hang_timeout


def young_daly_interval_s(mtbf_s: float, stall_s: float) -> float:
    """The checkpoint interval that minimises stall/I + I/(2 MTBF): sqrt(2 x MTBF x stall)."""
    if mtbf_s <= 0 or stall_s < 0:
        raise ValueError(f"young_daly_interval_s: need mtbf > 0 and stall >= 0, got {mtbf_s}, {stall_s}")
    return math.sqrt(2.0 * mtbf_s * stall_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class FailureCost:
    """Seconds one failure of a cause costs, by lever."""

    cause: str
    rate_s: float
    detect_s: float
    attribute_s: float
    replace_s: float
    restart_s: float  # stop + preflight (of the nodes not vouched for) + launch + load + first step
    rework_s: float  # work since the last commit, rolled back

    @property
    def downtime_s(self) -> float:
        return self.detect_s + self.attribute_s + self.replace_s + self.restart_s

    @property
    def total_s(self) -> float:
        return self.downtime_s + self.rework_s


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelResult:
    ettr: float
    stall_fraction: float
    by_lever: dict[str, float]  # fraction of wall time lost to each lever
    costs: tuple[FailureCost, ...]
    mtbf_s: float
    young_daly_s: float


def policy_hang_timeout_s(scenario: Scenario, policy: Policy) -> float:
    return hang_timeout(policy.supervisor, scenario.run.step_time_s, in_checkpoint=False)


def detect_s(scenario: Scenario, policy: Policy, cause: Cause) -> float:
    det = scenario.detection
    if cause.symptom == "node_lost":
        return policy.lease_ttl_s + det.lease_check_s / 2
    evidence = policy.use_evidence and bool(cause.evidence)
    if cause.symptom == "crash":
        return min(det.crash_s, det.evidence_s) if evidence else det.crash_s
    return det.evidence_s if evidence else policy_hang_timeout_s(scenario, policy)


def restart_preflight_s(scenario: Scenario, policy: Policy, *, hardware: bool) -> float:
    """The quick preflight on a restart's critical path (the core's rule, prepare.vouched_for). The
    hosts that trained healthily until the fault are vouched for while preflight_max_age_s > 0; a
    hardware fault's replacement too when the spares' background sweep keeps every spare's check
    within the vouch (spare_checks.due: at most 1.5 intervals plus the check itself old). A node from
    the scheduler's queue is preflighted."""
    if not policy.preflight:
        return 0.0
    sup, preflight_s = policy.supervisor, policy.effective_costs(scenario.costs).preflight_s
    if sup.preflight_max_age_s <= 0:
        return preflight_s
    if not hardware:
        return 0.0
    interval = sup.spare_check_interval_s
    checked_spare = (
        policy.spare_count(scenario.run) > 0
        and interval > 0
        and 1.5 * interval + preflight_s <= sup.preflight_max_age_s
    )
    return 0.0 if checked_spare else preflight_s


def failure_cost(scenario: Scenario, policy: Policy, cause: Cause) -> FailureCost:
    costs = policy.effective_costs(scenario.costs)
    interval, stall = policy.checkpoint_interval_s, policy.checkpoint_stall_s
    hang_dumps = (
        cause.symptom == "hang"
        and policy.flight_recorder
        and policy.supervisor.collect_dumps
        and not (policy.use_evidence and cause.evidence)
    )
    attribute = scenario.detection.dumps_s if hang_dumps else 0.0
    if cause.hardware:
        replace = costs.allocate_spare_s if policy.spare_count(scenario.run) > 0 else costs.allocate_queue_s
    else:
        replace = 0.0
    restart = (
        costs.stop_s
        + restart_preflight_s(scenario, policy, hardware=cause.hardware)
        + costs.launch_s
        + costs.load_s
        + costs.first_step_s
    )
    # A fault lands uniformly in a cycle of `interval` training + `stall` saving: the training since
    # the last commit is lost, on average interval/2 (a fault during the save loses the whole interval).
    rework = interval * (interval / 2 + stall) / (interval + stall)
    return FailureCost(
        cause=cause.name,
        rate_s=cause.fleet_rate_s(scenario.run),
        detect_s=detect_s(scenario, policy, cause),
        attribute_s=attribute,
        replace_s=replace,
        restart_s=restart,
        rework_s=rework,
    )


def first_order(scenario: Scenario, policy: Policy) -> ModelResult:
    """ETTR = (1 - rate x downtime) x I/(I+S) - rate x rework, planned stops included.

        lost fraction ~= stall / (interval + stall)  +  sum over causes of rate x minutes lost per failure

    A failure loses the work since the last commit (half a checkpoint cycle on average) plus the
    downtime from the fault to the first new step. Assumptions: failures are rare next to the
    checkpoint interval and the restart path, spares never run out, a repaired node never comes back
    broken. Young (1974) / Daly (2006): the interval that minimises stall/I + I/(2 x MTBF) is
    sqrt(2 x MTBF x stall).
    """
    interval, stall = policy.checkpoint_interval_s, policy.checkpoint_stall_s
    # A straggler and a control-plane blip do not stop the job (not in the model's first order).
    costs = tuple(
        failure_cost(scenario, policy, c)
        for c in scenario.causes
        if c.symptom not in ("straggler", "control_plane")
    )
    c = policy.effective_costs(scenario.costs)
    planned_rate = scenario.planned.rate_s(scenario.run)
    planned_down = (
        stall
        + c.stop_s
        + c.launch_s
        + c.load_s
        + c.first_step_s
        + restart_preflight_s(scenario, policy, hardware=False)
    )
    down = sum(fc.rate_s * fc.downtime_s for fc in costs) + planned_rate * planned_down
    rework = sum(fc.rate_s * fc.rework_s for fc in costs)
    up_fraction = 1.0 - down
    stall_fraction = up_fraction * stall / (interval + stall)
    ettr = up_fraction * interval / (interval + stall) - rework
    by_lever = {
        "checkpoint_stall": stall_fraction,
        "rework": rework,
        "detect": sum(fc.rate_s * fc.detect_s for fc in costs),
        "attribute": sum(fc.rate_s * fc.attribute_s for fc in costs),
        "replace": sum(fc.rate_s * fc.replace_s for fc in costs),
        "restart": sum(fc.rate_s * fc.restart_s for fc in costs),
        "planned": planned_rate * planned_down,
    }
    mtbf = scenario.mtbf_s()
    return ModelResult(
        ettr=ettr,
        stall_fraction=stall_fraction,
        by_lever=by_lever,
        costs=costs,
        mtbf_s=mtbf,
        young_daly_s=young_daly_interval_s(mtbf, stall) if math.isfinite(mtbf) else math.inf,
    )
