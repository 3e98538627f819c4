"""What every check unit gets (a context) and what the runner needs to know about it (a spec)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from preflight.config import PreflightConfig
from preflight.gpus import NOT_EXPECTED, GpuExpectation
from preflight.nvml import GpuLost, Nvml, NvmlError, NvmlNotSupported, NvmlUnavailable
from preflight.result import CheckResult, failed, inconclusive, skipped

T = TypeVar("T")


class NvmlSession:
    """One NVML init shared by the NVML checks of a run; a failed init is remembered, not retried."""

    def __init__(self, factory: Callable[[], Nvml]) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._nvml: Nvml | None = None
        self._error: NvmlUnavailable | None = None

    def get(self) -> Nvml:
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._nvml is None:
                nvml = self._factory()
                try:
                    nvml.init()
                except NvmlUnavailable as exc:
                    self._error = exc
                    raise
                except NvmlError as exc:
                    self._error = NvmlUnavailable(str(exc))
                    raise self._error from exc
                self._nvml = nvml
            return self._nvml

    def close(self) -> None:
        with self._lock:
            if self._nvml is not None:
                self._nvml.shutdown()
                self._nvml = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckContext:
    config: PreflightConfig
    mode: str
    nvml: NvmlSession
    deadline: float  # time.monotonic() by which the whole run must end
    # Where GPUs are expected (preflight.gpus); the runner reads it from the host for every run.
    gpus: GpuExpectation = NOT_EXPECTED


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckSpec:
    """One independent unit: `run` returns its results; `serial` units run one at a time, after the rest."""

    name: str
    run: Callable[[CheckContext], list[CheckResult]]
    timeout_s: Callable[[PreflightConfig, str], float]
    modes: Callable[[PreflightConfig], tuple[str, ...]]
    serial: bool = False


UNREACHABLE_REMEDY = (
    "the GPUs are expected here and cannot be reached: check the driver (nvidia-smi, dmesg for Xid), "
    "reseat or reset the GPUs, or fix the expectation (expected_gpu_count, the allocation)"
)


def gpus_unreachable(name: str, ctx: CheckContext, why: str, evidence: tuple[str, ...] = ()) -> CheckResult:
    """Where GPUs are expected, a check that cannot reach them FAILS (fail closed); elsewhere it SKIPs."""
    if not ctx.gpus.expected:
        return skipped(name, why, evidence=evidence)
    return failed(
        name,
        f"GPUs expected ({ctx.gpus.describe()}) but {why}",
        evidence=ctx.gpus.evidence() + evidence,
        remedy=UNREACHABLE_REMEDY,
        fail_closed=True,
    )


def budget_timeout(ctx: CheckContext, own_s: float, floor_s: float = 1.0) -> tuple[float, bool]:
    """How long a unit's child may run: its own limit, or what is left of the run's budget (less a
    margin, at least `floor_s`); True when the budget is the shorter, so a timeout then is the
    budget's, not the node's (`out_of_budget`)."""
    left = max(floor_s, ctx.deadline - time.monotonic() - 0.5)
    return (own_s, False) if own_s <= left else (left, True)


def out_of_budget(name: str, ctx: CheckContext, what: str) -> CheckResult:
    """A child stopped because the run's budget ran out before its own limit: it could not tell."""
    return inconclusive(
        name,
        f"{what}: stopped when the run's budget ran out, before its own limit; the budget ran out, "
        "not the node",
        remedy="run it again; if it repeats, raise [run] quick_budget_s / full_budget_s for this node",
    )


def nvml_query(name: str, gpu: int | None, fn: Callable[[], T]) -> T | CheckResult:
    """Runs one NVML query; an unsupported query becomes SKIP, a failing one FAIL (with NVML's words)."""
    try:
        return fn()
    except NvmlNotSupported as exc:
        return skipped(name, f"not supported by this GPU/driver: {exc}", gpu_index=gpu)
    except GpuLost as exc:
        return failed(
            name,
            str(exc),
            gpu_index=gpu,
            remedy="GPU fell off the bus: drain the node, reset or reseat the GPU",
        )
    except NvmlError as exc:
        return failed(
            name, f"NVML query failed: {exc}", gpu_index=gpu, remedy="check `nvidia-smi -q` on the node"
        )


def own_process_tree() -> frozenset[int]:
    """This process and its descendants (from /proc): their GPU memory is the preflight's own."""
    me = os.getpid()
    parents: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return frozenset({me})
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                stat = fh.read()
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    tree = {me}
    changed = True
    while changed:
        changed = False
        for pid, ppid in parents.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                changed = True
    return frozenset(tree)


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return "?"  # another PID namespace (containers) or already gone
