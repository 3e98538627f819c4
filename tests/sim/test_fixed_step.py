"""Software bugs at a fixed step (issue 26): the scenario's share, and the world's rotating culprit."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.sim.draws import draw
from controller.sim.engine import simulate
from controller.sim.report import outcome_of
from controller.sim.scenario import FixedStep, load_scenario, scenario_from_mapping, with_fixed_step_share
from runwarden.config import ConfigError
from runwarden.v1 import events_pb2 as E
from tests.sim.helpers import tiny

ROOT = Path(__file__).resolve().parents[2]


def test_the_share_moves_rate_to_fixed_step_causes_and_keeps_the_total() -> None:
    base = load_scenario(ROOT / "scenarios" / "llama3_405b.toml")
    sc = with_fixed_step_share(base, FixedStep(share=0.1, hang=1.0, crash=1.0))
    assert sc.interruption_rate_s() == pytest.approx(base.interruption_rate_s())
    fixed = {c.name: c for c in sc.causes if c.fixed_step}
    assert set(fixed) == {"fixed_step_hang", "fixed_step_crash"}
    total = sum(c.count or 0 for c in sc.causes)
    assert sum(c.count or 0 for c in fixed.values()) == pytest.approx(0.1 * total)
    assert {c.symptom for c in fixed.values()} == {"hang", "crash"}
    assert all(not c.hardware for c in fixed.values())
    gpu = next(c for c in sc.causes if c.name == "faulty_gpu")
    assert gpu.count == pytest.approx(148 * 0.9)
    assert with_fixed_step_share(base, FixedStep(share=0.0)) is base


def test_the_fixed_step_section_loads_and_is_validated() -> None:
    data = {
        "run": {"nodes": 4, "duration_days": 1},
        "cause": [{"name": "a", "count": 9}],
        "policy": {"p": {}},
        "fixed_step": {"share": 0.25, "crash": 0.0},
    }
    sc = scenario_from_mapping(data)
    assert [c.name for c in sc.causes] == ["a", "fixed_step_hang"]
    assert sc.causes[0].count == pytest.approx(6.75) and sc.causes[1].count == pytest.approx(2.25)
    with pytest.raises(ConfigError, match=r"fixed_step\.share"):
        scenario_from_mapping({**data, "fixed_step": {"share": 1.0}})
    with pytest.raises(ConfigError, match="fixed_step needs hardware = false"):
        scenario_from_mapping({**data, "cause": [{"name": "b", "count": 1, "fixed_step": True}]})


def test_a_bug_recurs_at_its_step_on_another_node_each_time() -> None:
    sc = tiny(
        nodes=16,
        days=1.0,
        mtbf_h=8.0,
        spares=4,
        causes=[
            {
                "name": "bug",
                "share": 1.0,
                "symptom": "crash",
                "hardware": False,
                "fixed_step": True,
                "fix_hours": 3,
            }
        ],
    )
    result = simulate(sc, sc.policy("p"), draw(sc, 3))
    hits = [i for i in result.interruptions if i.cause == "bug" and i.outcome in ("interrupted", "refail")]
    assert len(hits) > len([i for i in result.interruptions if i.outcome in ("interrupted", "armed")])
    detections = [e for e in result.events if e.kind == E.EVENT_KIND_DETECTION]
    # Each bug's hits: the same step (give or take one), a different node each time.
    by_bug: dict[int, list[tuple[int, str]]] = {}
    bug = 0
    for ev in detections:
        steps = by_bug.get(bug, [])
        if steps and abs(steps[0][0] - ev.step) > 1:
            bug += 1
        by_bug.setdefault(bug, []).append((ev.step, ev.detection.nodes[0]))
    repeated = [hits for hits in by_bug.values() if len(hits) >= 2]
    assert repeated
    for hits in repeated:
        nodes = [n for _, n in hits]
        assert len(set(nodes)) == len(nodes), hits
    # The core ended the run (a crash loop) and the operator started it again at the fix.
    assert result.run_restarts >= 1
    assert any(e.kind == E.EVENT_KIND_RUN_START for e in result.events)
    out = outcome_of(result, 0.0)
    assert abs(out.ettr + sum(out.lost_by_lever.values()) - 1.0) < 1e-6
    # Nothing was wrong with any node: every quarantine is of a healthy node, for the bug.
    assert all(q.healthy and q.fault_kind == "fixed_step" for q in result.quarantines)
