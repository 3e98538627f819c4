"""`controllerctl goodput`: the report from the controller, or offline from an event-log file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from controller.ctl.args import since_arg
from controller.ctl.client import CtlError, ExitCode
from controller.ctl.format import Cell, Painter, print_json, table
from controller.goodput.report import compute_goodput, normalise_by, shape_report
from runwarden.eventlog import LogEntry, read_events
from runwarden.v1 import controller_pb2


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "goodput",
        parents=[common],
        help="goodput, lost time by cause or week, rates, PNG chart",
        description="Goodput = time whose training progress was kept / allocated time. "
        "With --log FILE it is computed offline from an event-log file, "
        "with no controller running.",
    )
    p.add_argument("run", nargs="?", default="", help="one run (default: every run, summed)")
    p.add_argument("--since", type=since_arg, default=None, help="10m, 2h, 3d, an ISO time, or unix seconds")
    p.add_argument(
        "--by",
        choices=["cause", "week"],
        action="append",
        default=None,
        help="break lost time down by cause (the default) or ISO week (UTC); "
        "both (--by week --by cause): a week x cause table",
    )
    p.add_argument(
        "--png",
        metavar="FILE",
        help="also draw a chart to FILE: the postmortem timeline + lost time, "
        "or with --by week lost time per week stacked by cause",
    )
    p.add_argument("--log", metavar="FILE", help="compute offline from this event-log file")
    p.set_defaults(func=run)


def _offline_events(path: str) -> list[LogEntry]:
    p = Path(path)
    if not p.is_file():
        raise CtlError(f"no event-log file {path}", ExitCode.USAGE)
    try:
        read = read_events(p)
    except OSError as exc:
        raise CtlError(f"cannot read {path}: {exc.strerror}", ExitCode.USAGE) from None
    if read.torn_tail is not None:
        print(f"controllerctl: {path}: skipped a torn last line (a crash mid-write)", file=sys.stderr)
    for err in read.errors[:5]:
        print(f"controllerctl: {path}:{err.line_no}: skipped: {err.reason}", file=sys.stderr)
    return read.entries


def run(args: argparse.Namespace) -> int:
    events: list[LogEntry] | None = None
    by = normalise_by(args.by or ())  # argparse's choices already refused anything else
    if args.log:
        events = _offline_events(args.log)
        if args.run and not any(e.run == args.run for e in events):
            raise CtlError(f"no events for run {args.run!r} in {args.log}", ExitCode.NOT_FOUND)
        report = shape_report(compute_goodput(events, run=args.run, since=args.since).to_proto(), by)
    else:
        client = args.client_factory()
        resp = client.call(
            "GetGoodput", controller_pb2.GetGoodputRequest(run=args.run, since=args.since or 0.0, by=by)
        )
        report = resp.report
        if args.png:
            listed = client.call("ListEvents", controller_pb2.ListEventsRequest(run=args.run, limit=100_000))
            events = list(listed.events)
    if args.png:
        _draw(events or [], args, weekly="week" in by)
    if args.json_out:
        print_json(report)
    else:
        print(render_report(report, by or "cause", args.paint))
        if args.png:
            print(f"\nchart written to {args.png}")
    return 0


def _draw(events: list[LogEntry], args: argparse.Namespace, *, weekly: bool) -> None:
    from controller.goodput.chart import ChartError, render_png, render_weekly_png

    draw = render_weekly_png if weekly else render_png
    try:
        draw(compute_goodput(events, run=args.run, since=args.since), args.png)
    except ChartError as exc:
        raise CtlError(str(exc), ExitCode.FAILED) from None


def _hours(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    return f"{seconds / 60:.1f} min"


def render_report(r: controller_pb2.GoodputReport, by: str, paint: Painter) -> str:
    """The summary, then the breakdown: "cause", "week" or "week,cause" (a normalise_by value)."""
    colour = "green" if r.goodput >= 0.9 else "yellow" if r.goodput >= 0.7 else "red"
    lines = [
        f"{paint('run', 'bold')}         {r.run or '*'}",
        f"{paint('goodput', 'bold')}     {paint(f'{100 * r.goodput:.1f}%', colour)}   "
        f"productive {_hours(r.productive_s)} of {_hours(r.allocated_s)} allocated, lost {_hours(r.lost_s)}",
        f"{paint('failures', 'bold')}    {r.failures}  ({r.failures_per_1000_node_hours:.2f} per 1,000 node-hours)",
        f"{paint('detect', 'bold')}      mean {r.detect_mean_min:.2f} min, p90 {r.detect_p90_min:.2f} min",
        f"{paint('first step', 'bold')}  mean {r.first_step_mean_min:.2f} min from fault to first new step",
        f"{paint('preflight', 'bold')}   {r.preflight_rejections} rejections",
        "",
    ]
    if by == "week,cause":
        lines.append(week_cause_table(r, paint))
    elif by == "week":
        rows: list[list[Cell]] = [
            [w.week, _hours(w.allocated_s), _hours(w.productive_s), f"{100 * w.goodput:.1f}%"]
            for w in r.weeks
        ]
        lines.append(
            table(["week", "allocated", "productive", "goodput"], rows, paint) if rows else "no weeks"
        )
    else:
        lost = r.lost_s or 1.0
        rows = [[c.cause, _hours(c.seconds), f"{100 * c.seconds / lost:.1f}%"] for c in r.lost_by_cause]
        lines.append(table(["cause", "lost", "share"], rows, paint) if rows else "no lost time")
    return "\n".join(lines)


def week_cause_table(r: controller_pb2.GoodputReport, paint: Painter) -> str:
    """One row per week (allocated = productive + lost), then that week's causes, largest first."""
    rows: list[list[Cell]] = []
    for w in r.weeks:
        week_row: list[Cell] = [w.week, "", _hours(w.allocated_s), _hours(w.productive_s), _hours(w.lost_s)]
        rows.append([*week_row, _pct(w.goodput), ""])
        lost = w.lost_s or 1.0
        rows.extend(
            ["", c.cause, "", "", _hours(c.seconds), "", _pct(c.seconds / lost)] for c in w.lost_by_cause
        )
    if not rows:
        return "no weeks"
    return table(["week", "cause", "allocated", "productive", "lost", "goodput", "share"], rows, paint)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"
