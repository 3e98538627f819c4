"""In-memory snapshots between commits on a realistic state (BENCHMARKS.md, "in-memory snapshots").

    flock /tmp/runwarden-heavy.lock env PYTHONPATH=. .venv/bin/python bench/bench_snapshots.py \\
        [--layers 12 --d-model 768 --vocab 32000] [--pairs 12] [--out bench/results/bench_snapshots.json]

Two gloo ranks on CPU (one process each, two "hosts" of one rank: each is the other's buddy) train
a GPT-2-small-sized decoder (examples/decoder.py's, ~110M parameters with the defaults) with AdamW
under DDP: ~1.3 GB of model and optimizer state per rank, a step of several seconds on one core.
In one run, per rank:

* the stall: after 2 x SNAPSHOT_KEEP snapshots that allocate the snapshots' buffers (later ones
  reuse them), `--pairs` pairs of cycles of `--cycle-steps` steps, one cycle with a snapshot
  (nodeagent.trainer.Snapshotter.take) after its first step and one without, the pairs' order
  alternating (ABBA). A snapshot's stall is its cycle's time over its pair's plain cycle's (mean,
  its standard error and the median of the pairs): take()'s block and whatever the background
  copy, its checksums and (FSDP) the replication took from the steps, on any thread. Also per
  snapshot: the time take() blocks the training thread (of it, the exchange with the buddy) and
  when the host copy landed, its checksums were taken and (FSDP) the buddy held the shard, each
  after take() (a cycle must outlast them: else its cost spills into the next cycle);
* a DCP commit of the same state for comparison (async_save's blocking part: staging);
* restores of the newest snapshot: `memory` (both ranks hold it), `peer` (rank 1's process is new:
  the model and optimizer from rank 0 over gloo, its RNG and data position from its buddy), and of
  the commit from `storage` (DCP's load, page cache warm: the best case for storage) and from
  memory with rank 1's process new (`commit_peer`: DDP, the model and optimizer from rank 0; FSDP,
  rank 1's shard from the copy rank 0 took of it at the commit).

`--fsdp`: the same decoder sharded with FSDP2 (`fully_shard` per block and at the root) over the
two ranks: each rank's state is its own half, and a snapshot also sends it to the buddy's memory
(nodeagent.trainer.shard_replica, on a thread): `replicated_s`, from take() to the buddy holding
it; the `peer` restore takes rank 1's shard back from rank 0.

The ranks share this 2-core machine: each rank's host copy and the other rank's compute compete for
the same two cores (on a GPU host the copy is a device-to-host DMA beside the kernels).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WORLD = 2


def _mark(event: threading.Event, since: float, out: list[float]) -> None:
    event.wait(600)
    out.append(time.perf_counter() - since)


def _rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from examples.decoder import Decoder
    from nodeagent import trainer
    from nodeagent.trainer import memory_state, shard_replica, snapshot
    from nodeagent.trainer.checkpoint import latest_committed
    from nodeagent.trainer.dcp import DcpCheckpointer, load_dcp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Decoder(args.vocab, args.seq, args.d_model, args.heads, args.layers, 0.0)
    model: Any
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    else:
        model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = sum(p.numel() for p in net.parameters())
    gen = torch.Generator().manual_seed(rank)

    def step() -> float:
        t0 = time.perf_counter()
        tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    out: dict[str, Any] = {"rank": rank, "params": params}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):  # AdamW's moments exist after the first step
            step()
        local = [p.to_local() if hasattr(p, "to_local") else p for p in net.parameters()]
        state_bytes = sum(p.numel() * p.element_size() for p in local) * 3  # this rank's
        out["state_bytes"] = state_bytes
        snaps = trainer.Snapshotter(every=1, env={**os.environ, "LOCAL_WORLD_SIZE": "1"})
        done = 2

        def take_one(timed: bool) -> None:
            t0 = time.perf_counter()
            why = snaps.take(done, model=model, optimizer=opt, data_state={"next_step": done})
            assert why == "", why
            held = memory_state.snapshot(done, int(os.environ["RUNWARDEN_ATTEMPT"]))
            assert held is not None
            if not timed:
                return
            takes.append(snaps.stalls[done])
            exchanges.append(snaps.exchanges[done])
            threading.Thread(target=_mark, args=(held.copied, t0, landed), daemon=True).start()
            threading.Thread(target=_mark, args=(held.hashed, t0, hashed), daemon=True).start()
            job = snaps._replications.get(done)
            if job is not None:
                threading.Thread(target=_mark, args=(job.done, t0, replicated), daemon=True).start()

        takes: list[float] = []
        exchanges: list[float] = []
        landed: list[float] = []
        hashed: list[float] = []
        replicated: list[float] = []
        for _ in range(2 * memory_state.SNAPSHOT_KEEP):  # the first ones allocate their buffers
            done += 1
            step()
            take_one(timed=False)
        snaps.wait_replicated()
        # Cycles of --cycle-steps steps, with a snapshot after the cycle's first step or without,
        # in pairs whose order alternates (ABBA): drift and a cycle's spill into the next cancel.
        # A snapshot's cost, whatever thread pays it, is its cycle's time over a plain cycle's.
        with_snapshot: list[float] = []
        without: list[float] = []
        for pair in range(args.pairs):
            for snapping in (True, False) if pair % 2 == 0 else (False, True):
                t0 = time.perf_counter()
                for i in range(args.cycle_steps):
                    done += 1
                    step()
                    if snapping and i == 0:
                        take_one(timed=True)
                (with_snapshot if snapping else without).append(time.perf_counter() - t0)
        snaps.wait_replicated()
        last = max(snaps.stalls)  # the newest snapshot's step
        out.update(
            take_s=takes,
            exchange_s=exchanges,
            landed_s=landed,
            hashed_s=hashed,
            cycle_with_snapshot_s=with_snapshot,
            cycle_without_s=without,
            replicated_s=replicated,
        )
        # a DCP commit of the same state (async_save: what blocks is the staging)
        ckpt = args.out_dir / "ckpt"  # every rank's: the parent made it
        saver = DcpCheckpointer(ckpt, async_save=True)
        t0 = time.perf_counter()
        saver.save(done, model=model, optimizer=opt, data_state={"next_step": done})
        out["dcp_async_block_s"] = time.perf_counter() - t0
        saver.wait()
        dist.barrier()
        out["dcp_commit_s"] = time.perf_counter() - t0
        # the commit's own in-memory copy is not what is measured here (until its own restore, below)
        commit_copies = [x for x in memory_state._copies if x.kind == memory_state.COMMIT]
        memory_state._copies[:] = [x for x in memory_state._copies if x.kind == memory_state.SNAPSHOT]
        point = trainer.SnapshotPoint(step=last, attempt=int(os.environ["RUNWARDEN_ATTEMPT"]))
        dist.barrier()
        t0 = time.perf_counter()
        trainer.load_checkpoint(point, model=model, optimizer=opt, rank=rank)
        out["restore_memory_s"] = time.perf_counter() - t0
        out["restore_memory_source"] = memory_state.loaded_from(last)
        if rank == 1:  # a new process: it holds nothing
            memory_state._copies.clear()
            snapshot._buddy_states.clear()
            shard_replica.forget()
        dist.barrier()
        t0 = time.perf_counter()
        trainer.load_checkpoint(point, model=model, optimizer=opt, rank=rank)
        out["restore_peer_s"] = time.perf_counter() - t0
        out["restore_peer_source"] = memory_state.loaded_from(last)
        found = latest_committed(ckpt)
        assert found is not None
        dist.barrier()
        t0 = time.perf_counter()
        load_dcp(found, model=model, optimizer=opt, rank=rank)
        out["restore_storage_s"] = time.perf_counter() - t0
        # the commit from memory, rank 1's process new (as above): DDP, the model from rank 0; FSDP,
        # rank 1's shard from the copy its buddy took of it at the commit
        if rank == 0:
            memory_state._copies.extend(commit_copies)
        dist.barrier()
        t0 = time.perf_counter()
        trainer.load_checkpoint(found, model=model, optimizer=opt, rank=rank)
        out["restore_commit_peer_s"] = time.perf_counter() - t0
        out["restore_commit_peer_source"] = memory_state.loaded_from(found.step)
    (args.out_dir / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--pairs", type=int, default=12, help="pairs of cycles, with a snapshot and without")
    p.add_argument("--cycle-steps", type=int, default=2, help="steps per cycle (a snapshot after the first)")
    p.add_argument("--fsdp", action="store_true", help="shard the state with FSDP2 (fully_shard)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bench_snapshots.json")
    p.add_argument(
        "--ckpt-parent", type=Path, default=None, help="where the DCP commit goes (default: a temp dir)"
    )
    p.add_argument("--rank-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_child:
        _rank_main(args)
        return
    from testbed.etcd_server import free_port
    from testbed.gloo_ranks import gloo_rank_env

    load_before = os.getloadavg()[0]
    port = free_port()
    with tempfile.TemporaryDirectory(dir=args.ckpt_parent) as tmp:
        out_dir = Path(tmp)
        child = [sys.argv[0], *sys.argv[1:], "--rank-child", "--out-dir", str(out_dir)]
        procs = [
            subprocess.Popen(
                [sys.executable, *child],
                env=gloo_rank_env(r, WORLD, port, run="bench-snapshots", root=ROOT, warm=True),
            )
            for r in range(WORLD)
        ]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a rank failed: exit codes {codes}")
        ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]
    med = statistics.median
    rows = []
    for r in ranks:
        base = med(r["cycle_without_s"]) / args.cycle_steps
        diffs = [a - b for a, b in zip(r["cycle_with_snapshot_s"], r["cycle_without_s"], strict=True)]
        stall = statistics.mean(diffs)
        rows.append(
            {
                "rank": r["rank"],
                "params": r["params"],
                "state_gb": r["state_bytes"] / 1e9,
                "step_s": base,
                "take_s": med(r["take_s"]),
                "exchange_s": med(r["exchange_s"]),
                "copy_landed_s": med(r["landed_s"]),
                "hashed_s": med(r["hashed_s"]),
                "replicated_s": med(r["replicated_s"]) if r["replicated_s"] else 0.0,
                "stall_s": stall,
                "stall_stderr_s": statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else math.nan,
                "stall_median_s": med(diffs),
                "stall_pct_of_step": 100 * stall / base,
                "dcp_async_block_s": r["dcp_async_block_s"],
                "dcp_commit_s": r["dcp_commit_s"],
                "restore_memory_s": r["restore_memory_s"],
                "restore_peer_s": r["restore_peer_s"],
                "restore_peer_source": r["restore_peer_source"],
                "restore_storage_s": r["restore_storage_s"],
                "restore_commit_peer_s": r["restore_commit_peer_s"],
                "restore_commit_peer_source": r["restore_commit_peer_source"],
            }
        )
    result = {
        "command": " ".join(["bench/bench_snapshots.py", *sys.argv[1:]]),
        "load_average_before": load_before,
        "ranks": rows,
        "raw": ranks,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    keys = [k for k in rows[0] if k not in ("rank",)]
    print("| " + " | ".join(["rank", *keys]) + " |")
    for row in rows:
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()) + " |")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
