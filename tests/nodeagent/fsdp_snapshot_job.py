"""One rank of tests/nodeagent/test_snapshots.py's sharded cases: 4 gloo ranks on CPU as 2 hosts of
2 ranks train an FSDP2 model (`fully_shard`: parameters and AdamW moments are DTensor shards, each
rank's its own) and snapshot steps 3 and 5; each rank's shard goes to its buddy, the same local rank
on the other host. One more step, then snapshot 5 is restored into new model and optimizer objects
the way a restart resumes from it: `--forget R...` makes rank R's process new (it holds no snapshot,
no buddy's state and no buddy's shard), `--rot R` flips a byte of the shard rank R holds for the
rank behind it. Each rank writes where its state came from, the fingerprint of its shard of the
model and optimizer and of its RNG after the restore and right after the snapshot (they must be
equal), what it reported, and the default group's collective count, or the error every rank raised."""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from nodeagent import trainer
from nodeagent.trainer import memory_state, shard_replica, snapshot
from tests.nodeagent.fsdp_job import _model, _step
from tests.nodeagent.snapshot_job import LOCAL_WORLD, Reports, finish, job_args, restore_snapshot_5


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _fingerprint(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(_local(p.detach()).numpy().tobytes())
    for state in opt.state.values():
        for key in sorted(state):
            h.update(key.encode() + _local(state[key].detach()).numpy().tobytes())
    h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()


def _gloo_threads() -> dict[int, int]:
    """This process's gloo threads (transport loops, work runners): thread id -> niceness."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        if "gloo" in name:
            out[int(tid)] = int(fields[16])  # stat's 19th field: nice
    return out


def main() -> None:
    args = job_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = _model(world)
    torch.manual_seed(100 + rank)
    reports = Reports()
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL_WORLD)  # as the launcher sets it: 2 hosts of 2 ranks
    snaps = trainer.Snapshotter(every=1, reporter=reports)
    before = _gloo_threads()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        taken = {}
        for done in range(1, 6):
            _step(model, opt, done, rank)
            if done in (3, 5):
                assert snaps.take(done, model=model, optimizer=opt, data_state={"next_step": done}) == ""
                taken[done] = _fingerprint(model, opt)
        _step(model, opt, 6, rank)  # the state moves on past the snapshot: the restore must bring it back
        assert snaps.wait_replicated(60), "a shard's exchange with the buddies did not end"
        result: dict = {"reported": reports.snapshots}
        # the buddy pairs' groups were made by the first snapshot
        result["pair_threads_nice"] = sorted(n for t, n in _gloo_threads().items() if t not in before)
        if rank in args.forget:  # this rank's process is new: it holds nothing
            memory_state._copies.clear()
            snapshot._buddy_states.clear()
            shard_replica.forget()
        if rank in args.rot:
            shard = shard_replica.held("snap-test", 1, 5, (rank - LOCAL_WORLD) % world)
            assert shard is not None, "no shard held for the rank behind"
            shard.flat[shard.flat.numel() // 2] ^= 0xFF  # host memory changed under the held shard
        model, opt = _model(world)  # a restart's objects (a new process's, or a warm rank's reset)
        restore_snapshot_5(
            result,
            reports,
            lambda point: trainer.load_checkpoint(
                point, model=model, optimizer=opt, rank=rank, reporter=reports
            ),
            lambda: _fingerprint(model, opt),
            taken[5],
        )
    finish(result, args.out, rank)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
