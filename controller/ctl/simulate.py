"""`controllerctl simulate SCENARIO.toml [--seeds N] [--policy NAME ...]`.

Runs each policy of the scenario on the same failure draws (one set per seed) through the real
supervisor core, and prints ETTR per policy with a 95% confidence interval over seeds, the
first-order model's figure, lost time by lever and interruption counts by cause. `--events-out
DIR` writes each run's event log (the live controller's JSON-lines format), which
`controllerctl goodput --log FILE` reads like any other.

Exit codes: 0 done; 2 bad scenario or arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from controller.sim.draws import draw
from controller.sim.engine import simulate
from controller.sim.report import PolicySummary, compare, format_counts, format_summary
from controller.sim.scenario import Scenario, load_scenario
from runwarden.config import ConfigError
from runwarden.eventlog import encode_entry


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="replay a fleet scenario through the supervisor core (ETTR per policy)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(p)
    p.set_defaults(func=run)
    return p


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", help="scenario TOML file (format: the README's 'The fleet simulator')")
    p.add_argument("--seeds", type=int, default=5, help="seeds (failure draws) per policy (default 5)")
    p.add_argument("--seed-base", type=int, default=1, help="first seed (default 1)")
    p.add_argument(
        "--policy",
        action="append",
        default=None,
        help="policy to run (repeatable; default: every policy in the file)",
    )
    p.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    p.add_argument(
        "--events-out",
        metavar="DIR",
        default=None,
        help="write each run's event log to DIR/<policy>-seed<N>.jsonl",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _summary_json(s: PolicySummary) -> dict[str, Any]:
    m, ci = s.ettr
    return {
        "policy": s.policy,
        "ettr": m,
        "ettr_ci95": ci,
        "model_ettr": s.model_ettr,
        "seeds": [o.seed for o in s.outcomes],
        "ettr_by_seed": [o.ettr for o in s.outcomes],
        "lost_by_lever": s.lever_means(),
        "model_lost_by_lever": s.model_by_lever,
        "checkpoint_interval_s": s.checkpoint_interval_s,
        "young_daly_s": s.young_daly_s,
        "interruptions_seen": s.mean_counts("seen"),
        "interruptions_drawn": s.mean_counts("drawn"),
        "final_states": [o.final_state for o in s.outcomes],
        "notes": s.notes,
        "wall_s_per_run": [o.wall_s for o in s.outcomes],
    }


def write_event_logs(scenario: Scenario, policies: list[str], seeds: list[int], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        draws = draw(scenario, seed)
        for name in policies:
            result = simulate(scenario, scenario.policy(name), draws)
            path = out_dir / f"{name}-seed{seed}.jsonl"
            with open(path, "wb") as f:  # the live format; no fsync per line: it is a simulation
                for ev in result.events:
                    f.write(encode_entry(ev))


def run(args: argparse.Namespace) -> int:
    try:
        scenario = load_scenario(args.scenario)
        policies = list(args.policy) if args.policy else list(scenario.policies)
        for name in policies:
            scenario.policy(name)
    except ConfigError as exc:
        print(f"controllerctl simulate: {exc}", file=sys.stderr)
        return 2
    if args.seeds < 1 or args.workers < 1:
        print("controllerctl simulate: --seeds and --workers must be >= 1", file=sys.stderr)
        return 2
    seeds = list(range(args.seed_base, args.seed_base + args.seeds))
    t = time.perf_counter()
    try:
        summaries = compare(scenario, policies, seeds, workers=min(args.workers, os.cpu_count() or 1))
    except ValueError as exc:  # a policy the world cannot run (e.g. startup timeout below the launch time)
        print(f"controllerctl simulate: {exc}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - t
    if args.events_out:
        write_event_logs(scenario, policies, seeds, Path(args.events_out))
    if getattr(args, "json", False) or getattr(args, "json_global", False):
        print(
            json.dumps(
                {
                    "scenario": scenario.run.name,
                    "mtbf_s": scenario.mtbf_s(),
                    "wall_s": wall,
                    "policies": [_summary_json(s) for s in summaries],
                },
                indent=2,
                sort_keys=True,
            )
        )
        return 0
    print(format_summary(scenario, summaries))
    print()
    print(
        format_counts(
            scenario,
            summaries[-1]
            if len(summaries) == 1
            else next((s for s in summaries if s.policy == "defaults"), summaries[0]),
        )
    )
    print(f"\n{len(policies)} policies x {len(seeds)} seeds in {wall:.1f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="controllerctl simulate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
