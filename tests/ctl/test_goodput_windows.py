"""Windowed rates (1 h / 24 h / 7 d) folded in event by event, read at injected times; the log tail
that feeds them; and the Prometheus collector the controller serves."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from controller.goodput.metrics import WindowedRatesCollector
from controller.goodput.report import US, compute_goodput, to_us
from controller.goodput.tail import LogTail
from controller.goodput.windows import RatesBook, RunRates
from runwarden.eventlog import MAX_LINE_BYTES, LogEntry, encode_entry
from runwarden.v1 import common_pb2, events_pb2
from testbed.etcd_server import free_port

from .logbuild import LogBuilder
from .test_goodput_outputs import long_run
from .test_goodput_properties import event_logs
from .test_goodput_weekly import four_weeks

E = events_pb2
T0 = 1_764_547_200.0
H = 3600.0


def folded(b: LogBuilder, until: float | None = None) -> RunRates:
    book = RatesBook()
    for ev in b.events:
        if until is None or ev.ts <= until:
            book.fold(ev)
    return book.runs[b.run]


def test_a_fault_counts_in_each_window_until_it_expires() -> None:
    b = LogBuilder(nodes=10)
    b.startup(T0)  # first step at T0 + 40
    b.commit(T0 + 1200, step=100, save_s=20)
    b.detect(T0 + 1800, latency_s=60)  # the fault at T0 + 1740: 540 s of training rolled back
    b.attribute(T0 + 1810)
    b.preflight(T0 + 1900)
    b.launch(T0 + 1910, resume_step=100)
    b._add(T0 + 1905, E.EVENT_KIND_RESTART)
    b.first_step(T0 + 2340)  # 10 min after the fault
    rates = folded(b)
    at = rates.window("1h", T0 + 3000)
    assert at.failures == 1 and at.restarts == 1
    assert at.detect_minutes_mean == at.detect_minutes_max == 1.0
    assert at.first_step_minutes_mean == at.first_step_minutes_max == 10.0
    assert at.allocated_s == 3000 and at.node_hours == pytest.approx(10 * 3000 / H)
    # productive: 40..1180 kept by the commit, 2340..3000 still going; the rest lost
    assert at.productive_s == (1180 - 40) + (3000 - 2340)
    assert at.failures_per_1000_node_hours == pytest.approx(1000 / (10 * 3000 / H))
    # an hour after the fault it leaves the 1 h window (its detection, a minute later, not yet)
    later = rates.window("1h", T0 + 1740 + H + 1)
    assert later.failures == 0 and later.restarts == 1 and later.detect_minutes_max == 1.0
    assert later.allocated_s == H and later.productive_s == 5341 - 2340  # the restart is still in it
    gone = rates.window("1h", T0 + 2340 + H + 1)
    assert (gone.failures, gone.restarts, gone.detect_minutes_max, gone.first_step_minutes_max) == (
        0,
        0,
        0,
        0,
    )
    assert gone.productive_s == gone.allocated_s == H and gone.detect_minutes_mean == 0.0
    day = rates.window("24h", T0 + 1740 + H + 1)
    assert day.failures == 1 and day.first_step_minutes_max == 10.0
    week = rates.window("7d", T0 + 8 * 24 * H)  # a week and a day on, the run still going
    assert week.failures == 0 and week.goodput == 1.0 and week.allocated_s == 7 * 24 * H


def test_rollback_after_expiry_takes_only_what_is_left_in_the_window() -> None:
    b = LogBuilder(nodes=2)
    b.startup(T0)
    b.commit(T0 + 100, step=10, save_s=0)
    b.detect(T0 + 3 * H, latency_s=0, node="n1")  # 100 .. 3 h: uncommitted, rolled back
    rates = folded(b)
    w = rates.window("1h", T0 + 3 * H + 60)
    assert w.allocated_s == H and w.productive_s == 0.0 and w.goodput == 0.0
    assert rates.window("24h", T0 + 3 * H + 60).productive_s == 60  # 40 .. 100


def test_idle_window_has_no_goodput_and_rejections_are_told_apart() -> None:
    b = LogBuilder(nodes=4)
    b.start(T0)
    b.preflight(T0 + 10, node="n1", passed=False)
    b._add(
        T0 + 20,
        E.EVENT_KIND_PREFLIGHT_RESULT,
        message="burn-in of n7: failed (0/2 in a row); failed gpu.matmul",
        preflight=E.PreflightDetail(
            node="n7", summary=common_pb2.PreflightSummary(mode="full", passed=False, fail_count=1)
        ),
    )
    b._add(
        T0 + 30,
        E.EVENT_KIND_PREFLIGHT_RESULT,
        preflight=E.PreflightDetail(
            node="n8", summary=common_pb2.PreflightSummary(mode="burn_in", passed=False)
        ),
    )
    b.preflight(T0 + 40)
    b.end(T0 + 100, outcome="stopped")
    rates = folded(b)
    w = rates.window("1h", T0 + 200)
    assert (w.preflight_rejections, w.burn_in_rejections) == (1, 2)
    assert rates.totals(T0 + 200).preflight_rejections == 3 == compute_goodput(b.events).preflight_rejections
    idle = rates.window("1h", T0 + 100 + 2 * H)
    assert idle.allocated_s == 0 and idle.goodput is None and idle.failures_per_1000_node_hours is None


def test_totals_equal_the_report() -> None:
    for b in (long_run(), four_weeks()):
        report = compute_goodput(b.events)
        totals = folded(b).totals(b.events[-1].ts)
        assert totals.allocated_s == report.allocated_us / US
        assert totals.productive_s == report.productive_us / US
        assert totals.lost_by_cause_s == {c: us / US for c, us in report.lost_by_cause_us.items() if us}
        assert totals.failures == report.failures
        assert totals.detect_p90_minutes == pytest.approx(report.to_proto().detect_p90_min)
        assert totals.first_step_minutes_mean == pytest.approx(report.to_proto().first_step_mean_min)
        assert totals.node_hours == pytest.approx(report.node_seconds / H)


@given(event_logs(), st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=4))
@settings(max_examples=80, deadline=None)
def test_windows_equal_the_report_clipped_to_them(b: LogBuilder, fracs: list[float]) -> None:
    """Folded once, read at several times: each window is the report over (now - length, now], the
    totals the report up to now."""
    windows = (("a", 1_234_567_891), ("b", 9_876_543_210), ("c", 45_678_901_234))  # microseconds
    first, last = b.events[0].ts, b.events[-1].ts
    book = RatesBook(windows)
    pending = list(b.events)
    for frac in sorted(fracs):
        now = first + frac * (last - first)
        while pending and pending[0].ts <= now:
            book.fold(pending.pop(0))
        rates = book.runs[b.run]
        for name, length in windows:
            w = rates.window(name, now)
            since = (to_us(now) - length) / US  # the window's own cutoff, not a float sum
            want = compute_goodput(b.events, since=since, until=now)
            assert (w.allocated_us, w.productive_us) == (want.allocated_us, want.productive_us)
        whole = compute_goodput(b.events, until=now)
        totals = rates.totals(now)
        assert (totals.allocated_us, totals.productive_us, totals.failures) == (
            whole.allocated_us,
            whole.productive_us,
            whole.failures,
        )
        assert totals.lost_by_cause_s == {c: us / US for c, us in whole.lost_by_cause_us.items() if us}


def _write(path: Path, events: list[LogEntry], mode: str = "ab") -> None:
    with open(path, mode) as f:
        f.write(b"".join(encode_entry(e) for e in events))


def test_tail_reads_only_new_complete_lines(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    seen: list[int] = []
    resets: list[bool] = []
    tail = LogTail(log, lambda ev: seen.append(ev.seq), lambda: resets.append(True))
    assert tail.poll() == 0  # no file yet
    events = long_run().events
    _write(log, events[:3])
    line = encode_entry(events[3])
    with open(log, "ab") as f:
        f.write(line[:20])  # being written
    tail.poll()
    assert seen == [1, 2, 3]
    with open(log, "ab") as f:
        f.write(line[20:] + b"not json\n" + encode_entry(events[1]))  # then a bad line, a repeated seq
    tail.poll()
    assert seen == [1, 2, 3, 4] and tail.bad_lines == 2
    with open(log, "ab") as f:
        f.write(encode_entry(events[4])[:30])  # a torn tail the writer cuts off when it reopens
    tail.poll()
    data = log.read_bytes()
    log.write_bytes(data[: data.rfind(b"\n") + 1])
    _write(log, events[5:7])
    tail.poll()
    assert seen == [1, 2, 3, 4, 6, 7] and not resets
    log.unlink()  # replaced: read again from the start
    _write(log, events[:2])
    tail.poll()
    assert resets == [True] and seen[-2:] == [1, 2]


def test_collector_serves_windows_without_rereading_the_log(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    b = long_run()
    _write(log, b.events[:-1])
    now = [b.events[-2].ts + 60]
    collector = WindowedRatesCollector(log, clock=lambda: now[0])
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert 'runwarden_window_failures{run="llm",window="24h"} 2.0' in text
    assert 'runwarden_goodput_failures{run="llm"} 2.0' in text
    assert 'runwarden_window_detect_minutes{run="llm",stat="max",window="24h"} 0.75' in text
    assert "runwarden_event_log_bad_lines_total 0.0" in text
    # Overwrite what was read (same size, same file): a scrape that re-read the log would see only
    # bad lines. The incremental one reads just the line appended since.
    size = log.stat().st_size
    with open(log, "r+b") as f:
        f.write(b"x" * (size - 1) + b"\n")
    _write(log, b.events[-1:])  # RUN_END
    now[0] = b.events[-1].ts + 2 * H
    text = generate_latest(registry).decode()
    assert "runwarden_event_log_bad_lines_total 0.0" in text
    assert 'runwarden_window_failures{run="llm",window="1h"} 0.0' in text
    assert 'runwarden_window_goodput_ratio{run="llm",window="1h"}' not in text  # the run is over
    assert 'runwarden_window_goodput_ratio{run="llm",window="24h"}' in text
    report = compute_goodput(b.events)
    assert f'runwarden_goodput_ratio{{run="llm"}} {report.goodput!r}' in text


def test_tail_skips_an_overlong_line(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    seen: list[int] = []
    tail = LogTail(log, lambda ev: seen.append(ev.seq), lambda: None)
    events = long_run().events
    log.write_bytes(b"x" * (MAX_LINE_BYTES + 10))
    tail.poll()
    for _ in range(2):  # it goes on past another read: still the same line, reported once
        with open(log, "ab") as f:
            f.write(b"x" * (MAX_LINE_BYTES + 10))
        tail.poll()
    with open(log, "ab") as f:
        f.write(b"yyy\n" + encode_entry(events[0]))
    tail.poll()
    assert seen == [1] and tail.bad_lines == 1 and tail.backlog_bytes == 0


def test_the_controller_serves_them_on_loopback_by_default(tmp_path: Path) -> None:
    from controller.live.config import load_controller_config
    from controller.live.main import _serve_metrics

    cfg = load_controller_config(
        None,
        {
            "controller.run": "r",
            "controller.nodes": 1,
            "controller.command": ["x"],
            "controller.run_dir": str(tmp_path),
        },
    )
    assert cfg.run.metrics_address == "127.0.0.1:9401"
    log = tmp_path / "events.jsonl"
    _write(log, long_run().events)
    port = free_port()
    close = _serve_metrics(f"127.0.0.1:{port}", log)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        close()
    assert 'runwarden_goodput_failures{run="llm"} 2.0' in text and 'window="7d"' in text
    assert _serve_metrics("0", log) is None and _serve_metrics("127.0.0.1:0", log) is None  # off, as ""
    for bad in ("localhost", "127.0.0.1:http", "127.0.0.1:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            _serve_metrics(bad, log)


def test_no_rates_while_a_backlog_is_being_folded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import controller.goodput.metrics as metrics

    monkeypatch.setattr(metrics, "HOLD_BYTES", 2000)  # a scrape folds ~5 lines: the rest is a backlog
    log = tmp_path / "events.jsonl"
    b = long_run()
    _write(log, b.events)
    collector = WindowedRatesCollector(log, clock=lambda: b.events[-1].ts)
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert "runwarden_goodput_ratio{" not in text and "runwarden_window_" not in text
    assert "runwarden_event_log_backlog_bytes 0.0" not in text and "runwarden_event_log_backlog_bytes" in text
    collector.catch_up()
    text = generate_latest(registry).decode()
    assert (
        "runwarden_event_log_backlog_bytes 0.0" in text
        and 'runwarden_goodput_failures{run="llm"} 2.0' in text
    )
