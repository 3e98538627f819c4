"""The dcgmi diag JSON parser on realistic output, a failing diag, and malformed JSON; the check
itself runs a stand-in `dcgmi` script (a real process on PATH) or skips when dcgmi is absent."""

from __future__ import annotations

import dataclasses
import stat
from pathlib import Path

import pytest

from preflight.checks.dcgm import parse_dcgm_diag
from preflight.config import DcgmConfig, PreflightConfig
from preflight.result import CheckStatus
from preflight.runner import run_preflight

DATA = Path(__file__).parent / "data"


def test_passing_r1_diag() -> None:
    results = parse_dcgm_diag((DATA / "dcgm_diag_r1_pass.json").read_text())
    by_name = {r.name: r for r in results}
    assert by_name["dcgm.deployment.denylist"].status is CheckStatus.PASS
    assert by_name["dcgm.deployment.page_retirement_row_remap"].status is CheckStatus.PASS
    assert by_name["dcgm.deployment.inforom"].status is CheckStatus.SKIP
    assert not any(r.status is CheckStatus.FAIL for r in results)
    assert len(results) == 9


def test_failing_r2_diag_names_the_gpu_and_the_reason() -> None:
    results = parse_dcgm_diag((DATA / "dcgm_diag_r2_fail.json").read_text(), returncode=226)
    by_name = {r.name: r for r in results}
    pcie = by_name["dcgm.integration.pcie"]
    assert pcie.status is CheckStatus.FAIL and pcie.gpu_index == 1
    assert any("below the expected minimum" in e and "[error 28]" in e for e in pcie.evidence)
    assert by_name["dcgm.deployment.persistence_mode"].status is CheckStatus.WARN
    assert by_name["dcgm.hardware.gpu_memory"].status is CheckStatus.PASS
    assert by_name["dcgm.hardware.diagnostic"].status is CheckStatus.SKIP
    assert "dcgm.diag" not in by_name  # the nonzero exit is explained by the failing test


@pytest.mark.parametrize(
    "text",
    [
        '{"DCGM GPU Diagnostic": {"test_categories": [',
        "",
        "Error: unable to connect to host engine",
        '{"other": 1}',
        "[1, 2]",
        '{"DCGM Diagnostic": {"test_categories": 5}}',
    ],
)
def test_malformed_output(text: str) -> None:
    [failing] = parse_dcgm_diag(text, returncode=255)
    assert failing.name == "dcgm.diag" and failing.status is CheckStatus.FAIL
    [warning] = parse_dcgm_diag(text, returncode=0)
    assert warning.status is CheckStatus.WARN


def test_nonzero_exit_without_failing_test_is_fail() -> None:
    results = parse_dcgm_diag((DATA / "dcgm_diag_r1_pass.json").read_text(), returncode=1)
    assert [r.name for r in results if r.status is CheckStatus.FAIL] == ["dcgm.diag"]


def _config(dcgmi: str) -> PreflightConfig:
    return dataclasses.replace(PreflightConfig(), dcgm=DcgmConfig(dcgmi=dcgmi, quick_timeout_s=5.0))


def test_absent_dcgmi_is_skip() -> None:
    report = run_preflight(_config("/nonexistent/dcgmi"), "quick", only=("dcgm",))
    [r] = report.results
    assert r.status is CheckStatus.SKIP and "not found" in r.message


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "dcgmi"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_runs_dcgmi_with_level_and_json(tmp_path: Path) -> None:
    args = tmp_path / "args"
    dcgmi = _script(tmp_path, f'echo "$@" > {args}\ncat {DATA / "dcgm_diag_r2_fail.json"}\nexit 226\n')
    report = run_preflight(_config(dcgmi), "full", only=("dcgm",))
    assert args.read_text().strip() == "diag -r 2 -j"
    assert not report.passed and "dcgm.integration.pcie[gpu1]" in report.failed_checks


def test_hung_dcgmi_is_killed_and_fails(tmp_path: Path) -> None:
    dcgmi = _script(tmp_path, "sleep 60 &\nsleep 60\n")  # a grandchild holding the pipe must not block us
    cfg = dataclasses.replace(PreflightConfig(), dcgm=DcgmConfig(dcgmi=dcgmi, quick_timeout_s=1.0))
    report = run_preflight(cfg, "quick", only=("dcgm",))
    [r] = report.results
    assert r.status is CheckStatus.FAIL and "did not finish" in r.message
    assert report.duration_s < 10


def test_dcgmi_stopped_by_the_runs_budget_is_inconclusive(tmp_path: Path) -> None:
    """Its own limit (12 s) is longer than what the quick budget leaves: stopping it then says
    nothing about the node (INCONCLUSIVE, run once more), unlike the hung diag above (FAIL)."""
    dcgmi = _script(tmp_path, "sleep 60 &\nsleep 60\n")
    cfg = dataclasses.replace(PreflightConfig(), dcgm=DcgmConfig(dcgmi=dcgmi, quick_timeout_s=12.0))
    report = run_preflight(cfg, "quick", only=("dcgm",), budget_s=1.5)
    [r] = report.results
    assert r.status is CheckStatus.INCONCLUSIVE and "budget ran out" in r.message and "again" in r.message
    assert report.duration_s < 2 * 1.5 + 3
