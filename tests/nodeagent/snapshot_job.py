"""One rank of tests/nodeagent/test_snapshots.py: 4 gloo ranks on CPU as 2 hosts of 2 ranks (a
rank's buddy is the same local rank on the other host), a DDP model with AdamW and a scheduler.
Snapshots at steps 3 and 5 (memory only), one more step, then snapshot 5 is restored the way a
restart resumes from it: `--forget R...` makes rank R's process new (it holds no snapshot and no
buddy's state: a replacement host's rank, or a rank that crashed), `--rot R` flips a byte of rank
R's snapshot in host memory. Each rank writes where its state came from and a fingerprint of its
model, optimizer, scheduler and RNG after the restore, next to the one taken right after the
snapshot (they must be equal), or the error every rank raised."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nodeagent import trainer
from nodeagent.trainer import memory_state, snapshot, torch_api
from tests.nodeagent.peer_state_job import _model, _step  # the same DDP model, AdamW and schedule

LOCAL_WORLD = 2


class Reports:
    """What the snapshotter and the load tell a ProgressReporter, recorded."""

    def __init__(self) -> None:
        self.snapshots: list[list[int]] = []
        self.load_errors: list[tuple[int, str]] = []

    def set_snapshots(self, steps: tuple[int, ...]) -> None:
        self.snapshots.append(list(steps))

    def load_failed(self, step: int, error: str) -> None:
        self.load_errors.append((step, error))


def _fingerprint(
    model: nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler
) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    for state in opt.state.values():
        for key in sorted(state):
            h.update(key.encode() + state[key].detach().numpy().tobytes())
    h.update(json.dumps([g["lr"] for g in opt.param_groups]).encode())
    h.update(json.dumps(sched.state_dict()["last_epoch"]).encode())
    h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()


def job_args() -> argparse.Namespace:
    """`--out DIR`, `--forget RANK...`, `--rot RANK...` (this job's and fsdp_snapshot_job.py's)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--forget", type=int, nargs="*", default=[])
    parser.add_argument("--rot", type=int, nargs="*", default=[])
    return parser.parse_args()


def main() -> None:
    args = job_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    model, opt, sched = _model()
    reports = Reports()
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL_WORLD)  # as the launcher sets it: 2 hosts of 2 ranks
    snaps = trainer.Snapshotter(every=1, reporter=reports)
    assert snaps.buddy() == (rank + LOCAL_WORLD) % dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        taken = {}
        for done in range(1, 6):
            _step(model, opt, sched)
            if done in (3, 5):
                assert (
                    snaps.take(
                        done,
                        model=model,
                        optimizer=opt,
                        scheduler=sched,
                        data_state={"next_step": done, "rank": rank},
                    )
                    == ""
                )
                taken[done] = _fingerprint(model, opt, sched)
        _step(model, opt, sched)  # the state moves on past the snapshot: the restore must bring it back
        snaps.wait()
        if rank in args.forget:  # this rank's process is new: it holds nothing
            memory_state._copies.clear()
            snapshot._buddy_states.clear()
        if rank in args.rot:
            (held,) = [x for x in memory_state._copies if x.step == 5 and x.kind == memory_state.SNAPSHOT]
            assert held.hashed.wait(60) and held.digests, "the snapshot was never hashed"
            biggest = max(held.buffers, key=lambda b: b.numel())
            biggest.view(-1)[0] += 1.0  # host memory changed under the kept copy
        result: dict = {"reported": reports.snapshots}
        restore_snapshot_5(
            result,
            reports,
            lambda point: trainer.load_checkpoint(
                point, model=model, optimizer=opt, scheduler=sched, rank=rank, reporter=reports
            ),
            lambda: _fingerprint(model, opt, sched),
            taken[5],
        )
    finish(result, args.out, rank)


def restore_snapshot_5(
    result: dict, reports: Reports, load: Callable[[Any], Any], fingerprint: Callable[[], str], reference: str
) -> None:
    """Resume from snapshot 5 of attempt 1 the way a restart does (`load`); record where the state came
    from and its fingerprint next to `reference`, or the error every rank raised."""
    point = trainer.resume_point(
        "/nonexistent", {"RUNWARDEN_RESUME_STEP": "5", "RUNWARDEN_RESUME_SNAPSHOT": "1"}
    )
    assert point == trainer.SnapshotPoint(step=5, attempt=1)
    try:
        got = load(point)
    except trainer.SnapshotUnavailable as exc:
        result.update(error=str(exc), load_errors=reports.load_errors)
    else:
        result.update(
            source=memory_state.loaded_from(5),
            data_state=got.data_state,
            fingerprint=fingerprint(),
            reference=reference,
        )


def finish(result: dict, out: Path, rank: int) -> None:
    # the collective hang rule compares this count across ranks: the snapshots' exchanges must leave
    # it the same on every rank, whoever sent what
    result["collectives"] = torch_api.default_group_sequence()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
