"""In-node all-reduce bandwidth: one process per GPU (NCCL), or `cpu_processes` gloo ranks on CPU."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from preflight.checks.base import CheckContext, CheckSpec, budget_timeout, gpus_unreachable, out_of_budget
from preflight.checks.expectations import no_floor
from preflight.collective import AllReduceResult
from preflight.nvml import NvmlError
from preflight.result import CheckResult, failed, passed, skipped
from runwarden.net import free_port

_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])


def _local_world(ctx: CheckContext) -> tuple[str, int]:
    """(backend, ranks): one NCCL rank per GPU NVML sees, else gloo with `cpu_processes` ranks.
    Where GPUs are expected it is NCCL even with 0 ranks (NVML sees none): never gloo on a GPU host.
    Asks NVML, not torch: torch is imported only by the ranks, never by the caller (the agent)."""
    if ctx.config.compute.device != "cpu":
        try:
            count = ctx.nvml.get().device_count()
        except NvmlError:
            count = 0
        if count > 0 or ctx.gpus.expected:
            return "nccl", count
    return "gloo", ctx.config.collective.cpu_processes


def launch_local(
    world: int, backend: str, size_bytes: int, iterations: int, warmup: int, timeout_s: float
) -> AllReduceResult:
    """Starts `world` ranks of preflight.collective on this host and returns rank 0's result.

    Raises TimeoutError (ranks killed) or RuntimeError (a rank failed) with the ranks' last words.
    """
    return AllReduceResult(**launch_ranks(world, backend, size_bytes, iterations, warmup, timeout_s))


def launch_ranks(
    world: int,
    backend: str,
    size_bytes: int,
    iterations: int,
    warmup: int,
    timeout_s: float,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """`launch_local`'s work, with `extra` arguments for the ranks (the burn-in's --soak-s): rank 0's
    JSON result as a mapping. A store port another process took between our choice and rank 0's bind
    says nothing about the node: the ranks run once more on a new port (within the same deadline)."""
    deadline = time.monotonic() + timeout_s
    for attempt in range(_PORT_TRIES):
        try:
            return _run_ranks(world, backend, size_bytes, iterations, warmup, deadline, timeout_s, extra)
        except RuntimeError as exc:
            if attempt + 1 == _PORT_TRIES or not _port_taken(str(exc)) or time.monotonic() >= deadline:
                raise
    raise AssertionError("unreachable")


_PORT_TRIES = 3


def _port_taken(errors: str) -> bool:
    return "EADDRINUSE" in errors or "address already in use" in errors.lower()


def _run_ranks(
    world: int,
    backend: str,
    size_bytes: int,
    iterations: int,
    warmup: int,
    deadline: float,
    timeout_s: float,
    extra: tuple[str, ...],
) -> dict[str, Any]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="preflight-allreduce-") as tmp:
        out = os.path.join(tmp, "result.json")
        procs = []
        for rank in range(world):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                PYTHONPATH=os.pathsep.join(p for p in (_PROJECT_ROOT, os.environ.get("PYTHONPATH")) if p),
            )
            if backend == "gloo":
                env.setdefault("GLOO_SOCKET_IFNAME", "lo")
            cmd = [
                sys.executable,
                "-m",
                "preflight.collective",
                "--backend",
                backend,
                "--size-bytes",
                str(size_bytes),
                "--iterations",
                str(iterations),
                "--warmup",
                str(warmup),
                "--timeout",
                str(max(5.0, timeout_s)),
                "--out",
                out,
                *extra,
            ]
            with open(os.path.join(tmp, f"rank{rank}.err"), "wb") as err:
                procs.append(
                    subprocess.Popen(
                        cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
                    )
                )
        errors = _wait_all(procs, deadline, tmp)
        if errors is None:
            raise TimeoutError(f"all-reduce ranks did not finish in {timeout_s:.0f} s (killed)")
        if errors:
            raise RuntimeError("; ".join(errors))
        with open(out, encoding="utf-8") as fh:
            result: dict[str, Any] = json.load(fh)
            return result


def _wait_all(procs: list[subprocess.Popen[bytes]], deadline: float, tmp: str) -> list[str] | None:
    """Errors of failed ranks ([] when all exited 0); None on timeout. At the deadline, or once a rank
    failed (the others cannot finish a collective without it), the ranks still running are killed."""
    while any(proc.poll() is None for proc in procs):
        if time.monotonic() >= deadline:
            _kill(procs)
            return None
        if any(proc.returncode for proc in procs):
            _kill(procs)
            break
        time.sleep(_POLL_S)
    errors = []
    for rank, proc in enumerate(procs):
        if proc.returncode and proc.returncode > 0:
            with open(os.path.join(tmp, f"rank{rank}.err"), "rb") as fh:
                lines = fh.read().decode("utf-8", "replace").strip().splitlines()
            errors.append(f"rank {rank} exited {proc.returncode}: {(lines[-1:] or ['(no output)'])[0][:300]}")
    return errors or [
        f"rank {rank} killed by signal {-proc.returncode}"
        for rank, proc in enumerate(procs)
        if proc.returncode
    ]


_POLL_S = 0.05


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def evaluate(result: AllReduceResult, floor_gbps: float) -> CheckResult:
    name = "collective.all_reduce"
    kw = {
        "value": result.busbw_gbps,
        "unit": "GB/s",
        "threshold": floor_gbps or None,
        "evidence": (
            f"backend={result.backend} ranks={result.world_size} bytes={result.size_bytes} "
            f"iters={result.iterations} time={result.time_s * 1e3:.3f} ms "
            f"algbw={result.algbw_gbps:.3f} GB/s busbw={result.busbw_gbps:.3f} GB/s",
        ),
    }
    if not result.correct:
        return failed(
            name, "all-reduce returned a wrong sum", remedy="drain the node; check NVLink/NCCL", **kw
        )
    if floor_gbps and result.busbw_gbps < floor_gbps:
        return failed(
            name,
            f"bus bandwidth {result.busbw_gbps:.2f} GB/s below the floor {floor_gbps:.2f}",
            remedy="check NVLink/NVSwitch (nvidia-smi nvlink -s), PCIe and NCCL settings",
            **kw,
        )
    note = "" if floor_gbps else no_floor("collective.busbw_floor_gbps")
    return passed(
        name, f"bus bandwidth {result.busbw_gbps:.3g} GB/s over {result.world_size} ranks{note}", **kw
    )


def run_collective(ctx: CheckContext) -> list[CheckResult]:
    """Full mode: the all-reduce over every local GPU (NCCL), or gloo ranks on a CPU-only host.
    Quick mode, before every attempt: a short NCCL all-reduce on two or more GPUs, and on one local
    device (one GPU, or only the CPU) a SKIP that costs nothing: no process is started. Where GPUs
    are expected and NVML sees none, a FAIL (fail closed), in either mode."""
    cfg = ctx.config.collective
    name = "collective.all_reduce"
    backend, world = _local_world(ctx)
    quick = ctx.mode == "quick"
    if backend == "nccl" and world == 0:
        return [gpus_unreachable(name, ctx, "NVML sees no GPU for the in-node all-reduce")]
    if quick and (backend != "nccl" or world < 2):
        seen = f"{world} GPU" if backend == "nccl" else "no GPU, the CPU only"
        return [skipped(name, f"one local device: no in-node all-reduce ({seen})")]
    if importlib.util.find_spec("torch") is None:  # looks, without importing it
        return [skipped(name, "torch is not installed on this host")]
    if world < 2:
        return [skipped(name, f"needs at least 2 ranks on this node, have {world}")]
    size = cfg.size_bytes_quick if quick else cfg.size_bytes_gpu if backend == "nccl" else cfg.size_bytes_cpu
    iterations = cfg.iterations_quick if quick else cfg.iterations
    limit = cfg.quick_timeout_s if quick else cfg.timeout_s
    timeout, by_budget = budget_timeout(ctx, limit)
    try:
        result = launch_local(world, backend, size, iterations, cfg.warmup, timeout)
    except TimeoutError as exc:
        if by_budget:
            return [out_of_budget(name, ctx, str(exc))]
        return [failed(name, str(exc), remedy="a hung collective: check NCCL/NVLink and the GPUs' health")]
    except (RuntimeError, OSError, ValueError, TypeError) as exc:
        return [failed(name, f"all-reduce failed: {exc}", remedy="read the ranks' errors; check NCCL/NVLink")]
    return [evaluate(result, cfg.busbw_floor_gbps)]


SPEC = CheckSpec(
    name="collective",
    run=run_collective,
    timeout_s=lambda c, m: (c.collective.quick_timeout_s if m == "quick" else c.collective.timeout_s) + 2.0,
    modes=lambda c: c.collective.modes,
    serial=True,
)
