"""One rank of tests/nodeagent/test_save_stall.py: real DDP and DcpCheckpointer over gloo on CPU.

The storage is slow on purpose: every rank's DCP writer takes `UPLOAD_S` longer to write its
shards (on DCP's background thread under async_save). The rank times each save() and wait() call
itself, from outside, and records what the saver told its reporter (`set_committed(step,
save_stall_s=...)`) and when. Saves, in order:

1. async, step 1: returns after staging;
2. async, step 2 at once: its save() first waits for step 1's upload (step 1's stall);
   then `wait()` for step 2 (the stop's final save: step 2's stall up to its commit);
3. async, step 3, not waited for: the training thread goes on (polls for the commit, outside any
   save call), so the upload is no stall;
4. a synchronous saver, step 4: the whole save is the stall.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

from nodeagent.trainer.dcp import DcpCheckpointer

UPLOAD_S = 0.5  # the slow storage's extra time per save, on every rank


class SlowWriter(FileSystemWriter):
    """A FileSystemWriter on slow storage: its shards take UPLOAD_S longer to write."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        time.sleep(UPLOAD_S)  # the storage's latency (work being timed, not a wait for an event)
        return super().write_data(plan, planner)


class Commits:
    """The reporter side: every set_committed, with the stall and when (perf_counter) it came."""

    def __init__(self) -> None:
        self.committed: list[tuple[int, float | None, float]] = []

    def set_committed(self, step: int, *, save_stall_s: float | None = None) -> None:
        self.committed.append((step, save_stall_s, time.perf_counter()))

    def checkpoint_failed(self, step: int, error: str) -> None:
        raise AssertionError(f"save of step {step} failed: {error}")


def run_rank(rank: int, world: int, store: str, root: str, out: Any) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()  # the optimizer has state to save
    commits = Commits()
    saver = DcpCheckpointer(Path(root) / "async", reporter=commits, storage_writer=SlowWriter)
    blocked: dict[str, tuple[float, float]] = {}  # call -> (start, end), perf_counter

    def timed(name: str, call: Any, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        call(*args, **kwargs)
        blocked[name] = (start, time.perf_counter())

    timed("save1", saver.save, 1, model=model, optimizer=opt)
    timed("save2", saver.save, 2, model=model, optimizer=opt)
    timed("wait2", saver.wait)
    timed("save3", saver.save, 3, model=model, optimizer=opt)
    deadline = time.monotonic() + 60
    while saver.in_flight:  # training goes on meanwhile: not blocked by the save
        assert time.monotonic() < deadline, "step 3's upload did not finish in 60 s"
        time.sleep(0.01)
    stall3 = saver.stall_s(3)
    sync = DcpCheckpointer(Path(root) / "sync", reporter=commits, async_save=False, storage_writer=SlowWriter)
    timed("save4", sync.save, 4, model=model, optimizer=opt)
    dist.barrier()
    out.put((rank, {"blocked": blocked, "commits": commits.committed, "stall3": stall3}))
    dist.destroy_process_group()
