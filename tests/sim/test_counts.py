"""The Llama 3 failure processes reproduce the paper's counts (draws only: cheap, many seeds)."""

from pathlib import Path

from controller.sim.draws import draw
from controller.sim.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]


def test_llama3_counts_reproduced_within_ten_percent_over_seeds() -> None:
    sc = load_scenario(ROOT / "scenarios" / "llama3_405b.toml")
    seeds = range(200)
    totals = {c.name: 0 for c in sc.causes}
    planned = 0
    for s in seeds:
        d = draw(sc, s)
        for f in d.faults:
            totals[sc.causes[f.cause].name] += 1
        planned += len(d.planned)
    n = len(seeds)
    assert abs(sum(totals.values()) / n - 419) < 0.10 * 419 / 5  # total: well within 2%
    for c in sc.causes:
        assert c.count is not None
        if c.count >= 17:  # causes big enough for 200 seeds to pin them within 10%
            assert abs(totals[c.name] / n - c.count) <= 0.10 * c.count, (c.name, totals[c.name] / n)
    assert abs(planned / n - 47) <= 4.7
