"""Error counters through NVML: uncorrectable ECC, retired pages, row remapping, recovery action, throttling."""

from __future__ import annotations

from preflight.checks.base import CheckContext, CheckSpec, gpus_unreachable, nvml_query
from preflight.config import ErrorsConfig
from preflight.nvml import RECOVERY_ACTIONS, THROTTLE_BITS, Nvml, NvmlUnavailable
from preflight.result import CheckResult, failed, passed, warned

_DRAIN = "drain the node and run the vendor's field diagnostics; reset the GPU (or RMA) before reuse"


def run_counters(ctx: CheckContext) -> list[CheckResult]:
    cfg = ctx.config.errors
    try:
        nvml = ctx.nvml.get()
    except NvmlUnavailable as exc:
        return [gpus_unreachable("errors", ctx, f"no NVML: {exc}")]
    count = nvml_query("errors", None, nvml.device_count)
    if isinstance(count, CheckResult):
        return [count]
    results: list[CheckResult] = []
    for gpu in range(count):
        results += [
            _ecc(cfg, nvml, gpu),
            _retired_pages(nvml, gpu),
            _row_remap(nvml, gpu),
            _recovery_action(nvml, gpu),
            _throttle(cfg, nvml, gpu),
        ]
    return results


def _ecc(cfg: ErrorsConfig, nvml: Nvml, gpu: int) -> CheckResult:
    name = "errors.ecc_uncorrectable"
    volatile = nvml_query(name, gpu, lambda: nvml.ecc_uncorrected(gpu, volatile=True))
    if isinstance(volatile, CheckResult):
        return volatile  # ECC disabled or unsupported: SKIP with NVML's reason
    aggregate = nvml_query(name, gpu, lambda: nvml.ecc_uncorrected(gpu, volatile=False))
    evidence = (f"volatile={volatile}", f"aggregate={aggregate if isinstance(aggregate, int) else 'n/a'}")
    kw = {
        "gpu_index": gpu,
        "value": float(volatile),
        "unit": "count",
        "threshold": float(cfg.ecc_volatile_uncorrectable_max),
        "evidence": evidence,
    }
    if volatile > cfg.ecc_volatile_uncorrectable_max:
        return failed(
            name, f"{volatile} uncorrectable ECC error(s) since the driver loaded", remedy=_DRAIN, **kw
        )
    if isinstance(aggregate, int) and aggregate > cfg.ecc_aggregate_uncorrectable_max:
        return warned(
            name,
            f"{aggregate} uncorrectable ECC error(s) in the GPU's lifetime",
            remedy="watch this GPU; check retired pages / row remapping",
            **kw,
        )
    return passed(name, "no uncorrectable ECC errors", **kw)


def _retired_pages(nvml: Nvml, gpu: int) -> CheckResult:
    name = "errors.retired_pages_pending"
    pending = nvml_query(name, gpu, lambda: nvml.retired_pages_pending(gpu))
    if isinstance(pending, CheckResult):
        return pending  # GPUs with row remapping (A100 and later) do not retire pages
    if pending:
        return failed(
            name,
            "page retirement pending until the GPU is reset",
            gpu_index=gpu,
            evidence=("retired_pages_pending=1",),
            remedy="reset the GPU (or reboot) before reuse",
        )
    return passed(name, "no page retirement pending", gpu_index=gpu)


def _row_remap(nvml: Nvml, gpu: int) -> CheckResult:
    name = "errors.row_remap"
    rows = nvml_query(name, gpu, lambda: nvml.remapped_rows(gpu))
    if isinstance(rows, CheckResult):
        return rows
    evidence = (
        f"correctable={rows.correctable} uncorrectable={rows.uncorrectable} "
        f"pending={int(rows.pending)} failure={int(rows.failure)}",
    )
    if rows.failure:
        return failed(
            name,
            "row remapping failed (no spare rows left)",
            gpu_index=gpu,
            evidence=evidence,
            remedy="the GPU needs replacement (RMA): drain the node",
        )
    if rows.pending:
        return failed(
            name,
            "row remapping pending until the GPU is reset",
            gpu_index=gpu,
            evidence=evidence,
            remedy="reset the GPU (nvidia-smi -r) or reboot the node before reuse",
        )
    return passed(name, "no row remapping pending or failed", gpu_index=gpu, evidence=evidence)


def _recovery_action(nvml: Nvml, gpu: int) -> CheckResult:
    name = "errors.recovery_action"
    action = nvml_query(name, gpu, lambda: nvml.recovery_action(gpu))
    if isinstance(action, CheckResult):
        return action  # field absent before driver R550: SKIP, with NVML's reason
    label = RECOVERY_ACTIONS.get(action, f"unknown({action})")
    if action == 0:
        return passed(name, "NVML recovery action: none", gpu_index=gpu, value=0)
    return failed(
        name,
        f"NVML asks for recovery action {label}",
        gpu_index=gpu,
        value=float(action),
        evidence=(f"recovery_action={action} ({label})",),
        remedy=f"perform {label} before reuse",
    )


def _throttle(cfg: ErrorsConfig, nvml: Nvml, gpu: int) -> CheckResult:
    name = "errors.throttle"
    mask = nvml_query(name, gpu, lambda: nvml.throttle_reasons(gpu))
    if isinstance(mask, CheckResult):
        return mask
    active = sorted(reason for reason, bit in THROTTLE_BITS.items() if mask & bit)
    evidence = (f"clocks_event_reasons=0x{mask:x} ({', '.join(active) or 'none'})",)
    bad = [r for r in active if r in cfg.fail_throttle_reasons]
    if bad:
        return failed(
            name,
            "clocks throttled: " + ", ".join(bad),
            gpu_index=gpu,
            evidence=evidence,
            remedy="check cooling, power supply and the BMC event log; drain the node",
        )
    meh = [r for r in active if r in cfg.warn_throttle_reasons]
    if meh:
        return warned(
            name,
            "clocks throttled: " + ", ".join(meh),
            gpu_index=gpu,
            evidence=evidence,
            remedy="check the GPU's temperature and airflow",
        )
    return passed(name, "no harmful throttling", gpu_index=gpu, evidence=evidence)


SPEC = CheckSpec(
    name="errors",
    run=run_counters,
    timeout_s=lambda c, m: c.errors.timeout_s,
    modes=lambda c: c.errors.modes,
)
