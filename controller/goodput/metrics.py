"""The goodput figures as Prometheus metrics.

* `WindowedRatesCollector` (what the controller serves): windowed rates (1 h, 24 h, 7 d) and the
  whole-run figures of every run in the event log, folded in as lines are appended
  (`controller.goodput.windows`); a scrape never re-reads the log.
* `GoodputCollector`: the figures of reports computed by the caller (`register_goodput_metrics`),
  for a tool that already holds a report (the same names as the whole-run series above).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controller.goodput.report import US, GoodputReport, percentile
from controller.goodput.tail import LogTail
from controller.goodput.windows import RatesBook, RunTotals, WindowRates
from runwarden.eventlog import LogEntry

ReportSource = Callable[[], Sequence[GoodputReport]]
# Lines folded per hold of the collector's lock (~5,000 events, well under a second): a scrape
# waits at most that long behind the follower thread working through a long backlog.
HOLD_BYTES = 1 << 20


class GoodputCollector(Collector):
    """Yields runwarden_goodput_* metrics, one series per run (and per cause / week)."""

    def __init__(self, source: ReportSource) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        reports = list(self._source())
        ratio = GaugeMetricFamily(
            "runwarden_goodput_ratio", "Productive / allocated time (0..1).", labels=["run"]
        )
        alloc = GaugeMetricFamily(
            "runwarden_goodput_allocated_seconds", "Allocated wall-clock time.", labels=["run"]
        )
        prod = GaugeMetricFamily(
            "runwarden_goodput_productive_seconds", "Time whose progress was kept.", labels=["run"]
        )
        lost = GaugeMetricFamily(
            "runwarden_goodput_lost_seconds", "Lost time by cause.", labels=["run", "cause"]
        )
        failures = GaugeMetricFamily("runwarden_goodput_failures", "Unplanned interruptions.", labels=["run"])
        rate = GaugeMetricFamily(
            "runwarden_goodput_failures_per_1000_node_hours", "Failure rate.", labels=["run"]
        )
        detect = GaugeMetricFamily(
            "runwarden_goodput_detect_minutes", "Minutes from fault to detection.", labels=["run", "stat"]
        )
        first = GaugeMetricFamily(
            "runwarden_goodput_first_step_minutes_mean",
            "Minutes from fault to first new step.",
            labels=["run"],
        )
        rejections = GaugeMetricFamily(
            "runwarden_goodput_preflight_rejections", "Preflight rejections.", labels=["run"]
        )
        for r in reports:
            ratio.add_metric([r.run], r.goodput)
            alloc.add_metric([r.run], r.allocated_us / US)
            prod.add_metric([r.run], r.productive_us / US)
            for cause, us in sorted(r.lost_by_cause_us.items()):
                lost.add_metric([r.run, cause], us / US)
            failures.add_metric([r.run], r.failures)
            rate.add_metric([r.run], r.failures_per_1000_node_hours)
            d = r.detect_minutes
            detect.add_metric([r.run, "mean"], sum(d) / len(d) if d else 0.0)
            detect.add_metric([r.run, "p90"], percentile(d, 90))
            f = r.first_step_minutes
            first.add_metric([r.run], sum(f) / len(f) if f else 0.0)
            rejections.add_metric([r.run], r.preflight_rejections)
        yield from (ratio, alloc, prod, lost, failures, rate, detect, first, rejections)


def register_goodput_metrics(registry: CollectorRegistry, source: ReportSource) -> GoodputCollector:
    collector = GoodputCollector(source)
    registry.register(collector)
    return collector


class WindowedRatesCollector(Collector):
    """The windowed rates and whole-run totals of every run in an event-log file, kept incrementally.

    Each scrape folds in the lines appended since the previous scrape (``LogTail``), expires what
    left each window, and reads the sums: its cost follows the new events, not the log's length.
    The whole-run series keep the names of ``GoodputCollector`` (dashboards do not change); the
    windowed ones are ``runwarden_window_*{run, window}``. A window with nothing allocated in it has
    no goodput or failure-rate sample (absent, not 0: no alert fires on a run that is not going).
    """

    def __init__(self, event_log: str | os.PathLike[str], *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()  # scrapes may overlap (two Prometheus servers)
        self._book = RatesBook()
        self._tail = LogTail(event_log, self._fold, self._reset)

    def _fold(self, ev: LogEntry) -> None:
        self._book.fold(ev)

    def _reset(self) -> None:
        self._book = RatesBook()

    def catch_up(self) -> None:
        """Fold in everything appended so far, a chunk per lock hold (scrapes get in between)."""
        while True:
            with self._lock:
                if self._tail.poll(HOLD_BYTES) == 0:
                    return

    def follow(self, stop: threading.Event, interval_s: float = 1.0) -> None:
        """Keep folding new lines in until ``stop`` is set (the controller's metrics thread)."""
        while not stop.is_set():
            self.catch_up()
            stop.wait(interval_s)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            self._tail.poll(HOLD_BYTES)  # bounded: a long backlog is left to the follower thread
            backlog = self._tail.backlog_bytes
            bad = self._tail.bad_lines
            # Still folding a long log in (a restart on months of events): the figures so far
            # describe the past and, read at now, would mislead an alert. Absent until caught up.
            runs = list(self._book.runs.values()) if backlog == 0 else []
            now = self._clock()
            totals = [r.totals(now) for r in runs]
            windows = [(r.run, r.window(name, now)) for r in runs for name in r.window_names()]
        if runs:
            yield from _total_families(totals)
            yield from _window_families(windows)
        behind = GaugeMetricFamily(
            "runwarden_event_log_backlog_bytes",
            "Event-log bytes not folded in yet (the rates are absent until this is 0).",
        )
        behind.add_metric([], backlog)
        yield behind
        skipped = CounterMetricFamily(
            "runwarden_event_log_bad_lines",
            "Event-log lines skipped as unreadable (see the controller's log).",
        )
        skipped.add_metric([], bad)
        yield skipped


def _total_families(totals: Sequence[RunTotals]) -> Iterator[Metric]:
    ratio = GaugeMetricFamily(
        "runwarden_goodput_ratio", "Productive / allocated time (0..1).", labels=["run"]
    )
    alloc = GaugeMetricFamily(
        "runwarden_goodput_allocated_seconds", "Allocated wall-clock time.", labels=["run"]
    )
    prod = GaugeMetricFamily(
        "runwarden_goodput_productive_seconds", "Time whose progress was kept.", labels=["run"]
    )
    lost = GaugeMetricFamily("runwarden_goodput_lost_seconds", "Lost time by cause.", labels=["run", "cause"])
    failures = GaugeMetricFamily("runwarden_goodput_failures", "Unplanned interruptions.", labels=["run"])
    rate = GaugeMetricFamily(
        "runwarden_goodput_failures_per_1000_node_hours", "Failure rate.", labels=["run"]
    )
    detect = GaugeMetricFamily(
        "runwarden_goodput_detect_minutes", "Minutes from fault to detection.", labels=["run", "stat"]
    )
    first = GaugeMetricFamily(
        "runwarden_goodput_first_step_minutes_mean", "Minutes from fault to first new step.", labels=["run"]
    )
    rejections = GaugeMetricFamily(
        "runwarden_goodput_preflight_rejections", "Preflight rejections.", labels=["run"]
    )
    for t in totals:
        ratio.add_metric([t.run], t.goodput)
        alloc.add_metric([t.run], t.allocated_s)
        prod.add_metric([t.run], t.productive_s)
        for cause, seconds in sorted(t.lost_by_cause_s.items()):
            lost.add_metric([t.run, cause], seconds)
        failures.add_metric([t.run], t.failures)
        rate.add_metric([t.run], t.failures_per_1000_node_hours)
        d = t.detect_minutes
        detect.add_metric([t.run, "mean"], sum(d) / len(d) if d else 0.0)
        detect.add_metric([t.run, "p90"], t.detect_p90_minutes)
        first.add_metric([t.run], t.first_step_minutes_mean)
        rejections.add_metric([t.run], t.preflight_rejections)
    yield from (ratio, alloc, prod, lost, failures, rate, detect, first, rejections)


def _window_families(rows: Sequence[tuple[str, WindowRates]]) -> Iterator[Metric]:
    labels = ["run", "window"]

    def gauge(name: str, doc: str, extra: Sequence[str] = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(f"runwarden_window_{name}", doc, labels=[*labels, *extra])

    goodput = gauge("goodput_ratio", "Goodput over the window (absent when nothing was allocated in it).")
    alloc = gauge("allocated_seconds", "Allocated time within the window.")
    node_hours = gauge("node_hours", "Node-hours within the window.")
    failures = gauge("failures", "Unplanned interruptions whose fault falls in the window.")
    rate = gauge(
        "failures_per_1000_node_hours", "Failures per 1,000 node-hours (absent with no node-hours in it)."
    )
    detect = gauge(
        "detect_minutes", "Minutes from fault to detection, of detections in the window.", ["stat"]
    )
    first = gauge(
        "first_step_minutes",
        "Minutes from fault to the first new step, of first steps in the window.",
        ["stat"],
    )
    restarts = gauge("restarts", "Relaunches the supervisor decided (RESTART events) in the window.")
    preflight = gauge("preflight_rejections", "Nodes an attempt's preflight rejected in the window.")
    burn_in = gauge("burn_in_rejections", "Burn-in runs that failed in the window.")
    for run, w in rows:
        key = [run, w.window]
        if w.goodput is not None:
            goodput.add_metric(key, w.goodput)
        if w.failures_per_1000_node_hours is not None:
            rate.add_metric(key, w.failures_per_1000_node_hours)
        alloc.add_metric(key, w.allocated_s)
        node_hours.add_metric(key, w.node_hours)
        failures.add_metric(key, w.failures)
        detect.add_metric([*key, "mean"], w.detect_minutes_mean)
        detect.add_metric([*key, "max"], w.detect_minutes_max)
        first.add_metric([*key, "mean"], w.first_step_minutes_mean)
        first.add_metric([*key, "max"], w.first_step_minutes_max)
        restarts.add_metric(key, w.restarts)
        preflight.add_metric(key, w.preflight_rejections)
        burn_in.add_metric(key, w.burn_in_rejections)
    yield from (goodput, alloc, node_hours, failures, rate, detect, first, restarts, preflight, burn_in)
