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
says per attempt where the state came from. One copy is kept per process (the newest), in host
memory; its cost is one model + optimizer state per rank. The copy never leaves the process: there
is no path by which a stale rank hands it to another.
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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


_lock = threading.Lock()
_snapshot: Snapshot | None = None
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
    global _snapshot
    with _lock:
        _snapshot = snap


def take(
    step: int, committed_by: int | None, *, rank: int, world_size: int, env: Mapping[str, str] | None = None
) -> Any | None:
    """A deep copy of the kept payload if it is the state of commit `step` (committed by attempt
    `committed_by`, from its marker), else None (load from storage)."""
    run, _ = _identity(os.environ if env is None else env)
    with _lock:
        snap = _snapshot
    if (
        snap is None
        or committed_by is None
        or (snap.run, snap.step, snap.attempt, snap.rank, snap.world_size)
        != (run, step, committed_by, rank, world_size)
    ):
        return None
    return copy.deepcopy(snap.payload)  # the optimizer's load may alias tensors it is given


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


def kept_step() -> int | None:
    """The step of the kept copy (None: none)."""
    with _lock:
        return _snapshot.step if _snapshot is not None else None
