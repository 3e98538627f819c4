"""`preflight baseline`: measure this (known-good) node and write the floors into the config.

Floors are the measured value times (1 - margin): the slowest GPU's TFLOP/s for the matmul floor,
the bus bandwidth for the all-reduce floor. A node whose known-answer checks fail is not a baseline.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from preflight.config import PreflightConfig
from preflight.report import PreflightReport
from preflight.result import CheckStatus
from preflight.runner import run_preflight


@dataclass(frozen=True, slots=True, kw_only=True)
class Baseline:
    config: PreflightConfig  # the input config with the new floors
    tflops: float | None  # slowest device's measured TFLOP/s
    busbw_gbps: float | None
    report: PreflightReport


class BaselineError(RuntimeError):
    pass


def measure_baseline(config: PreflightConfig, margin: float = 0.2) -> Baseline:
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    unfloored = dataclasses.replace(
        config,
        compute=dataclasses.replace(config.compute, tflops_floor=0.0),
        collective=dataclasses.replace(config.collective, busbw_floor_gbps=0.0),
    )
    budget = unfloored.compute.timeout_s + unfloored.collective.timeout_s + 10.0
    report = run_preflight(unfloored, "full", only=("compute", "collective"), budget_s=budget)
    bad = [r for r in report.results if r.status is CheckStatus.FAIL]
    if bad:
        raise BaselineError("not a known-good node: " + "; ".join(f"{r.name}: {r.message}" for r in bad))
    tflops = [r.value for r in report.results if r.name == "compute.matmul" and r.value is not None]
    busbw = [r.value for r in report.results if r.name == "collective.all_reduce" and r.value is not None]
    compute_cfg, collective_cfg = config.compute, config.collective
    if tflops:
        compute_cfg = dataclasses.replace(compute_cfg, tflops_floor=_sig(min(tflops) * (1 - margin)))
    if busbw:
        collective_cfg = dataclasses.replace(collective_cfg, busbw_floor_gbps=_sig(busbw[0] * (1 - margin)))
    return Baseline(
        config=dataclasses.replace(config, compute=compute_cfg, collective=collective_cfg),
        tflops=min(tflops) if tflops else None,
        busbw_gbps=busbw[0] if busbw else None,
        report=report,
    )


def _sig(value: float) -> float:
    return float(f"{value:.4g}")  # four significant digits: CPU floors are tiny, GPU floors large


def baseline_header(b: Baseline, margin: float) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return (
        f"preflight config written by `preflight baseline` on {b.report.host} at {stamp}\n"
        f"measured: matmul {b.tflops} TFLOP/s (slowest device), all-reduce bus bandwidth {b.busbw_gbps} GB/s;\n"
        f"floors = measured x (1 - {margin})"
    )
