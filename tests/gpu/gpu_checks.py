"""Every GPU code path of preflight on a real GPU node: the NVML adapter (inventory and counters),
the CUDA known-answer matmul, the NCCL all-reduce, the burn-in's GPU paths (the sustained matmul
loop and the device-memory test on CUDA, with NVML counters around them; the NCCL soak on >= 2 GPUs),
the quick preflight's all-reduce (a short NCCL one on >= 2 GPUs, a SKIP on one), a leftover rank
holding real GPU memory (named with its attempt by the agent's view, killed, the memory freed), the
trainer's collective timer on CUDA (its DDP comm hook over a one-process NCCL group: CUDA events
recorded, gradients equal to an unhooked model's, compute + wait = the step), then the full
preflight through the CLI.

Run by tests/gpu/run.sh (which skips it, saying why, on a host without a GPU) beside
tests/gpu/gpu_runwarden.py (runwarden's own training-side GPU paths). Exits nonzero on the first
path that does not work, `preflight --full` exiting 1 (a FAIL) included; prints what it measured.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from preflight.checks import burn_in  # noqa: E402
from preflight.checks.base import CheckContext, NvmlSession  # noqa: E402
from preflight.checks.collective_check import launch_local  # noqa: E402
from preflight.checks.compute import run_compute  # noqa: E402
from preflight.config import BurnInConfig, ComputeConfig, PreflightConfig  # noqa: E402
from preflight.nvml import NvmlNotSupported, PynvmlAdapter  # noqa: E402
from preflight.result import CheckResult, CheckStatus  # noqa: E402
from preflight.runner import run_preflight  # noqa: E402


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def nvml_paths() -> int:
    step("NVML adapter: every query on every GPU")
    nvml = PynvmlAdapter()
    nvml.init()
    count = nvml.device_count()
    assert count >= 1, "NVML sees no GPU"
    print(f"driver {nvml.driver_version()} cuda {nvml.cuda_driver_version()} gpus {count}")
    queries = {
        "name": lambda i: nvml.name(i),
        "pci_bus_id": lambda i: nvml.pci_bus_id(i),
        "ecc_volatile": lambda i: nvml.ecc_uncorrected(i, volatile=True),
        "ecc_aggregate": lambda i: nvml.ecc_uncorrected(i, volatile=False),
        "retired_pages_pending": lambda i: nvml.retired_pages_pending(i),
        "remapped_rows": lambda i: nvml.remapped_rows(i),
        "recovery_action": lambda i: nvml.recovery_action(i),
        "compute_processes": lambda i: nvml.compute_processes(i),
        "pcie_link": lambda i: nvml.pcie_link(i),
        "throttle_reasons": lambda i: hex(nvml.throttle_reasons(i)),
        "persistence_mode": lambda i: nvml.persistence_mode(i),
        "mig_mode": lambda i: nvml.mig_mode(i),
    }
    for gpu in range(count):
        for name, query in queries.items():
            try:
                print(f"gpu{gpu} {name}: {query(gpu)}")
            except NvmlNotSupported as exc:
                print(f"gpu{gpu} {name}: not supported ({exc})")  # a SKIP in the check, by design
    link = nvml.pcie_link(0)
    assert link.max_width >= 1 and link.max_gen >= 1, link
    nvml.shutdown()

    report = run_preflight(PreflightConfig(), "quick", only=("inventory", "errors"))
    for r in report.results:
        print(
            f"  {r.status.value:4} {r.name}{'' if r.gpu_index is None else f'[gpu{r.gpu_index}]'}: {r.message}"
        )
    assert not any("no NVML" in r.message for r in report.results), "NVML checks skipped on a GPU host"
    assert not any("crashed" in r.message or "timed out" in r.message for r in report.results)
    names = {r.name for r in report.results}
    assert {
        "inventory.gpu_processes",
        "inventory.pcie_link",
        "errors.ecc_uncorrectable",
        "errors.throttle",
    } <= names
    return count


def cuda_matmul(count: int) -> None:
    step("CUDA known-answer matmul on every GPU")
    import torch

    assert torch.cuda.is_available() and torch.cuda.device_count() == count, (
        "torch does not see the GPUs NVML sees"
    )
    # isolate=True runs the GPUs in a child process (the agent's path); False in this process.
    for mode, isolate in (("quick", True), ("full", True), ("quick", False)):
        config = dataclasses.replace(PreflightConfig(), compute=ComputeConfig(device="cuda", isolate=isolate))
        ctx = CheckContext(
            config=config, mode=mode, nvml=NvmlSession(PynvmlAdapter), deadline=time.monotonic() + 120
        )
        results = run_compute(ctx)
        for r in results:
            print(f"  {mode}/{isolate}: {r.status.value} {r.message} | {' | '.join(r.evidence)}")
            assert r.status is CheckStatus.PASS, r.message
        assert len([r for r in results if r.name == "compute.matmul"]) == count
    config = dataclasses.replace(PreflightConfig(), compute=ComputeConfig(device="cuda"))

    def flip(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = torch.matmul(a, b)
        out[123, 45] += 1.0
        return out

    ctx = CheckContext(
        config=config, mode="quick", nvml=NvmlSession(PynvmlAdapter), deadline=time.monotonic() + 60
    )
    caught = run_compute(ctx, matmul=flip)
    assert all(r.status is CheckStatus.FAIL for r in caught if r.name == "compute.matmul"), (
        "corruption not caught"
    )
    print("  injected corruption caught on every GPU")


def nccl_all_reduce(count: int) -> None:
    step(f"NCCL all-reduce over {count} GPU(s)")
    result = launch_local(count, "nccl", 256 * 1024 * 1024, iterations=10, warmup=2, timeout_s=120)
    print(f"  {result}")
    assert result.backend == "nccl" and result.correct and result.algbw_gbps > 0


def burn_in_gpu_paths(count: int) -> None:
    step(f"burn-in on {count} GPU(s): sustained matmul, memory test, NCCL soak (short durations)")
    import torch

    # Short: the paths, not a real burn-in (minutes per stage by default).
    short = BurnInConfig(
        matmul_duration_s=10.0, memory_fraction=0.5, allreduce_duration_s=10.0, stage_slack_s=90.0
    )
    config = dataclasses.replace(PreflightConfig(), compute=ComputeConfig(device="cuda"), burn_in=short)

    def ctx() -> CheckContext:
        return CheckContext(
            config=config, mode="burn_in", nvml=NvmlSession(PynvmlAdapter), deadline=time.monotonic() + 150
        )

    stages = {
        "matmul": burn_in.run_matmul,  # in a child process (the agent's path)
        "memory": burn_in.run_memory,
        "allreduce": burn_in.run_allreduce,
    }
    for stage, run in stages.items():
        started = time.monotonic()
        results = run(ctx())
        print(f"  {stage}: {time.monotonic() - started:.1f} s")
        for r in results:
            gpu = "" if r.gpu_index is None else f"[gpu{r.gpu_index}]"
            print(f"    {r.status.value:4} {r.name}{gpu}: {r.message} | {' | '.join(r.evidence)}")
        assert not any(r.status is CheckStatus.FAIL for r in results), f"burn-in {stage} failed on a GPU"
        if stage == "allreduce" and count < 2:
            assert results[0].status is CheckStatus.SKIP and "have 1" in results[0].message
            print("  NCCL soak: SKIPPED (needs >= 2 GPUs on the node)")
            continue
        main = [r for r in results if r.name == f"burn_in.{stage}"]
        assert main and all(r.status is CheckStatus.PASS for r in main), main
        if stage in ("matmul", "memory"):
            assert len(main) == count and {r.gpu_index for r in main} == set(range(count))
            counters = [r for r in results if r.name == f"burn_in.{stage}.counters"]
            assert len(counters) == count and not any("no NVML" in r.message for r in counters)

    # The same loop in this process with one product corrupted at the torch boundary: caught on a GPU.
    calls = [0]

    def flip(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        out = torch.matmul(a, b)
        if calls[0] == 5:
            out[123, 45] += 1.0
        return out

    one = dataclasses.replace(
        config,
        compute=ComputeConfig(device="cuda"),
        burn_in=dataclasses.replace(short, matmul_duration_s=2.0),
    )
    results = burn_in.run_matmul(
        CheckContext(
            config=one, mode="burn_in", nvml=NvmlSession(PynvmlAdapter), deadline=time.monotonic() + 60
        ),
        matmul=flip,
    )
    bad = [r for r in results if r.name == "burn_in.matmul" and r.status is CheckStatus.FAIL]
    assert bad, "a corrupted product in the CUDA loop was not caught"
    print(f"  injected corruption caught: {bad[0].message}")

    def flip_word(chunk: torch.Tensor) -> torch.Tensor:
        out = chunk.clone()
        out[77] ^= 1 << 40
        return out

    small = dataclasses.replace(one, burn_in=dataclasses.replace(short, memory_fraction=0.05))
    results = burn_in.run_memory(
        CheckContext(
            config=small, mode="burn_in", nvml=NvmlSession(PynvmlAdapter), deadline=time.monotonic() + 60
        ),
        readback=flip_word,
    )
    bad = [r for r in results if r.name == "burn_in.memory" and r.status is CheckStatus.FAIL]
    assert bad and "byte offset 616" in bad[0].message, [r.message for r in results]
    print(f"  injected readback corruption caught: {bad[0].message}")


def quick_all_reduce(count: int) -> None:
    step(f"the quick preflight's in-node all-reduce on {count} GPU(s)")
    started = time.monotonic()
    (r,) = run_preflight(PreflightConfig(), "quick", only=["collective"]).results
    took = time.monotonic() - started
    print(f"  {r.status.value} {r.message} ({took:.2f} s)")
    if count < 2:
        assert r.status is CheckStatus.SKIP and r.message.startswith("one local device") and took < 1.0, r
    else:
        assert r.status is CheckStatus.PASS and took <= PreflightConfig().collective.quick_timeout_s + 2.0, r


def leftover_gpu_memory() -> None:
    step("a leftover rank holding GPU memory: named with its attempt, killed by the agent's view, gone")
    from nodeagent.daemon import leftovers, preflight_bridge

    code = (
        "import time, torch\nx = torch.empty(1 << 30, dtype=torch.uint8, device='cuda:0')\n"
        "torch.cuda.synchronize()\nprint('up', flush=True)\ntime.sleep(600)"
    )
    socket = f"/tmp/gpu-check-{os.getpid()}.sock"  # the agent it claims to come from (never created)
    marks = {"RUNWARDEN_NODE": "gpu-check", "RUNWARDEN_RUN": "r", "RUNWARDEN_ATTEMPT": "1"}
    marks["RUNWARDEN_AGENT_SOCKET"] = socket
    rank = subprocess.Popen(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=str(ROOT), **marks),
        stdout=subprocess.PIPE,
        start_new_session=True,
    )

    def check() -> tuple[leftovers.AgentProcesses, dict[tuple[str, int | None], CheckResult]]:
        view = leftovers.AgentProcesses(node="gpu-check", socket=socket, workers=list)
        specs = preflight_bridge.agent_specs(view, {})
        report = run_preflight(PreflightConfig(), "quick", only=["inventory", "processes"], specs=specs)
        return view, {(r.name, r.gpu_index): r for r in report.results}

    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == b"up", "the rank did not start"
        view, results = check()
        gpu0, left = results[("inventory.gpu_processes", 0)], results[("processes.leftover_ranks", None)]
        print(f"  {gpu0.status.value} {gpu0.message}: {gpu0.evidence}")
        mine = [e for e in gpu0.evidence if e.startswith(f"pid={rank.pid} ")]
        assert mine and "run r attempt 1" in mine[0], f"NVML does not list pid {rank.pid}: {gpu0}"
        assert left.status is CheckStatus.FAIL, left
        print(f"  cleaned: {view.clean(2.0)}")
        deadline = time.monotonic() + 15.0
        while results[("inventory.gpu_processes", 0)].status is not CheckStatus.PASS:
            assert time.monotonic() < deadline, f"the GPU memory was not released: {results}"
            time.sleep(0.5)
            _, results = check()
        print("  the next check passes: the memory is free")
    finally:
        if rank.poll() is None:
            rank.kill()
        rank.wait()


def collective_timer() -> None:
    step("the trainer's collective timer on CUDA: DDP comm hook over a one-process NCCL group")
    import copy
    import statistics

    import torch
    import torch.distributed as dist
    from torch import nn

    from nodeagent import trainer

    made: list[torch.cuda.Event] = []
    real_event = torch.cuda.Event

    def counted(*args: object, **kwargs: object) -> torch.cuda.Event:
        event = real_event(*args, **kwargs)
        made.append(event)
        return event

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    torch.cuda.Event = counted  # counts the timer's events
    try:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1)).cuda()
        plain = copy.deepcopy(net)
        ddp = nn.parallel.DistributedDataParallel(net, device_ids=[0])
        reporter = trainer.ProgressReporter(
            run="gpu", attempt=1, rank=0, local_rank=0, world_size=1, handle_sigterm=False
        )
        reporter.time_collectives(ddp)
        x = torch.randn(512, 256, device="cuda")
        ddp(x).square().mean().backward()
        plain(x).square().mean().backward()
        for a, b in zip(net.parameters(), plain.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
        assert made, "the hook recorded no CUDA event"
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        reporter.loaded(-1)
        timings = []
        for i in range(20):
            opt.zero_grad()
            loss = ddp(x).square().mean()
            loss.backward()
            opt.step()
            reporter.report(i + 1, loss=loss.item())
            last = reporter.last_timings
            assert last is not None and last[0] == i + 1
            timings.append(last[1:])
        reporter.close()
        assert len(made) >= 2 * 21 and len(made) % 2 == 0, len(made)  # ready + done, per bucket
        for step_time, compute, wait in timings:
            assert 0.0 <= wait <= step_time and abs(compute + wait - step_time) < 1e-9, timings
        step_ms = statistics.median(t[0] for t in timings) * 1e3
        wait_ms = statistics.median(t[2] for t in timings) * 1e3
        print(f"  {len(made)} CUDA events; median step {step_ms:.2f} ms, wait {wait_ms:.3f} ms (no peer)")
    finally:
        torch.cuda.Event = real_event
        dist.destroy_process_group()


def full_cli() -> None:
    step("preflight run --full --json (the CLI, every check)")
    with tempfile.TemporaryDirectory() as ckpt:
        cfg = Path(ckpt) / "preflight.toml"
        cfg.write_text(f"[storage]\ncheckpoint_path = '{ckpt}'\nfree_space_floor_gb = 1.0\n")
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "preflight", "run", "--full", "--json", "--config", str(cfg)],
            capture_output=True,
            text=True,
            timeout=200,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
        wall = time.monotonic() - started
    print(proc.stderr[-2000:])
    assert proc.stdout.strip(), f"preflight could not run (exit {proc.returncode}): no JSON"
    doc = json.loads(proc.stdout)
    for r in doc["results"]:
        gpu = "" if r["gpu_index"] is None else f"[gpu{r['gpu_index']}]"
        print(f"  {r['status']:4} {r['name']}{gpu}: {r['message']}")
    print(f"  exit {proc.returncode}, {wall:.1f} s wall, failed: {doc['failed_checks']}")
    names = {r["name"] for r in doc["results"]}
    assert {"compute.matmul", "errors.ecc_uncorrectable", "inventory.pcie_link"} <= names, names
    assert not any("crashed" in r["message"] for r in doc["results"])
    assert wall < 130, "the full preflight overran its 120 s budget"
    # a healthy GPU host passes: exit 1 (a FAIL) fails this script, after the results are printed
    assert proc.returncode == 0, f"preflight --full exited {proc.returncode}: failed {doc['failed_checks']}"


def main() -> int:
    started = time.monotonic()
    count = nvml_paths()
    cuda_matmul(count)
    nccl_all_reduce(count)
    burn_in_gpu_paths(count)
    quick_all_reduce(count)
    leftover_gpu_memory()
    collective_timer()
    full_cli()
    print(f"\nGPU checks passed in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
