"""Goodput from the event log: `compute_goodput(events)` is one pure function, used by the CLI, the
API, the demo and the simulator. Every instant of a run's allocated time gets exactly one label
(productive, or lost to a cause), kept in integer microseconds, so ``productive + lost ==
allocated`` holds exactly. The README's "Goodput" section has the definitions in full.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from controller.goodput.causes import cause_from_attribution
from runwarden.eventlog import LogEntry
from runwarden.v1 import controller_pb2, events_pb2

E = events_pb2
US = 1_000_000  # microseconds per second: every duration is an exact integer of these

PRODUCTIVE = "productive"
_MILESTONE_PHASE = {
    E.EVENT_KIND_DETECTION: "detect",
    E.EVENT_KIND_ATTRIBUTION: "attribute",
    E.EVENT_KIND_SPARE_TAKEN: "replace",
    E.EVENT_KIND_QUARANTINE: "replace",
    E.EVENT_KIND_PREFLIGHT_RESULT: "preflight",
    E.EVENT_KIND_LAUNCH: "launch",
    E.EVENT_KIND_LOAD_DONE: "load",
    E.EVENT_KIND_FIRST_STEP: "first_step",
}
# After a milestone, time not (yet) ended by another milestone belongs to the next phase.
_NEXT_PHASE = {
    "allocate": "preflight",
    "detect": "attribute",
    "attribute": "replace",
    "replace": "preflight",
    "preflight": "launch",
    "launch": "load",
    "load": "first_step",
    "first_step": "first_step",
}
PHASES = ("detect", "attribute", "replace", "preflight", "launch", "load", "first_step")


def to_us(seconds: float) -> int:
    return round(seconds * US)


@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    """One labelled stretch of the run's allocated time, [start_us, end_us)."""

    start_us: int
    end_us: int
    label: str  # PRODUCTIVE or a lost cause


@dataclass(frozen=True, slots=True, kw_only=True)
class Incident:
    """One unplanned interruption: its cause, rollback and how long each recovery phase took."""

    cause: str
    fault_ts: float
    detected_ts: float
    step: int
    nodes: tuple[str, ...]
    rollback_us: int
    phases_us: dict[str, int]
    first_step_ts: float | None  # the next FIRST_STEP after the fault, if any

    @property
    def lost_us(self) -> int:
        return self.rollback_us + sum(self.phases_us.values())


@dataclass(frozen=True, slots=True, kw_only=True)
class Marker:
    """A point on the timeline for the chart: a launch, a fault, a commit, a stop request."""

    ts: float
    kind: str  # "launch" | "fault" | "commit" | "stop"
    attempt: int
    step: int
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class WeekFigures:
    """One ISO week (UTC): ``productive_us + lost_us == allocated_us``, the causes summing to lost."""

    week: str
    allocated_us: int
    productive_us: int
    lost_by_cause_us: dict[str, int] = field(default_factory=dict)

    @property
    def lost_us(self) -> int:
        return sum(self.lost_by_cause_us.values())

    @property
    def goodput(self) -> float:
        return self.productive_us / self.allocated_us if self.allocated_us else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class GoodputReport:
    """The report. Integer microseconds are exact: ``productive_us + lost_us == allocated_us``."""

    run: str
    start_ts: float
    end_ts: float
    allocated_us: int
    productive_us: int
    uncommitted_us: int  # part of productive: training after the last commit, not yet rolled back
    lost_by_cause_us: dict[str, int]
    node_seconds: float
    incidents: tuple[Incident, ...]
    preflight_rejections: int
    planned_stops: int
    weeks: tuple[WeekFigures, ...]
    spans: tuple[Span, ...]
    markers: tuple[Marker, ...] = field(default=())

    @property
    def lost_us(self) -> int:
        return sum(self.lost_by_cause_us.values())

    @property
    def goodput(self) -> float:
        return self.productive_us / self.allocated_us if self.allocated_us else 0.0

    @property
    def failures(self) -> int:
        return len(self.incidents)

    @property
    def failures_per_1000_node_hours(self) -> float:
        hours = self.node_seconds / 3600.0
        return 1000.0 * self.failures / hours if hours > 0 else 0.0

    @property
    def detect_minutes(self) -> list[float]:
        return [(i.detected_ts - i.fault_ts) / 60.0 for i in self.incidents]

    @property
    def first_step_minutes(self) -> list[float]:
        return [(i.first_step_ts - i.fault_ts) / 60.0 for i in self.incidents if i.first_step_ts is not None]

    def to_proto(self) -> controller_pb2.GoodputReport:
        detect = self.detect_minutes
        first = self.first_step_minutes
        return controller_pb2.GoodputReport(
            run=self.run,
            allocated_s=self.allocated_us / US,
            productive_s=self.productive_us / US,
            lost_s=self.lost_us / US,
            goodput=self.goodput,
            lost_by_cause=[
                controller_pb2.LostTime(cause=c, seconds=us / US)
                for c, us in sorted_causes(self.lost_by_cause_us)
            ],
            failures=self.failures,
            failures_per_1000_node_hours=self.failures_per_1000_node_hours,
            detect_mean_min=_mean(detect),
            detect_p90_min=percentile(detect, 90),
            first_step_mean_min=_mean(first),
            preflight_rejections=self.preflight_rejections,
            weeks=[
                controller_pb2.GoodputWeek(
                    week=w.week,
                    goodput=w.goodput,
                    allocated_s=w.allocated_us / US,
                    productive_s=w.productive_us / US,
                    lost_s=w.lost_us / US,
                    lost_by_cause=[
                        controller_pb2.LostTime(cause=c, seconds=us / US)
                        for c, us in sorted_causes(w.lost_by_cause_us)
                    ],
                )
                for w in self.weeks
            ],
        )


def normalise_by(parts: Iterable[str]) -> str:
    """``--by`` flags (or the API's comma list) as "", "cause", "week" or "week,cause"; ValueError names a bad part."""
    chosen = {p.strip() for p in parts if p.strip()}
    bad = sorted(chosen - {"cause", "week"})
    if bad:
        raise ValueError(f"by must be 'cause', 'week' or both, got {', '.join(map(repr, bad))}")
    return ",".join(p for p in ("week", "cause") if p in chosen)


def shape_report(report: controller_pb2.GoodputReport, by: str) -> controller_pb2.GoodputReport:
    """Keep the breakdown asked for (a normalise_by value): the API and ``controllerctl --json`` agree."""
    if by == "cause":
        del report.weeks[:]
    elif by == "week":
        del report.lost_by_cause[:]
        for week in report.weeks:
            del week.lost_by_cause[:]  # "week,cause" keeps each week's split
    return report


def sorted_causes(lost: dict[str, int]) -> list[tuple[str, int]]:
    return sorted(((c, us) for c, us in lost.items() if us > 0), key=lambda cu: (-cu[1], cu[0]))


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (no interpolation): the value an operator can find in the data."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100.0 * len(ordered)))
    return ordered[rank - 1]


class Tentative:
    """Training since the last commit: kept on the next commit, lost to an incident's cause on a fault."""

    __slots__ = ("incident", "kept", "planned", "us")

    def __init__(self) -> None:
        self.kept = False
        self.planned = False  # a stop ended it uncommitted: lost to "planned"
        self.incident: OpenIncident | None = None
        self.us = 0  # its length so far: the rollback if a fault ends it (no rescan of the spans)


class OpenIncident:
    __slots__ = (
        "cause",
        "detected_ts",
        "fallback",
        "fault_ts",
        "first_step_ts",
        "launched",
        "nodes",
        "phases",
        "rollback",
        "step",
    )

    def __init__(self, *, fault_ts: float, detected_ts: float, step: int, nodes: tuple[str, ...]) -> None:
        self.fault_ts = fault_ts
        self.detected_ts = detected_ts
        self.step = step
        self.nodes = nodes
        self.cause: str | None = None  # from the incident's first attribution
        self.fallback = "unattributed"  # when no attribution names a cause
        self.rollback = 0
        self.phases: dict[str, int] = defaultdict(int)
        self.launched = False
        self.first_step_ts: float | None = None


Label = str | Tentative | OpenIncident  # an incident label means: rolled back to that incident's cause


class SpanSink(Protocol):
    """Receives the accountant's spans as they close (the windowed rates fold them in)."""

    def span(self, start_us: int, end_us: int, label: Label, nodes: int) -> None: ...

    def rolled_back(self, tentative: Tentative) -> None:
        """The tentative's spans, already passed to span(), are lost after all."""


class RunAccountant:
    """Walks one run's events in order and labels every microsecond of its allocated time.

    With ``history=False`` (the live windowed rates) it keeps no spans, markers or past incidents,
    so memory stays flat over a months-long log; its spans go to ``sink`` either way.
    """

    def __init__(self, run: str, *, history: bool = True, sink: SpanSink | None = None) -> None:
        self.run = run
        self.history = history
        self.sink = sink
        self.start: int | None = None
        self.cursor = 0
        self.mode = "idle"  # idle | startup | training | recovering | stopping | ended
        self.last_phase = "allocate"
        self.spans: list[tuple[int, int, Label]] = []
        self.tentative = Tentative()
        self.incident: OpenIncident | None = None
        self.incidents: list[OpenIncident] = []  # every incident (history) for the report
        self.awaiting_first_step: list[OpenIncident] = []  # faults since the last FIRST_STEP
        self.stop_pending = False
        self.stop_step = -1  # the step the pending stop was requested at: its save commits no earlier
        self.nodes_now = 0
        self.attempt_nodes: frozenset[str] = frozenset()  # the running attempt's (its LAUNCH)
        self.node_seconds = 0.0
        self.preflight_rejections = 0
        self.planned_stops = 0
        self.markers: list[Marker] = []

    # -- time accounting -------------------------------------------------------------------------

    def _label(self, milestone_phase: str | None) -> Label:
        if self.mode == "training":
            return self.tentative
        if self.mode == "stopping":
            return "planned"
        phase = milestone_phase or _NEXT_PHASE[self.last_phase]
        if self.mode == "recovering":
            return f"restart:{phase}"
        return f"startup:{phase}"

    def _advance(self, t_us: int, milestone_phase: str | None = None) -> None:
        if self.mode in ("idle", "ended") or t_us <= self.cursor:
            return
        label = self._label(milestone_phase)
        if isinstance(label, str) and label.startswith("restart:") and self.incident is not None:
            self.incident.phases[label.split(":", 1)[1]] += t_us - self.cursor
        self._emit(t_us, label)

    def _emit(self, t_us: int, label: Label) -> None:
        """Close the span [cursor, t_us) with ``label``."""
        if self.history:
            self.spans.append((self.cursor, t_us, label))
        if isinstance(label, Tentative):
            label.us += t_us - self.cursor
        if self.sink is not None:
            self.sink.span(self.cursor, t_us, label, self.nodes_now)
        self.node_seconds += self.nodes_now * (t_us - self.cursor) / US
        self.cursor = t_us

    def open_label(self) -> Label | None:
        """The label of the time since the last event, None while the run is not going."""
        return None if self.mode in ("idle", "ended") else self._label(None)

    # -- events ----------------------------------------------------------------------------------

    def begin(self, ev: LogEntry) -> None:
        t = to_us(ev.ts)
        if self.mode in ("idle", "ended"):
            if self.start is None:
                self.start = t
            self.cursor = max(self.cursor, t)
            self.mode = "startup"
            self.last_phase = "allocate"
        if ev.HasField("run_detail") and ev.run_detail.nodes > 0:
            self.nodes_now = ev.run_detail.nodes

    def handle(self, ev: LogEntry) -> None:
        kind = ev.kind
        if kind == E.EVENT_KIND_RUN_START or self.mode == "idle":
            self.begin(ev)
            if kind == E.EVENT_KIND_RUN_START:
                return
        if self.mode == "ended":
            return
        t = to_us(ev.ts)
        handler = _HANDLERS.get(kind)
        if handler is not None:
            handler(self, ev, t)
        elif kind in _MILESTONE_PHASE and self.mode in ("startup", "recovering"):
            self._milestone(ev, t)

    def _milestone(self, ev: LogEntry, t: int) -> None:
        phase = _MILESTONE_PHASE[ev.kind]
        self._advance(t, phase)
        self.last_phase = phase

    def on_detection(self, ev: LogEntry, t: int) -> None:
        if is_flag_only(ev):
            return  # the attempt went on: nothing was interrupted, no phase ended
        latency = to_us(max(0.0, ev.detection.latency_s)) if ev.HasField("detection") else 0
        fault = min(t, max(self.cursor, t - latency))
        nodes = tuple(ev.detection.nodes) if ev.HasField("detection") else ()
        if self.mode == "training" and nodes and self.attempt_nodes and not self.attempt_nodes & set(nodes):
            return  # a fault on a node outside the running attempt (an idle spare): not this run's loss
        if self.mode == "recovering" and self.incident is not None and not self.incident.launched:
            return  # overlapping fault: the same interruption, nothing new to roll back
        self._advance(fault)  # a fault during a restart closes the open incident's recovery here
        inc = OpenIncident(fault_ts=fault / US, detected_ts=t / US, step=ev.step, nodes=nodes)
        if ev.HasField("detection") and ev.detection.detector == E.DETECTOR_NODE_LOST:
            inc.fallback = "hardware:node_lost"
        if self.mode == "training":
            self.tentative.incident = inc
            inc.rollback = self.tentative.us
            if self.sink is not None:
                self.sink.rolled_back(self.tentative)
            self.tentative = Tentative()
        self.stop_pending = False
        self.incident = inc
        if self.history:
            self.incidents.append(inc)
        self.awaiting_first_step.append(inc)
        self.mode = "recovering"
        self.last_phase = "allocate"
        self._milestone(ev, t)
        self._mark(
            Marker(
                ts=fault / US,
                kind="fault",
                attempt=ev.attempt,
                step=ev.step,
                text=ev.detection.reason if ev.HasField("detection") else ev.message,
            )
        )

    def on_attribution(self, ev: LogEntry, t: int) -> None:
        if self.incident is not None and self.incident.cause is None:
            self.incident.cause = cause_from_attribution(ev.attribution)
        if self.mode in ("startup", "recovering"):
            self._milestone(ev, t)

    def on_control_plane(self, ev: LogEntry, t: int) -> None:
        if self.incident is not None and self.mode == "recovering" and self.incident.cause is None:
            self.incident.cause = "control_plane"

    def on_preflight(self, ev: LogEntry, t: int) -> None:
        if ev.HasField("preflight") and (not ev.preflight.summary.passed or len(ev.preflight.failed) > 0):
            self.preflight_rejections += 1
        if self.mode in ("startup", "recovering"):
            self._milestone(ev, t)

    def on_launch(self, ev: LogEntry, t: int) -> None:
        if self.mode == "training" and self.stop_pending:
            self._stop_rollback(t)
        if self.mode in ("startup", "recovering"):
            self._milestone(ev, t)
        else:
            self._advance(t)
        if self.incident is not None:
            self.incident.launched = True
        if ev.HasField("launch") and len(ev.launch.nodes) > 0:
            self.nodes_now = len(ev.launch.nodes)
            self.attempt_nodes = frozenset(ev.launch.nodes)
        self._mark(
            Marker(
                ts=ev.ts,
                kind="launch",
                attempt=ev.attempt,
                step=ev.launch.resume_step,
                text=f"attempt {ev.attempt}",
            )
        )

    def on_first_step(self, ev: LogEntry, t: int) -> None:
        if self.mode in ("startup", "recovering"):
            self._milestone(ev, t)
        else:
            self._advance(t)
        for inc in self.awaiting_first_step:
            inc.first_step_ts = t / US
        self.awaiting_first_step = []
        self.incident = None
        self.stop_pending = False
        self.mode = "training"

    def on_commit(self, ev: LogEntry, t: int) -> None:
        save = to_us(max(0.0, ev.checkpoint.save_duration_s)) if ev.HasField("checkpoint") else 0
        save_start = min(t, max(self.cursor, t - save))
        failed = ev.kind == E.EVENT_KIND_CHECKPOINT_FAILED
        if self.mode == "training":
            self._advance(save_start)
            if not failed:
                self.tentative.kept = True
                self.tentative = Tentative()
                self._mark(
                    Marker(ts=ev.ts, kind="commit", attempt=ev.attempt, step=ev.step, text=f"step {ev.step}")
                )
            if self.stop_pending and not failed and ev.step >= self.stop_step:
                # the stop's own save (an earlier step's commit is a save begun before the stop,
                # whose upload ended after it: training goes on to the stop's save)
                self.mode = "stopping"
                self._advance(t)
            elif t > self.cursor:
                self._emit(t, "checkpoint_stall")
        else:
            self._advance(t)

    def on_stop_request(self, ev: LogEntry, t: int) -> None:
        self._advance(t)
        self.planned_stops += 1
        self._mark(
            Marker(
                ts=ev.ts,
                kind="stop",
                attempt=ev.attempt,
                step=ev.step,
                text=ev.stop.reason if ev.HasField("stop") else "stop",
            )
        )
        if self.mode == "training":
            self.stop_pending = True
            self.stop_step = ev.step
        elif self.mode == "startup":
            self.mode = "stopping"

    def on_exit(self, ev: LogEntry, t: int) -> None:
        if self.mode == "training" and self.stop_pending:
            self._stop_rollback(t)

    def _stop_rollback(self, t: int) -> None:
        """A stop that ended training without a commit: the uncommitted work is lost to the stop."""
        self._advance(t)
        self.tentative.planned = True
        if self.sink is not None:
            self.sink.rolled_back(self.tentative)
        self.tentative = Tentative()
        self.mode = "stopping"
        self.stop_pending = False

    def on_run_end(self, ev: LogEntry, t: int) -> None:
        self._advance(t)
        outcome = ev.run_detail.outcome if ev.HasField("run_detail") else ""
        if self.mode == "training" and outcome in ("completed", "stopped", ""):
            self.tentative.kept = True  # the final save commits the last steps
        self.tentative = Tentative()
        self.mode = "ended"

    def _mark(self, marker: Marker) -> None:
        if self.history:
            self.markers.append(marker)

    def finish(self, end_us: int) -> None:
        if self.mode not in ("idle", "ended"):
            self._advance(end_us)


# How the supervisor has always worded a straggler it leaves running (logs from before flag_only).
_LEGACY_STRAGGLER_FLAG = "not killed mid-run"


def is_flag_only(ev: LogEntry) -> bool:
    """A DETECTION after which the attempt went on: ``flag_only``, or an older log's straggler flag."""
    if not ev.HasField("detection"):
        return False
    d = ev.detection
    return d.flag_only or (d.detector == E.DETECTOR_STRAGGLER and d.reason.endswith(_LEGACY_STRAGGLER_FLAG))


_HANDLERS = {
    E.EVENT_KIND_DETECTION: RunAccountant.on_detection,
    E.EVENT_KIND_ATTRIBUTION: RunAccountant.on_attribution,
    E.EVENT_KIND_CONTROL_PLANE: RunAccountant.on_control_plane,
    E.EVENT_KIND_PREFLIGHT_RESULT: RunAccountant.on_preflight,
    E.EVENT_KIND_LAUNCH: RunAccountant.on_launch,
    E.EVENT_KIND_FIRST_STEP: RunAccountant.on_first_step,
    E.EVENT_KIND_CHECKPOINT_COMMIT: RunAccountant.on_commit,
    E.EVENT_KIND_CHECKPOINT_FAILED: RunAccountant.on_commit,
    E.EVENT_KIND_STOP_REQUEST: RunAccountant.on_stop_request,
    E.EVENT_KIND_EXIT: RunAccountant.on_exit,
    E.EVENT_KIND_RUN_END: RunAccountant.on_run_end,
}


def _resolve(label: Label, incident_causes: dict[int, str]) -> str:
    if isinstance(label, str):
        return label
    if isinstance(label, OpenIncident):
        return incident_causes[id(label)]
    if label.incident is not None:
        return incident_causes[id(label.incident)]
    return "planned" if label.planned else PRODUCTIVE


def is_productive(label: Label) -> bool:
    """Whether time with this label counts as productive now (a tentative may still be rolled back)."""
    return isinstance(label, Tentative) and label.incident is None and not label.planned


def _incident_cause(inc: OpenIncident) -> str:
    return inc.cause or inc.fallback


def compute_goodput(
    events: Iterable[LogEntry],
    *,
    run: str = "",
    since: float | None = None,
    until: float | None = None,
) -> GoodputReport:
    """The goodput report for one run ("" : every run, summed) over [since, until].

    Pure: the same events give the same report. Events are ordered by (ts, seq). ``until``
    defaults to the last event's time; a run still going is counted up to it.

    * **Allocated**: RUN_START (or the run's first event) to RUN_END (or the end of the window).
    * **Productive**: training whose progress was kept (up to a committed checkpoint, and after the
      last commit that no failure has yet rolled back).
    * **Lost**, by cause: work a failure rolled back goes to the incident's cause (``hardware:<kind>``,
      ``network``, ``software``, ``control_plane``, ``unattributed[:first_exit]``; see
      ``controller.goodput.causes``); the fault to the first new step is ``restart:<phase>``, split at
      DETECTION, ATTRIBUTION, SPARE_TAKEN / QUARANTINE, PREFLIGHT_RESULT, LAUNCH, LOAD_DONE, FIRST_STEP
      (a run's first launch is ``startup:<phase>``); ``planned`` is a stop request's save, exit and
      relaunch; ``checkpoint_stall`` is ``save_duration_s`` before each CHECKPOINT_COMMIT / _FAILED.
    * The fault time is ``DETECTION.ts - detection.latency_s``. A second DETECTION before the
      relaunch is the same incident; one after opens a new incident with no rollback. A ``flag_only``
      DETECTION is no incident.
    """
    ordered = sorted(events, key=lambda e: (e.ts, e.seq))
    runs = sorted({e.run for e in ordered if e.run}) if not run else [run]
    window_end = until if until is not None else (ordered[-1].ts if ordered else 0.0)
    reports = [_one_run(r, [e for e in ordered if e.run == r], since, window_end) for r in runs]
    if len(reports) == 1:
        return reports[0]
    return merge_reports(reports, run=run or "*")


def _one_run(run: str, events: list[LogEntry], since: float | None, until: float) -> GoodputReport:
    acct = RunAccountant(run)
    for ev in events:
        if ev.ts > until:
            break
        acct.handle(ev)
    acct.finish(to_us(until))
    causes = {id(inc): _incident_cause(inc) for inc in acct.incidents}
    lo = to_us(since) if since is not None else None
    spans: list[Span] = []
    uncommitted = 0
    for s, e, lab in acct.spans:
        s2 = max(s, lo) if lo is not None else s
        if e <= s2:
            continue
        spans.append(Span(start_us=s2, end_us=e, label=_resolve(lab, causes)))
        if is_productive(lab) and isinstance(lab, Tentative) and not lab.kept:
            uncommitted += e - s2
    return _build_report(run, spans, acct, causes, uncommitted, lo)


def _build_report(
    run: str,
    spans: list[Span],
    acct: RunAccountant,
    causes: dict[int, str],
    uncommitted: int,
    lo: int | None,
) -> GoodputReport:
    lost: dict[str, int] = defaultdict(int)
    productive = 0
    for sp in spans:
        if sp.label == PRODUCTIVE:
            productive += sp.end_us - sp.start_us
        else:
            lost[sp.label] += sp.end_us - sp.start_us
    incidents = tuple(
        Incident(
            cause=causes[id(inc)],
            fault_ts=inc.fault_ts,
            detected_ts=inc.detected_ts,
            step=inc.step,
            nodes=inc.nodes,
            rollback_us=inc.rollback,
            phases_us={p: inc.phases.get(p, 0) for p in PHASES},
            first_step_ts=inc.first_step_ts,
        )
        for inc in acct.incidents
        if lo is None or to_us(inc.fault_ts) >= lo
    )
    start = spans[0].start_us if spans else (acct.start or 0)
    end = spans[-1].end_us if spans else start
    # an incident detected at the instant a run (re)started has no span after it: the report still
    # reaches it (a requeued run's RUN_START and a detection at the same time, say)
    end = max([end, *(to_us(i.detected_ts) for i in incidents)])
    return GoodputReport(
        run=run,
        start_ts=start / US,
        end_ts=end / US,
        allocated_us=sum(sp.end_us - sp.start_us for sp in spans),
        productive_us=productive,
        uncommitted_us=uncommitted,
        lost_by_cause_us=dict(lost),
        node_seconds=acct.node_seconds,
        incidents=incidents,
        preflight_rejections=acct.preflight_rejections,
        planned_stops=acct.planned_stops,
        weeks=weekly(spans),
        spans=tuple(spans),
        markers=tuple(acct.markers),
    )


def iso_week(ts_us: int) -> tuple[str, int]:
    """The ISO week label of an instant and the microsecond at which that week ends (UTC)."""
    day = dt.datetime.fromtimestamp(ts_us / US, tz=dt.UTC)
    year, week, weekday = day.isocalendar()
    monday = dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC) - dt.timedelta(days=weekday - 1)
    week_end = monday + dt.timedelta(days=7)
    return f"{year}-W{week:02d}", round(week_end.timestamp()) * US


def weekly(spans: Sequence[Span]) -> tuple[WeekFigures, ...]:
    """Allocated, productive and lost-by-cause time per ISO week; a span across Monday 00:00 UTC is split."""
    alloc: dict[str, int] = defaultdict(int)
    prod: dict[str, int] = defaultdict(int)
    lost: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for sp in spans:
        s = sp.start_us
        while s < sp.end_us:
            week, week_end = iso_week(s)
            e = min(sp.end_us, week_end)
            alloc[week] += e - s
            if sp.label == PRODUCTIVE:
                prod[week] += e - s
            else:
                lost[week][sp.label] += e - s
            s = e
    return tuple(
        WeekFigures(week=w, allocated_us=alloc[w], productive_us=prod[w], lost_by_cause_us=dict(lost[w]))
        for w in sorted(alloc)
    )


def merge_reports(reports: Sequence[GoodputReport], *, run: str) -> GoodputReport:
    """Several runs' reports summed (allocated time adds up across runs)."""
    lost: dict[str, int] = defaultdict(int)
    weeks_a: dict[str, int] = defaultdict(int)
    weeks_p: dict[str, int] = defaultdict(int)
    weeks_l: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in reports:
        for c, us in r.lost_by_cause_us.items():
            lost[c] += us
        for w in r.weeks:
            weeks_a[w.week] += w.allocated_us
            weeks_p[w.week] += w.productive_us
            for c, us in w.lost_by_cause_us.items():
                weeks_l[w.week][c] += us
    return GoodputReport(
        run=run,
        start_ts=min((r.start_ts for r in reports), default=0.0),
        end_ts=max((r.end_ts for r in reports), default=0.0),
        allocated_us=sum(r.allocated_us for r in reports),
        productive_us=sum(r.productive_us for r in reports),
        uncommitted_us=sum(r.uncommitted_us for r in reports),
        lost_by_cause_us=dict(lost),
        node_seconds=sum(r.node_seconds for r in reports),
        incidents=tuple(i for r in reports for i in r.incidents),
        preflight_rejections=sum(r.preflight_rejections for r in reports),
        planned_stops=sum(r.planned_stops for r in reports),
        weeks=tuple(
            WeekFigures(
                week=w, allocated_us=weeks_a[w], productive_us=weeks_p[w], lost_by_cause_us=dict(weeks_l[w])
            )
            for w in sorted(weeks_a)
        ),
        spans=(),
        markers=(),
    )
