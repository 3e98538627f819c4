"""The environment of one plain `torch.distributed` rank process started by a test or a benchmark
on this host (gloo, env:// rendezvous on loopback), without torchrun and under no agent."""

from __future__ import annotations

import os
from pathlib import Path


def gloo_rank_env(
    rank: int, world_size: int, port: int, *, run: str, root: Path, attempt: int = 1, warm: bool = False
) -> dict[str, str]:
    """This process's environment less any RUNWARDEN_* of its own, plus torch's env:// variables,
    the supervisor's run and attempt (what nodeagent.trainer.memory_state and the commit marker read), and
    `root` on PYTHONPATH. warm: the rank stands for one the warm path started (only those keep
    in-memory copies of their saves)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNWARDEN_")}
    env.update(
        PYTHONPATH=str(root),
        OMP_NUM_THREADS="1",
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RUNWARDEN_RUN=run,
        RUNWARDEN_ATTEMPT=str(attempt),
    )
    if warm:
        env["RUNWARDEN_LAUNCH_PATH"] = "warm"
    return env
