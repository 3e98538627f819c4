"""runwarden's own GPU paths on the training side, on one GPU (issue 28): called by gpu_checks.py.

* DCP save and load of CUDA tensors (nodeagent.trainer.dcp), from storage and from memory;
* the in-memory copies on a GPU: every tensor lands in pinned host memory, the copy allocates no
  GPU memory, the training thread only issues it (timed: issue vs landed), and the stall of an
  async save with and without the copy;
* in-memory snapshots of a state on the GPU (nodeagent.trainer.snapshot): no GPU memory, the
  training thread's hold, the step after one against one after none, the restore;
* the peer path's chunked staging through the GPU under NCCL (its peak GPU memory);
* `stop_agreed(device="cuda")` over NCCL;
* a warm rank (the real `nodeagent.warm.leader` and `nodeagent.warm.rank`) running NCCL attempts: an attempt
  aborted in its collectives (ncclCommAbort through `end`), a re-init in the next attempt, the GPU
  memory a parked rank keeps (NVML, MiB per rank) and what it says it keeps;
* NCCL flight-recorder dumps collected over the rank's socket and parsed, and the bootstrap's NCCL
  counters (pg_status with timing);
* the NVML poller and the Xid monitor's bus-id -> NVML index map on the real NVML.

`python tests/gpu/gpu_runwarden.py --cpu` runs the same paths on gloo/CPU (no NVML, nothing
pinned): the dry run of this file on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

WARM_ENV = {"RUNWARDEN_RUN": "gpu", "RUNWARDEN_ATTEMPT": "1", "RUNWARDEN_LAUNCH_PATH": "warm"}


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def _model(device: Any, width: int, layers: int) -> tuple[Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, width, device=device)).square().mean().backward()
    opt.step()
    return model, opt


def _same(a: Any, b: Any) -> bool:
    import torch

    return all(
        torch.equal(x.detach().cpu(), y.detach().cpu())
        for x, y in zip(a.parameters(), b.parameters(), strict=True)
    )


def copies_and_dcp(device: Any, tmp: Path) -> None:
    step(f"the in-memory copies and DCP save/load of {device.type} tensors")
    import torch

    from nodeagent import trainer
    from nodeagent.trainer import dcp, memory_state

    cuda = device.type == "cuda"
    os.environ.update(WARM_ENV)
    model, opt = _model(device, 2048, 8)  # 134 MiB of parameters, 403 MiB with AdamW's moments
    state = {"state": dcp.model_and_optim_state(model, opt)}
    sources = [t for t in memory_state._split(state)[1]]
    # the parameters and AdamW's moments are on the device (AdamW's `step` counters stay on the CPU)
    assert sum(t.device.type == device.type for t in sources) >= 3 * 16, "the state is not on the device"
    times = []
    for i in (1, 2, 3):  # the third reuses the first's pinned buffers
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        why = memory_state.keep(i, state, rank=0, world_size=1)
        issued = time.perf_counter() - t0
        assert why == "", why
        snap = memory_state._copies[-1]
        if cuda:
            assert torch.cuda.memory_allocated() == before, "the copy allocated GPU memory"
        assert snap.copied.wait(120) and not snap.failed, snap.failed
        landed = time.perf_counter() - t0
        times.append((issued, landed))
        leaves = [t for t in memory_state._split(snap.payload)[1]]
        assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in leaves)
        assert all(t.is_pinned() for t in leaves) == cuda, "host buffers are pinned iff CUDA"
        assert all(torch.equal(h, s.cpu()) for h, s in zip(leaves, sources, strict=True)), "the copy differs"
    mib = snap.nbytes / 2**20
    for i, (issued, landed) in enumerate(times, 1):
        rate = snap.nbytes / landed / 1e9
        print(
            f"  copy {i}: {mib:.0f} MiB, {issued * 1e3:.1f} ms on the training thread, landed {landed * 1e3:.1f} ms ({rate:.1f} GB/s)"
        )
    print(f"  kept: {memory_state.kept_steps()}, {memory_state.kept_bytes() / 2**20:.0f} MiB of host memory")

    # the stall of an async save, with and without the copy
    warnings.simplefilter("ignore")
    stalls: dict[str, list[float]] = {}
    for mode in ("cold", "warm"):
        if mode == "cold":
            os.environ.pop("RUNWARDEN_LAUNCH_PATH", None)
        else:
            os.environ.update(WARM_ENV)
        memory_state._copies.clear()
        saver = dcp.DcpCheckpointer(tmp / mode, async_save=True)
        for s in range(1, 5):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            saver.save(s, model=model, optimizer=opt, data_state={"next_step": s})
            stalls.setdefault(mode, []).append(time.perf_counter() - t0)
            saver.wait()
        print(f"  async save stall, {mode}: " + " ".join(f"{x * 1e3:.0f}" for x in stalls[mode]) + " ms")
    commit = trainer.resume_point(tmp / "warm", env={})
    assert commit is not None and commit.step == 4
    fresh, fresh_opt = _model(device, 2048, 8)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    dcp.load_dcp(commit, model=fresh, optimizer=fresh_opt)
    assert _same(fresh, model) and next(fresh.parameters()).device.type == device.type
    print("  load from storage: equal, on the device")
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    trainer.load_checkpoint(commit, model=fresh, optimizer=fresh_opt)
    assert memory_state.loaded_from(4) == "memory" and _same(fresh, model)
    print("  load from the in-memory copy: equal")
    memory_state._copies.clear()


def snapshots_on_device(device: Any) -> None:
    """Issue 30's GPU figure: a snapshot of a state on the GPU (never allocating GPU memory), what it
    holds the training thread, the step after it against one after none, and its restore."""
    step(f"in-memory snapshots of {device.type} state: the stall, the step after, the restore")
    import torch

    from nodeagent import trainer
    from nodeagent.trainer import memory_state

    cuda = device.type == "cuda"
    os.environ.update(WARM_ENV)
    memory_state._copies.clear()
    width = 4096 if cuda else 1024  # on a GPU 537 MiB of parameters, 1.6 GiB with AdamW's moments
    model, opt = _model(device, width, 8)
    snaps = trainer.Snapshotter(every=1, env={**os.environ, "LOCAL_WORLD_SIZE": "1"})
    x = torch.randn(256, width, device=device)

    def train_step() -> float:
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(3):
        train_step()
    plain = [train_step() for _ in range(5)]
    held, after = [], []
    for s in range(1, 6):
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        assert snaps.take(s, model=model, optimizer=opt, data_state={"next_step": s}) == ""
        held.append(time.perf_counter() - t0)
        if cuda:
            assert torch.cuda.memory_allocated() == before, "the snapshot allocated GPU memory"
        if s == 5:  # the state at the snapshot (read after the others' steps were timed)
            reference = [p.detach().cpu().clone() for p in model.parameters()]
        after.append(train_step())
    copy = memory_state.snapshot(5, 1)
    assert copy is not None and copy.copied.wait(120) and not copy.failed, "the last snapshot never landed"
    med = statistics.median(plain), statistics.median(held), statistics.median(after[:4])
    print(
        f"  {copy.nbytes / 2**20:.0f} MiB: step {med[0] * 1e3:.1f} ms; take() {med[1] * 1e3:.1f} ms on the "
        f"training thread; the step after it {med[2] * 1e3:.1f} ms (+{(med[2] - med[0]) / med[0] * 100:.1f}%)"
    )
    loaded = trainer.load_checkpoint(
        trainer.SnapshotPoint(step=5, attempt=1), model=model, optimizer=opt, rank=0
    )
    assert loaded.data_state == {"next_step": 5} and memory_state.loaded_from(5) == "memory"
    assert all(torch.equal(p.detach().cpu(), r) for p, r in zip(model.parameters(), reference, strict=True))
    assert next(model.parameters()).device.type == device.type
    print("  restored from memory: equal to the state at the snapshot, on the device")
    memory_state._copies.clear()


def nccl_paths(device: Any, tmp: Path) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    step(f"stop_agreed(device={device.type!r}) and the peer path's staging over {backend}")
    import torch
    import torch.distributed as dist

    from nodeagent import trainer
    from nodeagent.trainer import memory_state

    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        stop = tmp / "stop"
        reporter = trainer.ProgressReporter(
            run="gpu",
            attempt=1,
            rank=0,
            local_rank=0,
            world_size=1,
            handle_sigterm=False,
            stop_file=str(stop),
        )
        assert reporter.stop_agreed(device=device) is False
        stop.write_text("gpu check\n")
        assert reporter.stop_agreed(device=device) is True and reporter.stop_reason.startswith("stop file")
        reporter.close()
        print(f"  stop_agreed on {device.type}: False, then True after the stop file")
        flat = torch.arange(3 * memory_state.STAGE_BYTES // 4 + 5, dtype=torch.float32)  # 3 chunks and a bit
        want = flat.clone()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        memory_state._broadcast_host(flat, 0, rank=0, device=device.type)
        assert flat.device.type == "cpu" and torch.equal(flat, want)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated() - base
            assert peak <= memory_state.STAGE_BYTES + (1 << 20), peak
            print(
                f"  {flat.numel() * 4 / 2**20:.0f} MiB through the GPU in chunks: peak {peak / 2**20:.0f} MiB"
            )
    finally:
        dist.destroy_process_group()


WARM_JOB = """
import json, os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from nodeagent.trainer import rank_device
backend, device = rank_device.pick(os.environ["JOB_BACKEND"])
dist.init_process_group(backend)
x = torch.ones(1 << 20, device=device)
dist.all_reduce(x)
out = Path(os.environ["JOB_OUT"])
attempt = os.environ["RUNWARDEN_ATTEMPT"]
(out / f"attempt{attempt}.json").write_text(json.dumps({"pid": os.getpid(), "sum": float(x[0])}))
if os.environ.get("JOB_HANG"):
    (out / "hanging").write_text(attempt)
    store = dist.distributed_c10d._get_default_store()
    while True:  # until the abort: NCCL's next collective raises (gloo's world of one never
        dist.all_reduce(x)  # touches a socket: the store's shut socket is what raises there)
        if device.type == "cuda":
            torch.cuda.synchronize()
        else:
            store.set("alive", "1")
dist.destroy_process_group()
"""


def _used_mib(pid: int) -> float | None:
    from preflight.nvml import PynvmlAdapter

    nvml = PynvmlAdapter()
    nvml.init()
    try:
        for p in nvml.compute_processes(0):
            if p.pid == pid and p.used_bytes is not None:
                return p.used_bytes / 2**20
        return None
    finally:
        nvml.shutdown()


def warm_rank(device: Any, tmp: Path) -> None:
    step(f"a warm rank's attempts on {device.type}: NCCL abort, re-init, what a parked rank keeps")
    from nodeagent.warm import protocol
    from testbed.etcd_server import free_port

    cuda = device.type == "cuda"
    job = tmp / "warm_job.py"
    job.write_text(WARM_JOB)
    out = tmp / "warm_out"
    out.mkdir()
    log = (tmp / "leader.log").open("w+b")
    r, w = os.pipe()
    leader = subprocess.Popen(
        [sys.executable, "-m", "nodeagent.warm.leader", "--local-ranks", "1", "--ready-fd", str(w)],
        stdin=subprocess.PIPE,
        stdout=log,
        stderr=subprocess.STDOUT,
        pass_fds=(w,),
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        start_new_session=True,  # so a rank stuck in NCCL is killed with its leader below
    )
    os.close(w)
    lines = protocol.Lines(r, 4096)
    assert leader.stdin is not None

    def said(timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while (line := lines.pop()) is None:
            ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
            log_tail = (tmp / "leader.log").read_text(errors="replace")[-3000:]
            assert ready, f"the leader said nothing within {timeout_s:g} s: {log_tail}"
            assert lines.fill(), f"the leader is gone: {log_tail}"
        return line.decode()

    def hand_off(attempt: int, **extra: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), JOB_OUT=str(out), JOB_BACKEND="nccl" if cuda else "gloo")
        env.update(RUNWARDEN_RUN="gpu", RUNWARDEN_ATTEMPT=str(attempt), **extra)
        rendezvous = {
            "rdzv_id": f"gpu-{attempt}",
            "node_rank": 0,
            "nnodes": 1,
            "local_world_size": 1,
            "master_addr": "127.0.0.1",
            "master_port": free_port(),
            "timeout_s": 60.0,
        }
        msg = protocol.encode_handoff(
            argv=(str(job),), cwd=str(ROOT), env=env, rendezvous=rendezvous, attempt=attempt
        )
        leader.stdin.write(msg + b"\n")
        leader.stdin.flush()

    try:
        ready = said(120.0)  # the rank imports torch first
        assert ready.startswith("ready "), ready
        pid = int(ready.split()[1])
        hand_off(1)
        assert said() == "ended 0"
        parked = _used_mib(pid) if cuda else None
        hand_off(2, JOB_HANG="1")
        deadline = time.monotonic() + 60
        while not (out / "hanging").exists():
            assert time.monotonic() < deadline, "attempt 2 never reached its collectives"
            time.sleep(0.05)
        t0 = time.monotonic()
        leader.stdin.write(b"end\n")
        leader.stdin.flush()
        ended = said(30.0)  # an abort that does not get the rank out of NCCL fails here
        left = time.monotonic() - t0
        assert ended.startswith("ended ") and ended != "ended 0", ended
        hand_off(3)
        assert said() == "ended 0", "no re-init after the abort"
        docs = [json.loads((out / f"attempt{a}.json").read_text()) for a in (1, 2, 3)]
        assert {d["pid"] for d in docs} == {pid}, f"not the same process: {docs}"
        assert all(d["sum"] == 1.0 for d in docs), docs
        print(
            f"  3 attempts in rank pid {pid}; attempt 2 left its collectives {left:.2f} s after `end` ({ended})"
        )
        if cuda:
            print(
                f"  GPU memory of the parked rank (NVML): {parked} MiB after attempt 1, {_used_mib(pid)} MiB now"
            )
    finally:
        leader.stdin.close()
        try:
            leader.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(leader.pid, signal.SIGKILL)
            leader.wait()
        os.close(r)
    log.seek(0)
    text = log.read().decode(errors="replace")
    kept = [line for line in text.splitlines() if "parked after a GPU attempt" in line]
    print("  " + "\n  ".join(kept or ["(no GPU attempt: nothing to release)"]))
    assert bool(kept) == cuda, text[-3000:]
    assert ("process group abort" not in text) or not cuda, text[-3000:]


FR_JOB = """
import json, os, sys
os.environ["TORCH_NCCL_ENABLE_TIMING"] = "1"
import torch, torch.distributed as dist
from nodeagent.trainer import flight_recording as flight_recorder
from nodeagent.trainer import bootstrap
rec = flight_recorder.setup_flight_recording(sys.argv[1], buffer_size=200)
cuda = sys.argv[2] == "cuda"
if cuda:
    torch.cuda.set_device(0)
dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
rec.record_process_groups()
x = torch.ones(1024, device="cuda" if cuda else "cpu")
for _ in range(5):
    dist.all_reduce(x)
if cuda:
    torch.cuda.synchronize()
counters = {k: [v.enqueued, v.started, v.completed] for k, v in bootstrap.read_pg_status().items()}
print(json.dumps(counters), flush=True)
sys.stdin.readline()  # the parent collects the dump meanwhile
dist.destroy_process_group()
"""


def flight_recorder_and_counters(device: Any, tmp: Path) -> None:
    step(
        f"flight-recorder dump and the bootstrap's counters over {'NCCL' if device.type == 'cuda' else 'gloo'}"
    )
    from nodeagent.daemon.flight_recorder import collect_dumps
    from runwarden.flightrec import parse_dump

    sock = tmp / "fr" / "rank0.sock"
    child = subprocess.Popen(
        [sys.executable, "-c", FR_JOB, str(sock), device.type],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        counters = json.loads(child.stdout.readline())
        (dump,) = collect_dumps({0: sock}, 10.0)
        assert dump.ok, dump.error
        parsed = parse_dump(dump.data, rank=0)
        names = [e.profiling_name for e in parsed.entries]
        child.stdin.write("\n")
        child.stdin.flush()
    finally:
        child.wait(60)
    print(f"  counters per group (enqueued, started, completed): {counters}")
    print(f"  dump: {len(dump.data)} bytes, {len(names)} entries: {sorted(set(names))}")
    assert sum(1 for n in names if "all_reduce" in n) >= 5, names
    default = max(counters.values(), key=lambda v: v[2])
    assert default[2] >= 5, counters
    if device.type == "cuda":
        assert default[1] >= 5, "NCCL with timing: the started counter is tracked"
        assert any(n.startswith("nccl:") for n in names), names


def nvml_poller_and_xid_map() -> None:
    step("the NVML poller and the Xid monitor's bus-id -> NVML index map, on the real NVML")
    from nodeagent.daemon.monitors import GpuMap, NvmlPoller
    from preflight.nvml import PynvmlAdapter

    got: list[Any] = []
    poller = NvmlPoller(node="gpu", nvml=PynvmlAdapter(), publish=got.append)
    assert poller.start(3600.0), "the poller did not start"
    try:
        first = poller.poll_once()
        second = poller.poll_once()
    finally:
        poller.stop()
    print(f"  two polls: {len(first)} + {len(second)} evidence: {[e.detail for e in first + second]}")
    nvml = PynvmlAdapter()
    nvml.init()
    bus = nvml.pci_bus_id(0)
    nvml.shutdown()
    index, words = GpuMap(PynvmlAdapter(), visible_devices="").describe(bus)
    print(f"  {bus} -> {words}")
    assert index == 0, words


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="the dry run: gloo on the CPU, no NVML")
    args = p.parse_args(argv)
    import torch

    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if not args.cpu:
        assert torch.cuda.is_available(), "no CUDA"
        torch.cuda.set_device(device)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-runwarden-") as tmp:
        copies_and_dcp(device, Path(tmp))
        snapshots_on_device(device)
        nccl_paths(device, Path(tmp))
        warm_rank(device, Path(tmp))
        flight_recorder_and_counters(device, Path(tmp))
    if not args.cpu:
        nvml_poller_and_xid_map()
    print(f"\nrunwarden's GPU paths passed in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
