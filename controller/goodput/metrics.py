"""The goodput figures as Prometheus metrics, from the same report the CLI and the API show.

`GoodputCollector` computes the reports when Prometheus scrapes (a custom collector, so nothing
goes stale between scrapes); `register_goodput_metrics` hooks it into a registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CollectorRegistry, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controller.goodput.report import US, GoodputReport, percentile

ReportSource = Callable[[], Sequence[GoodputReport]]


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
