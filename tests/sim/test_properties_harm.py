"""Never more harm than the fault (issue 26): the real core through the simulator, random fault mixes.

Each example is a small fleet over half a day to two days with a random mix of hardware faults
(crashes with an Xid, network hangs, lost hosts), software bugs at a fixed step whose culprit
rotates (hangs the flight recorder blames on the rank that never arrived, crashes), stragglers,
planned stops and control-plane blips (the controller loses etcd for seconds). Invariants:

* the verdict: when the core declares a crash loop, the healthy nodes quarantined for the loop's
  bug carry no strike for it any more (given back without a strike);
* no strike without evidence about the node: a healthy node (no hardware fault) is quarantined only
  after a fault that named it (a fixed-step bug's culprit, a software fault's repeated first exit),
  never for a planned stop, a control-plane blip, or a hardware fault on another node;
* the goodput identity: productive + lost == allocated, exactly, and ETTR + lost levers == 1;
* the blast radius: more automatic quarantines within the window than the limit only with a page.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from controller.goodput.report import compute_goodput
from controller.sim.draws import draw
from controller.sim.engine import SimResult, World
from controller.sim.report import outcome_of
from controller.supervisor.actions import Action, Page
from tests.sim.helpers import tiny

# The blast radius as issue 26 states it (SupervisorConfig's fields where the core has them).
BLAST_NODES, BLAST_FRACTION, BLAST_WINDOW_S = 5, 0.02, 3600.0
CAUSES: dict[str, dict[str, Any]] = {
    "gpu_xid": {"symptom": "crash", "evidence": "xid"},
    "link": {"symptom": "hang", "evidence": "network", "repair_hours": 1.0},
    "host": {"symptom": "node_lost", "repair_hours": 2.0},
    "bug_hang": {"symptom": "hang", "hardware": False, "fixed_step": True},
    "bug_crash": {"symptom": "crash", "hardware": False, "fixed_step": True},
    "slow": {"symptom": "straggler"},
    "blip": {"symptom": "control_plane", "hardware": False},
    "sw_crash": {"symptom": "crash", "hardware": False},
}


class Checked(World):
    """The world, watching the core's crash-loop verdicts and pages as they happen."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.page_times: list[tuple[float, str]] = []
        self.kept_strikes: list[str] = []  # verdict violations, described

    def execute(self, act: Action) -> None:
        super().execute(act)
        if not isinstance(act, Page):
            return
        self.page_times.append((self.now, act.reason))
        if act.reason.startswith("crash loop") and self.bug is not None:
            # The batch's Releases ran before its Page: the verdict is complete in the pool now.
            for q in self.quarantines:
                if q.bug == self.bug.id and q.healthy:
                    strikes = self.core.pool.get(q.node).failure_times
                    if any(abs(s - (self.t0 + q.t)) < 1e-6 for s in strikes):
                        self.kept_strikes.append(
                            f"{q.node} quarantined at {q.t:.1f}s for bug {q.bug} ({q.fault}) still has "
                            f"that strike after the crash-loop verdict at {self.now:.1f}s: {act.reason}"
                        )


HARM_SUPERVISOR = {"hold_after_failures": 2, "restart_budget": 200, "restart_budget_window_s": 86400.0}


@st.composite
def mixes(draw_: st.DrawFn, only: tuple[str, ...] = tuple(CAUSES), planned: bool = True) -> tuple[Any, int]:
    shares = {name: draw_(st.integers(0, 3)) for name in only}
    if not any(shares.values()):
        shares[only[0]] = 1
    fix_hours = draw_(st.sampled_from([0.5, 2.0, 6.0]))
    causes = []
    for name, share in shares.items():
        if share:
            c = {"name": name, "share": float(share), **CAUSES[name]}
            if c.get("fixed_step"):
                c["fix_hours"] = fix_hours
            causes.append(c)
    sc = tiny(
        nodes=draw_(st.integers(6, 20)),
        days=draw_(st.sampled_from([0.5, 1.0, 2.0])),
        mtbf_h=draw_(st.sampled_from([1.0, 2.0, 4.0])),
        spares=draw_(st.integers(1, 6)),
        causes=causes,
        planned=float(draw_(st.integers(0, 6))) if planned else 0.0,
        supervisor=dict(HARM_SUPERVISOR),
    )
    return sc, draw_(st.integers(0, 10**6))


def run(sc: Any, seed: int) -> tuple[Checked, SimResult]:
    world = Checked(sc, sc.policy("p"), draw(sc, seed))
    return world, world.run()


def check_blast_radius(world: Checked, result: SimResult) -> list[str]:
    cfg = world.pol.supervisor
    window = getattr(cfg, "blast_radius_window_s", BLAST_WINDOW_S)
    limit = max(
        getattr(cfg, "blast_radius_nodes", BLAST_NODES),
        math.ceil(getattr(cfg, "blast_radius_fraction", BLAST_FRACTION) * len(world.nodes)),
    )
    times = [q.t for q in result.quarantines]
    pages = [t for t, reason in world.page_times if reason.startswith("blast radius")]
    bad = []
    for i, t in enumerate(times):
        within = sum(1 for u in times[: i + 1] if t - u < window)
        if within > limit and not any(t - window < p <= t for p in pages):
            bad.append(f"{within} quarantines within {window:g}s at {t:.1f}s (limit {limit}) and no page")
    return bad


def check_evidence(result: SimResult) -> list[str]:
    return [
        f"healthy {q.node} quarantined at {q.t:.1f}s after a {q.fault_kind} fault ({q.fault}): {q.reason}"
        for q in result.quarantines
        if q.healthy and q.fault_kind not in ("fixed_step", "software")
    ]


def check_goodput(result: SimResult) -> list[str]:
    report = compute_goodput(result.events, until=result.end_ts)
    out = outcome_of(result, 0.0)
    bad = []
    if report.productive_us + report.lost_us != report.allocated_us:
        bad.append(f"productive {report.productive_us} + lost {report.lost_us} != {report.allocated_us}")
    if abs(out.ettr + sum(out.lost_by_lever.values()) - 1.0) > 1e-6 or not 0.0 <= out.ettr <= 1.0:
        bad.append(f"ETTR {out.ettr} + levers {sum(out.lost_by_lever.values())} != 1")
    return bad


SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@SETTINGS
@given(mixes())
def test_no_strike_without_evidence_goodput_identity_and_blast_radius(mix: tuple[Any, int]) -> None:
    sc, seed = mix
    world, result = run(sc, seed)
    problems = {
        "evidence": check_evidence(result),
        "goodput": check_goodput(result),
        "blast_radius": check_blast_radius(world, result),
    }
    failed = {k: v for k, v in problems.items() if v}
    assert not failed, f"seed {seed}, causes {[c.name for c in sc.causes]}: " + "; ".join(
        f"{k}: {v[:3]}" for k, v in failed.items()
    )


@SETTINGS
@given(mixes(only=("bug_hang", "bug_crash"), planned=False))
def test_the_verdict_gives_back_the_victims_of_a_bug_alone(mix: tuple[Any, int]) -> None:
    """Fixed-step bugs and nothing else: every victim of a declared loop returns without its strike."""
    sc, seed = mix
    world, _ = run(sc, seed)
    assert not world.kept_strikes, f"seed {seed}: {world.kept_strikes[:3]}"


# Found by this module: the crash-loop candidate was reset by anything between the bug's hits (a
# planned stop, a control-plane fault, another failure), and the victims quarantined before the reset
# kept their strike after the verdict. Fixed by keeping candidates until the run gets past their step
# (restart.LoopCandidate); the minimal examples below are the regression tests.


@settings(SETTINGS, phases=[Phase.explicit, Phase.reuse, Phase.generate])  # no shrinking: kept fast
@given(mixes())
def test_the_verdict_gives_back_every_victim_in_any_mix(mix: tuple[Any, int]) -> None:
    sc, seed = mix
    world, _ = run(sc, seed)
    assert not world.kept_strikes, (
        f"seed {seed}, causes {[c.name for c in sc.causes]}: {world.kept_strikes[:3]}"
    )


def _bug(name: str, symptom: str, fix_hours: float, share: float = 1.0) -> dict[str, Any]:
    return {
        "name": name,
        "share": share,
        "symptom": symptom,
        "hardware": False,
        "fixed_step": True,
        "fix_hours": fix_hours,
    }


MINIMAL: dict[str, tuple[dict[str, Any], int]] = {
    # hang at step 7713 on n00003 and n00006 (both quarantined), a planned stop (commit 7699), then the
    # loop counts from scratch: n00000, n00001, n00004; n00003 and n00006 keep their strikes.
    "planned_stop_between_hits": (dict(causes=[_bug("bug_hang", "hang", 0.5)], planned=3.0, days=0.5), 0),
    # exit:1 at step 20490 on n00000 and q00001 (repeat first-exit offenders, quarantined), an unrelated
    # crash at step 20417, then three more at 20490: the verdict releases only the last loop's victims.
    "another_failure_between_hits": (
        dict(
            causes=[
                _bug("bug_crash", "crash", 0.5, 2.0),
                {"name": "sw_crash", "share": 1.0, "symptom": "crash", "hardware": False},
            ],
            days=1.0,
        ),
        0,
    ),
    # exit:1 at step 10204 (n00002 quarantined); the next hit's handling is caught by a control-plane
    # blip: relaunched as a control-plane fault (uncounted), the candidate reset; n00002 keeps its strike.
    "control_plane_blip_during_a_hit": (
        dict(
            causes=[
                _bug("bug_crash", "crash", 0.5),
                {"name": "blip", "share": 1.0, "symptom": "control_plane", "hardware": False},
            ],
            days=1.0,
        ),
        62014,
    ),
}


@pytest.mark.parametrize("case", sorted(MINIMAL))
def test_minimal_examples_of_victims_once_kept_after_the_verdict(case: str) -> None:
    kwargs, seed = MINIMAL[case]
    sc = tiny(nodes=6, mtbf_h=1.0, spares=1, supervisor=dict(HARM_SUPERVISOR), **kwargs)
    world, _ = run(sc, seed)
    assert not world.kept_strikes, world.kept_strikes


def test_a_rotating_bug_is_declared_a_crash_loop_and_its_victims_return() -> None:
    """The motivating case, fixed: a bug at one step that hangs on another node each attempt."""
    sc = tiny(
        nodes=16,
        days=1.0,
        mtbf_h=6.0,
        spares=4,
        causes=[{"name": "bug_hang", "share": 1.0, "symptom": "hang", "hardware": False, "fixed_step": True}],
    )
    world, result = run(sc, 7)
    loops = [r for _, r in world.page_times if r.startswith("crash loop")]
    assert loops and result.run_restarts >= 1
    assert world.kept_strikes == []
    healthy = [q for q in result.quarantines if q.healthy]
    assert healthy, "the flight recorder blamed the culprit of the hang"
    # At most two victims per bug before the verdict (the third failure quarantines nobody).
    per_bug: dict[int, int] = {}
    for q in healthy:
        per_bug[q.bug] = per_bug.get(q.bug, 0) + 1
    assert max(per_bug.values()) <= 2, per_bug
