"""Policies compared on shared draws: ETTR with a confidence interval, lost time by lever, counts.

ETTR (effective training time ratio) here is `controller.goodput.report.compute_goodput(events).goodput`
over the simulated window: the fraction of wall time whose training progress was kept.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

from controller.goodput.report import compute_goodput
from controller.sim.draws import draw
from controller.sim.engine import SimResult, simulate
from controller.sim.model import first_order
from controller.sim.scenario import Policy, Scenario

# Two-sided 95% Student t quantiles by degrees of freedom (df > 30: normal).
_T95 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    11: 2.201,
    12: 2.179,
    13: 2.160,
    14: 2.145,
    15: 2.131,
    16: 2.120,
    17: 2.110,
    18: 2.101,
    19: 2.093,
    20: 2.086,
    25: 2.060,
    30: 2.042,
}
LEVERS = (
    "checkpoint_stall",
    "rework",
    "detect",
    "attribute",
    "replace",
    "preflight",
    "launch",
    "load",
    "first_step",
    "planned",
    "startup",
    "ended_early",
)
SEEN = ("interrupted", "refail")  # outcomes in which the running job was interrupted


def t95(df: int) -> float:
    if df <= 0:
        return math.inf
    if df in _T95:
        return _T95[df]
    if df > 30:
        return 1.96
    return _T95[min(k for k in _T95 if k >= df)]


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval (Student t over seeds)."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, math.inf
    return m, t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def lever_of(cause: str) -> str:
    """Which lever a goodput lost-time cause belongs to."""
    if cause == "checkpoint_stall" or cause == "planned":
        return cause
    if cause.startswith("restart:"):
        return cause.split(":", 1)[1]
    if cause.startswith("startup:"):
        return "startup"
    return "rework"  # hardware:*, network, software, unattributed, control_plane: work rolled back


@dataclass(frozen=True, slots=True, kw_only=True)
class SeedOutcome:
    seed: int
    ettr: float
    lost_by_lever: dict[str, float]  # fraction of wall time
    lost_by_cause: dict[str, float]  # goodput's own causes, fraction of wall time
    seen_by_cause: dict[str, int]  # interruptions the running job saw, by root cause
    drawn_by_cause: dict[str, int]
    incidents: int
    handle_calls: int
    wall_s: float
    final_state: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicySummary:
    policy: str
    outcomes: tuple[SeedOutcome, ...]
    model_ettr: float
    model_by_lever: dict[str, float]
    young_daly_s: float
    checkpoint_interval_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def ettr(self) -> tuple[float, float]:
        return mean_ci([o.ettr for o in self.outcomes])

    def lever_means(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for o in self.outcomes:
            for k, v in o.lost_by_lever.items():
                out[k] += v / len(self.outcomes)
        return dict(out)

    def mean_counts(self, which: str = "seen") -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for o in self.outcomes:
            for k, v in (o.seen_by_cause if which == "seen" else o.drawn_by_cause).items():
                out[k] += v / len(self.outcomes)
        return dict(out)


def outcome_of(result: SimResult, wall_s: float) -> SeedOutcome:
    report = compute_goodput(result.events, until=result.end_ts)
    # The whole window counts: a run the core ended early (crash loop, budget) lost the rest of it.
    alloc = max(report.allocated_us, round((result.end_ts - result.start_ts) * 1_000_000), 1)
    by_cause = {c: us / alloc for c, us in report.lost_by_cause_us.items()}
    by_lever: dict[str, float] = defaultdict(float)
    for c, f in by_cause.items():
        by_lever[lever_of(c)] += f
    if alloc - report.allocated_us > 1_000_000:
        by_lever["ended_early"] = (alloc - report.allocated_us) / alloc
    seen = Counter(i.cause for i in result.interruptions if i.outcome in SEEN)
    drawn = Counter(i.cause for i in result.interruptions if i.outcome != "refail")
    return SeedOutcome(
        seed=result.seed,
        ettr=report.productive_us / alloc,
        lost_by_lever=dict(by_lever),
        lost_by_cause=by_cause,
        seen_by_cause=dict(seen),
        drawn_by_cause=dict(drawn),
        incidents=len(report.incidents),
        handle_calls=result.handle_calls,
        wall_s=wall_s,
        final_state=result.final_state,
    )


def run_one(scenario: Scenario, policy: Policy, seed: int) -> SeedOutcome:
    """One policy on one seed (the draws depend on the seed only: shared across policies)."""
    t = time.perf_counter()
    result = simulate(scenario, policy, draw(scenario, seed))
    return outcome_of(result, time.perf_counter() - t)


def _job(args: tuple[Scenario, Policy, int]) -> SeedOutcome:
    return run_one(*args)


def run_many(jobs: Iterable[tuple[Scenario, Policy, int]], workers: int = 1) -> list[SeedOutcome]:
    job_list = list(jobs)
    if workers <= 1 or len(job_list) <= 1:
        return [run_one(*j) for j in job_list]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_job, job_list))


def compare(
    scenario: Scenario,
    policies: Sequence[str],
    seeds: Sequence[int],
    workers: int = 1,
    progress: Callable[[str], None] | None = None,
) -> list[PolicySummary]:
    """Every policy on the same seeds' draws."""
    jobs = [(scenario, scenario.policy(p), s) for p in policies for s in seeds]
    outcomes = run_many(jobs, workers)
    out = []
    for i, name in enumerate(policies):
        pol = scenario.policy(name)
        mine = tuple(outcomes[i * len(seeds) : (i + 1) * len(seeds)])
        model = first_order(scenario, pol)
        summary = PolicySummary(
            policy=name,
            outcomes=mine,
            model_ettr=model.ettr,
            model_by_lever=model.by_lever,
            young_daly_s=model.young_daly_s,
            checkpoint_interval_s=pol.checkpoint_interval_s,
        )
        ended = [o for o in mine if o.final_state != "running"]
        if ended:
            summary.notes.append(
                f"{len(ended)} seed(s) ended early: {sorted({o.final_state for o in ended})}"
            )
        out.append(summary)
        if progress is not None:
            progress(f"{name}: done")
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepRow:
    label: str
    ettr: float
    ci: float
    delta: float  # mean paired difference from the first variant (same draws, seed by seed)
    delta_ci: float
    by_seed: tuple[float, ...]


def sweep(
    scenario: Scenario, variants: Sequence[tuple[str, Policy]], seeds: Sequence[int], workers: int = 1
) -> list[SweepRow]:
    """ETTR of policy variants on the same draws, with the paired difference from the first variant."""
    jobs = [(scenario, pol, s) for _, pol in variants for s in seeds]
    outcomes = run_many(jobs, workers)
    per = [[o.ettr for o in outcomes[i * len(seeds) : (i + 1) * len(seeds)]] for i in range(len(variants))]
    rows = []
    for (label, _), values in zip(variants, per, strict=True):
        m, ci = mean_ci(values)
        d, dci = mean_ci([v - b for v, b in zip(values, per[0], strict=True)])
        rows.append(SweepRow(label=label, ettr=m, ci=ci, delta=d, delta_ci=dci, by_seed=tuple(values)))
    return rows


def interval_variants(policy: Policy, intervals: Iterable[float]) -> list[tuple[str, Policy]]:
    return [
        (f"{i:g}", replace(policy, name=f"{policy.name}@I={i:g}", checkpoint_interval_s=float(i)))
        for i in intervals
    ]


def spare_variants(policy: Policy, fractions: Iterable[float]) -> list[tuple[str, Policy]]:
    return [
        (f"{f:g}", replace(policy, name=f"{policy.name}@spares={f:g}", spares=None, spare_fraction=float(f)))
        for f in fractions
    ]


def hang_variants(policy: Policy, timeouts: Iterable[float]) -> list[tuple[str, Policy]]:
    return [
        (
            f"{h:g}",
            replace(
                policy,
                name=f"{policy.name}@hang={h:g}",
                supervisor=replace(policy.supervisor, hang_timeout_s=float(h)),
            ),
        )
        for h in timeouts
    ]


def format_summary(scenario: Scenario, summaries: Sequence[PolicySummary]) -> str:
    lines = [
        f"scenario {scenario.run.name}: {scenario.run.nodes} nodes x {scenario.run.gpus_per_node} GPUs, "
        f"{scenario.run.duration_days:g} days, MTBF {scenario.mtbf_s() / 3600:.2f} h "
        f"({scenario.interruption_rate_s() * scenario.run.duration_s:.0f} unplanned interruptions expected)"
    ]
    lines.append(
        f"{'policy':<12} {'ETTR':>8} {'95% CI':>8} {'model':>7} {'seeds':>5}  lost by lever (% of wall time)"
    )
    for s in summaries:
        m, ci = s.ettr
        levers = s.lever_means()
        lever_txt = ", ".join(f"{k} {100 * levers[k]:.2f}" for k in LEVERS if levers.get(k, 0) >= 0.0005)
        lines.append(
            f"{s.policy:<12} {100 * m:7.2f}% {100 * ci:7.2f} {100 * s.model_ettr:6.2f}% {len(s.outcomes):>5}  "
            f"{lever_txt}"
        )
        for note in s.notes:
            lines.append(f"{'':<12} note: {note}")
    return "\n".join(lines)


def format_counts(scenario: Scenario, summary: PolicySummary) -> str:
    seen = summary.mean_counts("seen")
    drawn = summary.mean_counts("drawn")
    lines = [
        f"interruptions by cause, mean over {len(summary.outcomes)} seeds ({summary.policy}): "
        "scenario count / drawn / seen by the running job (incl. relapses of unrepaired nodes)"
    ]
    total_c = total_d = total_s = 0.0
    for c in scenario.causes:
        expected = c.fleet_rate_s(scenario.run) * scenario.run.duration_s
        total_c += expected
        total_d += drawn.get(c.name, 0.0)
        total_s += seen.get(c.name, 0.0)
        lines.append(
            f"  {c.name:<30} {expected:7.1f} {drawn.get(c.name, 0.0):7.1f} {seen.get(c.name, 0.0):7.1f}"
        )
    lines.append(f"  {'total':<30} {total_c:7.1f} {total_d:7.1f} {total_s:7.1f}")
    return "\n".join(lines)
