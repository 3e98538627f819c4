"""The weekly report: a week x cause table over a synthetic 4-week log, in the CLI, --json, the PNG
and the API, adding up exactly per ISO week (UTC)."""

from __future__ import annotations

import datetime as dt
import json
from collections import defaultdict
from pathlib import Path

import grpc
import pytest

from controller.api.server import build_server
from controller.api.store_view import StoreBackedView
from controller.ctl.format import Painter
from controller.ctl.goodput import _hours, _pct
from controller.ctl.main import main
from controller.goodput.chart import render_weekly_png
from controller.goodput.report import US, compute_goodput, normalise_by
from runwarden.eventlog import encode_entry
from runwarden.store import Store
from runwarden.v1 import common_pb2, controller_pb2, controller_pb2_grpc, events_pb2

from .logbuild import LogBuilder

E = events_pb2
H = 3600.0
DAY = 24 * H
# Sunday 2026-03-01 18:00 UTC (ISO week 2026-W09): the run starts 6 h before the first Monday.
START = dt.datetime(2026, 3, 1, 18, tzinfo=dt.UTC).timestamp()
MONDAY = [START + 6 * H + k * 7 * DAY for k in range(5)]  # 00:00 UTC of W10 .. W14


def four_weeks() -> LogBuilder:
    """28 days: hourly commits, one incident a week (one rollback and one restart across a Monday),
    a planned stop, a failed save, and the run's end on Sunday 2026-03-29 18:00."""
    b = LogBuilder(nodes=16)
    b.startup(START)
    t = START + 40
    for k in range(1, 6):  # commits up to Sunday 23:00
        b.commit(t + k * H - 40, step=100 * k, save_s=30)
    # W09 -> W10: the last commit at 23:00, a fault at Monday 01:00: 1 h rolled back, half in each week
    b.detect(MONDAY[0] + H, latency_s=0)
    b.attribute(MONDAY[0] + H + 30)
    b.quarantine(MONDAY[0] + H + 40)
    b.spare(MONDAY[0] + H + 45)
    b.preflight(MONDAY[0] + H + 120, "n4")
    b.launch(MONDAY[0] + H + 130, resume_step=500)
    b.load_done(MONDAY[0] + H + 200)
    b.first_step(MONDAY[0] + H + 260)
    t = MONDAY[0] + H + 260
    for k in range(1, 24 * 6):
        b.commit(t + k * H, step=500 + 100 * k, save_s=30)
    # Tuesday of W11: a software crash (no suspect)
    t = MONDAY[1] + DAY + 600
    b.detect(t, latency_s=20)
    b.attribute(t + 10, node=None)
    b.preflight(t + 60)
    b.launch(t + 70, resume_step=b.step)
    b.first_step(t + 200)
    for k in range(1, 24 * 5):
        b.commit(t + 200 + k * H, step=b.step + 100, save_s=30)
    # W11 -> W12: detected at Sunday 23:59, its restart runs on past Monday 00:00
    t = MONDAY[2] - 60
    b.detect(t, latency_s=120)
    b.attribute(t + 30, kind=common_pb2.EVIDENCE_KIND_NETWORK)
    b.preflight(t + 180)
    b.launch(t + 200, resume_step=b.step)
    b.load_done(t + 300)
    b.first_step(t + 400)
    for k in range(1, 24 * 3):
        b.commit(t + 400 + k * H, step=b.step + 100, save_s=30)
    # W12: a failed save, then a planned stop
    t = MONDAY[2] + 3 * DAY + 500
    b._add(
        t, E.EVENT_KIND_CHECKPOINT_FAILED, checkpoint=E.CheckpointDetail(save_duration_s=300, error="full")
    )
    b.stop(t + 600)
    b.commit(t + 660, step=b.step + 50, save_s=40)
    b.exit(t + 670)
    b.launch(t + 1500, resume_step=b.step)
    b.first_step(t + 1700)
    for k in range(1, 24 * 10):
        b.commit(t + 1700 + k * H, step=b.step + 100, save_s=30)
    b.end(MONDAY[3] + 6 * DAY + 18 * H)
    return b


def test_every_week_adds_up_exactly_and_splits_at_monday() -> None:
    report = compute_goodput(four_weeks().events)
    weeks = {w.week: w for w in report.weeks}
    assert list(weeks) == ["2026-W09", "2026-W10", "2026-W11", "2026-W12", "2026-W13"]
    for w in report.weeks:
        assert w.productive_us + w.lost_us == w.allocated_us
        assert all(us > 0 for us in w.lost_by_cause_us.values())
    assert weeks["2026-W09"].allocated_us == 6 * H * US  # Sunday 18:00 -> Monday 00:00
    assert all(weeks[w].allocated_us == 7 * DAY * US for w in ("2026-W10", "2026-W11", "2026-W12"))
    assert weeks["2026-W13"].allocated_us == (6 * DAY + 18 * H) * US
    # the weeks add up to the whole report, cause by cause
    total: dict[str, int] = defaultdict(int)
    for w in report.weeks:
        for cause, us in w.lost_by_cause_us.items():
            total[cause] += us
    assert dict(total) == {c: us for c, us in report.lost_by_cause_us.items() if us}
    assert sum(w.allocated_us for w in report.weeks) == report.allocated_us
    assert sum(w.productive_us for w in report.weeks) == report.productive_us
    # the rollback across the first Monday: 23:00 -> 01:00, one hour in each week
    assert weeks["2026-W09"].lost_by_cause_us["hardware:xid"] == 1 * H * US
    assert weeks["2026-W10"].lost_by_cause_us["hardware:xid"] == 1 * H * US
    # detected at Sunday 23:59 with 120 s latency (the fault at 23:57), attributed at 23:59:30, preflight
    # done at 00:02: its preflight phase is 30 s in W11 and 120 s in W12 (Tuesday's crash adds 20, 10, 50 s)
    assert weeks["2026-W11"].lost_by_cause_us["restart:detect"] == (20 + 120) * US
    assert weeks["2026-W11"].lost_by_cause_us["restart:attribute"] == (10 + 30) * US
    assert weeks["2026-W11"].lost_by_cause_us["restart:preflight"] == (50 + 30) * US
    assert weeks["2026-W12"].lost_by_cause_us["restart:preflight"] == 120 * US
    assert "restart:attribute" not in weeks["2026-W12"].lost_by_cause_us
    assert weeks["2026-W11"].lost_by_cause_us["software"] > 0
    assert weeks["2026-W12"].lost_by_cause_us["planned"] > 0
    assert weeks["2026-W12"].lost_by_cause_us["checkpoint_stall"] > 0


def _write(tmp_path: Path) -> Path:
    log = tmp_path / "events.jsonl"
    log.write_bytes(b"".join(encode_entry(e) for e in four_weeks().events))
    return log


def test_table_and_json_agree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = _write(tmp_path)
    assert main(["--color", "never", "goodput", "--log", str(log), "--by", "week", "--by", "cause"]) == 0
    text = capsys.readouterr().out
    assert main(["goodput", "--log", str(log), "--by", "cause", "--by", "week", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    expected: list[list[str]] = []
    for w in data["weeks"]:
        causes = w.get("lost_by_cause", [])
        assert w["productive_s"] + w["lost_s"] == pytest.approx(w["allocated_s"], abs=1e-6)
        assert sum(c["seconds"] for c in causes) == pytest.approx(w["lost_s"], abs=1e-6)
        hours = [_hours(w[k]) for k in ("allocated_s", "productive_s", "lost_s")]
        expected.append([w["week"], *" ".join(hours).split(), _pct(w["goodput"])])
        expected.extend(
            [c["cause"], *_hours(c["seconds"]).split(), _pct(c["seconds"] / w["lost_s"])] for c in causes
        )
    header = next(i for i, line in enumerate(text.splitlines()) if line.startswith("WEEK"))
    assert [line.split() for line in text.splitlines()[header + 1 :]] == expected
    assert len(data["weeks"]) == 5


def test_weekly_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = _write(tmp_path)
    png = tmp_path / "weekly.png"
    assert main(["goodput", "--log", str(log), "--by", "week", "--by", "cause", "--png", str(png)]) == 0
    assert f"chart written to {png}" in capsys.readouterr().out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    empty = render_weekly_png(compute_goodput([]), tmp_path / "empty.png")
    assert empty.stat().st_size > 5_000


def test_by_flags_and_api(store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert normalise_by(["cause", "week", "week"]) == "week,cause" == normalise_by(["cause", "week"])
    with pytest.raises(ValueError, match="'month'"):
        normalise_by(["week", "month"])
    log = _write(tmp_path)
    server, port = build_server(StoreBackedView(store, log), "127.0.0.1:0", poll_s=0.05)
    server.start()
    try:
        stub = controller_pb2_grpc.ControllerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        both = stub.GetGoodput(controller_pb2.GetGoodputRequest(by="week,cause"), timeout=10).report
        weeks = stub.GetGoodput(controller_pb2.GetGoodputRequest(by="week"), timeout=10).report
        argv = ["goodput", "--by", "week", "--by", "cause", "--json"]
        assert main(["--controller", f"127.0.0.1:{port}", *argv]) == 0
        online = json.loads(capsys.readouterr().out)
    finally:
        server.stop(grace=None)
    offline = compute_goodput(four_weeks().events).weeks
    assert [w.week for w in both.weeks] == [w.week for w in offline]
    for got, want in zip(both.weeks, offline, strict=True):
        assert {c.cause: c.seconds for c in got.lost_by_cause} == {
            c: us / US for c, us in want.lost_by_cause_us.items()
        }
    assert main([*argv, "--log", str(log)]) == 0
    assert online["weeks"] == json.loads(capsys.readouterr().out)["weeks"]  # the CLI online = offline
    assert all(not w.lost_by_cause for w in weeks.weeks) and weeks.weeks[1].lost_s == both.weeks[1].lost_s


def test_render_without_weeks() -> None:
    from controller.ctl.goodput import week_cause_table

    assert week_cause_table(controller_pb2.GoodputReport(), Painter(enabled=False)) == "no weeks"
