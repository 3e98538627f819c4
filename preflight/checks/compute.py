"""Known-answer matmul on every GPU (or the CPU): catches silent corruption and slow or throttled GPUs.
Integer-valued inputs make an fp32 product exact and checkable by row and column checksums; the
timed pass in the configured dtype is compared with it within a stated tolerance; the GPUs' digests
must agree and none may be slower than the median by more than `gpu_spread_max`. Where GPUs are
expected (preflight.gpus) CUDA unavailable is a FAIL, never a CPU run. torch is imported lazily (the
controller host does not have it). Called by the runner and the burn-in (preflight.burn_in_device).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from preflight.checks.base import CheckContext, CheckSpec, budget_timeout, gpus_unreachable, out_of_budget
from preflight.checks.expectations import no_floor
from preflight.config import MODES, ComputeConfig, config_from_mapping
from preflight.result import CheckResult, failed, passed, skipped

if TYPE_CHECKING:
    import torch

MatmulFn = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]
SEED = 20240611
_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass(frozen=True, slots=True, kw_only=True)
class MatmulOutcome:
    device: str
    gpu_index: int | None
    size: int
    dtype: str
    exact_ok: bool
    bad_rows: int
    bad_cols: int
    timed_ok: bool
    max_abs_error: float
    tflops: float
    digest: str


class CudaUnavailable(RuntimeError):
    """device = "cuda" (configured, or "auto" where GPUs are expected) and torch cannot use CUDA."""


def _torch() -> Any:
    import torch  # lazily: an optional dependency of GPU hosts only

    return torch


@functools.lru_cache(maxsize=2)  # the same inputs for every GPU of a run; never mutated
def known_inputs(size: int, seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor]:
    torch = _torch()
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(-2, 3, (size, size), generator=gen, dtype=torch.int64)
    b = torch.randint(-2, 3, (size, size), generator=gen, dtype=torch.int64)
    return a, b


def expected_checksums(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact row and column sums of a @ b, in int64, in O(n^2)."""
    return a @ b.sum(dim=1), a.sum(dim=0) @ b


def _sync(device: Any) -> None:
    torch = _torch()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tolerance(dtype: Any) -> tuple[float, float]:
    torch = _torch()
    return (2.0**-6, 1.0) if dtype in (torch.bfloat16, torch.float16) else (0.0, 0.0)


def run_matmul(
    device_name: str,
    size: int,
    iterations: int,
    dtype_name: str,
    matmul: MatmulFn | None = None,
    gpu_index: int | None = None,
) -> MatmulOutcome:
    """One device's known-answer check and throughput. `matmul` is the seam tests use to inject corruption.

    Inputs have entries in [-2, 2], so every product and partial sum is an integer below 2**24 and an
    fp32 (or TF32) matmul is exact. Huang-Abraham checksums: the row sums must equal A @ (B @ 1) and the
    column sums (1 @ A) @ B, computed in int64 on the CPU in O(n^2); one wrong element changes one row
    and one column sum. The timed pass's tolerance: rtol 2**-6 plus atol 1 for 16-bit dtypes (output
    rounding, cuBLAS's reduced-precision split-K reduction), exact for 32/64-bit dtypes.
    """
    torch = _torch()
    mm = matmul or torch.matmul
    device = torch.device(device_name)
    dtype = getattr(torch, dtype_name)
    a, b = known_inputs(size)
    rows_expected, cols_expected = expected_checksums(a, b)
    a32, b32 = a.to(device, torch.float32), b.to(device, torch.float32)
    exact = mm(a32, b32)
    _sync(device)
    rows = exact.double().sum(dim=1).cpu()
    cols = exact.double().sum(dim=0).cpu()
    bad_rows = int((rows != rows_expected.double()).sum())
    bad_cols = int((cols != cols_expected.double()).sum())
    digest = hashlib.sha256(rows.numpy().tobytes() + cols.numpy().tobytes()).hexdigest()[:16]

    at, bt = a32.to(dtype), b32.to(dtype)
    out = mm(at, bt)  # warm-up (kernel selection, clocks)
    _sync(device)
    start = time.perf_counter()
    for _ in range(iterations):
        out = mm(at, bt)
    _sync(device)
    elapsed = max(time.perf_counter() - start, 1e-9)
    rtol, atol = _tolerance(dtype)
    error = (out.double() - exact.double()).abs()
    timed_ok = bool((error <= rtol * exact.double().abs() + atol).all())
    return MatmulOutcome(
        device=device_name,
        gpu_index=gpu_index,
        size=size,
        dtype=dtype_name,
        exact_ok=bad_rows == 0 and bad_cols == 0,
        bad_rows=bad_rows,
        bad_cols=bad_cols,
        timed_ok=timed_ok,
        max_abs_error=float(error.max()),
        tflops=2.0 * size**3 * iterations / elapsed / 1e12,
        digest=digest,
    )


def cuda_unavailable_reason(torch: Any) -> str:
    """Why torch sees no CUDA device, in torch's words (its lazy init raises the real reason)."""
    try:
        torch.cuda.init()
    except Exception as exc:  # AssertionError (a CPU build), RuntimeError (no driver, a bad GPU)
        return f"torch {torch.__version__}: {type(exc).__name__}: {exc}"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"


def plan_devices(device: str) -> list[tuple[str, int | None]]:
    """The devices to test: every CUDA device for "cuda" (and "auto" where CUDA works), else the
    CPU. Raises CudaUnavailable for "cuda" when torch sees none: never a silent CPU fallback."""
    torch = _torch()
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return [("cpu", None)]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise CudaUnavailable(cuda_unavailable_reason(torch))
    return [(f"cuda:{i}", i) for i in range(count)]


def _plan(cfg: ComputeConfig, mode: str) -> tuple[list[tuple[str, int | None]], int, int, str]:
    devices = plan_devices(cfg.device)
    if devices[0][0] != "cpu":
        size = cfg.size_quick if mode == "quick" else cfg.size_full
        iters = cfg.iterations_quick if mode == "quick" else cfg.iterations_full
        dtype = "bfloat16" if cfg.dtype == "auto" else cfg.dtype
    else:
        size, iters = cfg.size_cpu, cfg.iterations_cpu
        dtype = "float32" if cfg.dtype == "auto" else cfg.dtype
    return devices, size, iters, dtype


def outcome_result(o: MatmulOutcome, floor: float) -> CheckResult:
    kw = {
        "gpu_index": o.gpu_index,
        "value": o.tflops,
        "unit": "TFLOP/s",
        "threshold": floor or None,
        "evidence": (
            f"device={o.device} n={o.size} dtype={o.dtype} digest={o.digest}",
            f"bad_row_sums={o.bad_rows} bad_col_sums={o.bad_cols} max_abs_error={o.max_abs_error:g}",
        ),
    }
    name = "compute.matmul"
    if not o.exact_ok:
        return failed(
            name,
            f"{o.device}: wrong matmul result ({o.bad_rows} row / {o.bad_cols} column checksums differ)",
            remedy="silent data corruption: drain the node and run the vendor diagnostics",
            **kw,
        )
    if not o.timed_ok:
        return failed(
            name,
            f"{o.device}: {o.dtype} result outside tolerance (max error {o.max_abs_error:g})",
            remedy="silent data corruption: drain the node and run the vendor diagnostics",
            **kw,
        )
    if floor and o.tflops < floor:
        return failed(
            name,
            f"{o.device}: {o.tflops:.2f} TFLOP/s below the floor {floor:.2f}",
            remedy="check clocks, throttle reasons and power; compare with `preflight baseline`",
            **kw,
        )
    note = "" if floor else no_floor("compute.tflops_floor")
    return passed(name, f"{o.device}: exact result, {o.tflops:.3g} TFLOP/s{note}", **kw)


def compare_devices(outcomes: list[MatmulOutcome], spread_max: float) -> CheckResult:
    name = "compute.consistency"
    digests = {o.digest for o in outcomes}
    median = statistics.median(o.tflops for o in outcomes)
    evidence = tuple(f"{o.device}: digest={o.digest} tflops={o.tflops:.3f}" for o in outcomes)
    if len(digests) > 1:
        return failed(
            name,
            f"devices disagree on the same product ({len(digests)} distinct digests)",
            evidence=evidence,
            remedy="silent data corruption on the odd GPU out: drain the node",
        )
    slow = [o for o in outcomes if o.tflops < median * (1.0 - spread_max)]
    worst_ratio = min(o.tflops for o in outcomes) / median if median > 0 else 0.0
    kw = {"value": worst_ratio, "unit": "ratio", "threshold": 1.0 - spread_max, "evidence": evidence}
    if slow:
        return failed(
            name,
            f"slower than the median by more than {spread_max:.0%}: " + ", ".join(o.device for o in slow),
            remedy="a throttled or degraded GPU: check clocks, power and PCIe",
            **kw,
        )
    return passed(name, f"{len(outcomes)} devices agree; slowest at {worst_ratio:.0%} of the median", **kw)


def device_outcomes(cfg: ComputeConfig, mode: str, matmul: MatmulFn | None = None) -> list[MatmulOutcome]:
    """Every device's outcome, in this process. Raises CudaUnavailable (see `plan_devices`)."""
    devices, size, iters, dtype = _plan(cfg, mode)
    return [run_matmul(device, size, iters, dtype, matmul=matmul, gpu_index=gpu) for device, gpu in devices]


def json_lines_in_child(module: str, args: list[str], timeout_s: float, what: str) -> list[dict[str, Any]]:
    """Runs `python -m module args` in its own session and returns the JSON objects it printed, one
    a line: neither torch nor the CUDA contexts (and their GPU memory) stay in the caller, a
    long-lived agent. Raises TimeoutError (the child's group killed) or RuntimeError."""
    cmd = [sys.executable, "-m", module, *args]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (_PROJECT_ROOT, os.environ.get("PYTHONPATH")) if p)
    )
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise TimeoutError(f"{what} did not finish in {timeout_s:.1f} s (killed)") from None
    if proc.returncode != 0:
        tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"{what} process exited {proc.returncode}: {tail[0][:300]}")
    try:
        return [json.loads(line) for line in out.decode().splitlines() if line.strip()]
    except ValueError as exc:
        raise RuntimeError(f"{what} process wrote something unexpected: {exc}") from exc


def outcomes_in_subprocess(cfg: ComputeConfig, mode: str, timeout_s: float) -> list[MatmulOutcome]:
    """`device_outcomes` in a child process (see `json_lines_in_child`)."""
    args = ["--mode", mode, "--compute", json.dumps(dataclasses.asdict(cfg))]
    lines = json_lines_in_child("preflight.checks.compute", args, timeout_s, "matmul")
    for line in lines:
        if "cuda_unavailable" in line:
            raise CudaUnavailable(str(line["cuda_unavailable"]))
    try:
        return [MatmulOutcome(**line) for line in lines]
    except TypeError as exc:
        raise RuntimeError(f"matmul process wrote something unexpected: {exc}") from exc


def run_compute(ctx: CheckContext, matmul: MatmulFn | None = None) -> list[CheckResult]:
    """The known-answer matmul on every device. `matmul` (a test seam) forces the in-process path."""
    cfg = ctx.config.compute
    started = time.monotonic()
    if importlib.util.find_spec("torch") is None:  # looks, without importing it
        return [no_torch("compute.matmul", ctx)]
    if cfg.isolate and matmul is None:
        timeout, by_budget = budget_timeout(ctx, cfg.timeout_s, floor_s=0.5)
        try:
            outcomes = outcomes_in_subprocess(cfg, ctx.mode, timeout)
        except CudaUnavailable as exc:
            return [no_cuda("compute.matmul", ctx, exc)]
        except TimeoutError as exc:
            if by_budget:
                return [out_of_budget("compute.matmul", ctx, str(exc))]
            return [failed("compute.matmul", str(exc), remedy="a hung GPU: drain the node and inspect it")]
        except (RuntimeError, OSError) as exc:
            return [failed("compute.matmul", str(exc), remedy="read the error; check the driver and GPUs")]
    else:
        try:
            outcomes = device_outcomes(cfg, ctx.mode, matmul)
        except CudaUnavailable as exc:
            return [no_cuda("compute.matmul", ctx, exc)]
    # Per device: the whole unit's time shared out (it includes importing torch and starting CUDA).
    per_device = (time.monotonic() - started) / len(outcomes)
    results = [outcome_result(o, cfg.tflops_floor).with_duration(per_device) for o in outcomes]
    if len(outcomes) > 1:
        results.append(compare_devices(outcomes, cfg.gpu_spread_max))
    return results


def no_torch(name: str, ctx: CheckContext) -> CheckResult:
    """No torch: SKIP on a CPU host; where GPUs are expected a FAIL, since nothing tested them."""
    if not ctx.gpus.expected:
        return skipped(name, "torch is not installed on this host")
    return failed(
        name,
        f"GPUs expected ({ctx.gpus.describe()}) but torch is not installed for {sys.executable}: "
        "the GPUs cannot be tested",
        remedy="install torch in the node agent's (preflight's) interpreter",
    )


def no_cuda(name: str, ctx: CheckContext, exc: CudaUnavailable) -> CheckResult:
    """CUDA unavailable where the device is cuda: FAIL (fail closed) where GPUs are expected, which a
    configured device = "cuda" is; the CPU is never tested in its place."""
    if ctx.gpus.expected:
        return gpus_unreachable(name, ctx, f"CUDA is unavailable: {exc}")
    return failed(
        name,
        f'device = "cuda" but CUDA is unavailable: {exc}',
        remedy="check the driver and the GPUs (nvidia-smi), or set [compute] device",
        fail_closed=True,
    )


def _worker_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m preflight.checks.compute")
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--compute", required=True, help="the [compute] config section as JSON")
    args = parser.parse_args(argv)
    cfg = config_from_mapping({"compute": json.loads(args.compute)}, "--compute").compute
    try:
        outcomes = device_outcomes(cfg, args.mode)
    except CudaUnavailable as exc:  # an answer, not a crash: the parent fails closed with it
        print(json.dumps({"cuda_unavailable": str(exc)}), flush=True)
        return 0
    for outcome in outcomes:
        print(json.dumps(dataclasses.asdict(outcome)), flush=True)
    return 0


SPEC = CheckSpec(
    name="compute",
    run=run_compute,
    timeout_s=lambda c, m: c.compute.timeout_s,
    modes=lambda c: c.compute.modes,
    serial=True,
)


if __name__ == "__main__":
    sys.exit(_worker_main())
