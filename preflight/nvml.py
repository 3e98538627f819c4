"""The narrowest boundary to NVML: one small adapter over `pynvml`, so tests substitute a fake here.

Every method returns plain Python values and raises one of three errors:
`NvmlUnavailable` (no library / no driver: every NVML check is SKIP), `NvmlNotSupported` (this
GPU or driver lacks the query: that sub-check is SKIP), or `NvmlError` (the query failed: FAIL,
with the NVML message as evidence). `GpuLost` is an `NvmlError` for a GPU that fell off the bus.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class NvmlError(RuntimeError):
    pass


class NvmlUnavailable(NvmlError):
    pass


class NvmlNotSupported(NvmlError):
    pass


class GpuLost(NvmlError):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class PcieLink:
    current_gen: int
    max_gen: int
    current_width: int
    max_width: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RemappedRows:
    correctable: int
    uncorrectable: int
    pending: bool
    failure: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuProcess:
    pid: int
    used_bytes: int | None


# NVML's clock-event ("throttle") reason bits (nvml.h, nvmlClocksEventReason*).
THROTTLE_BITS = {
    "gpu_idle": 0x1,
    "applications_clocks": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
    "display_clocks": 0x100,
}

# NVML's GPU recovery actions (nvml.h, nvmlDeviceGpuRecoveryAction_t), read through the field
# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION on drivers that have it (R550 and later).
RECOVERY_ACTIONS = {
    0: "none",
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
    5: "recover_imex_domain",
    6: "bus_reset",
    7: "system_reboot",
}


class Nvml(Protocol):
    """What preflight asks of NVML; `PynvmlAdapter` is the real one, tests pass a fake."""

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def driver_version(self) -> str: ...
    def cuda_driver_version(self) -> str: ...
    def device_count(self) -> int: ...
    def name(self, index: int) -> str: ...
    def pci_bus_id(self, index: int) -> str: ...
    def ecc_uncorrected(self, index: int, *, volatile: bool) -> int: ...
    def retired_pages_pending(self, index: int) -> bool: ...
    def remapped_rows(self, index: int) -> RemappedRows: ...
    def recovery_action(self, index: int) -> int: ...
    def compute_processes(self, index: int) -> list[GpuProcess]: ...
    def pcie_link(self, index: int) -> PcieLink: ...
    def throttle_reasons(self, index: int) -> int: ...
    def temperature(self, index: int) -> int: ...  # the GPU die, degrees C
    def persistence_mode(self, index: int) -> bool: ...
    def mig_mode(self, index: int) -> tuple[bool, bool]: ...


class PynvmlAdapter:
    """The real NVML through `pynvml` (the `nvidia-ml-py` distribution), imported on first use."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: dict[int, Any] = {}
        self._lock = threading.Lock()  # NVML is thread-safe; the handle cache is guarded here

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        nv = self._nvml
        try:
            return fn(*args)
        except nv.NVMLError_GpuIsLost as exc:
            raise GpuLost(f"GPU is lost (fallen off the bus): {exc}") from exc
        except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound) as exc:
            raise NvmlNotSupported(str(exc)) from exc
        except nv.NVMLError as exc:
            raise NvmlError(str(exc)) from exc

    def init(self) -> None:
        try:
            import pynvml
        except ImportError as exc:  # the nvidia-ml-py distribution is not installed
            raise NvmlUnavailable(f"pynvml not importable: {exc}") from exc
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML init failed: {exc}") from exc

    def shutdown(self) -> None:
        if self._nvml is not None:
            # Shutting down after a lost GPU may fail; there is nothing to do about it.
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlShutdown()

    def _handle(self, index: int) -> Any:
        with self._lock:
            if index not in self._handles:
                self._handles[index] = self._call(self._nvml.nvmlDeviceGetHandleByIndex, index)
            return self._handles[index]

    def driver_version(self) -> str:
        return _text(self._call(self._nvml.nvmlSystemGetDriverVersion))

    def cuda_driver_version(self) -> str:
        version = int(self._call(self._nvml.nvmlSystemGetCudaDriverVersion))
        return f"{version // 1000}.{(version % 1000) // 10}"

    def device_count(self) -> int:
        return int(self._call(self._nvml.nvmlDeviceGetCount))

    def name(self, index: int) -> str:
        return _text(self._call(self._nvml.nvmlDeviceGetName, self._handle(index)))

    def pci_bus_id(self, index: int) -> str:
        info = self._call(self._nvml.nvmlDeviceGetPciInfo, self._handle(index))
        return _text(info.busId)

    def ecc_uncorrected(self, index: int, *, volatile: bool) -> int:
        nv = self._nvml
        counter = nv.NVML_VOLATILE_ECC if volatile else nv.NVML_AGGREGATE_ECC
        return int(
            self._call(
                nv.nvmlDeviceGetTotalEccErrors,
                self._handle(index),
                nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                counter,
            )
        )

    def retired_pages_pending(self, index: int) -> bool:
        return bool(self._call(self._nvml.nvmlDeviceGetRetiredPagesPendingStatus, self._handle(index)))

    def remapped_rows(self, index: int) -> RemappedRows:
        corr, unc, pending, failure = self._call(self._nvml.nvmlDeviceGetRemappedRows, self._handle(index))
        return RemappedRows(
            correctable=int(corr), uncorrectable=int(unc), pending=bool(pending), failure=bool(failure)
        )

    def recovery_action(self, index: int) -> int:
        nv = self._nvml
        field_id = getattr(nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field_id is None:
            raise NvmlNotSupported("this pynvml has no NVML_FI_DEV_GET_GPU_RECOVERY_ACTION field")
        values = self._call(nv.nvmlDeviceGetFieldValues, self._handle(index), [field_id])
        if values[0].nvmlReturn != nv.NVML_SUCCESS:
            self._call(_raise_nvml, nv, values[0].nvmlReturn)
        return _field_value(nv, values[0])

    def compute_processes(self, index: int) -> list[GpuProcess]:
        procs = self._call(self._nvml.nvmlDeviceGetComputeRunningProcesses, self._handle(index))
        return [GpuProcess(pid=int(p.pid), used_bytes=_used_bytes(p.usedGpuMemory)) for p in procs]

    def pcie_link(self, index: int) -> PcieLink:
        nv, h = self._nvml, self._handle(index)
        return PcieLink(
            current_gen=int(self._call(nv.nvmlDeviceGetCurrPcieLinkGeneration, h)),
            max_gen=int(self._call(nv.nvmlDeviceGetMaxPcieLinkGeneration, h)),
            current_width=int(self._call(nv.nvmlDeviceGetCurrPcieLinkWidth, h)),
            max_width=int(self._call(nv.nvmlDeviceGetMaxPcieLinkWidth, h)),
        )

    def throttle_reasons(self, index: int) -> int:
        nv = self._nvml
        fn = (
            getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        return int(self._call(fn, self._handle(index)))

    def temperature(self, index: int) -> int:
        nv = self._nvml
        return int(self._call(nv.nvmlDeviceGetTemperature, self._handle(index), nv.NVML_TEMPERATURE_GPU))

    def persistence_mode(self, index: int) -> bool:
        nv = self._nvml
        return (
            int(self._call(nv.nvmlDeviceGetPersistenceMode, self._handle(index))) == nv.NVML_FEATURE_ENABLED
        )

    def mig_mode(self, index: int) -> tuple[bool, bool]:
        current, pending = self._call(self._nvml.nvmlDeviceGetMigMode, self._handle(index))
        return bool(current), bool(pending)


def _raise_nvml(nv: Any, code: int) -> None:
    raise nv.NVMLError(code)  # pynvml maps the code to its NVMLError_* subclass


def _field_value(nv: Any, field: Any) -> int:
    """An integer field value, read from the union member that NVML says it filled."""
    member = {
        nv.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
        nv.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        nv.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
        nv.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
        nv.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
    }.get(field.valueType, "uiVal")
    return int(getattr(field.value, member))


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _used_bytes(value: Any) -> int | None:
    # NVML reports NVML_VALUE_NOT_AVAILABLE (2**64 - 1) when it cannot see the usage (e.g. Windows/WDDM).
    if value is None or int(value) >= 2**63:
        return None
    return int(value)
