"""Inventory through NVML: GPU count, driver and CUDA versions, stray GPU processes, PCIe link, modes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from preflight.checks.base import CheckContext, CheckSpec, nvml_query, process_name
from preflight.checks.processes import OwnTree, ProcessView
from preflight.config import InventoryConfig
from preflight.nvml import Nvml, NvmlError, NvmlUnavailable
from preflight.result import CheckResult, CheckStatus, failed, passed, skipped, warned


def run_inventory(ctx: CheckContext, view: ProcessView | None = None) -> list[CheckResult]:
    """`view` says who may hold GPU memory (default: this process's own tree; the agent passes its own)."""
    cfg = ctx.config.inventory
    try:
        nvml = ctx.nvml.get()
    except NvmlUnavailable as exc:
        return [skipped("inventory", f"no NVML: {exc}")]
    count = nvml_query("inventory.gpu_count", None, nvml.device_count)
    if isinstance(count, CheckResult):
        return [count]
    results = [
        _gpu_count(cfg, count),
        _version("inventory.driver_version", cfg.driver_version, nvml.driver_version),
        _version("inventory.cuda_version", cfg.cuda_version, nvml.cuda_driver_version),
    ]
    view = OwnTree() if view is None else view
    for gpu in range(count):
        results.append(_gpu_processes(cfg, nvml, gpu, view))
        results.append(_pcie_link(cfg, nvml, gpu))
    results.append(_mode_check("inventory.persistence_mode", cfg.persistence_mode, nvml, count, _persistence))
    results.append(_mode_check("inventory.mig_mode", cfg.mig_mode, nvml, count, _mig))
    return results


def _gpu_count(cfg: InventoryConfig, count: int) -> CheckResult:
    name = "inventory.gpu_count"
    if cfg.expected_gpu_count == 0:
        return skipped(
            name, f"found {count} GPU(s); expected_gpu_count is not configured", value=count, unit="count"
        )
    kw = {"value": float(count), "unit": "count", "threshold": float(cfg.expected_gpu_count)}
    if count != cfg.expected_gpu_count:
        return failed(
            name,
            f"found {count} GPU(s), expected {cfg.expected_gpu_count}",
            remedy="a GPU is missing (off the bus or not enumerated): drain the node and inspect",
            **kw,
        )
    return passed(name, f"{count} GPU(s) as expected", **kw)


def _version(name: str, expected: str, read: Callable[[], str]) -> CheckResult:
    found = nvml_query(name, None, read)
    if isinstance(found, CheckResult):
        return found
    if not expected:
        return skipped(name, f"found {found}; no expected version configured", evidence=(f"found={found}",))
    if str(found) != expected:
        return failed(
            name,
            f"found {found}, expected {expected}",
            evidence=(f"found={found}", f"expected={expected}"),
            remedy="reimage the node with the configured driver",
        )
    return passed(name, f"{found} as configured")


def _gpu_processes(cfg: InventoryConfig, nvml: Nvml, gpu: int, view: ProcessView) -> CheckResult:
    name = "inventory.gpu_processes"
    procs = nvml_query(name, gpu, lambda: nvml.compute_processes(gpu))
    if isinstance(procs, CheckResult):
        return procs
    stray, pids = [], []
    for proc in procs:
        comm = process_name(proc.pid)
        if comm in cfg.allowed_gpu_processes or view.allowed(proc.pid):
            continue
        used = "unknown" if proc.used_bytes is None else f"{proc.used_bytes / 2**20:.0f} MiB"
        origin = view.origin(proc.pid)
        came = "" if origin is None else f" from {origin.describe()}"
        stray.append(f"pid={proc.pid} name={comm} used={used}{came}")
        pids.append(str(proc.pid))
    if stray:
        return failed(
            name,
            f"{len(stray)} process(es) hold GPU memory: pid {', '.join(pids)}",
            gpu_index=gpu,
            value=len(stray),
            unit="count",
            threshold=0,
            evidence=tuple(stray),
            remedy="kill the leftover processes (a previous attempt's zombies) or drain the node",
        )
    return passed(
        name, "no other process holds GPU memory", gpu_index=gpu, value=0, unit="count", threshold=0
    )


def _pcie_link(cfg: InventoryConfig, nvml: Nvml, gpu: int) -> CheckResult:
    name = "inventory.pcie_link"
    link = nvml_query(name, gpu, lambda: nvml.pcie_link(gpu))
    if isinstance(link, CheckResult):
        return link
    evidence = (f"gen {link.current_gen}/{link.max_gen} width x{link.current_width}/x{link.max_width}",)
    kw = {
        "gpu_index": gpu,
        "value": float(link.current_width),
        "unit": "lanes",
        "threshold": float(link.max_width),
        "evidence": evidence,
    }
    problems: list[tuple[str, str]] = []
    if link.current_width < link.max_width:
        problems.append(
            (cfg.pcie_width_below_max, f"PCIe width x{link.current_width} below max x{link.max_width}")
        )
    if link.current_gen < link.max_gen:
        problems.append((cfg.pcie_gen_below_max, f"PCIe gen {link.current_gen} below max {link.max_gen}"))
    remedy = "reseat the GPU / riser or replace the cable; a degraded link cuts host<->GPU bandwidth"
    for policy, status in (("fail", failed), ("warn", warned)):
        hits = [text for p, text in problems if p == policy]
        if hits:
            return status(name, "; ".join(hits), remedy=remedy, **kw)
    return passed(name, f"PCIe gen {link.current_gen} x{link.current_width}", **kw)


def _persistence(nvml: Nvml, gpu: int) -> bool:
    return nvml.persistence_mode(gpu)


def _mig(nvml: Nvml, gpu: int) -> bool:
    current, pending = nvml.mig_mode(gpu)
    if current != pending:
        raise NvmlError(f"MIG mode change pending ({'on' if pending else 'off'}) until GPU reset")
    return current


def _mode_check(
    name: str, wanted: str, nvml: Nvml, count: int, read: Callable[[Nvml, int], bool]
) -> CheckResult:
    evidence: list[str] = []
    statuses: list[bool] = []
    for gpu in range(count):
        state = nvml_query(name, gpu, lambda g=gpu: read(nvml, g))  # type: ignore[misc]  # default-arg lambda
        if isinstance(state, CheckResult):
            if state.status is CheckStatus.FAIL:
                return state
            evidence.append(f"gpu{gpu}: {state.message}")
            continue
        on = "on" if state else "off"
        evidence.append(f"gpu{gpu}: {on}")
        statuses.append(wanted in ("any", on))
    if not statuses:
        return skipped(name, "no GPU reports this mode", evidence=tuple(evidence))
    if wanted == "any":
        return skipped(name, "not configured (any); found: " + ", ".join(evidence), evidence=tuple(evidence))
    if not all(statuses):
        return failed(
            name,
            f"not {wanted} on every GPU",
            evidence=tuple(evidence),
            remedy=f"set the mode to {wanted} (nvidia-smi) and reset the GPUs, or fix the config",
        )
    return passed(name, f"{wanted} on every GPU", evidence=tuple(evidence))


SPEC = CheckSpec(
    name="inventory",
    run=run_inventory,
    timeout_s=lambda c, m: c.inventory.timeout_s,
    modes=lambda c: c.inventory.modes,
)


def spec_for(view: ProcessView) -> CheckSpec:
    """The inventory unit judging GPU memory holders by `view` (the node agent's)."""
    return dataclasses.replace(SPEC, run=lambda ctx: run_inventory(ctx, view))
