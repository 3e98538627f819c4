"""A plain DDP training script, written the way PyTorch's DDP tutorial writes one: no runwarden
import, no progress calls, no checkpoints. Launched with torchrun through nodeagent.trainer.bootstrap by
tests/nodeagent/test_bootstrap.py and tests/live/test_unmodified_script.py.

The only additions are the tests' knobs, as files so a test can turn them on and off while the
run goes on (`--fault-dir D`): while D/slow-rank<R> exists, rank R sleeps `--slow-s` in its forward
pass (a straggler); while D/stall-rank<R> exists, rank R sleeps between steps, outside any
collective (a hang its peers wait for); D/crash-rank<R> makes rank R raise. `--step-sleep` stands
in for the rest of a real step's work (the test machine has two cores).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def knob(fault_dir: str, name: str, rank: int) -> bool:
    return bool(fault_dir) and os.path.exists(os.path.join(fault_dir, f"{name}-rank{rank}"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--slow-s", type=float, default=0.2)
    parser.add_argument("--fault-dir", default="")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"Start running basic DDP example on rank {rank}.", flush=True)
    torch.manual_seed(1234)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.001)

    for step in range(args.steps):
        while knob(args.fault_dir, "stall", rank):
            time.sleep(0.05)
        if knob(args.fault_dir, "crash", rank):
            raise RuntimeError(f"rank {rank}: crashed at step {step} (the test's knob)")
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10))
        if knob(args.fault_dir, "slow", rank):
            time.sleep(args.slow_s)
        labels = torch.randn(20, 5)
        loss = loss_fn(outputs, labels)
        loss.backward()
        optimizer.step()
        time.sleep(args.step_sleep)
        if rank == 0 and step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
