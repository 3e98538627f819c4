"""Real gloo all-reduce across 2-4 local processes; the bus-bandwidth formula of nccl-tests."""

from __future__ import annotations

import dataclasses
import socket
import time

import pytest

from preflight.checks import collective_check
from preflight.checks.collective_check import evaluate, launch_local
from preflight.collective import AllReduceResult, bus_bandwidth
from preflight.config import CollectiveConfig, ComputeConfig, PreflightConfig
from preflight.result import CheckStatus
from preflight.runner import run_preflight


def test_bus_bandwidth_formula() -> None:
    # 1 GB in 0.1 s: algbw 10 GB/s; busbw = algbw * 2(n-1)/n.
    assert bus_bandwidth(10**9, 0.1, 8) == pytest.approx((10.0, 17.5))
    assert bus_bandwidth(10**9, 0.1, 2) == pytest.approx((10.0, 10.0))
    assert bus_bandwidth(10**9, 0.1, 1) == pytest.approx((10.0, 0.0))
    with pytest.raises(ValueError):
        bus_bandwidth(10**9, 0.0, 2)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_all_reduce_across_processes(world: int) -> None:
    size = 1 << 20
    result = launch_local(world, "gloo", size, iterations=5, warmup=1, timeout_s=120)
    assert result.correct and result.world_size == world and result.backend == "gloo"
    assert result.size_bytes == size
    algbw, busbw = bus_bandwidth(size, result.time_s, world)
    assert result.algbw_gbps == pytest.approx(algbw) and result.busbw_gbps == pytest.approx(busbw)
    assert result.busbw_gbps == pytest.approx(result.algbw_gbps * 2 * (world - 1) / world)
    assert result.busbw_gbps > 0


@pytest.mark.slow
def test_collective_check_through_the_runner_with_floor() -> None:
    config = dataclasses.replace(
        PreflightConfig(),
        compute=ComputeConfig(device="cpu"),
        collective=CollectiveConfig(
            cpu_processes=3, size_bytes_cpu=1 << 18, iterations=3, busbw_floor_gbps=1e6
        ),
    )
    report = run_preflight(config, "full", only=("collective",))
    [r] = report.results
    assert r.status is CheckStatus.FAIL and "below the floor" in r.message and r.unit == "GB/s"
    assert "ranks=3" in r.evidence[0]


@pytest.mark.slow
def test_hung_rank_is_killed_within_the_timeout() -> None:
    # 0.5 s is less than a rank needs to import torch and rendezvous: the launcher must kill the
    # group at its timeout and say so, not wait for the ranks.
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        launch_local(2, "gloo", 1 << 10, iterations=1, warmup=0, timeout_s=0.5)
    assert time.monotonic() - started < 10


@pytest.mark.slow
def test_a_store_port_taken_by_another_process_is_no_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    # Another process listens on the port chosen for rank 0's store (it took it between the choice
    # and the bind): the ranks run again on a new port, promptly, and the node passes.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        real_free_port = collective_check.free_port
        chosen: list[int] = []

        def choose() -> int:
            chosen.append(real_free_port() if chosen else taken.getsockname()[1])
            return chosen[-1]

        monkeypatch.setattr(collective_check, "free_port", choose)
        started = time.monotonic()
        result = launch_local(2, "gloo", 1 << 12, iterations=1, warmup=0, timeout_s=120)
    assert result.correct and len(chosen) == 2 and chosen[0] != chosen[1]
    assert time.monotonic() - started < 60


def test_wrong_sum_fails() -> None:
    bad = AllReduceResult(
        world_size=2,
        backend="gloo",
        size_bytes=4,
        iterations=1,
        time_s=1.0,
        algbw_gbps=1.0,
        busbw_gbps=1.0,
        correct=False,
    )
    assert evaluate(bad, 0.0).status is CheckStatus.FAIL
