"""A fake at the NVML adapter boundary (preflight.nvml.Nvml): tests set the GPU state they need.

A field set to an exception instance makes that query raise it (e.g. NvmlNotSupported).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from preflight.nvml import GpuProcess, NvmlUnavailable, PcieLink, RemappedRows


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    pci_bus_id: str = "00000000:18:00.0"
    ecc_volatile: Any = 0
    ecc_aggregate: Any = 0
    retired_pending: Any = False
    remapped: Any = field(
        default_factory=lambda: RemappedRows(correctable=0, uncorrectable=0, pending=False, failure=False)
    )
    recovery_action: Any = 0
    processes: Any = field(default_factory=list)
    pcie: Any = field(
        default_factory=lambda: PcieLink(current_gen=5, max_gen=5, current_width=16, max_width=16)
    )
    throttle: Any = 0x1  # idle
    temperature: Any = 40  # degrees C
    persistence: Any = True
    mig: Any = (False, False)


def _get(value: Any) -> Any:
    if isinstance(value, BaseException):
        raise value
    return value


@dataclass
class FakeNvml:
    gpus: list[FakeGpu] = field(
        default_factory=lambda: [FakeGpu(pci_bus_id=f"00000000:{0x18 + i:02X}:00.0") for i in range(8)]
    )
    driver: Any = "550.127.05"
    cuda: Any = "12.4"
    init_error: NvmlUnavailable | None = None
    inits: int = 0
    shutdowns: int = 0

    def init(self) -> None:
        self.inits += 1
        if self.init_error is not None:
            raise self.init_error

    def shutdown(self) -> None:
        self.shutdowns += 1

    def driver_version(self) -> str:
        return str(_get(self.driver))

    def cuda_driver_version(self) -> str:
        return str(_get(self.cuda))

    def device_count(self) -> int:
        return len(self.gpus)

    def name(self, index: int) -> str:
        return self.gpus[index].name

    def pci_bus_id(self, index: int) -> str:
        return self.gpus[index].pci_bus_id

    def ecc_uncorrected(self, index: int, *, volatile: bool) -> int:
        gpu = self.gpus[index]
        return int(_get(gpu.ecc_volatile if volatile else gpu.ecc_aggregate))

    def retired_pages_pending(self, index: int) -> bool:
        return bool(_get(self.gpus[index].retired_pending))

    def remapped_rows(self, index: int) -> RemappedRows:
        return _get(self.gpus[index].remapped)

    def recovery_action(self, index: int) -> int:
        return int(_get(self.gpus[index].recovery_action))

    def compute_processes(self, index: int) -> list[GpuProcess]:
        return list(_get(self.gpus[index].processes))

    def pcie_link(self, index: int) -> PcieLink:
        return _get(self.gpus[index].pcie)

    def throttle_reasons(self, index: int) -> int:
        return int(_get(self.gpus[index].throttle))

    def temperature(self, index: int) -> int:
        return int(_get(self.gpus[index].temperature))

    def persistence_mode(self, index: int) -> bool:
        return bool(_get(self.gpus[index].persistence))

    def mig_mode(self, index: int) -> tuple[bool, bool]:
        return _get(self.gpus[index].mig)
