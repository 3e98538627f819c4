"""The simulator against the first-order model and Young/Daly, where their assumptions hold."""

import math

from controller.sim.model import first_order, young_daly_interval_s
from controller.sim.report import interval_variants, mean_ci, run_many, sweep
from tests.sim.helpers import tiny

SEEDS = range(1, 9)


def test_simulated_ettr_agrees_with_first_order_model() -> None:
    # Mixed causes, every one blamed by evidence or a lease: spares never run out, nodes repaired.
    causes = [
        {"name": "gpu", "share": 6, "symptom": "crash", "evidence": "xid"},
        {"name": "sw", "share": 2, "symptom": "crash", "hardware": False},
        {"name": "host", "share": 1, "symptom": "node_lost"},
        {"name": "link", "share": 1, "symptom": "hang", "evidence": "network"},
    ]
    for interval, stall, mtbf_h in ((600.0, 30.0, 4.0), (1800.0, 60.0, 3.0)):
        sc = tiny(mtbf_h=mtbf_h, interval_s=interval, stall_s=stall, causes=causes, days=15)
        outcomes = run_many([(sc, sc.policy("p"), s) for s in SEEDS])
        sim, ci = mean_ci([o.ettr for o in outcomes])
        model = first_order(sc, sc.policy("p")).ettr
        assert abs(sim - model) < 0.015, (interval, sim, ci, model)


def test_optimal_interval_agrees_with_young_daly() -> None:
    stall, mtbf_h = 30.0, 2.0
    sc = tiny(mtbf_h=mtbf_h, stall_s=stall, days=20)
    yd = young_daly_interval_s(mtbf_h * 3600, stall)  # 657 s
    intervals = [150, 250, 400, 650, 1000, 1600, 2600]
    rows = sweep(sc, interval_variants(sc.policy("p"), intervals), SEEDS)
    # Fit lost(I) = a/I + b*I + c by least squares; the fitted optimum is sqrt(a/b).
    xs = [(1 / i, float(i), 1.0) for i in intervals]
    ys = [1 - r.ettr for r in rows]
    ata = [[sum(x[r] * x[c] for x in xs) for c in range(3)] for r in range(3)]
    aty = [sum(x[r] * y for x, y in zip(xs, ys, strict=True)) for r in range(3)]
    a, b, _ = _solve3(ata, aty)
    fitted = math.sqrt(a / b)
    assert 0.75 * yd < fitted < 1.33 * yd, (fitted, yd, rows)
    best = max(r.ettr for r in rows)
    at_yd = {r.label: r.ettr for r in rows}["650"]
    assert best - at_yd < 0.003


def _solve3(m: list[list[float]], v: list[float]) -> tuple[float, float, float]:
    def det(x: list[list[float]]) -> float:
        return (
            x[0][0] * (x[1][1] * x[2][2] - x[1][2] * x[2][1])
            - x[0][1] * (x[1][0] * x[2][2] - x[1][2] * x[2][0])
            + x[0][2] * (x[1][0] * x[2][1] - x[1][1] * x[2][0])
        )

    d = det(m)
    out = []
    for col in range(3):
        mc = [[v[r] if c == col else m[r][c] for c in range(3)] for r in range(3)]
        out.append(det(mc) / d)
    return out[0], out[1], out[2]
