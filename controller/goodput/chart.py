"""The postmortem picture (the run's timeline above a stacked bar of lost time by cause) and the
weekly report (lost time per ISO week, stacked by cause).

matplotlib is an optional extra (`runwarden[plot]`): it is imported only when a chart is drawn,
with the non-interactive Agg backend so it works on a headless controller host.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from controller.goodput.report import PRODUCTIVE, US, GoodputReport, sorted_causes

_FIXED_COLOURS = {
    PRODUCTIVE: "#2e9e44",
    "planned": "#f2c744",
    "checkpoint_stall": "#8c6d31",
    "software": "#9467bd",
    "network": "#ff7f0e",
    "control_plane": "#7f7f7f",
    "unattributed": "#bcbd22",
}
_RESTART_COLOURS = ["#08306b", "#2171b5", "#4292c6", "#6baed6", "#9ecae1", "#c6dbef", "#deebf7"]
_HARDWARE_COLOURS = ["#d62728", "#a50f15", "#ef3b2c", "#fb6a4a", "#67000d", "#fc9272"]
_PHASE_ORDER = ["detect", "attribute", "replace", "preflight", "launch", "load", "first_step"]


class ChartError(RuntimeError):
    """The chart cannot be drawn (matplotlib missing, or the file cannot be written)."""


def colour_for(label: str) -> str:
    if label in _FIXED_COLOURS:
        return _FIXED_COLOURS[label]
    prefix, _, rest = label.partition(":")
    if prefix in ("restart", "startup"):
        i = _PHASE_ORDER.index(rest) if rest in _PHASE_ORDER else 0
        return _RESTART_COLOURS[i] if prefix == "restart" else ["#d9d9d9", "#bdbdbd", "#969696"][i % 3]
    if prefix == "unattributed":
        return _FIXED_COLOURS["unattributed"]
    if prefix == "hardware":
        return _HARDWARE_COLOURS[sum(map(ord, rest)) % len(_HARDWARE_COLOURS)]
    return "#17becf"


def render_png(report: GoodputReport, path: str | Path, *, title: str | None = None) -> Path:
    """Draw the report to a PNG file and return its path."""
    plt = _pyplot()
    out = Path(path)
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(12, 6.5), gridspec_kw={"height_ratios": [2.2, 1.0]}, constrained_layout=True
    )
    try:
        _draw_timeline(top, report)
        _draw_lost_bar(bottom, report)
        heading = title or (
            f"run {report.run}: goodput {100 * report.goodput:.1f}%  "
            f"({_hours(report.productive_us)} productive of {_hours(report.allocated_us)} allocated, "
            f"{report.failures} failures, {report.planned_stops} planned stop{'' if report.planned_stops == 1 else 's'})"
        )
        fig.suptitle(heading, fontsize=12, fontweight="bold")
        _save(fig, out)
    finally:
        plt.close(fig)
    return out


def render_weekly_png(report: GoodputReport, path: str | Path, *, title: str | None = None) -> Path:
    """The weekly report: one bar per ISO week, its lost hours stacked by cause, goodput above it."""
    plt = _pyplot()
    out = Path(path)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(report.weeks) + 4.0), 5.0), constrained_layout=True)
    try:
        _draw_weekly(ax, report)
        heading = (
            title
            or f"run {report.run}: lost time per week by cause, goodput {100 * report.goodput:.1f}% overall"
        )
        fig.suptitle(heading, fontsize=12, fontweight="bold")
        _save(fig, out)
    finally:
        plt.close(fig)
    return out


def _draw_weekly(ax: Any, report: GoodputReport) -> None:
    weeks = report.weeks
    # one colour and legend entry per cause, in the order of the whole report's lost time
    causes = [c for c, _ in sorted_causes(report.lost_by_cause_us)]
    xs = list(range(len(weeks)))
    bottoms = [0.0] * len(weeks)
    for cause in causes:
        hours = [w.lost_by_cause_us.get(cause, 0) / US / 3600 for w in weeks]
        ax.bar(xs, hours, bottom=bottoms, color=colour_for(cause), edgecolor="white", label=cause)
        bottoms = [b + h for b, h in zip(bottoms, hours, strict=True)]
    for x, w, top in zip(xs, weeks, bottoms, strict=True):
        ax.text(x, top, f"{100 * w.goodput:.1f}%", ha="center", va="bottom", fontsize=8)
    ax.margins(y=0.08)  # room for the goodput label above the tallest bar
    ax.set_xticks(xs, [w.week for w in weeks])
    ax.set_ylabel("lost hours (stacked by cause)")
    ax.set_title(
        "lost time per ISO week (UTC); the goodput of each week above its bar", fontsize=10, loc="left"
    )
    if causes:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    else:
        ax.text(0.5, 0.5, "no lost time", transform=ax.transAxes, ha="center")


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ChartError("the PNG chart needs matplotlib: pip install 'runwarden[plot]'") from None
    return plt


def _save(fig: Any, out: Path) -> None:
    try:
        fig.savefig(out, dpi=110)
    except OSError as exc:
        raise ChartError(f"cannot write {out}: {exc.strerror}") from None


def _hours(us: int) -> str:
    s = us / US
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.1f} min"


def _draw_timeline(ax: Any, report: GoodputReport) -> None:
    t0 = report.start_ts
    scale, unit = _time_scale(report.end_ts - report.start_ts)
    seen: dict[str, str] = {}
    for sp in report.spans:
        colour = colour_for(sp.label)
        start = (sp.start_us / US - t0) / scale
        width = (sp.end_us - sp.start_us) / US / scale
        ax.broken_barh([(start, width)], (0.0, 1.0), facecolors=colour, edgecolor="none")
        seen.setdefault(sp.label, colour)
    commits = [m for m in report.markers if m.kind == "commit"]
    label_every = max(1, len(commits) // 10)
    for i, m in enumerate(commits):
        x = (m.ts - t0) / scale
        ax.plot([x, x], [-0.12, 0.0], color="black", linewidth=1)
        if i % label_every == 0:
            ax.text(x, -0.17, str(m.step), ha="center", va="top", fontsize=7)
    span = max((report.end_ts - t0) / scale, 1e-9)
    attempt_y = _Stagger(span, base=1.34)
    cause_y = _Stagger(span, base=1.2)
    for m in report.markers:
        x = (m.ts - t0) / scale
        if m.kind == "launch":
            ax.axvline(x, color="black", linestyle="--", linewidth=0.8)
            ax.text(x, attempt_y.at(x), f" attempt {m.attempt}", ha="left", va="bottom", fontsize=8)
        elif m.kind == "fault":
            ax.plot(x, 1.12, marker="v", color="#d62728", markersize=11)
        elif m.kind == "stop":
            ax.plot(x, 1.12, marker="s", color="#f2c744", markeredgecolor="black", markersize=8)
    for inc in report.incidents:
        x = (inc.fault_ts - t0) / scale
        ax.text(x, cause_y.at(x), inc.cause, ha="center", va="bottom", fontsize=8, color="#a50f15")
    ax.set_ylim(-0.45, 1.85)
    ax.set_xlim(0, max((report.end_ts - t0) / scale, 1e-9))
    ax.set_yticks([])
    started = dt.datetime.fromtimestamp(t0, tz=dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    ax.set_xlabel(f"{unit} since {started}   (ticks below the bar: committed steps; ▼ fault; ■ stop request)")
    ax.set_title("timeline: what every moment of the allocation was spent on", fontsize=10, loc="left")
    from matplotlib.patches import Patch

    # the startup phases are a sliver of any real run: one legend entry for all of them
    startup = [lab for lab in seen if lab.startswith("startup:")]
    entries = [(lab, c) for lab, c in seen.items() if lab not in startup]
    if startup:
        entries.insert(0, ("startup (greys)", seen[startup[0]]))
    handles = [Patch(facecolor=c, label=lab) for lab, c in entries]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)


class _Stagger:
    """Raises a label when it would overprint the previous one at nearly the same x."""

    def __init__(self, span: float, *, base: float) -> None:
        self._min_gap = span * 0.06
        self._base = base
        self._last_x = -1e18
        self._level = 0

    def at(self, x: float) -> float:
        self._level = self._level + 1 if x - self._last_x < self._min_gap else 0
        self._last_x = x
        return self._base + 0.15 * (self._level % 3)


def _draw_lost_bar(ax: Any, report: GoodputReport) -> None:
    causes = sorted_causes(report.lost_by_cause_us)
    left = 0.0
    for cause, us in causes:
        minutes = us / US / 60
        ax.barh(
            [0],
            [minutes],
            left=left,
            color=colour_for(cause),
            edgecolor="white",
            label=f"{cause}: {minutes:.1f} min",
        )
        left += minutes
    ax.set_yticks([])
    ax.set_xlabel("lost minutes (stacked by cause, largest first)")
    total = report.lost_us / US / 60
    ax.set_title(f"lost time by cause: {total:.1f} min in all", fontsize=10, loc="left")
    if causes:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False, ncol=1)
    else:
        ax.text(0.5, 0.5, "no lost time", transform=ax.transAxes, ha="center")


def _time_scale(seconds: float) -> tuple[float, str]:
    if seconds >= 3 * 86400:
        return 86400.0, "days"
    if seconds >= 3 * 3600:
        return 3600.0, "hours"
    if seconds >= 180:
        return 60.0, "minutes"
    return 1.0, "seconds"
