"""GPU hosts fail closed: where GPUs are expected (config, the scheduler's allocation, the PCI bus), a
check that cannot reach them FAILS, and nothing falls back to the CPU; with none expected (a CPU
host) the same checks SKIP. The boundaries: the PCI sysfs tree (a fake tree in tmp_path), NVML (the
fake adapter, tests/preflight/fake_nvml.py: a mock, named so) and torch.cuda (the real CPU build of
torch here, whose CUDA is genuinely unavailable)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from preflight.checks.inventory import gpu_count
from preflight.config import ComputeConfig, InventoryConfig, PreflightConfig
from preflight.gpus import (
    NOT_EXPECTED,
    GpuExpectation,
    PciGpus,
    allocation,
    expect_gpus,
    pci_gpus,
    resolve_device,
)
from preflight.nvml import NvmlUnavailable
from preflight.report import EXIT_FAIL
from preflight.result import CheckResult, CheckStatus
from preflight.runner import run_preflight
from tests.preflight.fake_nvml import FakeGpu, FakeNvml

EIGHT = [f"0000:{0x18 + i:02x}:00.0" for i in range(8)]  # FakeNvml's default GPUs, by bus id
DRIVER_GONE = NvmlUnavailable("NVML init failed: Driver Not Loaded")


def fake_bus(root: Path, gpus: list[str], others: dict[str, tuple[int, int]] | None = None) -> str:
    """A sysfs tree: NVIDIA 3D controllers at `gpus`, and `others` (bus id -> (vendor, class))."""
    devices = root / "bus" / "pci" / "devices"
    devices.mkdir(parents=True, exist_ok=True)
    for bus, (vendor, klass) in {**{g: (0x10DE, 0x030200) for g in gpus}, **(others or {})}.items():
        (devices / bus).mkdir()
        (devices / bus / "vendor").write_text(f"0x{vendor:04x}\n")
        (devices / bus / "class").write_text(f"0x{klass:06x}\n")
    return str(root)


def config_on(sysfs: str, **sections: object) -> PreflightConfig:
    base = PreflightConfig(inventory=InventoryConfig(sysfs_root=sysfs))
    return dataclasses.replace(base, **sections)


def pci_like(ids: list[str]) -> PciGpus:
    return PciGpus(bus_ids=tuple(ids), readable=True)


def by_name(results: tuple[CheckResult, ...] | list[CheckResult]) -> dict[str, CheckResult]:
    return {r.name: r for r in results}


# --- where GPUs are expected -----------------------------------------------------------------


def test_the_pci_bus_counts_nvidia_display_and_3d_controllers_only(tmp_path: Path) -> None:
    sysfs = fake_bus(
        tmp_path,
        ["0000:3b:00.0"],
        {
            "0000:5e:00.0": (0x10DE, 0x030000),  # an NVIDIA VGA controller: a GPU
            "0000:3b:00.1": (0x10DE, 0x040300),  # the GPU's HDMI audio function: not a GPU
            "0000:02:00.0": (0x1A03, 0x030000),  # the BMC's VGA (ASPEED): not NVIDIA
            "0000:9a:00.0": (0x10DE, 0x068000),  # an NVSwitch (bridge class): not a GPU
        },
    )
    found = pci_gpus(sysfs)
    assert found.readable and found.bus_ids == ("0000:3b:00.0", "0000:5e:00.0")
    missing = pci_gpus(str(tmp_path / "nosuch"))
    assert not missing.readable and "nosuch" in missing.note


@pytest.mark.parametrize(
    ("environ", "count"),
    [
        ({"SLURM_GPUS_ON_NODE": "4"}, 4),
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, 2),
        ({"NVIDIA_VISIBLE_DEVICES": "GPU-aa,GPU-bb,GPU-cc"}, 3),  # the Kubernetes device plugin's
        ({"NVIDIA_VISIBLE_DEVICES": "all"}, None),  # a CUDA image's default: not a request
        ({"CUDA_VISIBLE_DEVICES": "NoDevFiles", "SLURM_GPUS_ON_NODE": "0"}, None),  # Slurm, no GPUs
        ({"CUDA_VISIBLE_DEVICES": "-1"}, None),
        ({"CUDA_VISIBLE_DEVICES": ""}, None),
        ({}, None),
    ],
)
def test_the_schedulers_allocation(environ: dict[str, str], count: int | None) -> None:
    allocated, reasons = allocation(environ)
    assert allocated == count and bool(reasons) == (count is not None)


def test_mig_instances_expect_gpus_without_a_gpu_count() -> None:
    """Seven MIG instances may share one GPU: the list says GPUs are here, not how many NVML sees."""
    allocated, reasons = allocation({"CUDA_VISIBLE_DEVICES": ",".join(f"MIG-{i}" for i in range(7))})
    assert allocated is None and reasons


def test_each_source_expects_gpus_and_a_cpu_host_expects_none(tmp_path: Path) -> None:
    cpu = fake_bus(tmp_path / "cpu", [])
    assert not expect_gpus(PreflightConfig(), {}, cpu).expected
    bus = expect_gpus(PreflightConfig(), {}, fake_bus(tmp_path / "gpu", EIGHT))
    assert bus.expected and bus.reasons == ("8 NVIDIA GPU(s) on the PCI bus",)
    slurm = expect_gpus(PreflightConfig(), {"SLURM_GPUS_ON_NODE": "8"}, cpu)
    assert slurm.expected and slurm.allocated == 8
    counted = PreflightConfig(inventory=InventoryConfig(expected_gpu_count=8))
    assert expect_gpus(counted, {}, cpu).reasons == ("config inventory.expected_gpu_count = 8",)
    cuda = PreflightConfig(compute=ComputeConfig(device="cuda"))
    assert expect_gpus(cuda, {}, cpu).expected


def test_device_auto_is_cuda_where_gpus_are_expected() -> None:
    expected = GpuExpectation(reasons=("8 NVIDIA GPU(s) on the PCI bus",))
    assert resolve_device(PreflightConfig(), expected).compute.device == "cuda"
    assert resolve_device(PreflightConfig(), NOT_EXPECTED).compute.device == "auto"
    cpu = PreflightConfig(compute=ComputeConfig(device="cpu"))  # said so: left alone
    assert resolve_device(cpu, expected).compute.device == "cpu"


# --- NVML ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "gpus_on_bus", "count"),
    [
        ({}, EIGHT, 0),  # the PCI bus
        ({"SLURM_GPUS_ON_NODE": "8"}, [], 0),  # Slurm's allocation
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, [], 0),
        ({"NVIDIA_VISIBLE_DEVICES": "GPU-aa"}, [], 0),  # a Kubernetes device request
        ({}, [], 8),  # config (the agent fills it from local_ranks where GPUs are expected)
    ],
)
def test_nvml_init_failure_where_gpus_are_expected_fails_closed(
    tmp_path: Path, environ: dict[str, str], gpus_on_bus: list[str], count: int
) -> None:
    sysfs = fake_bus(tmp_path, gpus_on_bus)
    config = config_on(sysfs)
    config = dataclasses.replace(
        config, inventory=dataclasses.replace(config.inventory, expected_gpu_count=count)
    )
    report = run_preflight(
        config,
        "quick",
        only=("inventory", "errors"),
        nvml_factory=lambda: FakeNvml(init_error=DRIVER_GONE),
        gpus=expect_gpus(config, environ, sysfs),
    )
    results = by_name(report.results)
    for name in ("inventory", "errors"):
        r = results[name]
        assert r.status is CheckStatus.FAIL and r.fail_closed, r
        assert "GPUs expected" in r.message and "Driver Not Loaded" in r.message
    assert report.exit_code == EXIT_FAIL and not report.passed


def test_nvml_init_failure_on_a_cpu_host_is_skip(tmp_path: Path) -> None:
    sysfs = fake_bus(tmp_path, [])
    config = config_on(sysfs)
    report = run_preflight(
        config,
        "quick",
        only=("inventory", "errors"),
        nvml_factory=lambda: FakeNvml(init_error=DRIVER_GONE),
        gpus=expect_gpus(config, {}, sysfs),
    )
    assert [r.status for r in report.results] == [CheckStatus.SKIP, CheckStatus.SKIP]
    assert all("no NVML" in r.message and not r.fail_closed for r in report.results)
    assert report.passed


def test_eight_on_the_bus_seven_in_nvml_fails_naming_the_missing_bus_id(tmp_path: Path) -> None:
    sysfs = fake_bus(tmp_path, EIGHT)
    config = config_on(sysfs)
    seven = [FakeGpu(pci_bus_id=f"00000000:{int(b[5:7], 16):02X}:00.0") for b in EIGHT if b != "0000:1c:00.0"]
    report = run_preflight(
        config,
        "quick",
        only=("inventory",),
        nvml_factory=lambda: FakeNvml(gpus=seven),
        gpus=expect_gpus(config, {}, sysfs),
    )
    count = by_name(report.results)["inventory.gpu_count"]
    assert count.status is CheckStatus.FAIL and count.fail_closed
    assert "8 NVIDIA GPU(s) on the PCI bus, NVML sees 7: missing 0000:1c:00.0" in count.message
    assert count.value == 7.0


def test_the_bus_and_nvml_agreeing_passes_even_with_no_count_configured(tmp_path: Path) -> None:
    sysfs = fake_bus(tmp_path, EIGHT)
    config = config_on(sysfs)
    report = run_preflight(
        config, "quick", only=("inventory",), nvml_factory=FakeNvml, gpus=expect_gpus(config, {}, sysfs)
    )
    count = by_name(report.results)["inventory.gpu_count"]
    assert count.status is CheckStatus.PASS and "on the PCI bus 8" in count.message


def test_a_container_sees_its_allocation_not_the_whole_bus() -> None:
    """Kubernetes or Slurm with device cgroups: sysfs shows all 8, NVML the 4 allocated."""
    four = EIGHT[:4]
    bus = GpuExpectation(reasons=("allocation NVIDIA_VISIBLE_DEVICES",), allocated=4, pci=pci_like(EIGHT))
    assert gpu_count(bus, 0, 4, four).status is CheckStatus.PASS
    short = gpu_count(bus, 0, 3, four[:3])
    assert short.status is CheckStatus.FAIL and "the scheduler allocated 4, NVML sees 3" in short.message
    assert gpu_count(bus, 8, 4, four).status is CheckStatus.FAIL  # 8 configured: 4 is short


def test_nvml_seeing_no_gpu_where_they_are_expected_fails() -> None:
    bus = GpuExpectation(reasons=("2 NVIDIA GPU(s) on the PCI bus",), pci=pci_like(EIGHT[:2]))
    none = gpu_count(bus, 0, 0, [])
    assert (
        none.status is CheckStatus.FAIL
        and none.fail_closed
        and "missing 0000:18:00.0, 0000:19:00.0" in none.message
    )


# --- CUDA: compute and the burn-in's device stages -------------------------------------------


@pytest.mark.parametrize("isolate", [True, False], ids=["child", "in-process"])
def test_cuda_unavailable_on_a_host_with_nvidia_devices_fails_compute(tmp_path: Path, isolate: bool) -> None:
    """torch here is a CPU build: its CUDA is unavailable for real. With an NVIDIA GPU on the bus,
    device = "auto" must not test the CPU in its place (it did, and passed)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the test needs one without")
    sysfs = fake_bus(tmp_path, ["0000:3b:00.0"])
    config = config_on(sysfs, compute=ComputeConfig(isolate=isolate, size_cpu=64, iterations_cpu=1))
    report = run_preflight(config, "quick", only=("compute",), gpus=expect_gpus(config, {}, sysfs))
    (matmul,) = report.results
    assert matmul.status is CheckStatus.FAIL and matmul.fail_closed, matmul
    assert "CUDA is unavailable" in matmul.message and "1 NVIDIA GPU(s) on the PCI bus" in matmul.message
    # the same host with nothing on the bus: the CPU is the device, and it passes
    cpu = config_on(fake_bus(tmp_path / "cpu", []), compute=config.compute)
    (on_cpu,) = run_preflight(cpu, "quick", only=("compute",), gpus=NOT_EXPECTED).results
    assert on_cpu.status is CheckStatus.PASS and "cpu" in on_cpu.message


def test_cuda_unavailable_fails_the_burn_ins_device_stages(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the test needs one without")
    sysfs = fake_bus(tmp_path, ["0000:3b:00.0"])
    config = config_on(sysfs)
    report = run_preflight(
        config,
        "burn_in",
        only=("matmul", "memory"),
        nvml_factory=lambda: FakeNvml(init_error=DRIVER_GONE),
        gpus=expect_gpus(config, {}, sysfs),
    )
    results = by_name(report.results)
    for name in ("burn_in.matmul", "burn_in.memory", "burn_in.matmul.counters"):
        assert results[name].status is CheckStatus.FAIL and results[name].fail_closed, results[name]
    assert "CUDA is unavailable" in results["burn_in.matmul"].message


# --- the quick collective --------------------------------------------------------------------


@pytest.mark.parametrize(
    "nvml",
    [lambda: FakeNvml(gpus=[]), lambda: FakeNvml(init_error=DRIVER_GONE)],
    ids=["nvml-sees-none", "nvml-init-fails"],
)
def test_the_quick_collective_seeing_no_gpu_where_they_are_expected_fails(tmp_path: Path, nvml) -> None:
    sysfs = fake_bus(tmp_path, EIGHT[:2])
    config = config_on(sysfs)
    report = run_preflight(
        config, "quick", only=("collective",), nvml_factory=nvml, gpus=expect_gpus(config, {}, sysfs)
    )
    (r,) = report.results
    assert r.status is CheckStatus.FAIL and r.fail_closed and "NVML sees no GPU" in r.message
    cpu = config_on(fake_bus(tmp_path / "cpu", []))
    (skip,) = run_preflight(cpu, "quick", only=("collective",), nvml_factory=nvml, gpus=NOT_EXPECTED).results
    assert skip.status is CheckStatus.SKIP
