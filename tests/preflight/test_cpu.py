"""The CPU frequency check reads sysfs cpufreq; the tests build the tree as the kernel lays it out."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from preflight.config import ConfigError, CpuConfig, PreflightConfig, config_from_mapping
from preflight.result import CheckResult, CheckStatus
from preflight.runner import run_preflight

GHZ = 1_000_000  # kHz


def cpu(
    root: Path,
    n: int,
    *,
    hw_max: float,
    scaling_max: float,
    base: float | None = None,
    bios: float | None = None,
) -> None:
    freq = root / "devices" / "system" / "cpu" / f"cpu{n}" / "cpufreq"
    freq.mkdir(parents=True)
    (freq / "cpuinfo_max_freq").write_text(f"{int(hw_max * GHZ)}\n")
    (freq / "scaling_max_freq").write_text(f"{int(scaling_max * GHZ)}\n")
    if base is not None:
        (freq / "base_frequency").write_text(f"{int(base * GHZ)}\n")
    if bios is not None:
        (freq / "bios_limit").write_text(f"{int(bios * GHZ)}\n")


def run(root: Path, **kw: object) -> CheckResult:
    cfg = dataclasses.replace(PreflightConfig(), cpu=CpuConfig(sysfs_root=str(root), **kw))
    (result,) = run_preflight(cfg, "quick", only=("cpu",)).results
    return result


def test_cpus_at_nominal_pass_and_turbo_off_is_not_a_cap(tmp_path: Path) -> None:
    cpu(tmp_path, 0, hw_max=3.8, scaling_max=3.8, base=2.0)
    cpu(tmp_path, 1, hw_max=3.8, scaling_max=2.0, base=2.0)  # turbo off: at base, not below it
    result = run(tmp_path)
    assert result.status is CheckStatus.PASS, result.message
    assert "2 CPU(s) at their nominal 2.00 GHz" in result.message


def test_a_policy_cap_below_base_fails_naming_the_cpu_and_the_file(tmp_path: Path) -> None:
    for n in range(4):
        cpu(tmp_path, n, hw_max=3.8, scaling_max=3.8 if n != 2 else 1.2, base=2.0)
    result = run(tmp_path)
    assert result.status is CheckStatus.FAIL
    assert (
        "1 of 4 CPU(s) capped below nominal: lowest 1.20 GHz of 2.00 GHz (scaling_max_freq)" in result.message
    )
    assert result.evidence == ("cpu2: capped at 1.20 GHz by scaling_max_freq, nominal 2.00 GHz",)
    assert result.value == 0.6
    assert run(tmp_path, capped_below_nominal="warn").status is CheckStatus.WARN


def test_a_platform_limit_or_max_perf_pct_is_a_cap_too(tmp_path: Path) -> None:
    cpu(tmp_path, 0, hw_max=3.0, scaling_max=3.0, bios=1.5)  # no base_frequency: nominal is the hw max
    result = run(tmp_path)
    assert result.status is CheckStatus.FAIL
    assert "(bios_limit)" in result.message
    other = tmp_path / "pstate"
    cpu(other, 0, hw_max=3.0, scaling_max=3.0)
    pstate = other / "devices" / "system" / "cpu" / "intel_pstate"
    pstate.mkdir()
    (pstate / "max_perf_pct").write_text("50\n")
    assert "intel_pstate/max_perf_pct=50" in run(other).message
    (pstate / "max_perf_pct").write_text("100\n")
    assert run(other).status is CheckStatus.PASS


def test_within_the_tolerance_is_nominal(tmp_path: Path) -> None:
    cpu(tmp_path, 0, hw_max=2.0, scaling_max=1.99)
    assert run(tmp_path).status is CheckStatus.PASS
    assert run(tmp_path, cap_tolerance=0.0).status is CheckStatus.FAIL


def test_no_cpufreq_is_skip_with_its_reason(tmp_path: Path) -> None:
    (tmp_path / "devices" / "system" / "cpu" / "cpu0").mkdir(parents=True)  # a VM: no cpufreq directory
    result = run(tmp_path)
    assert result.status is CheckStatus.SKIP
    assert "no cpufreq in sysfs for 1 CPU(s)" in result.message


def test_garbage_in_sysfs_is_not_a_reading(tmp_path: Path) -> None:
    cpu(tmp_path, 0, hw_max=2.0, scaling_max=2.0)
    (tmp_path / "devices" / "system" / "cpu" / "cpu0" / "cpufreq" / "scaling_max_freq").write_text(
        "<unsupported>\n"
    )
    assert run(tmp_path).status is CheckStatus.PASS  # the cap it cannot read is not invented


@pytest.mark.parametrize(
    ("section", "words"),
    [
        ({"capped_below_nominal": "maybe"}, "not one of fail, warn, ignore"),
        ({"cap_tolerance": 1.5}, "a fraction below 1"),
    ],
)
def test_bad_cpu_config_is_refused(section: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        config_from_mapping({"cpu": section})
