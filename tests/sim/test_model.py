import math

import pytest

from controller.sim.model import failure_cost, first_order, young_daly_interval_s
from tests.sim.helpers import tiny


def test_young_daly_is_sqrt_two_mtbf_stall() -> None:
    assert young_daly_interval_s(10_000, 2) == pytest.approx(200.0)
    assert young_daly_interval_s(54 * 86400 / 419, 5) == pytest.approx(math.sqrt(2 * 11136.3 * 5), rel=1e-4)
    with pytest.raises(ValueError):
        young_daly_interval_s(0, 1)


def test_first_order_by_hand() -> None:
    sc = tiny(mtbf_h=4.0, interval_s=600, stall_s=30)
    pol = sc.policy("p")
    fc = failure_cost(sc, pol, sc.causes[0])
    # crash with evidence: min(crash 5, evidence 5); spare 5; stop 5 + launch 30 + load 30 + first 15,
    # no preflight: the spare was re-checked in the background, the others trained healthily
    assert fc.detect_s == 5 and fc.replace_s == 5 and fc.restart_s == 80
    assert fc.rework_s == pytest.approx(600 * (300 + 30) / 630)
    rate = 1 / (4 * 3600)
    up = 1 - rate * 90
    expected = up * 600 / 630 - rate * fc.rework_s
    assert first_order(sc, pol).ettr == pytest.approx(expected)


def test_the_restart_pays_the_preflight_only_for_nodes_not_vouched_for() -> None:
    every_attempt = tiny(supervisor={"preflight_max_age_s": 0.0})
    fc = failure_cost(every_attempt, every_attempt.policy("p"), every_attempt.causes[0])
    assert fc.restart_s == 110  # the old rule: every node of every attempt, 30 s on the path
    causes = [
        {"name": "gpu", "share": 0.5, "symptom": "crash", "evidence": "xid"},
        {"name": "bug", "share": 0.5, "symptom": "crash", "hardware": False},
    ]
    unchecked_spares = tiny(causes=causes, supervisor={"spare_check_interval_s": 0.0})
    pol = unchecked_spares.policy("p")
    hardware = [c for c in unchecked_spares.causes if c.hardware]
    software = [c for c in unchecked_spares.causes if not c.hardware]
    assert all(failure_cost(unchecked_spares, pol, c).restart_s == 110 for c in hardware)
    assert all(failure_cost(unchecked_spares, pol, c).restart_s == 80 for c in software)
    assert hardware and software
    # a sweep every 400 s leaves a spare's check up to 1.5 x 400 + 30 s old: past the 600 s vouch
    sparse = tiny(causes=causes, supervisor={"spare_check_interval_s": 400.0})
    assert all(failure_cost(sparse, sparse.policy("p"), c).restart_s == 110 for c in hardware)
    assert all(failure_cost(sparse, sparse.policy("p"), c).restart_s == 80 for c in software)


def test_hang_detection_uses_the_cores_timeout() -> None:
    sc = tiny(causes=[{"name": "h", "share": 1, "symptom": "hang"}], supervisor={"hang_timeout_s": 120.0})
    pol = sc.policy("p")
    assert failure_cost(sc, pol, sc.causes[0]).detect_s == 120
    assert failure_cost(sc, pol, sc.causes[0]).attribute_s == 10  # flight-recorder dumps
