"""The quick mode's in-node all-reduce, decided at the torch boundary: `launch_local` is what starts
the torch ranks, so a test that replaces it sees exactly what would have been started (or nothing)."""

from __future__ import annotations

import time

import pytest

from preflight.checks import collective_check
from preflight.checks.base import CheckContext, NvmlSession
from preflight.collective import AllReduceResult
from preflight.config import PreflightConfig
from preflight.nvml import NvmlUnavailable
from preflight.result import CheckStatus
from preflight.runner import run_preflight
from tests.preflight.fake_nvml import FakeGpu, FakeNvml

MIB = 1024 * 1024


def _nvml(gpus: int | None) -> FakeNvml:
    if gpus is None:  # a CPU-only host: no driver
        return FakeNvml(gpus=[], init_error=NvmlUnavailable("NVML Shared Library Not Found"))
    return FakeNvml(gpus=[FakeGpu() for _ in range(gpus)])


def _ctx(mode: str, gpus: int | None) -> CheckContext:
    return CheckContext(
        config=PreflightConfig(),
        mode=mode,
        nvml=NvmlSession(lambda: _nvml(gpus)),
        deadline=time.monotonic() + 15.0,
    )


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, ...]]:
    calls: list[tuple[object, ...]] = []

    def launch_local(
        world: int, backend: str, size_bytes: int, iterations: int, warmup: int, timeout_s: float
    ) -> AllReduceResult:
        calls.append((world, backend, size_bytes, iterations, warmup, timeout_s))
        return AllReduceResult(
            world_size=world,
            backend=backend,
            size_bytes=size_bytes,
            iterations=iterations,
            time_s=0.001,
            algbw_gbps=33.5,
            busbw_gbps=58.7,
            correct=True,
        )

    monkeypatch.setattr(collective_check, "launch_local", launch_local)
    return calls


@pytest.mark.parametrize(("gpus", "seen"), [(1, "1 GPU"), (None, "no GPU, the CPU only")])
def test_one_local_device_in_quick_mode_is_a_skip_that_starts_nothing_fake_nvml(launches, gpus, seen) -> None:
    t0 = time.monotonic()
    (result,) = collective_check.run_collective(_ctx("quick", gpus))
    took = time.monotonic() - t0
    assert result.status is CheckStatus.SKIP
    assert result.message == f"one local device: no in-node all-reduce ({seen})"
    assert launches == [] and took < 0.1


def test_two_or_more_gpus_in_quick_mode_run_a_short_nccl_all_reduce_fake_nvml(launches) -> None:
    (result,) = collective_check.run_collective(_ctx("quick", 8))
    ((world, backend, size, iterations, warmup, timeout),) = launches
    cfg = PreflightConfig().collective
    assert (world, backend, size, iterations, warmup) == (8, "nccl", 32 * MIB, 5, cfg.warmup)
    assert size == cfg.size_bytes_quick < cfg.size_bytes_gpu and iterations < cfg.iterations
    assert 1.0 <= timeout <= cfg.quick_timeout_s == 10.0
    assert result.status is CheckStatus.PASS and "over 8 ranks" in result.message
    assert "no floor set: collective.busbw_floor_gbps = 0; not checked" in result.message


@pytest.mark.parametrize(
    ("gpus", "want"), [(8, (8, "nccl", 256 * MIB, 10)), (None, (2, "gloo", 4 * MIB, 10))]
)
def test_full_mode_keeps_the_long_all_reduce_and_the_cpu_gloo_path_fake_nvml(launches, gpus, want) -> None:
    (result,) = collective_check.run_collective(_ctx("full", gpus))
    ((*started, _warmup, timeout),) = launches
    assert tuple(started) == want and timeout <= PreflightConfig().collective.timeout_s
    assert result.status is CheckStatus.PASS


def test_the_default_quick_preflight_skips_it_on_this_cpu_host_in_no_time_fake_nvml(launches) -> None:
    report = run_preflight(PreflightConfig(), "quick", only=["collective"], nvml_factory=lambda: _nvml(None))
    (result,) = report.results
    assert result.status is CheckStatus.SKIP and "one local device" in result.message
    assert result.duration_s < 0.1 and launches == []
