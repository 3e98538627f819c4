"""The runner: parallel and serial units, per-unit timeouts, the total budget, streaming, the report."""

from __future__ import annotations

import json
import threading
import time

import pytest

from preflight.checks.base import CheckContext, CheckSpec
from preflight.config import CollectiveConfig, ComputeConfig, PreflightConfig
from preflight.gpus import NOT_EXPECTED
from preflight.report import PreflightReport
from preflight.result import CheckResult, CheckStatus, failed, passed, skipped
from preflight.runner import ALL_SPECS, run_preflight, select_specs
from runwarden.v1 import common_pb2

RELEASE = threading.Event()  # set at teardown so abandoned "hung" threads end


@pytest.fixture(autouse=True)
def _release_hung_units() -> object:
    RELEASE.clear()
    yield
    RELEASE.set()


def spec(name: str, fn: object, timeout: float = 5.0, serial: bool = False) -> CheckSpec:
    return CheckSpec(
        name=name, run=fn, timeout_s=lambda c, m: timeout, modes=lambda c: ("quick", "full"), serial=serial
    )


def sleeper(name: str, seconds: float, log: list[str] | None = None) -> object:
    def run(ctx: CheckContext) -> list[CheckResult]:
        if log is not None:
            log.append(f"start {name}")
        time.sleep(seconds)
        if log is not None:
            log.append(f"end {name}")
        return [passed(f"{name}.done", f"slept {seconds}")]

    return run


def hang(ctx: CheckContext) -> list[CheckResult]:
    RELEASE.wait(60)
    return [passed("hang.done", "released")]


def test_parallel_units_overlap_and_serial_units_do_not() -> None:
    log: list[str] = []
    specs = [
        spec("p1", sleeper("p1", 0.5)),
        spec("p2", sleeper("p2", 0.5)),
        spec("s1", sleeper("s1", 0.2, log), serial=True),
        spec("s2", sleeper("s2", 0.2, log), serial=True),
    ]
    started = time.monotonic()
    report = run_preflight(PreflightConfig(), "quick", specs=specs)
    assert (
        time.monotonic() - started < 0.5 + 0.5 + 0.4 + 1.0
    )  # parallel lane overlaps; generous for 2 shared CPUs
    assert log == ["start s1", "end s1", "start s2", "end s2"]
    assert sorted(r.name for r in report.results) == ["p1.done", "p2.done", "s1.done", "s2.done"]
    assert all(r.duration_s > 0 for r in report.results)


def test_a_hung_unit_is_fail_and_does_not_hold_the_runner() -> None:
    specs = [spec("hang", hang, timeout=0.5), spec("ok", sleeper("ok", 0.0))]
    started = time.monotonic()
    report = run_preflight(PreflightConfig(), "quick", specs=specs)
    assert time.monotonic() - started < 3.0
    by_name = {r.name: r for r in report.results}
    assert by_name["hang"].status is CheckStatus.FAIL and "timed out" in by_name["hang"].message
    assert by_name["ok.done"].status is CheckStatus.PASS
    assert report.abandoned == ("hang",) and report.exit_code == 1


def test_the_budget_running_out_is_inconclusive_and_the_unit_runs_again_once() -> None:
    """A unit cut off by the run's budget (not its own timeout), and one that could not start, say
    INCONCLUSIVE, not FAIL: the budget ran out, not the node. Nothing failed, so both run once more
    with a fresh budget; their answers then are the report's, and only those are streamed."""
    calls: list[str] = []

    def hangs_once(ctx: CheckContext) -> list[CheckResult]:
        calls.append("slow")
        if len(calls) == 1:
            RELEASE.wait(60)
        return [passed("slow.done", "answered")]

    specs = [spec("slow", hangs_once, timeout=60, serial=True), spec("s2", sleeper("s2", 0.0), serial=True)]
    streamed: list[CheckResult] = []
    started = time.monotonic()
    report = run_preflight(PreflightConfig(), "quick", specs=specs, budget_s=1.5, on_result=streamed.append)
    assert time.monotonic() - started < 1.5 + 1.0 + 2.0  # one budget, then the quick re-run
    assert calls == ["slow", "slow"]
    assert [(r.name, r.status) for r in report.results] == [
        ("slow.done", CheckStatus.PASS),
        ("s2.done", CheckStatus.PASS),
    ]
    assert streamed == list(report.results) and report.passed and report.exit_code == 0


def test_a_unit_that_runs_out_of_the_budget_twice_is_inconclusive_not_failed() -> None:
    specs = [spec("s1", hang, timeout=60, serial=True), spec("s2", sleeper("s2", 0.0), serial=True)]
    started = time.monotonic()
    report = run_preflight(PreflightConfig(), "quick", specs=specs, budget_s=1.2)
    assert time.monotonic() - started < 2 * 1.2 + 2.0
    s1, s2 = report.results
    assert s1.status is CheckStatus.INCONCLUSIVE and "budget" in s1.message and "again" in s1.message
    assert s2.status is CheckStatus.INCONCLUSIVE and "not started" in s2.message
    summary = report.summary()
    assert (summary.passed, summary.fail_count, summary.inconclusive_count) == (False, 0, 2)
    assert report.exit_code == 3  # EXIT_INCONCLUSIVE: run it again later, no strike


def test_with_a_failure_the_budgets_inconclusive_units_do_not_run_again() -> None:
    calls: list[str] = []

    def counted_hang(ctx: CheckContext) -> list[CheckResult]:
        calls.append("hang")
        return hang(ctx)

    def fails(ctx: CheckContext) -> list[CheckResult]:
        return [failed("bad", "a real failure")]

    specs = [spec("bad", fails), spec("s1", counted_hang, timeout=60, serial=True)]
    report = run_preflight(PreflightConfig(), "quick", specs=specs, budget_s=1.2)
    assert calls == ["hang"]
    statuses = {r.name: r.status for r in report.results}
    assert statuses == {"bad": CheckStatus.FAIL, "s1": CheckStatus.INCONCLUSIVE}
    assert report.exit_code == 1


def test_a_crashing_unit_is_fail_with_the_exception() -> None:
    def boom(ctx: CheckContext) -> list[CheckResult]:
        raise KeyError("no such GPU")

    report = run_preflight(PreflightConfig(), "quick", specs=[spec("boom", boom)])
    [r] = report.results
    assert r.status is CheckStatus.FAIL and "KeyError" in r.message


def test_results_are_streamed_as_units_finish() -> None:
    seen: list[tuple[str, float]] = []
    specs = [spec("fast", sleeper("fast", 0.0)), spec("slow", sleeper("slow", 0.6))]
    started = time.monotonic()
    report = run_preflight(
        PreflightConfig(),
        "quick",
        specs=specs,
        on_result=lambda r: seen.append((r.name, time.monotonic() - started)),
    )
    assert [name for name, _ in seen] == ["fast.done", "slow.done"]
    assert seen[0][1] < seen[1][1] - 0.3  # the fast one arrived before the slow one was done
    assert [r.name for r in report.results] == ["fast.done", "slow.done"]


def test_summary_and_versioned_json_round_trip() -> None:
    def mixed(ctx: CheckContext) -> list[CheckResult]:
        return [
            passed("a", "ok", value=1.5, unit="GB/s", threshold=1.0),
            failed("b", "bad", gpu_index=3, evidence=("x=1",), remedy="fix it"),
            skipped("c", "no NVML"),
        ]

    report = run_preflight(PreflightConfig(), "full", specs=[spec("mixed", mixed)])
    summary = report.summary()
    assert isinstance(summary, common_pb2.PreflightSummary)
    assert (summary.mode, summary.passed, summary.pass_count, summary.fail_count, summary.skip_count) == (
        "full",
        False,
        1,
        1,
        1,
    )
    assert list(summary.failed_checks) == ["b[gpu3]"]
    doc = json.loads(report.dumps())
    assert doc["schema"] == "runwarden.preflight.report" and doc["version"] == 1
    assert PreflightReport.from_json(doc) == report
    proto = report.results[1].to_proto()
    assert (
        proto.status == common_pb2.CHECK_STATUS_FAIL and proto.gpu_index == 3 and not proto.HasField("value")
    )
    assert report.results[0].to_proto().threshold == 1.0
    with pytest.raises(ValueError):
        PreflightReport.from_json({**doc, "version": 2})


def test_skip_must_say_why_and_evidence_is_bounded() -> None:
    with pytest.raises(ValueError):
        skipped("x", "")
    r = passed("x", "ok", evidence=tuple("e" * 10_000 for _ in range(100)))
    assert len(r.evidence) == 33 and all(len(e) <= 512 for e in r.evidence)


def test_mode_selection_and_only() -> None:
    cfg = PreflightConfig(collective=CollectiveConfig(modes=("full",)))
    quick = [s.name for s in select_specs(cfg, "quick")]
    full = [s.name for s in select_specs(cfg, "full")]
    assert "collective" not in quick and "collective" in full
    # by default the quick mode has it too (a SKIP on one local device, see test_collective)
    assert "collective" in [s.name for s in select_specs(PreflightConfig(), "quick")]
    assert [s.name for s in select_specs(cfg, "quick", only=["collective"])] == ["collective"]
    with pytest.raises(ValueError):
        select_specs(cfg, "quick", only=["nope"])
    with pytest.raises(ValueError):
        select_specs(cfg, "slow")
    assert {s.name for s in ALL_SPECS if s.serial} == {"compute", "collective", "dcgm"}


def test_a_real_matmul_child_stopped_by_the_budget_is_inconclusive_not_a_hung_gpu() -> None:
    """The quick mode's matmul child (torch's import alone takes longer than this budget here) is
    stopped when the budget runs out: INCONCLUSIVE, run once more, INCONCLUSIVE again; never the
    'hung GPU' FAIL it was. Its own limit (timeout_s) is far longer."""
    pytest.importorskip("torch")
    cfg = PreflightConfig(compute=ComputeConfig(size_cpu=64, iterations_cpu=1, timeout_s=60.0))
    started = time.monotonic()
    report = run_preflight(cfg, "quick", only=("compute",), budget_s=1.2, gpus=NOT_EXPECTED)
    assert time.monotonic() - started < 2 * 1.2 + 3.0
    (matmul,) = report.results
    assert matmul.status is CheckStatus.INCONCLUSIVE, matmul
    assert "budget ran out" in matmul.message and "again" in matmul.message
    assert report.summary().fail_count == 0 and report.exit_code == 3
