"""The burn-in pipeline on its CPU paths with real torch, each stage failing on a real injected fault:
a corrupted product at the torch matmul boundary, a corrupted memory readback, a wrong all-reduce
sum, an unwritable checkpoint path; NVML counters before / during / after through the fake at the
pynvml adapter boundary (tests named ..._fake_nvml); the config's validation; the runner and CLI."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nodeagent.daemon.preflight_bridge import summarize
from preflight.burn_in_device import memory_test, sustained_matmul
from preflight.checks import burn_in
from preflight.checks.base import CheckContext, NvmlSession, process_name
from preflight.checks.burn_in import Counters, evaluate_soak, judge_counters, loop_result, loop_spread
from preflight.cli import main as cli_main
from preflight.collective import SoakResult, soak
from preflight.config import (
    BurnInConfig,
    CollectiveConfig,
    ComputeConfig,
    ConfigError,
    DcgmConfig,
    ErrorsConfig,
    InventoryConfig,
    PreflightConfig,
    StorageConfig,
    load_config,
)
from preflight.nvml import THROTTLE_BITS, GpuProcess, NvmlUnavailable, RemappedRows
from preflight.report import EXIT_INCONCLUSIVE, PreflightReport
from preflight.result import CheckResult, CheckStatus
from preflight.runner import run_preflight
from testbed.wait import wait_until
from tests.preflight.fake_nvml import FakeGpu, FakeNvml

DATA = Path(__file__).parent / "data"
MiB = 1024 * 1024
QUICK = BurnInConfig(
    matmul_duration_s_cpu=0.3,
    matmul_size_cpu=64,
    memory_mb_cpu=2,
    memory_chunk_mb=1,
    allreduce_duration_s_cpu=0.3,
    sample_interval_s=0.02,
    stage_slack_s=30.0,
)


def config(**sections: Any) -> PreflightConfig:
    base: dict[str, Any] = {"compute": ComputeConfig(device="cpu", isolate=False), "burn_in": QUICK}
    base.update(sections)
    return dataclasses.replace(PreflightConfig(), **base)


def no_nvml() -> FakeNvml:
    return FakeNvml(init_error=NvmlUnavailable("NVML Shared Library Not Found"))


def ctx(cfg: PreflightConfig | None = None, nvml: Callable[[], Any] = no_nvml) -> CheckContext:
    return CheckContext(
        config=cfg or config(), mode="burn_in", nvml=NvmlSession(nvml), deadline=time.monotonic() + 120
    )


def by_name(results: list[CheckResult]) -> dict[str, list[CheckResult]]:
    out: dict[str, list[CheckResult]] = {}
    for r in results:
        out.setdefault(r.name, []).append(r)
    return out


def corrupt_call(
    k: int, at: tuple[int, int] = (5, 7)
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """torch.matmul, except that the k-th call's result has one element off by one."""
    calls = [0]

    def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        out = torch.matmul(a, b)
        if calls[0] == k:
            out[at] += 1.0
        return out

    return mm


# --- matmul ----------------------------------------------------------------------------------


class _TickingClock:
    """Each read moves 10 ms on: the loop's length is a count of reads, not the machine's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.01
        return self.now


def test_sustained_matmul_loops_for_its_duration_and_every_product_is_right() -> None:
    o = sustained_matmul("cpu", 64, 0.3, "float32", clock=_TickingClock())
    assert o.reference_ok and o.bad_iterations == 0 and o.first_bad == ""
    assert o.iterations > 3 and o.seconds >= 0.3 and o.tflops > 0
    # On the real clock too: it runs its duration, however slow the machine is.
    real = sustained_matmul("cpu", 64, 0.3, "float32")
    assert real.reference_ok and real.bad_iterations == 0 and real.iterations >= 1 and real.seconds >= 0.3


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_device_worker_ends_mid_stage_when_the_agent_that_started_it_is_gone(tmp_path: Path) -> None:
    """A burn-in's device child outlived a stopped agent (bench_peers: "left behind"): it now ends
    within its parent poll, mid-stage, whoever ended the agent."""
    agent = subprocess.Popen(
        [sys.executable, "-c", (
            "import subprocess, sys, time\n"
            "from preflight.burn_in_device import child_args\n"
            "from preflight.config import BurnInConfig, ComputeConfig\n"
            "args = child_args(BurnInConfig(matmul_duration_s_cpu=300.0), ComputeConfig(device='cpu'))\n"
            "child = subprocess.Popen([sys.executable, '-m', 'preflight.burn_in_device', *args],\n"
            "                         stdin=subprocess.PIPE, start_new_session=True)\n"
            "child.stdin.write(b'matmul\\n'); child.stdin.flush()\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(600)\n"
        )],
        stdout=subprocess.PIPE,
        cwd=burn_in._PROJECT_ROOT,
    )  # fmt: skip
    assert agent.stdout is not None
    child = int(agent.stdout.readline())
    try:
        # torch imported and the stage's loop running (importing torch costs ~1.5 s of CPU)
        wait_until(lambda: _cpu_seconds(child) > 4.0, 120, "the device child in its matmul stage")
        agent.kill()
        agent.wait()
        wait_until(lambda: _gone(child), 10, "the device child to end with its agent")
    finally:
        agent.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, 9)


def test_an_agent_that_exits_mid_burn_in_ends_its_device_worker_on_the_way_out() -> None:
    """An agent stopped (SIGINT, SIGTERM: it exits normally) while a burn-in stage runs: the stage's
    child is gone by the time the agent's exit is, not a poll later."""
    agent = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, threading, time\n"
            "from preflight.checks.burn_in import DeviceWorker\n"
            "from preflight.config import BurnInConfig, ComputeConfig, PreflightConfig\n"
            "cfg = PreflightConfig(burn_in=BurnInConfig(matmul_duration_s_cpu=300.0), compute=ComputeConfig(device='cpu'))\n"
            "worker = DeviceWorker()\n"
            "threading.Thread(target=worker.run, args=('matmul', cfg, 600.0), daemon=True).start()\n"
            "while worker._proc is None:\n"
            "    time.sleep(0.01)\n"
            "print(worker._proc.pid, flush=True)\n"
            "sys.stdin.readline()\n"
        )],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=burn_in._PROJECT_ROOT,
    )  # fmt: skip
    assert agent.stdin is not None and agent.stdout is not None
    child = int(agent.stdout.readline())
    try:
        wait_until(lambda: _cpu_seconds(child) > 4.0, 120, "the device child in its matmul stage")
        agent.stdin.write(b"exit\n")
        agent.stdin.flush()
        assert agent.wait(timeout=30) == 0
        assert _gone(child)
    finally:
        agent.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, 9)


def test_a_corrupted_product_mid_loop_at_the_torch_boundary_fails_the_stage() -> None:
    # Call 1 is the reference, 2 the first product: call 4 is product 2, long after a one-shot check.
    results = burn_in.run_matmul(ctx(), matmul=corrupt_call(4))
    [r] = by_name(results)["burn_in.matmul"]
    assert r.status is CheckStatus.FAIL and "1 of" in r.message and "products wrong" in r.message
    assert any("product 2: 1 element(s) wrong, first [5, 7] = " in e for e in r.evidence), r.evidence
    assert "silent data corruption" in r.remedy


def test_a_corrupted_reference_product_fails_before_the_loop() -> None:
    [r] = by_name(burn_in.run_matmul(ctx(), matmul=corrupt_call(1)))["burn_in.matmul"]
    assert r.status is CheckStatus.FAIL and "wrong reference product" in r.message
    assert "checksums differ" in r.message


def test_throughput_below_the_baseline_floor_and_a_slow_gpu_fail() -> None:
    fast = burn_in.LoopOutcome(
        device="cuda:0",
        gpu_index=0,
        size=8192,
        dtype="bfloat16",
        iterations=100,
        bad_iterations=0,
        reference_ok=True,
        first_bad="",
        tflops=700.0,
        tflops_min_window=690.0,
        seconds=300.0,
    )
    slow = dataclasses.replace(fast, device="cuda:1", gpu_index=1, tflops=500.0)
    assert loop_result(fast, 600.0).status is CheckStatus.PASS
    below = loop_result(slow, 600.0)
    assert below.status is CheckStatus.FAIL and "below the floor 600.00" in below.message
    spread = loop_spread([fast, fast, slow, fast], spread_max=0.15)
    assert spread.status is CheckStatus.FAIL and "cuda:1" in spread.message
    assert loop_spread([fast, fast], 0.15).status is CheckStatus.PASS


# --- memory ----------------------------------------------------------------------------------


def test_memory_patterns_over_a_host_buffer_pass() -> None:
    [r, counters] = burn_in.run_memory(ctx())
    assert r.name == "burn_in.memory" and r.status is CheckStatus.PASS, r.message
    assert (
        "walking_ones,walking_zeros,address,random" in r.evidence[0] and "tested=2097152 B" in r.evidence[0]
    )
    assert counters.name == "burn_in.memory.counters" and counters.status is CheckStatus.SKIP
    assert "no NVML" in counters.message


@pytest.mark.parametrize("pattern", ["walking_ones", "walking_zeros", "address", "random"])
def test_a_corrupted_readback_fails_naming_the_pattern_and_offset(pattern: str) -> None:
    calls = [0]

    def flip_in_chunk_1(chunk: torch.Tensor) -> torch.Tensor:
        calls[0] += 1  # chunks are read back in order: the second read is chunk 1
        if calls[0] != 2:
            return chunk
        bad = chunk.clone()
        bad[100] ^= 1 << 17
        return bad

    o = memory_test(
        "cpu",
        host_bytes=3 * MiB,
        fraction=1.0,
        chunk_bytes=MiB,
        patterns=[pattern],
        seed=7,
        readback=flip_in_chunk_1,
    )
    offset = (MiB // 8 + 100) * 8
    r = burn_in.memory_result(o)
    assert r.status is CheckStatus.FAIL and o.bad_words == 1 and o.chunks == 3
    assert f"pattern {pattern}: 1 word(s) wrong in chunk 1; first at byte offset {offset}" in r.message


def test_memory_stage_fails_through_the_readback_seam() -> None:
    def flip(chunk: torch.Tensor) -> torch.Tensor:
        bad = chunk.clone()
        bad[3] ^= 1
        return bad

    [r, _] = burn_in.run_memory(ctx(), readback=flip)
    assert r.status is CheckStatus.FAIL and "read back wrong" in r.message
    assert "pattern walking_ones: 1 word(s) wrong in chunk 0; first at byte offset 24 (0x18)" in r.message


# --- NVML counters around a stage (the fake at the adapter boundary) -------------------------


def two_gpus() -> FakeNvml:
    return FakeNvml(gpus=[FakeGpu(), FakeGpu(pci_bus_id="00000000:19:00.0")])


def test_a_new_uncorrectable_ecc_error_during_the_loop_fails_that_gpu_fake_nvml() -> None:
    fake = two_gpus()
    calls = [0]

    def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3:
            fake.gpus[1].ecc_volatile = 2  # the loop's load brings out a bad cell on GPU 1
        return torch.matmul(a, b)

    results = by_name(burn_in.run_matmul(ctx(nvml=lambda: fake), matmul=mm))
    assert results["burn_in.matmul"][0].status is CheckStatus.PASS  # the products were right
    gpu0, gpu1 = results["burn_in.matmul.counters"]
    assert gpu0.status is CheckStatus.PASS and gpu0.gpu_index == 0
    assert gpu1.status is CheckStatus.FAIL and gpu1.gpu_index == 1
    assert "2 new uncorrectable ECC error(s) during the stage" in gpu1.message
    assert (
        "ecc_volatile_uncorrectable=0" in gpu1.evidence[0]
        and "ecc_volatile_uncorrectable=2" in gpu1.evidence[2]
    )


def test_throttling_seen_only_while_the_loop_runs_fails_fake_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = two_gpus()
    calls, reads = [0], [0]
    read_throttle = fake.throttle_reasons

    def counted(index: int) -> int:
        reads[0] += index == 0
        return read_throttle(index)

    monkeypatch.setattr(fake, "throttle_reasons", counted)

    def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3:
            fake.gpus[0].throttle = THROTTLE_BITS["hw_slowdown"]
            seen = reads[0]  # several samples (the stage's thread samples while this one works) see it ...
            wait_until(lambda: reads[0] >= seen + 2, 30, "two samples of GPU 0 while it throttles")
        elif calls[0] == 4:
            fake.gpus[0].throttle = THROTTLE_BITS["gpu_idle"]  # ... gone again before the stage ends
        return torch.matmul(a, b)

    results = by_name(burn_in.run_matmul(ctx(nvml=lambda: fake), matmul=mm))
    gpu0, gpu1 = results["burn_in.matmul.counters"]
    assert gpu0.status is CheckStatus.FAIL and "clocks throttled under load: hw_slowdown" in gpu0.message
    assert "hw_slowdown" in gpu0.evidence[1] and "gpu_idle" in gpu0.evidence[2]
    assert gpu1.status is CheckStatus.PASS


def test_a_pending_row_remap_and_an_overheating_gpu_fail_fake_nvml() -> None:
    fake = two_gpus()

    def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        fake.gpus[0].remapped = RemappedRows(correctable=0, uncorrectable=1, pending=True, failure=False)
        fake.gpus[1].temperature = 95
        return torch.matmul(a, b)

    results = by_name(burn_in.run_matmul(ctx(nvml=lambda: fake), matmul=mm))
    gpu0, gpu1 = results["burn_in.matmul.counters"]
    assert gpu0.status is CheckStatus.FAIL
    assert "row remapping pending" in gpu0.message and "1 new row(s) remapped" in gpu0.message
    assert gpu1.status is CheckStatus.FAIL and "reached 95 C, above the 87 C limit" in gpu1.message
    assert gpu1.value == 95.0 and gpu1.unit == "C"


def test_counters_judged_from_readings() -> None:
    ok = Counters(
        ecc_volatile=0,
        remap=RemappedRows(correctable=0, uncorrectable=0, pending=False, failure=False),
        throttle=0x4,
        temperature=60,
    )
    kw: dict[str, Any] = {
        "throttle_seen": 0x4,
        "hottest": 70,
        "errors": ErrorsConfig(),
        "temperature_max_c": 87,
    }
    assert judge_counters("memory", 0, ok, ok, **kw).status is CheckStatus.PASS  # sw_power_cap is normal
    warm = judge_counters("memory", 0, ok, ok, **{**kw, "throttle_seen": THROTTLE_BITS["sw_thermal"]})
    assert warm.status is CheckStatus.WARN
    lost = Counters(
        ecc_volatile=None, remap=None, throttle=None, temperature=None, errors=("ecc: GPU is lost",)
    )
    gone = judge_counters("memory", 0, ok, lost, **kw)
    assert gone.status is CheckStatus.FAIL and "GPU is lost" in gone.message
    none = Counters(ecc_volatile=None, remap=None, throttle=None, temperature=None)
    assert judge_counters("memory", 0, none, none, **kw).status is CheckStatus.SKIP


# --- dcgm, allreduce, storage ----------------------------------------------------------------


def test_dcgm_stage_runs_diag_level_3(tmp_path: Path) -> None:
    args = tmp_path / "args"
    dcgmi = tmp_path / "dcgmi"
    dcgmi.write_text(f'#!/bin/sh\necho "$@" > {args}\ncat {DATA / "dcgm_diag_r2_fail.json"}\nexit 226\n')
    dcgmi.chmod(dcgmi.stat().st_mode | stat.S_IEXEC)
    results = burn_in.run_dcgm(ctx(config(dcgm=DcgmConfig(dcgmi=str(dcgmi), burn_in_timeout_s=10.0))))
    assert args.read_text().strip() == "diag -r 3 -j"
    failing = [r for r in results if r.status is CheckStatus.FAIL]
    assert failing and all(r.name.startswith("burn_in.dcgm.") for r in results)


def test_dcgm_stage_without_dcgm_is_skip() -> None:
    [r] = burn_in.run_dcgm(ctx(config(dcgm=DcgmConfig(dcgmi="/nonexistent/dcgmi"))))
    assert r.name == "burn_in.dcgm.diag" and r.status is CheckStatus.SKIP and "not found" in r.message


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A real gloo group of one rank in this process (the soak's code path without processes)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_soak_checks_every_result_and_a_wrong_sum_fails(one_rank_group: None) -> None:
    calls = [0]

    def bad_all_reduce(tensor: torch.Tensor, *args: Any, **kw: Any) -> Any:
        out = dist.all_reduce(tensor, *args, **kw)
        calls[0] += 1
        if calls[0] == 9:  # round 1 (iterations=5, no warm-up): one element of one result wrong
            tensor[11] += 1.0
        return out

    good = soak(4096, iterations=5, warmup=0, duration_s=0.2)
    assert good.bad_results == 0 and good.rounds >= 1 and len(good.busbw_gbps) == good.rounds
    bad = soak(4096, iterations=5, warmup=0, duration_s=0.2, all_reduce=bad_all_reduce)
    assert bad.bad_results == 1 and bad.first_bad_round == 1
    r = evaluate_soak(bad, QUICK)
    assert r.status is CheckStatus.FAIL and "1 all-reduce result(s) wrong, the first in round 1" in r.message


def soak_result(rates: list[float]) -> SoakResult:
    return SoakResult(
        world_size=8,
        backend="nccl",
        size_bytes=1 << 28,
        iterations=5,
        rounds=len(rates),
        busbw_gbps=tuple(rates),
        bad_results=0,
        first_bad_round=-1,
        duration_s=120.0,
    )


def test_bandwidth_that_sags_below_its_first_rounds_fails() -> None:
    steady = evaluate_soak(soak_result([400, 410, 405, 395, 400, 402, 398, 150]), BurnInConfig())
    assert steady.status is CheckStatus.PASS  # one slow round is noise: windows take the median
    sagging = evaluate_soak(soak_result([400, 410, 405, 395, 250, 240, 245, 240]), BurnInConfig())
    assert (
        sagging.status is CheckStatus.FAIL and "sagged to 59% of its first rounds" in sagging.message
    )  # 240 / 405
    few = evaluate_soak(soak_result([400, 100]), BurnInConfig())
    assert few.status is CheckStatus.PASS and "too few rounds (2 < 6)" in few.message


SAG: list[float] = [400, 410, 405, 395, 250, 240, 245, 240]  # the later windows at 59% of the first rounds


def test_a_sag_on_a_loaded_host_is_inconclusive_and_on_an_idle_one_a_fail() -> None:
    idle = evaluate_soak(soak_result(SAG), BurnInConfig(), load=burn_in.HostLoad(cpu_share=0.02))
    assert idle.status is CheckStatus.FAIL, idle.message
    loaded = evaluate_soak(soak_result(SAG), BurnInConfig(), load=burn_in.HostLoad(cpu_share=0.45))
    assert loaded.status is CheckStatus.INCONCLUSIVE, loaded.message
    assert "not idle: other processes used 45% of the host's CPUs (limit 10%)" in loaded.message
    on_gpu = burn_in.HostLoad(cpu_share=0.0, gpu_processes=("gpu3 pid=4242 name=python",))
    shared = evaluate_soak(soak_result(SAG), BurnInConfig(), load=on_gpu)
    assert shared.status is CheckStatus.INCONCLUSIVE and "gpu3 pid=4242" in shared.message
    # A wrong sum is the node's whatever else ran: load does not corrupt a reduction.
    wrong = dataclasses.replace(soak_result(SAG), bad_results=2, first_bad_round=4)
    assert evaluate_soak(wrong, BurnInConfig(), load=on_gpu).status is CheckStatus.FAIL
    # Unmeasured load (no /proc/stat, no NVML) judges as before: a sag fails.
    assert evaluate_soak(soak_result(SAG), BurnInConfig()).status is CheckStatus.FAIL


def test_a_sag_is_judged_by_the_load_during_its_own_rounds() -> None:
    """A neighbour's burst over the sag's rounds is the host's load even when the soak's average is
    low (the demo's burn-in failed a healthy node so: another node's burn-in ran beside part of it)."""
    idle_average = burn_in.HostLoad(cpu_share=0.02)
    rounds = dict(host_cpus=2, round_s=(1.0,) * 8)  # 8 rounds of 1 s on 2 CPUs
    burst = dataclasses.replace(soak_result(SAG), round_foreign_s=(0, 0, 0, 0, 1.0, 1.2, 1.0, 0.8), **rounds)
    judged = evaluate_soak(burst, BurnInConfig(), load=idle_average)
    assert judged.status is CheckStatus.INCONCLUSIVE, judged.message
    assert any("in the slowest window" in e for e in judged.evidence), judged.evidence
    quiet = dataclasses.replace(soak_result(SAG), round_foreign_s=(1, 1, 0, 0, 0, 0.02, 0, 0), **rounds)
    assert evaluate_soak(quiet, BurnInConfig(), load=idle_average).status is CheckStatus.FAIL
    # short rounds: the window widens to the rounds around it until they span 0.5 s (/proc/stat
    # counts 10 ms ticks), here the burst's four; a soak too short for that judges by its average
    short = dataclasses.replace(burst, round_s=(0.1,) * 8, round_foreign_s=(0, 0, 0, 0, 0.1, 0.12, 0.1, 0.08))
    assert evaluate_soak(short, BurnInConfig(), load=idle_average).status is CheckStatus.INCONCLUSIVE
    tiny = dataclasses.replace(burst, round_s=(0.001,) * 8)
    assert evaluate_soak(tiny, BurnInConfig(), load=idle_average).status is CheckStatus.FAIL


def test_the_sag_is_judged_against_the_nodes_own_floor_when_it_has_one() -> None:
    # 245 GB/s after 405 at first: a sag against the first rounds, yet above 0.7 x the floor of this
    # node class (300 GB/s, `preflight baseline`'s figure less its margin): the link is fine.
    held = evaluate_soak(soak_result(SAG), BurnInConfig(), floor_gbps=300.0)
    assert held.status is CheckStatus.PASS and "busbw_floor_gbps" in held.message, held.message
    # A node slow from its first round never sags against itself; its floor catches it.
    slow = evaluate_soak(soak_result([150.0] * 8), BurnInConfig(), floor_gbps=300.0)
    assert slow.status is CheckStatus.FAIL and "50% of the node's floor" in slow.message
    assert evaluate_soak(soak_result([150.0] * 8), BurnInConfig()).status is CheckStatus.PASS


def test_other_processes_cpu_share_is_the_hosts_busy_time_less_the_ranks_own() -> None:
    r = dataclasses.replace(soak_result(SAG), duration_s=10.0, own_cpu_s=12.0, host_busy_s=20.0, host_cpus=4)
    assert burn_in.foreign_cpu_share(r) == pytest.approx(0.2)  # (20 - 12) / (10 s x 4 CPUs)
    assert burn_in.foreign_cpu_share(dataclasses.replace(r, host_busy_s=-1.0)) is None


@contextlib.contextmanager
def cpu_burner() -> Iterator[subprocess.Popen[bytes]]:
    """A process spinning one CPU, not this test's child tree's work: started, then waited for
    until it has used CPU (an event, not a sleep)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "print('go', flush=True)\nwhile True: pass"], stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"go\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_the_soak_measures_other_processes_load_on_the_host(one_rank_group: None) -> None:
    with cpu_burner():
        r = soak(4096, iterations=5, warmup=0, duration_s=0.5)
    share = burn_in.foreign_cpu_share(r)
    assert r.own_cpu_s > 0 and r.host_cpus >= 1 and share is not None
    assert share * r.host_cpus >= 0.6, (share, r)  # the burner's core (less scheduling noise)


@pytest.mark.slow
def test_allreduce_stage_soaks_across_two_local_gloo_processes() -> None:
    [r] = burn_in.run_allreduce(ctx())
    # This host is shared (other tests run beside it): a sag under their load is INCONCLUSIVE, never FAIL.
    assert r.name == "burn_in.allreduce" and r.status in (CheckStatus.PASS, CheckStatus.INCONCLUSIVE), (
        r.message
    )
    assert "backend=gloo ranks=2" in r.evidence[0] and "host load by other processes: CPU" in r.evidence[2]


@pytest.mark.slow
def test_allreduce_stage_under_another_processes_load_is_inconclusive_not_failed() -> None:
    # A floor no loopback reaches makes every window a sag; whether that is the node's fault
    # depends only on whether something else loaded it.
    floor = CollectiveConfig(busbw_floor_gbps=1e6, cpu_processes=2, size_bytes_cpu=1 << 16)
    with cpu_burner():
        [loaded] = burn_in.run_allreduce(ctx(config(collective=floor)))
    assert loaded.status is CheckStatus.INCONCLUSIVE, loaded.message
    assert "not idle: other processes used" in loaded.message
    tolerant = dataclasses.replace(QUICK, allreduce_max_foreign_load=1.0)
    [judged] = burn_in.run_allreduce(ctx(config(collective=floor, burn_in=tolerant)))
    assert judged.status is CheckStatus.FAIL and "of the node's floor" in judged.message


def test_gpu_strangers_are_processes_on_the_gpus_not_the_checks_own_fake_nvml() -> None:
    mine = os.getpid()
    gpus = [
        FakeGpu(processes=[GpuProcess(pid=mine, used_bytes=1)]),
        FakeGpu(processes=[GpuProcess(pid=1, used_bytes=1)]),
    ]
    found = burn_in.gpu_strangers(ctx(nvml=lambda: FakeNvml(gpus=gpus)))
    assert found == [f"gpu1 pid=1 name={process_name(1)}"]
    allowed = config(inventory=InventoryConfig(allowed_gpu_processes=(process_name(1),)))
    assert burn_in.gpu_strangers(ctx(allowed, nvml=lambda: FakeNvml(gpus=gpus))) == []
    assert burn_in.gpu_strangers(ctx()) == []  # no NVML: the CPU share alone says


def test_an_inconclusive_check_is_no_pass_and_no_failure_in_the_report() -> None:
    r = burn_in.evaluate_soak(soak_result(SAG), BurnInConfig(), load=burn_in.HostLoad(cpu_share=0.5))
    report = PreflightReport(
        mode="burn_in", host="h", started_at=0.0, duration_s=1.0, budget_s=10.0, results=(r,)
    )
    s = report.summary()
    assert not report.passed and report.exit_code == EXIT_INCONCLUSIVE and report.failed_checks == []
    assert (s.passed, s.fail_count, s.inconclusive_count, list(s.inconclusive_checks)) == (
        False,
        0,
        1,
        ["burn_in.allreduce"],
    )
    again = PreflightReport.from_json(json.loads(report.dumps()))
    assert again == report and again.stages()[0][1] is CheckStatus.INCONCLUSIVE
    wire = summarize("burn_in", [r.to_proto()], 1.0)
    assert (wire.passed, wire.fail_count, list(wire.inconclusive_checks)) == (False, 0, ["burn_in.allreduce"])


def test_allreduce_stage_with_one_gpu_is_skip_fake_nvml() -> None:
    cfg = config(compute=ComputeConfig(device="auto", isolate=False))
    [r] = burn_in.run_allreduce(ctx(cfg, nvml=lambda: FakeNvml(gpus=[FakeGpu()])))
    assert r.status is CheckStatus.SKIP and "have 1 (nccl)" in r.message


def test_storage_stage_fails_on_an_unwritable_checkpoint_path() -> None:
    # /sys refuses new files even to root; the throughput probe is not attempted after that.
    results = burn_in.run_storage(ctx(config(storage=StorageConfig(checkpoint_path="/sys/kernel"))))
    [w] = [r for r in results if r.name == "burn_in.storage.checkpoint_writable"]
    assert w.status is CheckStatus.FAIL and "is not writable" in w.message
    assert "burn_in.storage.throughput" not in {r.name for r in results}


def test_storage_stage_is_the_full_form_with_throughput(tmp_path: Path) -> None:
    cfg = config(
        storage=StorageConfig(checkpoint_path=str(tmp_path), free_space_floor_gb=0.001, throughput_mb=2)
    )
    names = {r.name: r.status for r in burn_in.run_storage(ctx(cfg))}
    assert names["burn_in.storage.checkpoint_writable"] is CheckStatus.PASS
    assert names["burn_in.storage.throughput"] is CheckStatus.PASS


# --- the pipeline: runner, config, CLI -------------------------------------------------------


def test_the_pipeline_runs_its_stages_in_order_one_at_a_time(tmp_path: Path) -> None:
    cfg = config(
        burn_in=dataclasses.replace(QUICK, stages=("storage", "memory", "matmul", "dcgm")),
        storage=StorageConfig(checkpoint_path=str(tmp_path), free_space_floor_gb=0.001, throughput_mb=1),
        dcgm=DcgmConfig(dcgmi="/nonexistent/dcgmi"),
    )
    streamed: list[str] = []
    report = run_preflight(cfg, "burn_in", on_result=lambda r: streamed.append(r.name), nvml_factory=no_nvml)
    assert report.mode == "burn_in" and report.budget_s == 3600.0 and report.passed
    stages = [s for s, _, _ in report.stages()]
    assert stages == ["storage", "memory", "matmul", "dcgm"]
    staged = [n.split(".")[1] for n in streamed if n.startswith("burn_in.")]
    assert staged == sorted(staged, key=["storage", "memory", "matmul", "dcgm"].index)
    # the quick preflight's units run too, as in quick mode; a stage supersedes its quick unit
    # (storage, dcgm, compute here), the quick all-reduce stays (no allreduce stage configured)
    units = {n.split(".")[0] for n in streamed if not n.startswith("burn_in.")}
    assert {"inventory", "errors", "preflight", "collective"} <= units, units
    assert not units & {"compute", "dcgm", "storage"}, units
    verdicts = {s: v for s, v, _ in report.stages()}
    assert verdicts["dcgm"] is CheckStatus.SKIP and verdicts["matmul"] is CheckStatus.PASS
    assert "stage dcgm: SKIP (1 SKIP)" in report.render_table()
    only = run_preflight(cfg, "burn_in", only=["memory"], nvml_factory=no_nvml)
    assert {r.name for r in only.results} == {"burn_in.memory", "burn_in.memory.counters"}


def test_a_burn_in_report_round_trips_and_names_the_failed_stage() -> None:
    report = run_preflight(config(), "burn_in", only=["dcgm"], nvml_factory=no_nvml)
    again = PreflightReport.from_json(json.loads(report.dumps()))
    assert again == report and again.summary().mode == "burn_in"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[burn_in]\nmatmul_minutes = 5\n", "unknown key(s) matmul_minutes"),
        (
            "[burn_in]\nstages = ['matmul', 'gpu_burn']\n",
            "stages: ['matmul', 'gpu_burn'] must name each stage",
        ),
        ("[burn_in]\nstages = ['matmul', 'matmul']\n", "at most once"),
        ("[burn_in]\nmemory_patterns = ['checkerboard']\n", "memory_patterns: ['checkerboard'] must be"),
        ("[burn_in]\nmemory_patterns = []\n", "must be one or more of"),
        ("[burn_in]\nmemory_fraction = 1.5\n", "memory_fraction: must be in (0, 1]"),
        ("[burn_in]\nmatmul_duration_s = 0\n", "matmul_duration_s: must be positive"),
        ("[burn_in]\nallreduce_duration_s_cpu = -1\n", "must not be negative"),
        ("[burn_in]\nmatmul_dtype = 'int8'\n", "not one of auto, float32"),
        ("[burn_in]\nmatmul_size = 'big'\n", "expected an integer"),
        ("[dcgm]\nburn_in_level = 5\n", "burn_in_level: dcgmi diag runs levels 1-4"),
        ("[compute]\nmodes = ['burn_in']\n", "may contain only quick, full"),
        ("[run]\nburn_in_budget_s = 0\n", "budgets must be positive"),
    ],
)
def test_bad_burn_in_config_names_file_and_key(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert words in str(info.value) and str(path) in str(info.value)


def test_cli_burn_in_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[dcgm]\ndcgmi = '/nonexistent/dcgmi'\n[run]\nburn_in_budget_s = 30.0\n")
    code = cli_main(["run", "--burn-in", "--only", "dcgm", "--json", "--config", str(path)])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["mode"] == "burn_in" and doc["budget_s"] == 30.0
    assert [r["name"] for r in doc["results"]] == ["burn_in.dcgm.diag"]
    assert cli_main(["run", "--burn-in", "--only", "nosuch", "--config", str(path)]) == 2


# --- the device worker: one child process for a burn-in's device stages ----------------------


def test_device_stages_share_one_child_process_and_it_ends_with_the_run() -> None:
    isolated = config(compute=ComputeConfig(device="cpu", isolate=True))
    worker = burn_in.DeviceWorker()
    c = ctx(isolated)
    try:
        [loop, _] = burn_in.run_matmul(c, worker=worker)
        child = worker._proc
        [mem, _] = burn_in.run_memory(c, worker=worker)
        assert loop.status is CheckStatus.PASS and mem.status is CheckStatus.PASS, (loop, mem)
        assert child is not None and worker._proc is child and child.poll() is None  # torch started once
    finally:
        worker.close()
    assert child.poll() == 0


def test_a_device_stage_past_its_time_is_killed_and_fails() -> None:
    # 0.5 s is less than the child needs to import torch: the stage must not wait past its limit.
    slow = config(
        compute=ComputeConfig(device="cpu", isolate=True),
        burn_in=dataclasses.replace(
            QUICK, matmul_duration_s=0.1, matmul_duration_s_cpu=0.1, stage_slack_s=0.4
        ),
    )
    worker = burn_in.DeviceWorker()
    started = time.monotonic()
    [r, _] = burn_in.run_matmul(ctx(slow), worker=worker)
    assert r.status is CheckStatus.FAIL and "did not finish in 0.5 s (killed)" in r.message
    assert time.monotonic() - started < 5 and worker._proc is not None and worker._proc.poll() is not None
    worker.close()
