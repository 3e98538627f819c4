"""Real gloo jobs that hang, run once per test session and shared by every test that reads their dumps."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.flightrec.scenarios import Scenario, ScenarioRun, run_scenarios

TP_DP = {"tp0": [0, 1], "tp1": [2, 3], "dp0": [0, 2], "dp1": [1, 3]}

SCENARIOS = [
    Scenario(name="w2_c0_spinning", world=2, culprit=0, spin=True),
    Scenario(name="w3_c0", world=3, culprit=0),
    # A ring of 8 records after ~13 collectives: every rank's buffer has wrapped.
    Scenario(name="w3_c1_wrapped", world=3, culprit=1, steps=14, hang_step=12, buffer_size=8),
    Scenario(name="w3_c2_subgroup", world=3, culprit=2, groups={"tp": [1, 2]}, hang_group="tp", steps=4),
    Scenario(name="w4_c3_tp_dp", world=4, culprit=3, groups=TP_DP, hang_group="tp1", steps=4),
    Scenario(name="w4_c1_sigstop", world=4, culprit=1, groups=TP_DP, hang_group="tp0", steps=4, sigstop=True),
]


@pytest.fixture(scope="session")
def fr_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ScenarioRun]:
    base: Path = tmp_path_factory.mktemp("fr")
    return run_scenarios(SCENARIOS, base, parallel=3)
