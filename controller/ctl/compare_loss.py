"""`controllerctl compare-loss RUN`: for each resumed attempt, its replayed steps' loss against the
earlier attempt's, from the event log (offline with --log FILE, or from the controller).

The core logs what this reads (controller/supervisor/loss.py): LOSS_REPLAY events, one point per
replayed step (that step's worst rank: earlier and new loss, relative difference, ranks compared;
a step's ranks may be split over two events, merged here), and DIVERGENCE, the first (step, rank)
of an attempt beyond `divergence_tolerance`. So the comparison needs no loss records besides the log.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.ctl.client import CtlError, ExitCode
from controller.ctl.format import Cell, print_json, table
from runwarden.eventlog import LogEntry, read_events
from runwarden.v1 import controller_pb2, events_pb2

E = events_pb2
KINDS = (E.EVENT_KIND_LOSS_REPLAY, E.EVENT_KIND_DIVERGENCE)
HEADERS = ["step", "rank", "node", "earlier loss", "loss", "rel diff", "ranks"]


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "compare-loss",
        parents=[common],
        help="the replayed steps' loss of each resumed attempt against the earlier attempt's",
        description="For each resumed attempt of RUN: the steps it replayed, the loss an earlier "
        "attempt reported and the new one (each step's worst rank), and the largest relative "
        "difference. With --log FILE it reads an event-log file, with no controller running.",
    )
    p.add_argument("run", help="the run")
    p.add_argument("--log", metavar="FILE", help="read this event-log file instead of the controller")
    p.add_argument("--attempt", type=int, default=0, help="only this attempt")
    p.set_defaults(func=run)


@dataclass
class AttemptComparison:
    attempt: int
    resume_step: int = -1
    tolerance: float = 0.0
    points: dict[int, events_pb2.LossPoint] = field(default_factory=dict)  # step -> worst rank
    divergence: events_pb2.LossPoint | None = None
    divergence_message: str = ""

    @property
    def max_rel_diff(self) -> float:
        return max((p.rel_diff for p in self.points.values()), default=0.0)

    @property
    def diverged(self) -> bool:
        return self.divergence is not None or (self.tolerance > 0 and self.max_rel_diff > self.tolerance)


def compare(events: list[LogEntry], run: str) -> list[AttemptComparison]:
    """The run's resumed attempts, oldest first, from its LOSS_REPLAY and DIVERGENCE events."""
    by_attempt: dict[int, AttemptComparison] = {}
    for ev in events:
        if ev.run != run or ev.kind not in KINDS or not ev.HasField("loss"):
            continue
        c = by_attempt.setdefault(ev.attempt, AttemptComparison(attempt=ev.attempt))
        d = ev.loss
        c.resume_step, c.tolerance = d.resume_step, d.threshold
        if ev.kind == E.EVENT_KIND_DIVERGENCE:
            if c.divergence is None and d.points:
                c.divergence, c.divergence_message = d.points[0], ev.message
            continue
        for p in d.points:
            old = c.points.get(p.step)
            if old is None:
                c.points[p.step] = p
                continue
            merged = events_pb2.LossPoint()
            merged.CopyFrom(p if p.rel_diff > old.rel_diff else old)
            merged.ranks_compared = old.ranks_compared + p.ranks_compared
            c.points[p.step] = merged
    return [by_attempt[a] for a in sorted(by_attempt)]


def _num(x: float) -> str:
    return f"{x:.6g}" if math.isfinite(x) else str(x)


def _json_num(x: float) -> float | str:
    """Non-finite floats as protobuf's JSON mapping writes them ("NaN", "Infinity"): strict JSON."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return x


def _point_json(p: events_pb2.LossPoint) -> dict[str, Any]:
    return {
        "step": p.step,
        "rank": p.rank,
        "node": p.node,
        "earlier_attempt": p.earlier_attempt,
        "earlier_loss": _json_num(p.earlier_loss),
        "loss": _json_num(p.loss),
        "rel_diff": _json_num(p.rel_diff),
        "ranks_compared": p.ranks_compared,
    }


def to_json(run: str, comparisons: list[AttemptComparison]) -> dict[str, Any]:
    return {
        "run": run,
        "attempts": [
            {
                "attempt": c.attempt,
                "resume_step": c.resume_step,
                "tolerance": c.tolerance,
                "replayed_steps": len(c.points),
                "max_rel_diff": _json_num(c.max_rel_diff),
                "diverged": c.diverged,
                "divergence": _point_json(c.divergence) if c.divergence is not None else None,
                "steps": [_point_json(c.points[s]) for s in sorted(c.points)],
            }
            for c in comparisons
        ],
    }


def render(run: str, comparisons: list[AttemptComparison], paint: Any) -> str:
    if not comparisons:
        return f"run {run}: no resumed attempt replayed a step with a loss to compare"
    out: list[str] = []
    for c in comparisons:
        steps = sorted(c.points)
        span = f"steps {steps[0]}-{steps[-1]}" if steps else "no steps"
        verdict = (
            paint("DIVERGED", "red")
            if c.diverged
            else paint("identical", "green")
            if c.max_rel_diff == 0
            else paint("within tolerance", "green")
            if c.tolerance > 0
            else "no tolerance set"
        )
        out.append(
            f"{paint(f'attempt {c.attempt}', 'bold')} resumed from step {c.resume_step}: "
            f"{len(steps)} replayed ({span}), max relative difference {_num(c.max_rel_diff)} "
            f"(tolerance {_num(c.tolerance)}): {verdict}"
        )
        if c.divergence is not None:
            out.append(f"  {c.divergence_message}")
        rows: list[list[Cell]] = [
            [
                str(p.step),
                str(p.rank),
                p.node or "-",
                f"{_num(p.earlier_loss)} (a{p.earlier_attempt})",
                _num(p.loss),
                (_num(p.rel_diff), "red" if c.tolerance > 0 and p.rel_diff > c.tolerance else None),
                str(p.ranks_compared),
            ]
            for p in (c.points[s] for s in steps)
        ]
        if rows:
            out.append(table(HEADERS, rows, paint))
        out.append("")
    return "\n".join(out).rstrip()


def _offline(path: str) -> list[LogEntry]:
    p = Path(path)
    if not p.is_file():
        raise CtlError(f"no event-log file {path}", ExitCode.USAGE)
    try:
        read = read_events(p)
    except OSError as exc:
        raise CtlError(f"cannot read {path}: {exc.strerror}", ExitCode.USAGE) from None
    for err in read.errors[:5]:
        print(f"controllerctl: {path}:{err.line_no}: skipped: {err.reason}", file=sys.stderr)
    return read.entries


def run(args: argparse.Namespace) -> int:
    if args.log:
        events = _offline(args.log)
        if not any(e.run == args.run for e in events):
            raise CtlError(f"no events for run {args.run!r} in {args.log}", ExitCode.NOT_FOUND)
    else:
        resp = args.client_factory().call(
            "ListEvents", controller_pb2.ListEventsRequest(run=args.run, kinds=KINDS, limit=100_000)
        )
        events = list(resp.events)
    comparisons = compare(events, args.run)
    if args.attempt:
        comparisons = [c for c in comparisons if c.attempt == args.attempt]
    if args.json_out:
        print_json(to_json(args.run, comparisons))
    else:
        print(render(args.run, comparisons, args.paint))
    return 0
