"""The known-answer matmul on CPU with real torch; corruption injected at the `matmul` seam."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from preflight.checks.base import CheckContext, NvmlSession
from preflight.checks.compute import (
    MatmulOutcome,
    compare_devices,
    expected_checksums,
    known_inputs,
    outcome_result,
    run_compute,
    run_matmul,
)
from preflight.config import ComputeConfig, PreflightConfig
from preflight.nvml import PynvmlAdapter
from preflight.result import CheckStatus


def ctx(**compute: object) -> CheckContext:
    compute.setdefault("isolate", False)  # in-process unless a test asks for the child process
    config = dataclasses.replace(PreflightConfig(), compute=ComputeConfig(device="cpu", **compute))
    return CheckContext(config=config, mode="quick", nvml=NvmlSession(PynvmlAdapter), deadline=float("inf"))


def test_checksums_equal_the_full_product() -> None:
    a, b = known_inputs(64)
    rows, cols = expected_checksums(a, b)
    full = a @ b
    assert torch.equal(rows, full.sum(dim=1)) and torch.equal(cols, full.sum(dim=0))


def test_cpu_matmul_is_exact_and_passes() -> None:
    [result] = run_compute(ctx(size_cpu=128, iterations_cpu=2))
    assert result.status is CheckStatus.PASS, result.message
    assert result.value is not None and result.value > 0 and result.unit == "TFLOP/s"
    assert "no floor set: compute.tflops_floor = 0; not checked" in result.message


def corrupt_one_element(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.matmul(a, b)
    out[17, 3] += 1.0  # one wrong element, as a flipped low mantissa bit would make
    return out


def test_corrupted_result_is_caught() -> None:
    [result] = run_compute(ctx(size_cpu=128, iterations_cpu=2), matmul=corrupt_one_element)
    assert result.status is CheckStatus.FAIL
    assert "1 row / 1 column checksums differ" in result.message


def test_corruption_only_in_the_timed_dtype_is_caught() -> None:
    calls = {"n": 0}

    def corrupt_after_first(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        out = torch.matmul(a, b)
        if calls["n"] > 1:  # the exact fp32 pass is right; the timed passes are not
            out[0, 0] += 64.0
        return out

    outcome = run_matmul("cpu", 96, 2, "bfloat16", matmul=corrupt_after_first)
    assert outcome.exact_ok and not outcome.timed_ok
    assert outcome_result(outcome, 0.0).status is CheckStatus.FAIL


def test_bfloat16_rounding_is_within_the_stated_tolerance() -> None:
    outcome = run_matmul("cpu", 256, 1, "bfloat16")
    assert outcome.exact_ok and outcome.timed_ok


def test_throughput_below_floor_fails() -> None:
    [result] = run_compute(ctx(size_cpu=64, iterations_cpu=1, tflops_floor=1e6))
    assert result.status is CheckStatus.FAIL and result.threshold == 1e6


def _outcome(device: str, tflops: float, digest: str = "d") -> MatmulOutcome:
    return MatmulOutcome(
        device=device,
        gpu_index=int(device[-1]),
        size=8,
        dtype="bfloat16",
        exact_ok=True,
        bad_rows=0,
        bad_cols=0,
        timed_ok=True,
        max_abs_error=0.0,
        tflops=tflops,
        digest=digest,
    )


@pytest.mark.parametrize(
    ("tflops", "digests", "status"),
    [
        ([700.0, 710.0, 690.0], ["d", "d", "d"], CheckStatus.PASS),
        ([700.0, 710.0, 400.0], ["d", "d", "d"], CheckStatus.FAIL),  # a throttled GPU
        ([700.0, 710.0, 690.0], ["d", "d", "x"], CheckStatus.FAIL),  # one GPU computes something else
    ],
)
def test_devices_are_compared(tflops: list[float], digests: list[str], status: CheckStatus) -> None:
    outcomes = [_outcome(f"cuda:{i}", t, d) for i, (t, d) in enumerate(zip(tflops, digests, strict=True))]
    assert compare_devices(outcomes, 0.15).status is status


def test_isolated_in_a_child_process_gives_the_same_answer() -> None:
    [in_process] = run_compute(ctx(size_cpu=96, iterations_cpu=1, isolate=False))
    [isolated] = run_compute(ctx(size_cpu=96, iterations_cpu=1, isolate=True))
    assert in_process.status is isolated.status is CheckStatus.PASS
    digest = [e for e in in_process.evidence[0].split() if e.startswith("digest=")]
    assert digest and digest[0] in isolated.evidence[0]


def test_isolated_child_that_overruns_is_killed() -> None:
    """Over its own limit (timeout_s): FAIL, a hung GPU's sign. Stopped because the run's budget ran
    out first: INCONCLUSIVE, the budget's doing (the runner runs it again)."""
    own = dataclasses.replace(
        PreflightConfig(), compute=ComputeConfig(device="cpu", isolate=True, timeout_s=1.0)
    )
    long = CheckContext(
        config=own, mode="quick", nvml=NvmlSession(PynvmlAdapter), deadline=time.monotonic() + 60
    )
    [result] = run_compute(long)  # 1 s is less than the child needs to import torch
    assert result.status is CheckStatus.FAIL and "killed" in result.message
    config = dataclasses.replace(PreflightConfig(), compute=ComputeConfig(device="cpu", isolate=True))
    short = CheckContext(
        config=config, mode="quick", nvml=NvmlSession(PynvmlAdapter), deadline=time.monotonic() + 1.2
    )
    [result] = run_compute(short)
    assert (
        result.status is CheckStatus.INCONCLUSIVE
        and "killed" in result.message
        and "budget" in result.message
    )
