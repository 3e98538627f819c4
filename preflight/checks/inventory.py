"""Inventory through NVML: GPU count, driver and CUDA versions, stray GPU processes, PCIe link, modes.

The GPU count is held against every independent count (preflight.gpus): the NVIDIA GPUs on the PCI
bus (NVML must see each of them, by bus id: "8 on the bus, 7 in NVML" names the missing one), the
configured expected_gpu_count, and the scheduler's allocation. A container or a Slurm job with
device cgroups sees only its allocated GPUs in NVML while sysfs shows the whole bus: there the
allocation, not the bus, is what NVML must match.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from preflight.checks.base import CheckContext, CheckSpec, gpus_unreachable, nvml_query, process_name
from preflight.checks.processes import OwnTree, ProcessView
from preflight.config import InventoryConfig
from preflight.gpus import GpuExpectation, normalize_bus_id
from preflight.nvml import Nvml, NvmlError, NvmlUnavailable
from preflight.result import CheckResult, CheckStatus, failed, passed, skipped, warned


def run_inventory(ctx: CheckContext, view: ProcessView | None = None) -> list[CheckResult]:
    """`view` says who may hold GPU memory (default: this process's own tree; the agent passes its own)."""
    cfg = ctx.config.inventory
    try:
        nvml = ctx.nvml.get()
    except NvmlUnavailable as exc:
        return [gpus_unreachable("inventory", ctx, f"no NVML: {exc}")]
    count = nvml_query("inventory.gpu_count", None, nvml.device_count)
    if isinstance(count, CheckResult):
        return [count]
    results = [
        gpu_count(ctx.gpus, cfg.expected_gpu_count, count, _bus_ids(nvml, count)),
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


def _bus_ids(nvml: Nvml, count: int) -> list[str] | str:
    """NVML's bus id of each GPU, normalized; or why they could not be read."""
    try:
        return [normalize_bus_id(nvml.pci_bus_id(gpu)) for gpu in range(count)]
    except NvmlError as exc:
        return f"NVML could not say its GPUs' bus ids: {exc}"


def gpu_count(gpus: GpuExpectation, expected: int, count: int, nvml_ids: list[str] | str) -> CheckResult:
    """NVML's `count` against the PCI bus, the configured count (`expected`, 0: unset) and the
    allocation (preflight.gpus)."""
    name = "inventory.gpu_count"
    pci = gpus.pci
    evidence = [
        *gpus.evidence(),
        f"NVML: {count} GPU(s) " + (", ".join(nvml_ids) if isinstance(nvml_ids, list) else f"({nvml_ids})"),
    ]
    missing: list[str] = []  # what is short of an expected count: the host cannot run its work
    excess: list[str] = []
    if pci.readable and len(pci.bus_ids) > count:
        if gpus.allocated is not None and count >= gpus.allocated:
            evidence.append(
                f"NVML sees the {count} allocated of the bus's {len(pci.bus_ids)} (a container or cgroup)"
            )
        else:
            lost = sorted(set(pci.bus_ids) - set(nvml_ids)) if isinstance(nvml_ids, list) else []
            named = f": missing {', '.join(lost)}" if lost else ""
            missing.append(f"{len(pci.bus_ids)} NVIDIA GPU(s) on the PCI bus, NVML sees {count}{named}")
    elif pci.readable and 0 < len(pci.bus_ids) < count:
        evidence.append("the PCI bus shows fewer GPUs than NVML (a virtualized sysfs): not compared")
    if expected and count < expected:
        missing.append(f"found {count} GPU(s), expected {expected}")
    elif expected and count > expected:
        excess.append(f"found {count} GPU(s), expected {expected}")
    if gpus.allocated is not None and count < gpus.allocated:
        missing.append(f"the scheduler allocated {gpus.allocated}, NVML sees {count}")
    if gpus.expected and count == 0 and not missing:
        missing.append("NVML sees no GPU")
    kw = {
        "value": float(count),
        "unit": "count",
        "threshold": float(expected or gpus.allocated or len(pci.bus_ids)) or None,
        "evidence": tuple(evidence),
    }
    if missing:
        return failed(
            name,
            "; ".join(missing + excess),
            remedy="a GPU is missing (off the bus or not enumerated): drain the node and inspect",
            fail_closed=True,
            **kw,
        )
    if excess:
        return failed(
            name, "; ".join(excess), remedy="more GPUs than configured: fix expected_gpu_count", **kw
        )
    compared = [
        f"{what} {n}"
        for what, n in (
            ("expected", expected),
            ("allocated", gpus.allocated),
            ("on the PCI bus", len(pci.bus_ids)),
        )
        if n
    ]
    if not compared:
        return skipped(
            name,
            f"found {count} GPU(s); expected_gpu_count is not configured and none is on the PCI bus",
            **kw,
        )
    return passed(name, f"{count} GPU(s) in NVML ({', '.join(compared)})", **kw)


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
