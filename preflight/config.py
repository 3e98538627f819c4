"""Preflight thresholds: one frozen dataclass per TOML section, documented defaults, unknown keys rejected.

The defaults below are the documentation (each field's comment says what it means); `defaults.toml`
beside this module is the same values as a file an operator can copy, and a test keeps the two equal.
Durations are seconds as floats. An empty string or a zero floor means "not checked" and the check
says so in its result, never silently passes.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from preflight.nvml import THROTTLE_BITS

MODES = ("quick", "full")  # the per-attempt modes; each check's `modes` names some of these
BURN_IN = "burn_in"  # the burn-in pipeline: its stages are [burn_in].stages, not the checks' `modes`
RUN_MODES = (*MODES, BURN_IN)
BURN_IN_STAGES = ("matmul", "memory", "dcgm", "allreduce", "storage")
MEMORY_PATTERNS = ("walking_ones", "walking_zeros", "address", "random")


class ConfigError(ValueError):
    """A config file or value that cannot be used; the message names the file and key."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    quick_budget_s: float = 15.0  # total wall-clock budget of `preflight run --quick`
    full_budget_s: float = 120.0  # total wall-clock budget of `preflight run --full`
    burn_in_budget_s: float = 3600.0  # total wall-clock budget of `preflight run --burn-in`


@dataclass(frozen=True, slots=True, kw_only=True)
class InventoryConfig:
    modes: tuple[str, ...] = MODES
    timeout_s: float = 10.0
    expected_gpu_count: int = 0  # 0: not checked (the count is still reported)
    driver_version: str = ""  # e.g. "550.127.05"; "": not checked
    cuda_version: str = ""  # the driver's CUDA version, e.g. "12.4"; "": not checked
    persistence_mode: str = "any"  # "on" | "off" | "any"
    mig_mode: str = "any"  # "on" | "off" | "any"
    pcie_width_below_max: str = "fail"  # "fail" | "warn" | "ignore": x4 instead of x16 is a real fault
    # Idle GPUs lower their PCIe generation to save power, so a lower current generation is a warning.
    pcie_gen_below_max: str = "warn"
    allowed_gpu_processes: tuple[str, ...] = ()  # process names allowed to hold GPU memory
    sysfs_root: str = "/sys"  # the PCI bus's NVIDIA GPUs are read from <sysfs_root>/bus/pci/devices


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorsConfig:
    modes: tuple[str, ...] = MODES
    timeout_s: float = 10.0
    ecc_volatile_uncorrectable_max: int = 0  # above: FAIL (errors since the last driver load)
    ecc_aggregate_uncorrectable_max: int = 0  # above: WARN (lifetime count, includes repaired history)
    fail_throttle_reasons: tuple[str, ...] = ("hw_slowdown", "hw_thermal", "hw_power_brake")
    warn_throttle_reasons: tuple[str, ...] = ("sw_thermal",)


@dataclass(frozen=True, slots=True, kw_only=True)
class XidConfig:
    modes: tuple[str, ...] = MODES
    timeout_s: float = 10.0
    window_s: float = 3600.0  # Xid lines older than this (by kernel timestamp) are ignored
    source: str = "auto"  # "auto" (kmsg, then dmesg) | "kmsg" | "dmesg" | a file path


@dataclass(frozen=True, slots=True, kw_only=True)
class DcgmConfig:
    modes: tuple[str, ...] = MODES
    dcgmi: str = "dcgmi"  # the dcgmi binary; absent: the check is skipped
    quick_level: int = 1  # `dcgmi diag -r 1` in quick mode
    full_level: int = 2  # `dcgmi diag -r 2` in full mode
    quick_timeout_s: float = 12.0
    full_timeout_s: float = 90.0
    burn_in_level: int = 3  # `dcgmi diag -r 3` in the burn-in (the long stress tests, ~10-30 min)
    burn_in_timeout_s: float = 2400.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ComputeConfig:
    modes: tuple[str, ...] = MODES
    timeout_s: float = 60.0
    device: str = "auto"  # "auto" (cuda if available) | "cuda" | "cpu"
    isolate: bool = True  # in a child process: no torch, CUDA context or GPU memory stays in the caller
    dtype: str = "auto"  # timed pass: "auto" (bfloat16 on cuda, float32 on cpu) | a torch dtype
    size_quick: int = 4096  # matrix side on a GPU, quick mode
    size_full: int = 8192  # matrix side on a GPU, full mode
    size_cpu: int = 384  # matrix side on CPU (tests, CPU-only hosts)
    iterations_quick: int = 5
    iterations_full: int = 20
    iterations_cpu: int = 3
    tflops_floor: float = 0.0  # per device; 0: not checked (set by `preflight baseline`)
    gpu_spread_max: float = 0.15  # a GPU slower than the median by more than this fraction: FAIL


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveConfig:
    # quick: before every attempt, a short NCCL all-reduce on >= 2 local GPUs; a SKIP costing nothing
    # on one device (one GPU, or a CPU-only host). full: every GPU's all-reduce, gloo ranks on CPU.
    modes: tuple[str, ...] = MODES
    timeout_s: float = 60.0  # full mode
    quick_timeout_s: float = 10.0  # quick mode: starting the ranks, torch and NCCL are most of it
    size_bytes_gpu: int = 256 * 1024 * 1024
    size_bytes_quick: int = 32 * 1024 * 1024  # quick mode (GPUs)
    size_bytes_cpu: int = 4 * 1024 * 1024
    iterations: int = 10
    iterations_quick: int = 5
    warmup: int = 2
    cpu_processes: int = 2  # gloo ranks on a CPU-only host
    busbw_floor_gbps: float = 0.0  # GB/s; 0: not checked (set by `preflight baseline`)


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageConfig:
    modes: tuple[str, ...] = MODES
    timeout_s: float = 20.0
    checkpoint_path: str = ""  # "": not checked
    free_space_floor_gb: float = 10.0
    require_mount: bool = False  # the checkpoint path must be on its own mount, not the root fs
    dataset_index: str = ""  # a file listing dataset shards; "": not checked
    throughput_mb: int = 64  # full mode: write + fsync, then read back uncached, this many MiB (0: off)
    min_write_mbps: float = 0.0  # floors for that probe, MB/s (0: unset, the figure is only reported)
    min_read_mbps: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class NetworkConfig:
    modes: tuple[str, ...] = MODES
    timeout_s: float = 5.0
    sysfs_root: str = "/sys"
    require_ib: bool = False  # no /sys/class/infiniband: FAIL instead of SKIP
    nics: tuple[str, ...] = ()  # interfaces that must be up; (): every physical NIC found
    min_speed_mbps: int = 0  # a NIC up below this speed FAILs (0: unset; an unknown speed is WARN)
    expected_nic_count: int = 0  # physical NICs (and HCAs) the node must show; 0: not checked
    pcie_width_below_max: str = (
        "fail"  # a NIC/HCA's PCIe link trained narrower than its max: "fail" | "warn" | "ignore"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class CpuConfig:
    modes: tuple[str, ...] = MODES
    timeout_s: float = 5.0
    sysfs_root: str = "/sys"
    capped_below_nominal: str = (
        "fail"  # a CPU whose frequency cap is below its rated base: "fail" | "warn" | "ignore"
    )
    cap_tolerance: float = (
        0.02  # a cap this fraction below nominal is still nominal (rounding in the drivers)
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class BurnInConfig:
    """The burn-in pipeline (`preflight run --burn-in`, the supervisor's burn-in of a quarantined
    node): `stages` run one at a time, in this order, within [run] burn_in_budget_s. Each stage's
    time limit is its own duration plus `stage_slack_s` (starting CUDA, the reference product)."""

    stages: tuple[str, ...] = BURN_IN_STAGES
    stage_slack_s: float = 120.0
    sample_interval_s: float = 1.0  # NVML (throttle, temperature) is sampled this often during a stage
    temperature_max_c: int = 87  # a GPU hotter than this during a stage FAILs (0: not checked)
    # matmul: the known-answer product in a loop on every device at once, every result checked.
    matmul_duration_s: float = 300.0  # per GPU, all GPUs at once
    matmul_duration_s_cpu: float = 5.0  # on a host without a GPU
    matmul_size: int = 8192  # matrix side on a GPU (the size `preflight baseline` measures)
    matmul_size_cpu: int = 256
    matmul_dtype: str = "auto"  # "auto" (bfloat16 on cuda, float32 on cpu) | a torch dtype
    # memory: write/verify patterns over `memory_fraction` of each GPU's free memory, in chunks.
    memory_fraction: float = 0.9
    memory_chunk_mb: int = 1024
    memory_mb_cpu: int = 64  # on a host without a GPU: a host buffer of this size
    memory_patterns: tuple[str, ...] = MEMORY_PATTERNS
    memory_seed: int = 20240611  # the "random" pattern's seed (regenerated to verify, never stored)
    # allreduce: the in-node all-reduce repeated, every result checked, bandwidth watched for sag.
    allreduce_duration_s: float = 120.0
    allreduce_duration_s_cpu: float = 5.0
    allreduce_iterations: int = 5  # all-reduces per round (one bandwidth figure per round)
    allreduce_window: int = 3  # baseline = median of the first rounds; each later window's median ...
    allreduce_min_ratio: float = 0.7  # ... must stay >= this x the baseline, else FAIL (a sagging link)
    # The soak judges an idle node only: other processes using more than this share of the host's
    # CPUs (or any on its GPUs) make a sag INCONCLUSIVE (retried), never a FAIL.
    allreduce_max_foreign_load: float = 0.1


@dataclass(frozen=True, slots=True, kw_only=True)
class PreflightConfig:
    run: RunConfig = field(default_factory=RunConfig)
    inventory: InventoryConfig = field(default_factory=InventoryConfig)
    errors: ErrorsConfig = field(default_factory=ErrorsConfig)
    xid: XidConfig = field(default_factory=XidConfig)
    dcgm: DcgmConfig = field(default_factory=DcgmConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    collective: CollectiveConfig = field(default_factory=CollectiveConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    cpu: CpuConfig = field(default_factory=CpuConfig)
    burn_in: BurnInConfig = field(default_factory=BurnInConfig)

    def budget_s(self, mode: str) -> float:
        if mode == BURN_IN:
            return self.run.burn_in_budget_s
        return self.run.quick_budget_s if mode == "quick" else self.run.full_budget_s


_CHOICES = {
    "persistence_mode": ("on", "off", "any"),
    "mig_mode": ("on", "off", "any"),
    "pcie_width_below_max": ("fail", "warn", "ignore"),
    "pcie_gen_below_max": ("fail", "warn", "ignore"),
    "capped_below_nominal": ("fail", "warn", "ignore"),
    "device": ("auto", "cuda", "cpu"),
    "matmul_dtype": ("auto", "float32", "float64", "bfloat16", "float16"),
}


def _coerce(value: Any, hint: Any, where: str) -> Any:
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):  # TOML has nan and inf; no threshold or duration is either
            raise ConfigError(f"{where}: must be a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of strings, got {value!r}")
        return tuple(value)
    raise ConfigError(f"{where}: unsupported type {hint}")  # a bug in this module, not in the file


def _load_section(cls: type, mapping: Any, where: str) -> Any:
    if not isinstance(mapping, dict):
        raise ConfigError(f"{where}: expected a table, got {mapping!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(mapping) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    values = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in mapping.items()}
    for key, allowed in _CHOICES.items():
        if key in values and values[key] not in allowed:
            raise ConfigError(f"{where}.{key}: {values[key]!r} is not one of {', '.join(allowed)}")
    for key, value in values.items():
        if key == "modes" and not set(value) <= set(MODES):
            raise ConfigError(f"{where}.modes: {list(value)} may contain only {', '.join(MODES)}")
        if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
            raise ConfigError(f"{where}.{key}: must not be negative, got {value}")
    return cls(**values)


def config_from_mapping(data: dict[str, Any], where: str = "<config>") -> PreflightConfig:
    sections = {f.name: f for f in dataclasses.fields(PreflightConfig)}
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise ConfigError(
            f"{where}: unknown section(s) [{'], ['.join(unknown)}]; known: {', '.join(sections)}"
        )
    hints = typing.get_type_hints(PreflightConfig)
    built = {name: _load_section(hints[name], data[name], f"{where}: [{name}]") for name in data}
    config = PreflightConfig(**built)
    for key in ("fail_throttle_reasons", "warn_throttle_reasons"):
        bad = sorted(set(getattr(config.errors, key)) - set(THROTTLE_BITS))
        if bad:
            raise ConfigError(
                f"{where}: [errors].{key}: unknown reason(s) {', '.join(bad)}; "
                f"known: {', '.join(THROTTLE_BITS)}"
            )
    if config.cpu.cap_tolerance >= 1:
        raise ConfigError(f"{where}: [cpu].cap_tolerance: a fraction below 1, got {config.cpu.cap_tolerance}")
    if min(config.run.quick_budget_s, config.run.full_budget_s, config.run.burn_in_budget_s) <= 0:
        raise ConfigError(f"{where}: [run] budgets must be positive")
    _check_burn_in(config, where)
    return config


def _check_burn_in(config: PreflightConfig, where: str) -> None:
    b = config.burn_in
    here = f"{where}: [burn_in]"
    unknown = [s for s in b.stages if s not in BURN_IN_STAGES]
    if unknown or len(set(b.stages)) != len(b.stages):
        raise ConfigError(
            f"{here}.stages: {list(b.stages)} must name each stage at most once, "
            f"from {', '.join(BURN_IN_STAGES)}"
        )
    bad = [p for p in b.memory_patterns if p not in MEMORY_PATTERNS]
    if bad or not b.memory_patterns:
        raise ConfigError(
            f"{here}.memory_patterns: {list(b.memory_patterns)} must be one or more of "
            f"{', '.join(MEMORY_PATTERNS)}"
        )
    positive = (
        "matmul_duration_s",
        "matmul_duration_s_cpu",
        "matmul_size",
        "matmul_size_cpu",
        "memory_chunk_mb",
        "memory_mb_cpu",
        "allreduce_duration_s",
        "allreduce_duration_s_cpu",
        "allreduce_iterations",
        "allreduce_window",
        "sample_interval_s",
    )
    for key in positive:
        if getattr(b, key) <= 0:
            raise ConfigError(f"{here}.{key}: must be positive, got {getattr(b, key)}")
    for key in ("memory_fraction", "allreduce_min_ratio", "allreduce_max_foreign_load"):
        if not 0 < getattr(b, key) <= 1:
            raise ConfigError(f"{here}.{key}: must be in (0, 1], got {getattr(b, key)}")
    if not 1 <= config.dcgm.burn_in_level <= 4:
        raise ConfigError(
            f"{where}: [dcgm].burn_in_level: dcgmi diag runs levels 1-4, got {config.dcgm.burn_in_level}"
        )


def load_config(path: str | Path | None) -> PreflightConfig:
    """Reads a TOML file (None: the defaults). Raises ConfigError with the file and key on any problem."""
    if path is None:
        return PreflightConfig()
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    return config_from_mapping(data, str(path))


def config_to_mapping(config: PreflightConfig) -> dict[str, dict[str, Any]]:
    return {
        f.name: {
            k.name: getattr(getattr(config, f.name), k.name)
            for k in dataclasses.fields(getattr(config, f.name))
        }
        for f in dataclasses.fields(config)
    }


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def config_to_toml(config: PreflightConfig, header: str = "") -> str:
    """The whole config as TOML (every key, so a baseline file documents what it decided)."""
    lines = [f"# {line}" for line in header.splitlines()]
    for section, values in config_to_mapping(config).items():
        lines += ["", f"[{section}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    return "\n".join(lines).lstrip("\n") + "\n"
