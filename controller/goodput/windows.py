"""Windowed rates (last 1 h, 24 h, 7 d) and whole-run totals of every run, folded in as events are
appended (`RatesBook`): each event is folded in once with the report's own `RunAccountant` and
what falls out of a window is subtracted when it expires, so a scrape costs the new and expired
events, never a re-read of the log. All times are integer microseconds. Called by
`controller.goodput.metrics`' `WindowedRatesCollector` (the controller's /metrics).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from controller.goodput.report import (
    US,
    Label,
    OpenIncident,
    RunAccountant,
    Tentative,
    is_productive,
    percentile,
    to_us,
)
from runwarden.eventlog import LogEntry
from runwarden.v1 import events_pb2

E = events_pb2
HOUR_US = 3600 * US
WINDOWS: tuple[tuple[str, int], ...] = (("1h", HOUR_US), ("24h", 24 * HOUR_US), ("7d", 7 * 24 * HOUR_US))


class _Samples:
    """Points (t_us, value) in a window: a running sum and count, the max by a monotonic deque."""

    __slots__ = ("_maxq", "_points", "count", "total")

    def __init__(self) -> None:
        self._points: deque[tuple[int, int]] = deque()
        self._maxq: deque[tuple[int, int]] = deque()  # decreasing values: the window's max first
        self.total = 0
        self.count = 0

    def add(self, t: int, value: int) -> None:
        if self._points and t < self._points[-1][0]:
            t = self._points[-1][0]  # an out-of-order line: kept in order, so expiry stays a popleft
        self._points.append((t, value))
        self.total += value
        self.count += 1
        while self._maxq and self._maxq[-1][1] <= value:
            self._maxq.pop()
        self._maxq.append((t, value))

    def expire(self, cutoff: int) -> None:
        while self._points and self._points[0][0] <= cutoff:
            _, value = self._points.popleft()
            self.total -= value
            self.count -= 1
        while self._maxq and self._maxq[0][0] <= cutoff:
            self._maxq.popleft()

    @property
    def max(self) -> int:
        return self._maxq[0][1] if self._maxq else 0


class _Spans:
    """A window's labelled time: spans that still overlap it, and their sums."""

    __slots__ = ("allocated", "node_us", "productive", "spans", "tentative", "tentative_us")

    def __init__(self) -> None:
        self.spans: deque[tuple[int, int, Label, int]] = deque()
        self.allocated = 0
        self.productive = 0
        self.node_us = 0  # node-microseconds
        self.tentative: Tentative | None = None  # the current training span, the one a fault can roll back
        self.tentative_us = 0  # its length within the window

    def add(self, start: int, end: int, label: Label, nodes: int) -> None:
        d = end - start
        self.spans.append((start, end, label, nodes))
        self.allocated += d
        self.node_us += nodes * d
        if is_productive(label):
            self.productive += d
        if isinstance(label, Tentative):
            if label is not self.tentative:
                self.tentative, self.tentative_us = label, 0
            self.tentative_us += d

    def rolled_back(self, tentative: Tentative) -> None:
        if tentative is self.tentative:
            self.productive -= self.tentative_us

    def expire(self, cutoff: int) -> None:
        while self.spans and self.spans[0][1] <= cutoff:
            start, end, label, nodes = self.spans.popleft()
            d = end - start
            self.allocated -= d
            self.node_us -= nodes * d
            if is_productive(label):
                self.productive -= d
            if label is self.tentative:
                self.tentative_us -= d

    def sums(self, cutoff: int) -> tuple[int, int, int]:
        """(allocated, productive, node_us) after (cutoff): the first span may start before it."""
        allocated, productive, node_us = self.allocated, self.productive, self.node_us
        if self.spans and self.spans[0][0] < cutoff:
            start, _, label, nodes = self.spans[0]
            before = cutoff - start
            allocated -= before
            node_us -= nodes * before
            if is_productive(label):
                productive -= before
        return allocated, productive, node_us


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowRates:
    """One run's figures over one window (or, for ``window == "run"``, its whole life so far)."""

    window: str
    allocated_us: int  # integers, as in the report: goodput is the same division, to the last digit
    productive_us: int
    node_hours: float
    failures: int
    detect_minutes_mean: float
    detect_minutes_max: float
    first_step_minutes_mean: float
    first_step_minutes_max: float
    restarts: int
    preflight_rejections: int
    burn_in_rejections: int

    @property
    def goodput(self) -> float | None:
        """None when nothing was allocated in the window (no run going: no figure, not zero)."""
        return self.productive_us / self.allocated_us if self.allocated_us > 0 else None

    @property
    def allocated_s(self) -> float:
        return self.allocated_us / US

    @property
    def productive_s(self) -> float:
        return self.productive_us / US

    @property
    def failures_per_1000_node_hours(self) -> float | None:
        return 1000.0 * self.failures / self.node_hours if self.node_hours > 0 else None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunTotals:
    """The whole run so far: the report's headline figures, kept incrementally."""

    run: str
    allocated_us: int
    productive_us: int
    lost_by_cause_s: dict[str, float]
    node_hours: float
    failures: int
    detect_minutes: tuple[float, ...]
    first_step_minutes_mean: float
    preflight_rejections: int

    @property
    def goodput(self) -> float:
        return self.productive_us / self.allocated_us if self.allocated_us > 0 else 0.0

    @property
    def allocated_s(self) -> float:
        return self.allocated_us / US

    @property
    def productive_s(self) -> float:
        return self.productive_us / US

    @property
    def failures_per_1000_node_hours(self) -> float:
        return 1000.0 * self.failures / self.node_hours if self.node_hours > 0 else 0.0

    @property
    def detect_p90_minutes(self) -> float:
        return percentile(self.detect_minutes, 90)


class _Window:
    __slots__ = ("burn_in", "detect", "failures", "first_step", "length", "preflight", "restarts", "spans")

    def __init__(self, length: int) -> None:
        self.length = length
        self.spans = _Spans()
        self.failures = _Samples()
        self.detect = _Samples()
        self.first_step = _Samples()
        self.restarts = _Samples()
        self.preflight = _Samples()
        self.burn_in = _Samples()

    def samples(self) -> tuple[_Samples, ...]:
        return (self.failures, self.detect, self.first_step, self.restarts, self.preflight, self.burn_in)

    def expire(self, now: int) -> None:
        cutoff = now - self.length
        self.spans.expire(cutoff)
        for s in self.samples():
            s.expire(cutoff)


def is_burn_in(ev: LogEntry) -> bool:
    """A burn-in's PREFLIGHT_RESULT (not an attempt's): its mode, or the supervisor's own wording."""
    return ev.preflight.summary.mode == "burn_in" or ev.message.startswith("burn-in of ")


class RunRates:
    """One run's windows and totals. Fold its events in order; read at any ``now``."""

    def __init__(self, run: str, windows: tuple[tuple[str, int], ...] = WINDOWS) -> None:
        self.run = run
        self._acct = RunAccountant(run, history=False, sink=self)
        self._windows = {name: _Window(length) for name, length in windows}
        self._latest = 0  # the newest event time folded in (expiry never waits for a scrape)
        # whole-run totals
        self._allocated = 0
        self._productive = 0
        self._lost: dict[str, int] = defaultdict(int)  # fixed labels and uncommitted stops
        self._rolled: list[tuple[OpenIncident, int]] = []  # rollbacks: the cause may come later
        self._node_us = 0
        self._detect: list[int] = []
        self._first_step_us = 0
        self._first_steps = 0
        self._preflight_rejections = 0

    # -- SpanSink: the accountant's spans as they close -----------------------------------------

    def span(self, start_us: int, end_us: int, label: Label, nodes: int) -> None:
        for w in self._windows.values():
            w.spans.add(start_us, end_us, label, nodes)
        d = end_us - start_us
        self._allocated += d
        self._node_us += nodes * d
        if isinstance(label, str):
            self._lost[label] += d
        elif is_productive(label):
            self._productive += d

    def rolled_back(self, tentative: Tentative) -> None:
        for w in self._windows.values():
            w.spans.rolled_back(tentative)
        self._productive -= tentative.us
        if tentative.incident is not None:
            self._rolled.append((tentative.incident, tentative.us))
        else:
            self._lost["planned"] += tentative.us

    # -- events ----------------------------------------------------------------------------------

    def fold(self, ev: LogEntry) -> None:
        acct = self._acct
        incident, rejections = acct.incident, acct.preflight_rejections
        waiting = list(acct.awaiting_first_step) if ev.kind == E.EVENT_KIND_FIRST_STEP else []
        acct.handle(ev)
        t = to_us(ev.ts)
        self._latest = max(self._latest, t)
        points: list[tuple[str, int, int]] = []  # (sample, t_us, value)
        if acct.incident is not None and acct.incident is not incident:
            fault = to_us(acct.incident.fault_ts)
            detect = to_us(acct.incident.detected_ts) - fault
            points += [("failures", fault, 1), ("detect", t, detect)]
            self._detect.append(detect)
        for inc in waiting:
            if inc.first_step_ts is not None:
                took = to_us(inc.first_step_ts) - to_us(inc.fault_ts)
                points.append(("first_step", t, took))
                self._first_step_us += took
                self._first_steps += 1
        if acct.preflight_rejections > rejections:
            self._preflight_rejections += 1
            points.append(("burn_in" if is_burn_in(ev) else "preflight", t, 1))
        if ev.kind == E.EVENT_KIND_RESTART:
            points.append(("restarts", t, 1))
        for w in self._windows.values():
            for name, at, value in points:
                getattr(w, name).add(at, value)
            w.expire(self._latest)

    # -- reading ---------------------------------------------------------------------------------

    def _open(self, now: int) -> tuple[int, Label | None]:
        """The time since the last event, not yet a span: from the accountant's cursor to now."""
        label = self._acct.open_label()
        return (self._acct.cursor, label) if label is not None and now > self._acct.cursor else (now, None)

    def window(self, name: str, now_s: float) -> WindowRates:
        now = max(to_us(now_s), self._latest)  # a clock behind the newest event: read at that event
        w = self._windows[name]
        w.expire(now)
        cutoff = now - w.length
        allocated, productive, node_us = w.spans.sums(cutoff)
        start, label = self._open(now)
        if label is not None:
            d = now - max(start, cutoff)
            allocated += d
            node_us += self._acct.nodes_now * d
            productive += d if is_productive(label) else 0
        return WindowRates(
            window=name,
            allocated_us=allocated,
            productive_us=productive,
            node_hours=node_us / US / 3600,
            failures=w.failures.count,
            detect_minutes_mean=_mean_min(w.detect),
            detect_minutes_max=w.detect.max / US / 60,
            first_step_minutes_mean=_mean_min(w.first_step),
            first_step_minutes_max=w.first_step.max / US / 60,
            restarts=w.restarts.count,
            preflight_rejections=w.preflight.count,
            burn_in_rejections=w.burn_in.count,
        )

    def totals(self, now_s: float) -> RunTotals:
        now = max(to_us(now_s), self._latest)
        allocated, productive, node_us = self._allocated, self._productive, self._node_us
        lost = dict(self._lost)
        for inc, us in self._rolled:
            cause = inc.cause or inc.fallback
            lost[cause] = lost.get(cause, 0) + us
        start, label = self._open(now)
        if label is not None:
            allocated += now - start
            node_us += self._acct.nodes_now * (now - start)
            if isinstance(label, str):
                lost[label] = lost.get(label, 0) + now - start
            elif is_productive(label):
                productive += now - start
        return RunTotals(
            run=self.run,
            allocated_us=allocated,
            productive_us=productive,
            lost_by_cause_s={c: us / US for c, us in lost.items() if us > 0},
            node_hours=node_us / US / 3600,
            failures=len(self._detect),
            detect_minutes=tuple(d / US / 60 for d in self._detect),
            first_step_minutes_mean=self._first_step_us / self._first_steps / US / 60
            if self._first_steps
            else 0.0,
            preflight_rejections=self._preflight_rejections,
        )

    def window_names(self) -> tuple[str, ...]:
        return tuple(self._windows)


def _mean_min(s: _Samples) -> float:
    return s.total / s.count / US / 60 if s.count else 0.0


class RatesBook:
    """Every run's RunRates, fed one event at a time (events without a run are not a run's).

    Per run and window (half-open (now - length, now]): allocated, productive and node time (goodput,
    failures per 1,000 node-hours; a rollback is subtracted from each window's productive time at once);
    failures at the fault time, minutes to detect, minutes from the fault to the first new step,
    restarts, preflight rejections and burn-in rejections (`is_burn_in`). Whole-run totals are the
    report's figures (``runwarden_goodput_*``), kept the same way.
    """

    def __init__(self, windows: tuple[tuple[str, int], ...] = WINDOWS) -> None:
        self._windows = windows
        self.runs: dict[str, RunRates] = {}

    def fold(self, ev: LogEntry) -> None:
        if not ev.run:
            return
        rates = self.runs.get(ev.run)
        if rates is None:
            rates = self.runs[ev.run] = RunRates(ev.run, self._windows)
        rates.fold(ev)
