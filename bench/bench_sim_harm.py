"""Issue 26: the harm a software bug at a fixed step does through the supervisor core, in the simulator.

    .venv/bin/python bench/bench_sim_harm.py [--share 0.1] [--seeds 5] [--workers 2] [--policy defaults]
        [--label today|after] [--out bench/results/bench_sim_harm_<label>.json]

The Llama 3 405B replay (`scenarios/llama3_405b.toml`) with `--share` of its unplanned failures made
software/data bugs at a fixed step (`controller.sim.scenario.with_fixed_step_share`: every cause keeps
1 - share of its rate; the share goes to `fixed_step_hang` and `fixed_step_crash`, half each unless
--hang/--crash say otherwise). Each bug recurs at its step on every attempt that reaches it, on another
node each time, until the job is fixed `--fix-hours` after its first hit; a run the core ends
meanwhile is started again by the operator at the fix (a fresh core from the store's state).

Per seed: ETTR (goodput over the whole window), the healthy nodes lost (quarantines of nodes with
no hardware fault: by the fault that caused them; held; node-hours out of service), the nodes given
back without a strike, the crash-loop and blast-radius pages. Which core it measures is the tree it
runs in: run it from a worktree of the commit to measure (BENCHMARKS.md says how).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller.sim.draws import draw  # noqa: E402
from controller.sim.engine import simulate  # noqa: E402
from controller.sim.report import mean_ci, outcome_of  # noqa: E402
from controller.sim.scenario import FixedStep, Scenario, load_scenario, with_fixed_step_share  # noqa: E402


def window(sc: Scenario, days: float) -> Scenario:
    """The same failure rates over a shorter window (counts keep their own denominator)."""
    causes = tuple(dataclasses.replace(c, over_days=c.over_days or sc.run.duration_days) for c in sc.causes)
    planned = dataclasses.replace(sc.planned, over_days=sc.planned.over_days or sc.run.duration_days)
    return dataclasses.replace(
        sc, causes=causes, planned=planned, run=dataclasses.replace(sc.run, duration_days=days)
    )


def one(args: tuple[Scenario, str, int]) -> dict[str, Any]:
    sc, policy, seed = args
    t = time.perf_counter()
    result = simulate(sc, sc.policy(policy), draw(sc, seed))
    wall = time.perf_counter() - t
    o = outcome_of(result, wall)
    healthy = [q for q in result.quarantines if q.healthy]
    return {
        "seed": seed,
        "ettr": o.ettr,
        "final_state": result.final_state,
        "wall_s": wall,
        "handle_calls": result.handle_calls,
        "quarantines": len(result.quarantines),
        "healthy_quarantines": len(healthy),
        "healthy_nodes": len({q.node for q in healthy}),
        "healthy_by_fault": dict(Counter(q.fault_kind for q in healthy)),
        "healthy_held": sum(q.held for q in healthy),
        "healthy_node_hours_out": sum(q.out_s for q in healthy) / 3600.0,
        "released_without_strike": sum("crash loop" in r.reason for r in result.releases),
        "releases": len(result.releases),
        "crash_loop_pages": sum(p.startswith("crash loop") for p in result.pages),
        "blast_radius_pages": sum(p.startswith("blast radius") for p in result.pages),
        "pages": len(result.pages),
        "run_restarts": result.run_restarts,
        "fixed_step_hits": sum(
            1
            for i in result.interruptions
            if i.cause.startswith("fixed_step") and i.outcome in ("interrupted", "refail")
        ),
        "fixed_step_bugs": sum(
            1
            for i in result.interruptions
            if i.cause.startswith("fixed_step") and i.outcome in ("interrupted", "armed")
        ),
        "lost_by_lever": o.lost_by_lever,
    }


def git_head() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "controller/supervisor"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        return out.stdout.strip() + (" (core modified)" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", default=str(ROOT / "scenarios" / "llama3_405b.toml"))
    ap.add_argument("--policy", default="defaults")
    ap.add_argument("--share", type=float, default=0.1)
    ap.add_argument("--hang", type=float, default=1.0, help="weight of hangs among the fixed-step bugs")
    ap.add_argument("--crash", type=float, default=1.0, help="weight of crashes among the fixed-step bugs")
    ap.add_argument("--fix-hours", type=float, default=2.0)
    ap.add_argument(
        "--days", type=float, default=0.0, help="a shorter window at the same rates (0: the scenario's)"
    )
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    base = load_scenario(args.scenario)
    if args.days:
        base = window(base, args.days)
    sc = with_fixed_step_share(
        base, FixedStep(share=args.share, hang=args.hang, crash=args.crash, fix_hours=args.fix_hours)
    )
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    jobs = [(sc, args.policy, s) for s in seeds]
    t0 = time.perf_counter()
    if args.workers > 1:
        with ProcessPoolExecutor(max_workers=args.workers) as pool:
            rows = list(pool.map(one, jobs))
    else:
        rows = [one(j) for j in jobs]
    wall = time.perf_counter() - t0
    head = git_head()
    print(
        f"{sc.run.name} policy {args.policy}, fixed-step share {args.share:g} (hang {args.hang:g} : crash "
        f"{args.crash:g}, fixed {args.fix_hours:g} h after the first hit), {sc.run.duration_days:g} days, "
        f"seeds {seeds}, core at {head}, "
        f"{wall:.0f} s"
    )
    print(
        "| seed | ETTR | final | bugs | bug hits | quarantines | healthy quarantined | healthy nodes | "
        "healthy held | healthy node-h out | given back w/o strike | crash-loop pages | blast-radius pages | "
        "run restarts |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['seed']} | {100 * r['ettr']:.2f}% | {r['final_state']} | {r['fixed_step_bugs']} | "
            f"{r['fixed_step_hits']} | {r['quarantines']} | {r['healthy_quarantines']} "
            f"{r['healthy_by_fault'] or ''} | {r['healthy_nodes']} | {r['healthy_held']} | "
            f"{r['healthy_node_hours_out']:.1f} | {r['released_without_strike']} | {r['crash_loop_pages']} | "
            f"{r['blast_radius_pages']} | {r['run_restarts']} |"
        )
    ettr, ci = mean_ci([r["ettr"] for r in rows])
    mean = {
        k: statistics.fmean(r[k] for r in rows)
        for k in ("healthy_quarantines", "healthy_nodes", "healthy_held")
    }
    hours = statistics.fmean(r["healthy_node_hours_out"] for r in rows)
    print(
        f"mean: ETTR {100 * ettr:.2f}% ± {100 * ci:.2f}; healthy quarantined {mean['healthy_quarantines']:.1f} "
        f"({mean['healthy_nodes']:.1f} nodes, {mean['healthy_held']:.1f} held), {hours:.1f} healthy node-hours out"
    )
    out = Path(
        args.out
        or ROOT / "bench" / "results" / f"bench_sim_harm{'_' + args.label if args.label else ''}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "scenario": sc.run.name,
                "policy": args.policy,
                "share": args.share,
                "hang": args.hang,
                "crash": args.crash,
                "fix_hours": args.fix_hours,
                "days": sc.run.duration_days,
                "core": head,
                "label": args.label,
                "wall_s": wall,
                "ettr_mean": ettr,
                "ettr_ci95": ci,
                "rows": rows,
            },
            indent=1,
            sort_keys=True,
        )
    )
    print(f"raw: {out}")


if __name__ == "__main__":
    main()
