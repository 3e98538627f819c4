"""A small LLM-style training job, supervised: a decoder-only transformer trained with DDP.

What a real pre-training loop has, at toy size (4 ranks on 2 CPU cores, tens of ms a step):
causal self-attention blocks (pre-norm, GELU MLP, tied embeddings), synthetic token data that is a
pure function of (seed, step, rank, micro-batch), gradient accumulation (DDP's all-reduce only on
the last micro-batch), gradient clipping, AdamW and a cosine learning-rate schedule with linear
warmup; checkpoints through torch.distributed.checkpoint with async_save (model, AdamW moments,
the schedule, RNG states, data position).

runwarden's part is the few `nodeagent.trainer` calls marked `# runwarden` below, and no timers:
the reporter measures each step's compute and collective wait itself (`time_collectives`, a hook
on DDP's gradient all-reduce), so a slowed rank is flagged a straggler from `report()` alone.

    torchrun --nproc-per-node=4 examples/decoder.py --steps 300 --ckpt-dir /tmp/ck --out /tmp/out

Every rank appends `{"step", "loss", "attempt", "ts"}` to `<out>/loss-rank<r>.jsonl` (the e2e test
compares rank 0's losses with an uninterrupted run). The flags match examples/train.py's, so the
test clusters run either job with the same command line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nodeagent import trainer
from nodeagent.trainer import rank_device
from nodeagent.trainer.checkpoint import CheckpointError
from nodeagent.trainer.dcp import SaveFailed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="train until this optimizer step (exclusive)")
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--out", type=Path, required=True, help="where the loss logs go")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--step-sleep", type=float, default=0.0, help="simulated extra compute per step (s)")
    p.add_argument("--collective-timeout", type=float, default=600.0)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument(
        "--decay-steps",
        type=int,
        default=2000,
        help="the cosine schedule's horizon (not --steps: a run stopped early keeps its schedule)",
    )
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--sync-save", action="store_true", help="save synchronously (default: async_save)")
    # Test-only switches (tests/e2e/test_decoder_run.py): what the supervisor's loss rules must catch.
    p.add_argument(
        "--test-nan-at-step",
        type=int,
        default=-1,
        help="TEST ONLY: in attempt 1, report a NaN loss for this step (steps completed)",
    )
    p.add_argument(
        "--test-skip-rng-restore-if",
        type=Path,
        default=None,
        metavar="PATH",
        help="TEST ONLY: a resume skips restoring the RNG states while PATH exists (the replay diverges)",
    )
    rank_device.add_backend_argument(p)  # auto: nccl on CUDA, gloo on CPU
    return p.parse_args(argv)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        drop = self.dropout if self.training else 0.0
        att = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, heads: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        for m in self.modules():  # GPT-2's initialisation: small weights, logits near uniform at first
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def tokens_for(args: argparse.Namespace, step: int, rank: int, micro: int) -> torch.Tensor:
    """Micro-batch `micro` of optimizer step `step` on `rank`: (micro_batch, seq + 1) tokens, a pure
    function of its arguments (the data position is the step). Each sequence follows
    x[t+1] = (a * x[t] + c) mod vocab for its own (a, c), with a few tokens replaced by noise, so
    there is something to learn."""
    g = torch.Generator().manual_seed(((args.seed * 1_000_003 + step) * 1009 + rank) * 31 + micro)
    n, length = args.micro_batch, args.seq + 1
    a = torch.randint(1, 8, (n, 1), generator=g)
    c = torch.randint(0, args.vocab, (n, 1), generator=g)
    x = torch.empty(n, length, dtype=torch.long)
    x[:, 0] = torch.randint(0, args.vocab, (n,), generator=g)
    for t in range(1, length):
        x[:, t] = (a[:, 0] * x[:, t - 1] + c[:, 0]) % args.vocab
    noise = torch.rand(n, length, generator=g) < 0.05
    return torch.where(noise, torch.randint(0, args.vocab, (n, length), generator=g), x)


def cosine_with_warmup(warmup: int, total: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))  # down to 10% of the peak

    return factor


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    recording = trainer.setup_flight_recording()  # runwarden: before the process group
    backend, device = rank_device.pick(args.backend)  # NCCL on the LOCAL_RANK GPU, or gloo
    dist.init_process_group(backend, timeout=timedelta(seconds=args.collective_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    reporter = trainer.ProgressReporter.from_env(rank=rank, world_size=world)  # runwarden
    attempt = int(os.environ.get("RUNWARDEN_ATTEMPT", "0") or 0)

    torch.manual_seed(args.seed)
    net = Decoder(args.vocab, args.seq, args.d_model, args.heads, args.layers, args.dropout)
    ids = [device.index] if device.type == "cuda" else None
    model = nn.parallel.DistributedDataParallel(net.to(device), device_ids=ids)
    reporter.time_collectives(model)  # runwarden: compute and wait per step, measured
    decay = [p for n, p in net.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in net.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(args.warmup, args.decay_steps))
    # runwarden: DCP saves under the commit protocol (async: training goes on during the upload)
    saver = trainer.DcpCheckpointer(args.ckpt_dir, reporter=reporter, async_save=not args.sync_save)
    if recording is not None:
        recording.record_process_groups()  # after the last new group (the saver's)
    # runwarden: in-memory snapshots between the commits, at the policy's interval (a relaunch
    # resumes from the newest one every rank's state survives in)
    snapshots = trainer.Snapshotter(reporter=reporter)

    start = 0
    found = trainer.resume_point(args.ckpt_dir)  # runwarden: the supervisor's committed step
    if found is not None:
        skip_rng = args.test_skip_rng_restore_if is not None and args.test_skip_rng_restore_if.exists()
        loaded = trainer.load_checkpoint(
            found,
            model=model,
            optimizer=opt,
            scheduler=sched,
            rank=rank,
            restore_rng=not skip_rng,
            reporter=reporter,  # runwarden: a corrupt step is reported, and the commit before it used
        )
        start = int(loaded.data_state["next_step"])
    reporter.loaded(found.step if found is not None else -1)  # runwarden: the load phase ends here

    args.out.mkdir(parents=True, exist_ok=True)
    loss_log = (args.out / f"loss-rank{rank}.jsonl").open("a", buffering=1)
    model.train()
    for step in range(start, args.steps):
        total = 0.0
        for micro in range(args.accum):
            tokens = tokens_for(args, step, rank, micro).to(device)
            last = micro == args.accum - 1
            with model.no_sync() if not last else contextlib.nullcontext():  # all-reduce on the last only
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
                (loss / args.accum).backward()
            total += loss.item() / args.accum
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        stop = reporter.stop_agreed(
            device=device
        )  # runwarden: SIGTERM / stop file / the agent's flag, on any rank
        done = step + 1
        loss_log.write(
            json.dumps({"step": step, "loss": total, "attempt": attempt, "ts": time.time()}) + "\n"
        )
        reported = math.nan if done == args.test_nan_at_step and attempt == 1 else total
        reporter.report(done, loss=reported)  # runwarden: progress and loss; timings measured
        snapshot_due = snapshots.due(done)  # runwarden: every rank, every step
        if done % args.ckpt_every == 0 or stop or done == args.steps:
            reporter.report(done, in_checkpoint=True)  # runwarden: the blocking part of the save
            try:
                saver.save(done, model=model, optimizer=opt, scheduler=sched, data_state={"next_step": done})
                if stop or done == args.steps:
                    saver.wait()  # the last save is committed before the rank exits
            except (OSError, CheckpointError) as exc:
                failed = exc.step if isinstance(exc, SaveFailed) else done
                reporter.checkpoint_failed(failed, f"{type(exc).__name__}: {exc}")  # runwarden
                print(f"rank {rank}: checkpoint {failed} failed: {exc}", file=sys.stderr, flush=True)
                reporter.close()
                return 1
            reporter.report(done, loss=reported)
        elif snapshot_due:  # runwarden: host memory only; the copy overlaps the next step's compute
            snapshots.take(done, model=model, optimizer=opt, scheduler=sched, data_state={"next_step": done})
        if stop:
            print(f"rank {rank}: stop requested, committed step {done}, exiting 0", flush=True)
            break
    else:
        reporter.finished()  # runwarden: what follows is teardown, not a hang
    reporter.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
