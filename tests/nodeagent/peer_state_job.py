"""One rank of tests/nodeagent/test_peer_state.py: 3 gloo ranks on CPU, a DDP model saved with DCP
(step 3, attempt 1), then loaded back the way a warm restart would: `--forget R` makes rank R drop
its in-memory copy first (the replacement host's fresh rank), `--shift R` relabels rank R's copy as
rank R+1's (a survivor renumbered by the replacement), `--no-peer` turns the peer path off, `--rot R`
flips a byte of rank R's copy in host memory after it was kept (bit rot), `--garble R` flips a byte
of what rank R receives from a peer (a transfer that corrupts).
Steps 3 and 5 are saved; the load is of step 3. Each rank writes the commits its saver reported, what it loaded from and a fingerprint of its model, optimizer, scheduler and RNG
after the load, next to the same after a load from storage (DCP's collective load)."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from nodeagent import trainer
from nodeagent.trainer import memory_state
from nodeagent.trainer.checkpoint import read_commit, step_dir
from nodeagent.trainer.dcp import DcpCheckpointer, load_dcp


class CommitReports:
    """What the saver tells a ProgressReporter of commits (set_committed), recorded."""

    def __init__(self) -> None:
        self.committed: list[int] = []

    def set_committed(self, step: int, *, save_stall_s: float | None = None) -> None:
        self.committed.append(step)

    def checkpoint_failed(self, step: int, error: str) -> None:
        raise AssertionError(f"save of step {step} failed: {error}")


def _model() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (i + 1))
    return model, opt, sched


def _step(model: nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler) -> None:
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


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
    h.update(torch.randn(3).numpy().tobytes())  # the RNG as restored
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--forget", type=int, nargs="*", default=[])
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--shift", type=int, nargs="*", default=[])
    parser.add_argument("--rot", type=int, nargs="*", default=[])
    parser.add_argument("--garble", type=int, nargs="*", default=[])
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    model, opt, sched = _model()
    reports = CommitReports()
    saver = DcpCheckpointer(args.ckpt, async_save=False, reporter=reports)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            _step(model, opt, sched)
        saver.save(3, model=model, optimizer=opt, scheduler=sched, data_state={"next_step": 3, "rank": rank})
        dist.barrier()
        if rank in args.forget:
            memory_state._copies.clear()  # this rank's process is new: it holds no copy
        if rank in args.shift:  # this process was rank+1 when it saved (a replacement renumbered it)
            world = dist.get_world_size()
            other = (rank + 1) % world
            memory_state._copies[:] = [
                dataclasses.replace(
                    x,
                    rank=other,
                    payload={
                        **x.payload,
                        "rank_state": {**x.payload["rank_state"], "data_state": {"rank": other}},
                    },
                )
                for x in memory_state._copies
            ]
        if rank in args.rot:
            (held,) = [x for x in memory_state._copies if x.step == 3]
            assert held.hashed.wait(60) and held.digests, "the copy was never hashed"
            biggest = max(held.buffers, key=lambda b: b.numel())
            biggest.view(-1)[0] += 1.0  # host memory changed under the kept copy
        if rank in args.garble:
            real = memory_state._broadcast_host

            def garbling(flat, sender, **kw):
                real(flat, sender, **kw)
                if flat.numel():
                    flat.view(-1)[0] += 1.0

            memory_state._broadcast_host = garbling
        for _ in range(2):  # the state moves on past the commit: the load must bring it back
            _step(model, opt, sched)
        saver.save(5, model=model, optimizer=opt, scheduler=sched, data_state={"next_step": 5, "rank": rank})
        _step(model, opt, sched)
        commit = read_commit(step_dir(args.ckpt, 3))
        assert commit is not None
        got = trainer.load_checkpoint(
            commit, model=model, optimizer=opt, scheduler=sched, rank=rank, from_peer=not args.no_peer
        )
        source = memory_state.loaded_from(3)
        fell_back = memory_state.why_fell_back(3)
        after = _fingerprint(model, opt, sched)
        for _ in range(2):
            _step(model, opt, sched)
        state = load_dcp(commit, model=model, optimizer=opt, scheduler=sched, rank=rank)
        reference = _fingerprint(model, opt, sched)
    (args.out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "source": source,
                "fell_back": fell_back,
                "commits_reported": reports.committed,
                "data_state": got.data_state,
                "reference_data_state": state.data_state,
                "fingerprint": after,
                "reference": reference,
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
