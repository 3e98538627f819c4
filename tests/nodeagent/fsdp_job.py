"""One rank of tests/nodeagent/test_fsdp_state.py: gloo ranks on CPU train an FSDP2 model
(`fully_shard`: parameters and AdamW moments are DTensors sharded over the ranks), save step 3 with
DcpCheckpointer, train steps 4-5 (the reference losses), then load step 3 back and replay 4-5.
`--mode`: `storage` (fresh model and optimizer, no copies: DCP's sharded load), `memory` (warm ranks:
each restores its own in-memory copy of its shard), `forget` (warm, but rank 1's process is new: it
takes its shard from its buddy, rank 0, which holds it, and rank 0 uses its own copy), `forget-both`
(both processes new: no shard has a holder, every rank loads from storage), `rot` (rank 1's process
is new and the copy of its shard rank 0 holds changed in host memory: refused, every rank loads
from storage), `corrupt` (rank 0 flips a byte of a shard file after the commit: every rank's load
refuses the step). Each rank writes what it loaded from, its losses and the error it met, if any."""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from nodeagent import trainer
from nodeagent.trainer import memory_state, shard_replica
from nodeagent.trainer.checkpoint import CorruptCheckpoint, read_commit, step_dir
from nodeagent.trainer.dcp import DcpCheckpointer


def _model(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4), nn.ReLU(), nn.Linear(4, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> float:
    data = torch.Generator().manual_seed(1000 * step + rank)  # each rank's batch, the same in every replay
    loss = model(torch.randn(4, 8, generator=data)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--mode", choices=("storage", "memory", "forget", "forget-both", "rot", "corrupt"), required=True
    )
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = _model(world)
    result: dict[str, object] = {"error": ""}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in (1, 2, 3):
            _step(model, opt, step, rank)
        saver = DcpCheckpointer(args.ckpt, async_save=False)
        saver.save(3, model=model, optimizer=opt, data_state={"next_step": 3})
        dist.barrier()
        commit = read_commit(step_dir(args.ckpt, 3))
        assert commit is not None
        result["shards"] = sorted(commit.shard_xxh3)
        result["reference"] = [_step(model, opt, step, rank) for step in (4, 5)]
        assert shard_replica.wait_all(60), "the commit's exchange with the buddy did not end"
        if args.mode == "rot" and rank == 0:
            shard = shard_replica.held("fsdp-test", 1, 3, 1, kind=memory_state.COMMIT)
            assert shard is not None, "rank 0 holds no shard of rank 1"
            shard.flat[shard.flat.numel() // 2] ^= 0xFF  # host memory changed under the held shard
        if (args.mode in ("forget", "rot") and rank == 1) or args.mode == "forget-both":
            memory_state._copies.clear()  # this rank's process is new: it holds no copy
            shard_replica.forget()  # and no buddy's shard
        if args.mode == "corrupt" and rank == 0:
            shard = commit.path / sorted(commit.shard_xxh3)[-1]
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
        dist.barrier()
        if args.mode == "storage":
            model, opt = _model(world)  # a fresh process's objects
        try:
            got = trainer.load_checkpoint(commit, model=model, optimizer=opt, rank=rank)
            result["data_state"] = got.data_state
            result["source"] = memory_state.loaded_from(3)
            result["fell_back"] = memory_state.why_fell_back(3)
            result["replay"] = [_step(model, opt, step, rank) for step in (4, 5)]
        except CorruptCheckpoint as exc:
            result["error"] = str(exc)
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
