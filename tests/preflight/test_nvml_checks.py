"""NVML checks through a fake at the adapter boundary (preflight.nvml.Nvml): one case per fault."""

from __future__ import annotations

import dataclasses
import os

import pynvml
import pytest

from preflight.config import ErrorsConfig, InventoryConfig, PreflightConfig
from preflight.nvml import (
    GpuLost,
    GpuProcess,
    NvmlNotSupported,
    NvmlUnavailable,
    PcieLink,
    PynvmlAdapter,
    RemappedRows,
)
from preflight.result import CheckResult, CheckStatus
from preflight.runner import run_preflight
from tests.preflight.fake_nvml import FakeGpu, FakeNvml


def run_nvml(fake: FakeNvml, config: PreflightConfig | None = None) -> list[CheckResult]:
    report = run_preflight(
        config or PreflightConfig(), "quick", only=("inventory", "errors"), nvml_factory=lambda: fake
    )
    return list(report.results)


def pick(results: list[CheckResult], name: str, gpu: int | None = None) -> CheckResult:
    found = [r for r in results if r.name == name and r.gpu_index == gpu]
    assert len(found) == 1, f"{name}[{gpu}]: {[(r.name, r.gpu_index) for r in results]}"
    return found[0]


def with_inventory(**kw: object) -> PreflightConfig:
    return dataclasses.replace(PreflightConfig(), inventory=InventoryConfig(**kw))


def test_healthy_node_passes_every_nvml_check_fake_nvml() -> None:
    cfg = with_inventory(
        expected_gpu_count=8,
        driver_version="550.127.05",
        cuda_version="12.4",
        persistence_mode="on",
        mig_mode="off",
    )
    results = run_nvml(FakeNvml(), cfg)
    bad = [(r.name, r.gpu_index, r.status, r.message) for r in results if r.status is not CheckStatus.PASS]
    assert bad == []
    assert len([r for r in results if r.name == "errors.ecc_uncorrectable"]) == 8


def test_no_nvml_is_skip_with_reason_fake_nvml() -> None:
    results = run_nvml(FakeNvml(init_error=NvmlUnavailable("NVML Shared Library Not Found")))
    assert {r.status for r in results} == {CheckStatus.SKIP}
    assert all("no NVML" in r.message for r in results)


def test_no_nvml_on_this_host_is_skip_real_pynvml() -> None:
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this host has an NVIDIA driver; the no-NVML path is tested by the fake case")
    report = run_preflight(PreflightConfig(), "quick", only=("inventory", "errors"))
    assert [r.status for r in report.results] == [CheckStatus.SKIP, CheckStatus.SKIP]
    assert report.passed and report.count(CheckStatus.PASS) == 0  # SKIP never counts as PASS


def test_ecc_uncorrectable_volatile_fails_aggregate_warns_fake_nvml() -> None:
    fake = FakeNvml()
    fake.gpus[3].ecc_volatile, fake.gpus[3].ecc_aggregate = 2, 2
    fake.gpus[5].ecc_aggregate = 1
    results = run_nvml(fake)
    r3 = pick(results, "errors.ecc_uncorrectable", 3)
    assert r3.status is CheckStatus.FAIL and r3.value == 2 and "volatile=2" in r3.evidence
    assert pick(results, "errors.ecc_uncorrectable", 5).status is CheckStatus.WARN
    assert pick(results, "errors.ecc_uncorrectable", 0).status is CheckStatus.PASS


def test_ecc_not_supported_is_skip_for_that_gpu_fake_nvml() -> None:
    fake = FakeNvml(gpus=[FakeGpu(ecc_volatile=NvmlNotSupported("Not Supported"))])
    r = pick(run_nvml(fake), "errors.ecc_uncorrectable", 0)
    assert r.status is CheckStatus.SKIP and "not supported" in r.message


def test_retired_pages_pending_fails_fake_nvml() -> None:
    fake = FakeNvml(gpus=[FakeGpu(retired_pending=True), FakeGpu(retired_pending=NvmlNotSupported("n/a"))])
    results = run_nvml(fake)
    assert pick(results, "errors.retired_pages_pending", 0).status is CheckStatus.FAIL
    assert pick(results, "errors.retired_pages_pending", 1).status is CheckStatus.SKIP


@pytest.mark.parametrize(("pending", "failure", "word"), [(True, False, "pending"), (False, True, "failed")])
def test_row_remap_pending_or_failed_fails_fake_nvml(pending: bool, failure: bool, word: str) -> None:
    fake = FakeNvml(
        gpus=[
            FakeGpu(remapped=RemappedRows(correctable=0, uncorrectable=1, pending=pending, failure=failure))
        ]
    )
    r = pick(run_nvml(fake), "errors.row_remap", 0)
    assert r.status is CheckStatus.FAIL and word in r.message


def test_recovery_action_fails_and_unsupported_field_skips_fake_nvml() -> None:
    fake = FakeNvml(
        gpus=[FakeGpu(recovery_action=2), FakeGpu(recovery_action=NvmlNotSupported("Function Not Found"))]
    )
    results = run_nvml(fake)
    r0 = pick(results, "errors.recovery_action", 0)
    assert r0.status is CheckStatus.FAIL and "node_reboot" in r0.message
    assert pick(results, "errors.recovery_action", 1).status is CheckStatus.SKIP


def test_stray_process_holding_gpu_memory_fails_own_process_does_not_fake_nvml() -> None:
    fake = FakeNvml(
        gpus=[
            FakeGpu(
                processes=[
                    GpuProcess(pid=os.getpid(), used_bytes=2**30),
                    GpuProcess(pid=999_999_999, used_bytes=40 * 2**30),
                ]
            )
        ]
    )
    r = pick(run_nvml(fake), "inventory.gpu_processes", 0)
    assert r.status is CheckStatus.FAIL and r.value == 1
    assert r.evidence == ("pid=999999999 name=? used=40960 MiB",)


def test_wrong_driver_and_cuda_version_fail_fake_nvml() -> None:
    results = run_nvml(
        FakeNvml(driver="535.54.03", cuda="12.2"),
        with_inventory(driver_version="550.127.05", cuda_version="12.4"),
    )
    driver = pick(results, "inventory.driver_version")
    assert driver.status is CheckStatus.FAIL and "535.54.03" in driver.message
    assert pick(results, "inventory.cuda_version").status is CheckStatus.FAIL


def test_unconfigured_versions_are_skip_not_pass_fake_nvml() -> None:
    r = pick(run_nvml(FakeNvml()), "inventory.driver_version")
    assert r.status is CheckStatus.SKIP and "550.127.05" in r.message


def test_pcie_x4_instead_of_x16_fails_lower_gen_warns_fake_nvml() -> None:
    fake = FakeNvml(
        gpus=[
            FakeGpu(pcie=PcieLink(current_gen=5, max_gen=5, current_width=4, max_width=16)),
            FakeGpu(pcie=PcieLink(current_gen=1, max_gen=5, current_width=16, max_width=16)),
        ]
    )
    results = run_nvml(fake)
    x4 = pick(results, "inventory.pcie_link", 0)
    assert x4.status is CheckStatus.FAIL and x4.value == 4 and x4.threshold == 16
    assert pick(results, "inventory.pcie_link", 1).status is CheckStatus.WARN


@pytest.mark.parametrize(
    ("mask", "status"),
    [
        (0x8, CheckStatus.FAIL),
        (0x40, CheckStatus.FAIL),
        (0x80, CheckStatus.FAIL),
        (0x20, CheckStatus.WARN),
        (0x1 | 0x4, CheckStatus.PASS),
    ],
)
def test_throttle_reasons_fake_nvml(mask: int, status: CheckStatus) -> None:
    r = pick(run_nvml(FakeNvml(gpus=[FakeGpu(throttle=mask)])), "errors.throttle", 0)
    assert r.status is status, r.message


def test_throttle_policy_comes_from_config_fake_nvml() -> None:
    cfg = dataclasses.replace(PreflightConfig(), errors=ErrorsConfig(fail_throttle_reasons=("sw_power_cap",)))
    r = pick(run_nvml(FakeNvml(gpus=[FakeGpu(throttle=0x4)]), cfg), "errors.throttle", 0)
    assert r.status is CheckStatus.FAIL


def test_expected_gpu_count_fake_nvml() -> None:
    results = run_nvml(FakeNvml(gpus=[FakeGpu() for _ in range(7)]), with_inventory(expected_gpu_count=8))
    r = pick(results, "inventory.gpu_count")
    assert r.status is CheckStatus.FAIL and (r.value, r.threshold) == (7, 8)


def test_persistence_and_mig_mode_as_configured_fake_nvml() -> None:
    fake = FakeNvml(gpus=[FakeGpu(), FakeGpu(persistence=False, mig=(True, True))])
    results = run_nvml(fake, with_inventory(persistence_mode="on", mig_mode="off"))
    assert pick(results, "inventory.persistence_mode").status is CheckStatus.FAIL
    assert pick(results, "inventory.mig_mode").status is CheckStatus.FAIL
    pending = FakeNvml(gpus=[FakeGpu(mig=(False, True))])
    r = pick(run_nvml(pending, with_inventory(mig_mode="off")), "inventory.mig_mode", 0)
    assert r.status is CheckStatus.FAIL and "pending" in r.message


def test_gpu_lost_is_fail_fake_nvml() -> None:
    fake = FakeNvml(gpus=[FakeGpu(remapped=GpuLost("GPU is lost"))])
    r = pick(run_nvml(fake), "errors.row_remap", 0)
    assert r.status is CheckStatus.FAIL and "bus" in r.remedy


def test_nvml_is_initialised_once_and_shut_down_fake_nvml() -> None:
    fake = FakeNvml()
    run_nvml(fake)
    assert (fake.inits, fake.shutdowns) == (1, 1)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (pynvml.NVML_ERROR_NOT_SUPPORTED, NvmlNotSupported),
        (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, NvmlNotSupported),
        (pynvml.NVML_ERROR_GPU_IS_LOST, GpuLost),
    ],
)
def test_adapter_maps_real_pynvml_errors(code: int, expected: type) -> None:
    adapter = PynvmlAdapter()
    adapter._nvml = pynvml  # the real module; only its exception classes are used here

    def query() -> None:
        raise pynvml.NVMLError(code)

    with pytest.raises(expected):
        adapter._call(query)


def test_adapter_reads_recovery_action_from_the_field_union_real_pynvml_structs() -> None:
    # The real ctypes struct pynvml returns, filled the way libnvml fills it (no driver needed).
    from preflight.nvml import _field_value

    field = pynvml.c_nvmlFieldValue_t()
    field.fieldId = pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
    field.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    field.value.uiVal = pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET
    assert _field_value(pynvml, field) == 4
    field.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    field.value.ullVal = 2
    assert _field_value(pynvml, field) == 2
