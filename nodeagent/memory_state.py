"""The rank's in-memory copy of its last checkpoint: the fast path of a warm restart (issue 18).

A warm rank process outlives its attempts (nodeagent.warm), and this module, imported once, with
it. `keep` is called by `nodeagent.trainer.save_checkpoint` once every rank has written its file
(after the save's barrier, before rank 0 writes the commit marker): a deep copy of exactly what went
to storage, so the next optimizer step cannot change it. `take` is called by `load_checkpoint`: the
copy serves the load only if it is the state of that commit, i.e.

* its step is the commit's step, and the commit marker says the attempt that took the copy
  committed it (a superseded attempt's copy, or a step committed by another attempt after a
  rollback, never is);
* the same run, the same global rank and world size (each rank's file is its own).

Anything else loads from storage, which stays the truth on disk. Which source served the load is
remembered (`loaded_from`) and the progress reporter sends it with its load mark, so the event log
says per attempt where the state came from. Two copies are kept per process (the newest; KEEP says
why), in host memory; their cost is two model + optimizer states per rank. The copy never leaves the process: there
is no path by which a stale rank hands it to another.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MEMORY = "memory"
STORAGE = "storage"


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    run: str
    attempt: int
    step: int
    rank: int
    world_size: int
    payload: Any  # what save_checkpoint wrote to this rank's file, deep-copied


# The newest two: an asynchronous save's commit comes after the next steps, and a save waits for the
# previous one to commit before it starts, so the latest commit is always one of the two kept.
KEEP = 2
_lock = threading.Lock()
_snapshots: list[Snapshot] = []  # oldest first
_loaded: tuple[int, str] | None = None  # (step, source) of the last load in this process


def _identity(env: Mapping[str, str]) -> tuple[str, int]:
    attempt = env.get("RUNWARDEN_ATTEMPT", "")
    return env.get("RUNWARDEN_RUN", ""), int(attempt) if attempt.isdigit() else -1


def keep(
    step: int, payload: Any, *, rank: int, world_size: int, env: Mapping[str, str] | None = None
) -> None:
    """Remember `payload` (deep-copied) as this rank's state at checkpoint `step`."""
    run, attempt = _identity(os.environ if env is None else env)
    if attempt < 0:
        return  # not under a supervisor: no commit can name the copy's attempt
    snap = Snapshot(
        run=run, attempt=attempt, step=step, rank=rank, world_size=world_size, payload=copy.deepcopy(payload)
    )
    with _lock:
        _snapshots[:] = [*(x for x in _snapshots if x.step != step), snap][-KEEP:]


def take(
    step: int, committed_by: int | None, *, rank: int, world_size: int, env: Mapping[str, str] | None = None
) -> Any | None:
    """A deep copy of the kept payload if it is the state of commit `step` (committed by attempt
    `committed_by`, from its marker), else None (load from storage)."""
    run, _ = _identity(os.environ if env is None else env)
    if committed_by is None:
        return None
    want = (run, step, committed_by, rank, world_size)
    with _lock:
        snap = next((x for x in _snapshots if (x.run, x.step, x.attempt, x.rank, x.world_size) == want), None)
    if snap is None:
        return None
    return copy.deepcopy(snap.payload)  # the optimizer's load may alias tensors it is given


def take_everywhere(step: int, committed_by: int | None, *, rank: int) -> Any | None:
    """`take`, agreed by every rank (a MIN all-reduce of "I hold it" on the default group): a load
    that is itself a collective (DCP's) must run on every rank or on none, so the copies serve only
    when every rank of the attempt holds its own (every node kept its processes); else None."""
    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    payload = take(step, committed_by, rank=rank, world_size=world_size)
    if world_size == 1:
        return payload
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([0 if payload is None else 1], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return payload if int(flag.item()) == 1 else None


def restore_dcp(
    payload: Any, path: Path, *, model: Any, optimizer: Any, scheduler: Any, restore_rng: bool
) -> tuple[Any, Any]:
    """Put a kept DCP save (`{"state": <model/optim state dicts>, "rank_state": <its JSON>}`) into
    model, optimizer and scheduler, and the RNG states; returns (data_state, extra)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    from nodeagent.dcp import _rng_restorer

    state, rank_state = payload["state"], payload["rank_state"]
    restore = _rng_restorer(rank_state.get("rng"), path) if restore_rng else None
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if scheduler is not None and rank_state.get("scheduler") is not None:
        scheduler.load_state_dict(rank_state["scheduler"])
    if restore is not None:
        restore()
    return rank_state.get("data_state"), rank_state.get("extra")


def loaded(step: int, source: str) -> None:
    """Record which source served the load of `step` (the reporter's load mark sends it)."""
    global _loaded
    with _lock:
        _loaded = (step, source)


def loaded_from(step: int) -> str:
    """The source of this process's last load if it loaded `step`, else ""."""
    with _lock:
        last = _loaded
    return last[1] if last is not None and last[0] == step else ""


def kept_steps() -> tuple[int, ...]:
    """The steps of the kept copies, oldest first."""
    with _lock:
        return tuple(x.step for x in _snapshots)
