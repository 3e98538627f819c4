"""A tiny real distributed trainer for the backend tests (run under torchrun, gloo on CPU).

Each step all-reduces a tensor; rank 0 saves every SAVE_EVERY steps (state file, fsync, then the
COMMITTED marker, fsync: a checkpoint without the marker does not exist). Rank 0 polls the stop
file once per step and the decision is all-reduced, so every rank stops at the same step: save,
commit, exit 0. On start it resumes from the newest *committed* checkpoint. Every notable thing
is one JSON line in <checkpoint dir>/trainer.log.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

CKPT = Path(os.environ["RUNWARDEN_CHECKPOINT_DIR"])
STOP_FILE = Path(os.environ.get("RUNWARDEN_STOP_FILE") or CKPT / "STOP")
STEPS = int(os.environ.get("TRAINER_STEPS", "100000"))
STEP_S = float(os.environ.get("TRAINER_STEP_S", "0.1"))
SAVE_EVERY = int(os.environ.get("TRAINER_SAVE_EVERY", "5"))
SAVE_S = float(os.environ.get("TRAINER_SAVE_S", "0.5"))  # a save that takes a while, like a real one
RANK = int(os.environ["RANK"])


def note(event: str, **fields: object) -> None:
    line = {
        "event": event,
        "rank": RANK,
        "node": os.environ.get("SLURMD_NODENAME", ""),
        "rdzv": os.environ.get("TORCHELASTIC_RUN_ID", ""),
        "restart_count": os.environ.get("SLURM_RESTART_COUNT", ""),
        "t": time.time(),
        **fields,
    }
    with open(CKPT / "trainer.log", "a") as f:
        f.write(json.dumps(line) + "\n")


def committed_step() -> int:
    steps = [int(p.name[5:]) for p in CKPT.glob("step-*") if (p / "COMMITTED").exists()]
    return max(steps, default=-1)


def save(step: int) -> None:
    d = CKPT / f"step-{step}"
    d.mkdir(exist_ok=True)
    with open(d / "state.json", "w") as f:
        json.dump({"step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    time.sleep(SAVE_S)
    with open(d / "COMMITTED", "w") as f:
        f.flush()
        os.fsync(f.fileno())
    note("committed", step=step)


def main() -> int:
    dist.init_process_group("gloo")
    start = committed_step() + 1
    note("started", resume_from=start - 1, world=dist.get_world_size())
    t = torch.ones(4)
    for step in range(start, STEPS):
        time.sleep(STEP_S)
        dist.all_reduce(t)
        t.fill_(1.0)
        stop = torch.tensor([1.0 if RANK == 0 and STOP_FILE.exists() else 0.0])
        dist.all_reduce(stop)
        if stop.item() > 0:
            if RANK == 0:
                save(step)
            dist.barrier()
            note("stopped", step=step)
            dist.destroy_process_group()
            return 0
        if RANK == 0 and step % SAVE_EVERY == 0:
            save(step)
    note("finished", step=STEPS - 1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
