"""`controllerctl compare-loss RUN --log FILE`: offline, from an event log the core itself wrote."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from controller.ctl.compare_loss import compare, to_json
from controller.ctl.main import main
from controller.supervisor.blame import FlightRecorderVerdict
from controller.supervisor.events import AttemptExited, CheckpointCommitted, DumpsCollected
from runwarden.eventlog import EventLog, LogEntry, read_events
from runwarden.v1 import events_pb2
from tests.supervisor.harness import Driver, fast


def curve(step: int, rank: int) -> float:
    return 2.0 / (1.0 + 0.05 * step) + 0.001 * rank


def restart(d: Driver) -> None:
    a = d.sup.attempt
    d.send(AttemptExited(node="n1", attempt=a, exit_code=1, ended_at=d.now))
    d.send(DumpsCollected(attempt=a, verdict=FlightRecorderVerdict()))
    d.send(AttemptExited(node="n2", attempt=a, exit_code=-15))
    d.advance(d.cfg.backoff_max_s + 1)
    d.answer_preflight()


def synthetic_log(path: Path) -> Path:
    """Attempt 1 runs to step 30 (commit 20); attempt 2 replays 21-30 identically, runs to 45 (commit
    40); attempt 3 replays 41-45 with rank 1's loss off by 1 % from step 43, then a NaN at 45 (a LOSS_ANOMALY, no comparison)."""
    d = Driver(cfg=fast(divergence_tolerance=1e-6), nodes=2, run="llm")  # a deterministic job
    d.start()
    d.steps(1, 30, loss=curve)
    d.send(CheckpointCommitted(step=20))
    restart(d)
    d.steps(21, 45, loss=curve)
    d.send(CheckpointCommitted(step=40))
    restart(d)
    d.steps(
        41,
        45,
        loss=lambda s, r: (
            math.nan if s == 45 and r == 1 else curve(s, r) * (1.01 if s >= 43 and r == 1 else 1)
        ),
    )
    d.steps(46, 47, loss=curve)
    with EventLog(path) as log:
        for e in d.events():
            log.append(e)
    return path


def test_compare_loss_shows_each_resumed_attempt_offline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = synthetic_log(tmp_path / "events.jsonl")
    assert main(["--color", "never", "compare-loss", "llm", "--log", str(log)]) == 0
    out = capsys.readouterr().out
    a2, a3 = out.split("\nattempt 3")
    assert "attempt 2 resumed from step 20: 10 replayed (steps 21-30), max relative difference 0" in a2
    assert "identical" in a2 and "DIVERGED" not in a2
    assert " resumed from step 40: 5 replayed (steps 41-45), max relative difference 0.01" in a3
    assert "DIVERGED" in a3 and "divergence after resume: step 43 rank 1 on n2" in a3
    row43 = next(line for line in a3.splitlines() if line.split()[:1] == ["43"])
    assert "n2" in row43 and "(a2)" in row43 and "0.01" in row43


def test_compare_loss_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = synthetic_log(tmp_path / "events.jsonl")
    assert main(["compare-loss", "llm", "--log", str(log), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)  # strict JSON: NaN and inf as strings
    assert doc["run"] == "llm" and [a["attempt"] for a in doc["attempts"]] == [2, 3]
    a2, a3 = doc["attempts"]
    assert a2["replayed_steps"] == 10 and a2["max_rel_diff"] == 0 and not a2["diverged"]
    assert a2["divergence"] is None and a2["resume_step"] == 20 and a2["tolerance"] == 1e-6
    assert [s["step"] for s in a2["steps"]] == list(range(21, 31))
    assert all(s["earlier_attempt"] == 1 and s["ranks_compared"] == 2 for s in a2["steps"])
    assert a3["diverged"] and a3["max_rel_diff"] == pytest.approx(0.01)
    assert a3["divergence"]["step"] == 43 and a3["divergence"]["rank"] == 1
    assert a3["divergence"]["rel_diff"] == pytest.approx(0.01)
    s45 = a3["steps"][-1]  # rank 1's NaN is a LOSS_ANOMALY, not a comparison: rank 0 alone
    assert s45["step"] == 45 and s45["rank"] == 0 and s45["ranks_compared"] == 1 and s45["rel_diff"] == 0
    assert main(["compare-loss", "llm", "--log", str(log), "--json", "--attempt", "2"]) == 0
    assert [a["attempt"] for a in json.loads(capsys.readouterr().out)["attempts"]] == [2]


def test_a_step_split_over_two_events_is_merged() -> None:
    def replay(points: list[tuple[int, int, float, int]]) -> LogEntry:
        return LogEntry(
            run="r",
            attempt=2,
            kind=events_pb2.EVENT_KIND_LOSS_REPLAY,
            loss=events_pb2.LossDetail(
                rule="replay",
                resume_step=10,
                threshold=1e-6,
                points=[
                    events_pb2.LossPoint(step=s, rank=r, rel_diff=d, ranks_compared=n, earlier_attempt=1)
                    for s, r, d, n in points
                ],
            ),
        )

    (c,) = compare([replay([(11, 0, 0.0, 3), (12, 0, 0.0, 3)]), replay([(12, 5, 0.5, 1)])], "r")
    assert (
        c.points[12].rank == 5 and c.points[12].ranks_compared == 4 and c.max_rel_diff == 0.5 and c.diverged
    )
    c.points[12].loss, c.points[12].rel_diff = math.nan, math.inf
    doc = json.loads(json.dumps(to_json("r", [c]), allow_nan=False))  # strict JSON
    assert (
        doc["attempts"][0]["steps"][1]["loss"] == "NaN" and doc["attempts"][0]["max_rel_diff"] == "Infinity"
    )


def test_no_resume_and_a_missing_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = Driver(cfg=fast(), nodes=1, run="llm")
    d.start()
    d.steps(1, 5, loss=curve)
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        for e in d.events():
            log.append(e)
    assert read_events(path).entries
    assert main(["compare-loss", "llm", "--log", str(path)]) == 0
    assert "no resumed attempt replayed a step" in capsys.readouterr().out
    assert main(["compare-loss", "other", "--log", str(path)]) != 0
    assert main(["compare-loss", "llm", "--log", str(tmp_path / "nope.jsonl")]) != 0
