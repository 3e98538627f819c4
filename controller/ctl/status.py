"""`controllerctl status`: every run under the root (several runs share one fleet), their phase,
attempt, step, committed step, restart budget, the nodes each holds a claim on, and its leader."""

from __future__ import annotations

import argparse
import time
from typing import Any

from controller.ctl.args import client_of
from controller.ctl.format import Cell, Painter, duration, enum_label, print_json, step_label, table
from runwarden.v1 import controller_pb2

_PHASE_COLOUR = {
    "running": "green",
    "recovering": "yellow",
    "preflight": "yellow",
    "launching": "yellow",
    "stopping": "yellow",
    "waiting": "yellow",
    "failed": "red",
    "completed": "blue",
}


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("status", parents=[common], help="runs: phase, attempt, step, committed step, budget")
    p.add_argument("run", nargs="?", default="", help="one run (default: every run)")
    p.set_defaults(func=run)


def waiting_line(r: controller_pb2.RunStatus, now: float) -> str:
    """'waiting for 1 node from the queue for 4 min' while the run waits for nodes; else ''."""
    if r.waiting_for_nodes <= 0 or r.waiting_since <= 0:
        return ""
    n = r.waiting_for_nodes
    minutes = max(0.0, now - r.waiting_since) / 60
    since = f"{minutes:.0f} min" if minutes >= 1 else f"{minutes * 60:.0f} s"
    return f"waiting for {n} node{'s' if n != 1 else ''} from the queue for {since}"


def run(args: argparse.Namespace) -> int:
    resp = client_of(args).call("GetStatus", controller_pb2.GetStatusRequest(run=args.run))
    if args.json_out:
        print_json(resp)
        return 0
    paint: Painter = args.paint
    rows: list[list[Cell]] = []
    for r in resp.runs:
        phase = enum_label(controller_pb2.RunPhase.Name(r.phase), "RUN_PHASE_")
        rows.append(
            [
                r.run,
                (phase, _PHASE_COLOUR.get(phase)),
                str(r.attempt),
                step_label(r.current_step),
                step_label(r.last_committed_step),
                str(r.restart_budget_left),
                duration(r.since_last_progress_s) if r.since_last_progress_s >= 0 else "-",
                str(len(r.nodes)),
                str(r.claimed_nodes),
                r.leader or ("none", "red"),
                waiting_line(r, time.time()) or r.reason or "-",
            ]
        )
    if resp.leader:  # one controller's answer (several runs: each run's leader is on its row)
        print(f"leader: {resp.leader} (fence {resp.fence})")
    elif len(resp.runs) <= 1:
        print("leader: unknown")
    if not rows:
        print("no runs")
        return 0
    print(
        table(
            [
                "run",
                "phase",
                "attempt",
                "step",
                "committed",
                "budget",
                "last progress",
                "nodes",
                "claimed",
                "leader",
                "reason",
            ],
            rows,
            paint,
        )
    )
    return 0
