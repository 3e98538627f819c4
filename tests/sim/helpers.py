"""Small scenarios built in code for the simulator's tests."""

from __future__ import annotations

from typing import Any

from controller.sim.scenario import Scenario, scenario_from_mapping


def tiny(
    *,
    nodes: int = 16,
    days: float = 10.0,
    mtbf_h: float = 2.0,
    interval_s: float = 600.0,
    stall_s: float = 30.0,
    spares: int = 8,
    causes: list[dict[str, Any]] | None = None,
    planned: float = 0.0,
    **policy: Any,
) -> Scenario:
    """A fleet where the first-order model's assumptions hold: ample spares, crashes with evidence.

    The fleet MTBF is `mtbf_h` hours, split over the given causes in proportion to their `share`.
    """
    causes = causes or [{"name": "gpu", "share": 1.0, "symptom": "crash", "evidence": "xid"}]
    total = sum(c["share"] for c in causes)
    expected = days * 24.0 / mtbf_h
    cause_tables = []
    for c in causes:
        t = {k: v for k, v in c.items() if k != "share"}
        t["count"] = expected * c["share"] / total
        t.setdefault("repair_hours", 4.0)
        cause_tables.append(t)
    pol = {
        "spares": spares,
        "lease_ttl_s": 5.0,
        "checkpoint_interval_s": interval_s,
        "checkpoint_stall_s": stall_s,
        "supervisor": {"restart_budget": 10_000, "restart_budget_window_s": 0.0, "hold_after_failures": 1000},
    }  # repaired nodes always return
    sup = {**pol["supervisor"], **policy.pop("supervisor", {})}
    pol.update(policy)
    pol["supervisor"] = sup
    data = {
        "run": {"name": "tiny", "nodes": nodes, "duration_days": days, "step_time_s": 2.0},
        "costs": {
            "allocate_spare_s": 5,
            "allocate_queue_s": 600,
            "preflight_s": 30,
            "stop_s": 5,
            "launch_s": 30,
            "load_s": 30,
            "first_step_s": 15,
            "repair_hours": 4,
            "burn_in_s": 600,
        },
        "detection": {"crash_s": 5, "evidence_s": 5, "dumps_s": 10},
        "cause": cause_tables,
        "planned": {"count": planned},
        "policy": {"p": pol},
    }
    return scenario_from_mapping(data, source="tiny")
