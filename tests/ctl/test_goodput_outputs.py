"""The PNG chart and the Prometheus export show the same report as the CLI."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from controller.goodput.chart import render_png
from controller.goodput.metrics import register_goodput_metrics
from controller.goodput.report import compute_goodput
from runwarden.v1 import common_pb2

from .conftest import incident_log
from .logbuild import LogBuilder

T0 = 1_764_547_200.0


def long_run() -> LogBuilder:
    """Eight hours: two faults (one during the restart), a planned stop, commits every 30 min."""
    b = LogBuilder(nodes=64)
    b.startup(T0)
    for k in range(1, 9):
        b.commit(T0 + 40 + 1800 * k, step=500 * k, save_s=25)
    t = T0 + 40 + 1800 * 8 + 1200
    b.detect(t, latency_s=45)
    b.attribute(t + 20)
    b.quarantine(t + 25)
    b.spare(t + 30)
    b.preflight(t + 130, "n64")
    b.launch(t + 150, resume_step=4000)
    b.detect(t + 300, latency_s=5)
    b.attribute(t + 301, kind=common_pb2.EVIDENCE_KIND_NETWORK)
    b.preflight(t + 400)
    b.launch(t + 410, resume_step=4000)
    b.load_done(t + 600)
    b.first_step(t + 700)
    b.stop(t + 3000)
    b.commit(t + 3060, step=5000, save_s=40)
    b.exit(t + 3070)
    b.launch(t + 3900, resume_step=5000)
    b.load_done(t + 4100)
    b.first_step(t + 4200)
    b.end(t + 7000)
    return b


def test_png_is_written_and_non_empty(tmp_path: Path) -> None:
    report = compute_goodput(long_run().events)
    assert report.failures == 2 and report.planned_stops == 1
    out = render_png(report, tmp_path / "run.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 40_000
    quiet = LogBuilder()
    quiet.startup(T0)
    quiet.end(T0 + 60)
    assert render_png(compute_goodput(quiet.events), tmp_path / "quiet.png").stat().st_size > 10_000


def test_prometheus_export_matches_the_report() -> None:
    registry = CollectorRegistry()
    report = compute_goodput(incident_log().events)
    register_goodput_metrics(registry, lambda: [report])
    text = generate_latest(registry).decode()
    assert 'runwarden_goodput_ratio{run="llm"} 0.31666666666666665' in text
    assert 'runwarden_goodput_lost_seconds{cause="hardware:xid",run="llm"} 90.0' in text
    assert 'runwarden_goodput_lost_seconds{cause="restart:preflight",run="llm"} 19.0' in text
    assert 'runwarden_goodput_failures{run="llm"} 1.0' in text
    assert 'runwarden_goodput_detect_minutes{run="llm",stat="p90"} 0.16666666666666666' in text
    assert 'runwarden_goodput_failures_per_1000_node_hours{run="llm"} 3000.0' in text
