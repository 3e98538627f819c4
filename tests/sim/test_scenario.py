from pathlib import Path

import pytest

from controller.sim.scenario import load_scenario, scenario_from_mapping
from runwarden.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "scenarios" / "llama3_405b.toml"


def test_llama3_scenario_carries_the_papers_counts() -> None:
    sc = load_scenario(LLAMA)
    counts = {c.name: c.count for c in sc.causes}
    assert sum(counts.values()) == 419
    assert counts["faulty_gpu"] == 148 and counts["gpu_hbm3_memory"] == 72 and counts["software_bug"] == 54
    assert len(counts) == 18
    assert sc.planned.count == 47
    assert sc.run.nodes * sc.run.gpus_per_node == 16_384
    assert set(sc.policies) == {"naive", "defaults", "commits", "cold", "tuned"}
    # the shipped defaults: the warm path's stop and launch (issue 18's measured breakdown, scaled),
    # resumes from the in-memory snapshots every 60 s, loaded from memory, the core's preflight rule
    # as shipped; commits: as before the snapshots; cold: as before the warm path and the rule
    defaults, commits, cold = sc.policy("defaults"), sc.policy("commits"), sc.policy("cold")
    assert defaults.costs == {"stop_s": 3, "launch_s": 30, "load_s": 10} and not cold.costs
    assert defaults.checkpoint_interval_s == 60 and commits.checkpoint_interval_s == 600
    assert commits.effective_costs(sc.costs).load_s == sc.costs.load_s == 120
    assert defaults.supervisor.preflight_max_age_s > 0 and defaults.supervisor.spare_check_interval_s > 0
    assert cold.supervisor.preflight_max_age_s == 0 and cold.spare_fraction == defaults.spare_fraction
    naive = sc.policy("naive")
    assert naive.spare_count(sc.run) == 0 and not naive.preflight and naive.supervisor.hang_timeout_s == 600
    assert naive.checkpoint_interval_s == 3600
    # 419 interruptions in 54 days: one every ~3.1 hours.
    assert sc.mtbf_s() == pytest.approx(54 * 86400 / 419)


def test_every_shipped_scenario_loads() -> None:
    for path in sorted((ROOT / "scenarios").glob("*.toml")):
        assert load_scenario(path).policies


def _base() -> dict:
    return {
        "run": {"nodes": 4, "duration_days": 1},
        "cause": [{"name": "a", "count": 1}],
        "policy": {"p": {}},
    }


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["run"].update(nodez=3), "unknown key(s) nodez"),
        (lambda d: d.update(extra={}), "unknown section(s) extra"),
        (lambda d: d["cause"][0].update(node_mtbf_hours=10), "exactly one of count"),
        (lambda d: d["cause"][0].update(symptom="explode"), "symptom"),
        (lambda d: d["cause"][0].update(evidence="vibes"), "evidence"),
        (lambda d: d["cause"].append({"name": "a", "count": 2}), "unique"),
        (lambda d: d["policy"]["p"].update(supervisor={"hang_timeout": 5}), "unknown key(s) hang_timeout"),
        (lambda d: d["policy"]["p"].update(costs={"lunch_s": 5}), "unknown key(s) lunch_s"),
        (lambda d: d["policy"]["p"].update(checkpoint_interval_s=0), "checkpoint_interval_s"),
        (lambda d: d["run"].update(duration_days=-1), "duration_days"),
        (lambda d: d.pop("policy"), "policy"),
    ],
)
def test_bad_scenarios_are_refused_with_the_key_named(mutate, message) -> None:
    data = _base()
    mutate(data)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        scenario_from_mapping(data)


def test_rates_scale_with_fleet_size_and_mtbf_form() -> None:
    data = _base()
    data["cause"] = [
        {"name": "a", "count": 10, "over_days": 10, "over_nodes": 100},
        {"name": "b", "node_mtbf_hours": 24 * 1000},
    ]
    data["run"]["nodes"] = 200
    sc = scenario_from_mapping(data)
    a, b = sc.causes
    assert a.fleet_rate_s(sc.run) == pytest.approx(2 * 10 / (10 * 86400))  # twice the nodes: twice the rate
    assert b.fleet_rate_s(sc.run) == pytest.approx(200 / (1000 * 86400))
