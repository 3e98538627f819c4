"""CPU frequency capped below nominal (from sysfs cpufreq): a BIOS power limit, a platform cap or a
`max_perf_pct` left low starves the input pipeline and the host side of every step, and nothing
GPU-side shows it. One of the quick preflight's units (`preflight.runner`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from preflight.checks.base import CheckContext, CheckSpec
from preflight.config import CpuConfig
from preflight.result import CheckResult, failed, passed, skipped, warned

NAME = "cpu.frequency"
_CPU_DIR = re.compile(r"cpu\d+")


def _positive_int(path: Path) -> int | None:
    try:
        value = int(path.read_text(encoding="utf-8", errors="replace").strip())
    except (OSError, ValueError):
        return None
    return value if value > 0 else None


@dataclass(frozen=True, slots=True)
class CpuFreq:
    cpu: str
    nominal_khz: int
    cap_khz: int
    cap_source: str  # which file set the cap

    @property
    def fraction(self) -> float:
        return self.cap_khz / self.nominal_khz


def read_cpu(cpufreq: Path, cpu: str, max_perf_pct: int | None) -> CpuFreq | None:
    hw_max = _positive_int(cpufreq / "cpuinfo_max_freq")
    if hw_max is None:
        return None
    nominal = _positive_int(cpufreq / "base_frequency") or hw_max
    caps = [(hw_max, "cpuinfo_max_freq")]
    if (scaling := _positive_int(cpufreq / "scaling_max_freq")) is not None:
        caps.append((scaling, "scaling_max_freq"))
    if (bios := _positive_int(cpufreq / "bios_limit")) is not None:
        caps.append((bios, "bios_limit"))
    if max_perf_pct is not None and max_perf_pct < 100:
        caps.append((hw_max * max_perf_pct // 100, f"intel_pstate/max_perf_pct={max_perf_pct}"))
    cap, source = min(caps)
    return CpuFreq(cpu=cpu, nominal_khz=nominal, cap_khz=cap, cap_source=source)


def frequency_result(cfg: CpuConfig) -> CheckResult:
    """ "Nominal" is the rated base frequency (`base_frequency`, intel_pstate) or, where the driver does
    not expose one, the hardware maximum (`cpuinfo_max_freq`). The cap is the lowest of the policy
    maximum (`scaling_max_freq`), the platform's limit (`bios_limit`, acpi-cpufreq) and intel_pstate's
    `max_perf_pct` share of the hardware maximum. Turbo switched off is not a cap below nominal.
    """
    root = Path(cfg.sysfs_root) / "devices" / "system" / "cpu"
    pct = _positive_int(root / "intel_pstate" / "max_perf_pct")
    cpus = sorted(
        (p for p in root.iterdir() if _CPU_DIR.fullmatch(p.name)) if root.is_dir() else [],
        key=lambda p: int(p.name[3:]),
    )
    read = [f for p in cpus if (f := read_cpu(p / "cpufreq", p.name, pct)) is not None]
    if not read:
        return skipped(
            NAME,
            f"no cpufreq in sysfs for {len(cpus)} CPU(s) (a VM, or a driver without cpufreq): "
            "the frequency cap cannot be read",
        )
    capped = [f for f in read if f.fraction < 1.0 - cfg.cap_tolerance]
    lowest = min(read, key=lambda f: f.fraction)
    if not capped:
        return passed(
            NAME,
            f"{len(read)} CPU(s) at their nominal {lowest.nominal_khz / 1e6:.2f} GHz or above",
            value=round(lowest.fraction, 3),
            unit="of nominal",
        )
    evidence = tuple(
        f"{f.cpu}: capped at {f.cap_khz / 1e6:.2f} GHz by {f.cap_source}, nominal {f.nominal_khz / 1e6:.2f} GHz"
        for f in capped[:16]
    ) + ((f"... and {len(capped) - 16} more",) if len(capped) > 16 else ())
    message = (
        f"{len(capped)} of {len(read)} CPU(s) capped below nominal: lowest "
        f"{lowest.cap_khz / 1e6:.2f} GHz of {lowest.nominal_khz / 1e6:.2f} GHz ({lowest.cap_source})"
    )
    make = failed if cfg.capped_below_nominal == "fail" else warned
    return make(
        NAME,
        message,
        evidence=evidence,
        value=round(lowest.fraction, 3),
        unit="of nominal",
        remedy="check the BIOS power/performance profile and the cpufreq policy (cpupower frequency-info)",
    )


def run_cpu(ctx: CheckContext) -> list[CheckResult]:
    cfg = ctx.config.cpu
    if cfg.capped_below_nominal == "ignore":
        return [skipped(NAME, "capped_below_nominal = ignore")]
    return [frequency_result(cfg)]


SPEC = CheckSpec(
    name="cpu",
    run=run_cpu,
    timeout_s=lambda c, m: c.cpu.timeout_s,
    modes=lambda c: c.cpu.modes,
)
