"""Fleet simulator benchmarks (issue 9): the Llama 3 405B scenario through the real supervisor core.

    .venv/bin/python bench/bench_sim.py [--seeds 5] [--workers 2] [--sens-seeds 3] [--sens-days 14]

Prints markdown for BENCHMARKS.md ("## simulator") and writes the raw figures as JSON (--out).
1. interruption counts by cause (the draws over 200 seeds, and what the running job saw);
2. ETTR per policy with a 95% CI over seeds, the first-order model, lost time by lever;
3. sensitivity of the defaults: checkpoint interval, spare fraction, hang-detection time;
4. speed: one 54-day, 2,048-node run of the defaults in one process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.sim.draws import draw
from controller.sim.engine import simulate
from controller.sim.model import first_order, young_daly_interval_s
from controller.sim.report import (
    LEVERS,
    compare,
    hang_variants,
    interval_variants,
    spare_variants,
    sweep,
)
from controller.sim.scenario import Scenario, load_scenario

ROOT = Path(__file__).resolve().parents[1]


def window(sc: Scenario, days: float) -> Scenario:
    """The same failure rates over a shorter window (counts keep their 54-day denominator)."""
    causes = tuple(dataclasses.replace(c, over_days=c.over_days or sc.run.duration_days) for c in sc.causes)
    planned = dataclasses.replace(sc.planned, over_days=sc.planned.over_days or sc.run.duration_days)
    return dataclasses.replace(
        sc, causes=causes, planned=planned, run=dataclasses.replace(sc.run, duration_days=days)
    )


def counts_section(sc: Scenario, summaries: list) -> tuple[str, dict]:
    n = 200
    drawn = {c.name: 0 for c in sc.causes}
    for s in range(n):
        for f in draw(sc, 10_000 + s).faults:
            drawn[sc.causes[f.cause].name] += 1
    seen = {s.policy: s.mean_counts("seen") for s in summaries}
    lines = [
        "| cause | paper | drawn (mean of 200 seeds) | error | "
        + " | ".join(f"seen by job: {s.policy}" for s in summaries)
        + " |",
        "|---|---:|---:|---:|" + "---:|" * len(summaries),
    ]
    for c in sc.causes:
        mean = drawn[c.name] / n
        err = (mean - (c.count or 0)) / (c.count or 1)
        lines.append(
            f"| {c.name} | {c.count:g} | {mean:.1f} | {100 * err:+.1f}% | "
            + " | ".join(f"{seen[s.policy].get(c.name, 0.0):.1f}" for s in summaries)
            + " |"
        )
    total = sum(drawn.values()) / n
    lines.append(
        f"| **total** | 419 | {total:.1f} | {100 * (total - 419) / 419:+.1f}% | "
        + " | ".join(f"{sum(seen[s.policy].values()):.1f}" for s in summaries)
        + " |"
    )
    return "\n".join(lines), {"drawn_mean": {k: v / n for k, v in drawn.items()}, "seen": seen}


def policy_section(sc: Scenario, summaries: list) -> str:
    lines = [
        "| policy | ETTR (mean) | 95% CI | first-order model | checkpoint interval | Young/Daly | "
        + " | ".join(LEVERS)
        + " |",
        "|---|---:|---:|---:|---:|---:|" + "---:|" * len(LEVERS),
    ]
    for s in summaries:
        m, ci = s.ettr
        lev = s.lever_means()
        lines.append(
            f"| {s.policy} | {100 * m:.2f}% | ±{100 * ci:.2f} | {100 * s.model_ettr:.2f}% | "
            f"{s.checkpoint_interval_s:g} s | {s.young_daly_s:.0f} s | "
            + " | ".join(f"{100 * lev.get(k, 0.0):.2f}" for k in LEVERS)
            + " |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default=str(ROOT / "scenarios" / "llama3_405b.toml"))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--sens-seeds", type=int, default=3)
    ap.add_argument("--sens-days", type=float, default=14.0)
    ap.add_argument("--skip-sensitivity", action="store_true")
    ap.add_argument(
        "--parts",
        default="speed,compare,sensitivity,levers",
        help="comma-separated subset of speed,compare,sensitivity,levers",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_sim.json"))
    args = ap.parse_args()
    sc = load_scenario(args.scenario)
    out: dict = {"load_before": os.getloadavg()}

    parts = set(args.parts.split(","))
    if "levers" in parts:
        levers_section(sc, args, out)
    if "speed" in parts:
        speed_section(sc, out)
    if "compare" in parts:
        compare_section(sc, args, out)
    if "sensitivity" in parts and not args.skip_sensitivity:
        sensitivity_section(sc, args, out)
    out["load_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, sort_keys=True, default=str))
    print(f"raw figures: {args.out}")
    return 0


def levers_section(sc: Scenario, args: argparse.Namespace, out: dict) -> None:
    """From the defaults toward 97%: one lever at a time, on the same draws."""
    short = window(sc, args.sens_days)
    base, tuned = short.policy("defaults"), short.policy("tuned")
    ckpt = dataclasses.replace(
        base, checkpoint_interval_s=tuned.checkpoint_interval_s, checkpoint_stall_s=tuned.checkpoint_stall_s
    )
    path = dataclasses.replace(base, costs={**base.costs, **tuned.costs})
    variants = [
        ("defaults", base),
        ("+ spares 2%", dataclasses.replace(base, spare_fraction=tuned.spare_fraction, spares=None)),
        ("+ lease TTL 3 s", dataclasses.replace(base, lease_ttl_s=tuned.lease_ttl_s)),
        (f"+ checkpoint {tuned.checkpoint_interval_s:g} s / {tuned.checkpoint_stall_s:g} s stall", ckpt),
        ("+ fast restart path", path),
        (
            "+ checkpoint + restart path",
            dataclasses.replace(
                path,
                checkpoint_interval_s=tuned.checkpoint_interval_s,
                checkpoint_stall_s=tuned.checkpoint_stall_s,
            ),
        ),
        ("tuned (all)", tuned),
    ]
    variants = [(label, dataclasses.replace(p, name=f"v{i}")) for i, (label, p) in enumerate(variants)]
    sseeds = list(range(1, args.sens_seeds + 1))
    rows = sweep(short, variants, sseeds, args.workers)
    out["levers"] = [
        {**dataclasses.asdict(r), "model": first_order(short, p).ettr}
        for r, (_, p) in zip(rows, variants, strict=True)
    ]
    print(f"\n### Levers from the defaults toward 97% ({args.sens_days:g}-day window, {len(sseeds)} seeds)\n")
    print("| variant | ETTR | 95% CI | gain vs defaults (paired) | model |\n|---|---:|---:|---:|---:|")
    for r in out["levers"]:
        print(
            f"| {r['label']} | {100 * r['ettr']:.2f}% | ±{100 * r['ci']:.2f} | "
            f"{100 * r['delta']:+.2f} ±{100 * r['delta_ci']:.2f} | {100 * r['model']:.2f}% |"
        )
    print(flush=True)


def speed_section(sc: Scenario, out: dict) -> None:
    t = time.perf_counter()
    res = simulate(sc, sc.policy("defaults"), draw(sc, 1))
    speed = time.perf_counter() - t
    out["speed"] = {
        "wall_s": speed,
        "handle_calls": res.handle_calls,
        "events": len(res.events),
        "us_per_call": 1e6 * speed / res.handle_calls,
        "load": os.getloadavg(),
    }
    print(
        f"speed: 54-day 2,048-node defaults run in {speed:.1f}s wall, {res.handle_calls} core calls, "
        f"{len(res.events)} events (load {os.getloadavg()[0]:.1f})",
        flush=True,
    )


def compare_section(sc: Scenario, args: argparse.Namespace, out: dict) -> None:
    seeds = list(range(1, args.seeds + 1))
    t = time.perf_counter()
    summaries = compare(sc, list(sc.policies), seeds, workers=args.workers)
    out["compare_wall_s"] = time.perf_counter() - t
    print("\n### ETTR per policy\n\n" + policy_section(sc, summaries), flush=True)
    for s in summaries:
        for note in s.notes:
            print(f"\nnote ({s.policy}): {note}")
    out["policies"] = {
        s.policy: {
            "ettr": s.ettr[0],
            "ci95": s.ettr[1],
            "model": s.model_ettr,
            "by_seed": [o.ettr for o in s.outcomes],
            "levers": s.lever_means(),
            "model_levers": s.model_by_lever,
            "young_daly_s": s.young_daly_s,
            "wall_s": [o.wall_s for o in s.outcomes],
        }
        for s in summaries
    }
    text, counts = counts_section(sc, summaries)
    print("\n### Interruptions by cause\n\n" + text, flush=True)
    out["counts"] = counts


def sensitivity_section(sc: Scenario, args: argparse.Namespace, out: dict) -> None:
    short = window(sc, args.sens_days)
    sseeds = list(range(1, args.sens_seeds + 1))
    base = short.policy("defaults")
    mtbf = sc.mtbf_s()
    intervals = [150, 300, 600, 1200, 2400, 3600]
    no_evidence = dataclasses.replace(base, name="defaults-no-evidence", use_evidence=False)
    sens = {
        "checkpoint_interval_s": sweep(short, interval_variants(base, intervals), sseeds, args.workers),
        "spare_fraction": sweep(
            short, spare_variants(base, [0.0, 0.0025, 0.005, 0.01, 0.02, 0.05]), sseeds, args.workers
        ),
        "hang_timeout_s (evidence off)": sweep(
            short, hang_variants(no_evidence, [18, 60, 180, 600]), sseeds, args.workers
        ),
    }
    out["sensitivity"] = {k: [dataclasses.asdict(r) for r in rows] for k, rows in sens.items()}
    print(
        f"\n### Sensitivity (defaults; {args.sens_days:g}-day window at the same rates, "
        f"{len(sseeds)} seeds, shared draws)\n"
    )
    print(
        f"Young/Daly for the defaults' {base.checkpoint_interval_s:g} s interval and "
        f"{base.checkpoint_stall_s:g} s stall: sqrt(2 x {mtbf:.0f} s x {base.checkpoint_stall_s:g} s) = "
        f"{young_daly_interval_s(mtbf, base.checkpoint_stall_s):.0f} s\n"
    )
    for name, rows in sens.items():
        print(f"| {name} | " + " | ".join(r.label for r in rows) + " |")
        print("|---|" + "---:|" * len(rows))
        print("| ETTR | " + " | ".join(f"{100 * r.ettr:.2f}%" for r in rows) + " |")
        print(
            f"| vs {rows[0].label} (paired, 95% CI) | "
            + " | ".join(f"{100 * r.delta:+.2f} ±{100 * r.delta_ci:.2f}" for r in rows)
            + " |"
        )
        if name == "checkpoint_interval_s":
            model = [
                first_order(short, dataclasses.replace(base, checkpoint_interval_s=float(i))).ettr
                for i in intervals
            ]
            print("| model | " + " | ".join(f"{100 * m:.2f}%" for m in model) + " |")
        print()


if __name__ == "__main__":
    sys.exit(main())
