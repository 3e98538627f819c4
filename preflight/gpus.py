"""Where this host is expected to have GPUs, and who says so (`expect_gpus`): the config, the
scheduler's allocation and the PCI bus, read once per run. Where any source expects GPUs, a check
that cannot reach them is a FAIL marked `fail_closed`, never a SKIP, and `device = "auto"` means
"cuda" (`resolve_device`): nothing falls back to the CPU. Called by the runner and the inventory
and compute checks.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from preflight.config import PreflightConfig

NVIDIA_VENDOR = 0x10DE
GPU_CLASSES = (0x0300, 0x0302)  # PCI base class 03 (display): VGA controller, 3D controller
# CUDA_VISIBLE_DEVICES values that hide every GPU (Slurm writes NoDevFiles for a job without GPUs).
_NO_DEVICES = {"", "-1", "none", "nodevfiles", "void"}


@dataclass(frozen=True, slots=True, kw_only=True)
class PciGpus:
    """The NVIDIA GPUs the PCI bus shows; `readable` is False when the sysfs tree could not be read."""

    bus_ids: tuple[str, ...] = ()  # "0000:3b:00.0", sorted
    readable: bool = False
    note: str = ""  # why it could not be read


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuExpectation:
    """Why GPUs are expected here (`reasons`; empty: a CPU host) and the counts the sources give."""

    reasons: tuple[str, ...] = ()
    config_count: int = 0  # [inventory] expected_gpu_count (0: unset)
    allocated: int | None = None  # the scheduler's count, when one says it
    pci: PciGpus = PciGpus()

    @property
    def expected(self) -> bool:
        return bool(self.reasons)

    def describe(self) -> str:
        return "; ".join(self.reasons) if self.reasons else "no source expects GPUs here"

    def evidence(self) -> tuple[str, ...]:
        pci = (
            f"PCI bus: {len(self.pci.bus_ids)} NVIDIA GPU(s) {', '.join(self.pci.bus_ids)}".rstrip()
            if self.pci.readable
            else f"PCI bus not readable: {self.pci.note}"
        )
        return (f"GPUs expected by: {self.describe()}", pci)


NOT_EXPECTED = GpuExpectation()


def normalize_bus_id(text: str) -> str:
    """NVML's `00000000:3B:00.0` and sysfs's `0000:3b:00.0` as one form, `0000:3b:00.0`."""
    text = text.strip().lower()
    parts = text.split(":")
    if len(parts) == 3:
        return f"{parts[0][-4:].rjust(4, '0')}:{parts[1]}:{parts[2]}"
    return text


def _hex(path: Path) -> int | None:
    try:
        return int(path.read_text(encoding="ascii").strip(), 16)
    except (OSError, ValueError):
        return None


def pci_gpus(sysfs_root: str) -> PciGpus:
    """The NVIDIA display / 3D controllers in `<sysfs_root>/bus/pci/devices` (no driver needed)."""
    devices = Path(sysfs_root) / "bus" / "pci" / "devices"
    try:
        entries = sorted(os.listdir(devices))
    except OSError as exc:
        return PciGpus(note=f"{devices}: {exc.strerror or exc}")
    found = []
    for entry in entries:
        vendor, klass = _hex(devices / entry / "vendor"), _hex(devices / entry / "class")
        if vendor == NVIDIA_VENDOR and klass is not None and klass >> 8 in GPU_CLASSES:
            found.append(normalize_bus_id(entry))
    return PciGpus(bus_ids=tuple(sorted(found)), readable=True)


def _listed(value: str) -> tuple[bool, int | None]:
    """Whether a *_VISIBLE_DEVICES list names devices, and how many GPUs (None: unknown, for MIG
    instances, several of which share one GPU)."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items or items[0].lower() in _NO_DEVICES:
        return False, None
    if any(i.lower().startswith("mig-") for i in items):
        return True, None
    return True, len(items)


def allocation(environ: Mapping[str, str]) -> tuple[int | None, tuple[str, ...]]:
    """The scheduler's GPU count for this host (the largest any variable says; None when none says
    a count) and which variables say GPUs are allocated."""
    counts: list[int] = []
    reasons: list[str] = []
    slurm = environ.get("SLURM_GPUS_ON_NODE", "").strip()
    if slurm.isdigit() and int(slurm) > 0:
        counts.append(int(slurm))
        reasons.append(f"Slurm allocation SLURM_GPUS_ON_NODE={slurm}")
    for name, what in (("NVIDIA_VISIBLE_DEVICES", "device request"), ("CUDA_VISIBLE_DEVICES", "allocation")):
        value = environ.get(name)
        if value is None or (name == "NVIDIA_VISIBLE_DEVICES" and value.strip().lower() == "all"):
            continue
        named, listed = _listed(value)
        if named:
            counts += [listed] if listed else []
            reasons.append(f"{what} {name}={value.strip()[:80]}")
    return (max(counts) if counts else None), tuple(reasons)


def expect_gpus(
    config: PreflightConfig, environ: Mapping[str, str] | None = None, sysfs_root: str | None = None
) -> GpuExpectation:
    """Every source's say; `environ` and `sysfs_root` default to this host's.

    * config: `[inventory] expected_gpu_count` (the node agent fills it from its `local_ranks` where
      another source expects GPUs, nodeagent.daemon.preflight_defaults) and `[compute] device = "cuda"`;
    * the scheduler's allocation: `SLURM_GPUS_ON_NODE`, `CUDA_VISIBLE_DEVICES`, and
      `NVIDIA_VISIBLE_DEVICES` as the Kubernetes device plugin sets it ("all" is a CUDA image's
      default, not a request, and says nothing);
    * the PCI bus: NVIDIA display / 3D controllers (vendor 0x10de, class 0x0300xx or 0x0302xx) under
      `<[inventory] sysfs_root>/bus/pci/devices`, which needs no driver: the count NVML must match.

    `local_ranks` alone is no expectation: a CPU cluster runs that many gloo ranks.
    """
    env = os.environ if environ is None else environ
    pci = pci_gpus(config.inventory.sysfs_root if sysfs_root is None else sysfs_root)
    reasons: list[str] = []
    count = config.inventory.expected_gpu_count
    if count:
        reasons.append(f"config inventory.expected_gpu_count = {count}")
    if config.compute.device == "cuda":
        reasons.append('config compute.device = "cuda"')
    allocated, said = allocation(env)
    reasons += said
    if pci.bus_ids:
        reasons.append(f"{len(pci.bus_ids)} NVIDIA GPU(s) on the PCI bus")
    return GpuExpectation(reasons=tuple(reasons), config_count=count, allocated=allocated, pci=pci)


def resolve_device(config: PreflightConfig, gpus: GpuExpectation) -> PreflightConfig:
    """`[compute] device = "auto"` is "cuda" where GPUs are expected: no CPU fallback on a GPU host."""
    if not gpus.expected or config.compute.device != "auto":
        return config
    return dataclasses.replace(config, compute=dataclasses.replace(config.compute, device="cuda"))
