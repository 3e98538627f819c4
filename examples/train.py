"""A small, real DDP training job that honours runwarden's contract.

Launched by torchrun (--max-restarts=0, one rendezvous id per attempt) under a node agent:

* progress every step through `nodeagent.trainer.ProgressReporter` (microseconds, non-blocking),
  timed by the reporter itself: a communication hook on the DDP model measures the wait in the
  gradient all-reduce, `reporter.stop_agreed()` times its stop-flag all-reduce; no timers in the loop;
* a stop request polled every step: finish the step, save, commit, exit 0;
* optionally (`--eval-every N`) an evaluation on rank 0 alone after every N-th step, declared with
  `reporter.evaluating()`, while the other ranks go on and wait for it in the next step's collectives;
* a checkpoint every `--ckpt-every` steps through the commit protocol (model, optimizer, RNG
  states, data position): torch.distributed.checkpoint with async_save by default
  (`nodeagent.trainer.dcp`; `--sync-save` blocks instead, `--ckpt-format torch` writes the old
  `rank<r>.pt` files), and resume from the latest *committed* checkpoint (either format);
* an in-memory snapshot between the commits (`nodeagent.trainer.Snapshotter`) at the supervisor's
  interval or every `--snapshot-every N` steps: host memory only, a relaunch resumes from it;
* flight recording set up before the process group, so a hang can be attributed.

The data is synthetic and deterministic: batch `i` of rank `r` is a function of (seed, i, r) only,
so the data position is the step and a resumed run sees exactly the batches an uninterrupted run
would. Every rank appends `{"step", "loss", "attempt", "ts"}` to `<out>/loss-rank<r>.jsonl`; the e2e
test compares those losses with an uninterrupted run of the same seed.

    torchrun --nproc-per-node=2 examples/train.py --steps 50 --ckpt-dir /tmp/ck --out /tmp/out
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nodeagent import trainer
from nodeagent.trainer import rank_device
from nodeagent.trainer.checkpoint import CheckpointError
from nodeagent.trainer.dcp import SaveFailed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="train until this step (exclusive)")
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument(
        "--ckpt-format",
        choices=("dcp", "torch"),
        default="dcp",
        help="dcp: torch.distributed.checkpoint (default); torch: the old per-rank rank<r>.pt files",
    )
    p.add_argument("--sync-save", action="store_true", help="dcp: save synchronously (default: async_save)")
    p.add_argument("--out", type=Path, required=True, help="where the loss logs go")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--width", type=int, default=64)
    p.add_argument(
        "--lr",
        type=number(float, low=0, strict=True),
        default=0.05,
        help="SGD's learning rate (momentum 0.9)",
    )
    p.add_argument("--step-sleep", type=float, default=0.05, help="simulated extra compute per step (s)")
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=600.0,
        help="per-collective timeout (PyTorch's default is 10 minutes)",
    )
    p.add_argument(
        "--dropout", type=float, default=0.0, help="dropout after each hidden layer (uses the RNG)"
    )
    p.add_argument(
        "--test-kill-rank-in-save",
        default="",
        metavar="RANK:STEP",
        help="TEST ONLY: in attempt 1, rank RANK SIGKILLs itself in the middle of the DCP save of STEP "
        "(its shard written, then torn to half, before DCP hears of it)",
    )
    p.add_argument(
        "--test-software-fault",
        default="",
        type=software_fault,
        metavar="{hang,crash,nan}@STEP",
        help="TEST ONLY: a software or data bug at step STEP of every attempt, in the rank "
        "(RUNWARDEN_ATTEMPT - 1) %% world size (its victim rotates): hang blocks before its forward, "
        "outside any collective (a data loader deadlocked on a bad shard); crash raises; nan reports "
        "a NaN loss",
    )
    p.add_argument(
        "--test-poison-snapshots-from",
        type=number(int, low=0),
        default=0,
        metavar="STEP",
        help="TEST ONLY: in attempt 1, rank 0's in-memory snapshots of step STEP and later are taken of "
        "its model with one weight NaN (their checksums match them: corruption before the copy, which no "
        "checksum sees); its training stays clean (default 0: never)",
    )
    p.add_argument(
        "--eval-every",
        type=number(int, low=0),
        default=0,
        metavar="N",
        help="after every N-th step (not the last), rank 0 alone evaluates on a held-out batch, inside "
        "reporter.evaluating(), while the others go on into the next step (default 0: never)",
    )
    p.add_argument(
        "--eval-seconds",
        type=number(float, low=0),
        default=0.0,
        metavar="S",
        help="simulated extra evaluation time (s) (default 0)",
    )
    p.add_argument(
        "--snapshot-every",
        type=number(int, low=0),
        default=None,
        metavar="N",
        help="an in-memory snapshot every N steps between the commits (default: the supervisor's "
        "interval, RUNWARDEN_SNAPSHOT_INTERVAL_S; 0: none)",
    )
    rank_device.add_backend_argument(p)  # auto: nccl on CUDA, gloo on CPU
    return p.parse_args(argv)


def number(kind: type, *, low: float, strict: bool = False) -> Callable[[str], Any]:
    """An argparse type: a finite `kind` (int or float) >= low (> low when strict)."""
    want = f"a finite {kind.__name__} {'>' if strict else '>='} {low:g}"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if not (math.isfinite(value) and (value > low if strict else value >= low)):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return value

    return parse


SOFTWARE_FAULTS = ("hang", "crash", "nan")


def software_fault(spec: str) -> tuple[str, int] | None:
    """`--test-software-fault KIND@STEP` -> (kind, step); "" -> None."""
    if not spec:
        return None
    kind, _, step = spec.partition("@")
    if kind not in SOFTWARE_FAULTS or not step.isdigit():
        raise argparse.ArgumentTypeError(f"expected one of {'/'.join(SOFTWARE_FAULTS)}@STEP, got {spec!r}")
    return kind, int(step)


def software_fault_here(fault: tuple[str, int] | None, step: int, rank: int, world: int, attempt: int) -> str:
    """TEST ONLY (`--test-software-fault`): the fault this rank hits at this step ("" for none)."""
    if fault is None or step != fault[1] or rank != (attempt - 1) % world:
        return ""
    kind = fault[0]
    if kind == "hang":  # a deadlocked data loader: never reaches the gradient all-reduce the others wait in
        print(f"rank {rank}: test fault: hanging before step {step}", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    if kind == "crash":
        raise RuntimeError(f"rank {rank}: test fault: a bad batch at step {step}")
    return kind


@contextlib.contextmanager
def poisoned_while_copied(model: nn.Module, snapshots: trainer.Snapshotter, poison: bool) -> Iterator[None]:
    """TEST ONLY (`--test-poison-snapshots-from`): one weight is NaN until the snapshot's copy landed."""
    if not poison:
        yield
        return
    weight = next(model.parameters())
    kept = weight.detach().clone()
    with torch.no_grad():
        weight.view(-1)[0] = float("nan")
    try:
        yield
    finally:
        snapshots.wait()
        with torch.no_grad():
            weight.copy_(kept)


# The last step index this rank logged (the test-only writer below waits for the step after its save).
_logged_step = -1


def killing_writer(rank: int, spec: str, attempt: int) -> Callable[[Path], Any] | None:
    """TEST ONLY (`--test-kill-rank-in-save`): a DCP storage writer that dies mid-save."""
    if not spec or attempt != 1:
        return None
    victim, step = (int(x) for x in spec.split(":"))
    if rank != victim:
        return None
    from torch.distributed.checkpoint import FileSystemWriter

    class KillingWriter(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            result = super().write_data(plan, planner)
            if Path(self.path).name == f"step_{step:012d}":
                # the save is async: the ranks train on meanwhile; die once they have, whatever the load
                deadline = time.monotonic() + 60
                while _logged_step < step and time.monotonic() < deadline:
                    time.sleep(0.01)
                for shard in Path(self.path).glob(f"{plan.storage_data.prefix}*"):
                    os.truncate(shard, shard.stat().st_size // 2)  # torn, as if killed while writing
                os.kill(os.getpid(), signal.SIGKILL)
            return result

    return lambda path: KillingWriter(path, sync_files=True)


class MLP(nn.Module):
    def __init__(self, width: int, dropout: float = 0.0) -> None:
        super().__init__()
        drop = [nn.Dropout(dropout)] if dropout > 0 else []
        self.net = nn.Sequential(
            nn.Linear(16, width),
            nn.Tanh(),
            *drop,
            nn.Linear(width, width),
            nn.Tanh(),
            *drop,
            nn.Linear(width, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def batch_for(seed: int, step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch `step` of `rank`: a pure function of its arguments (the data position is the step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(size, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True)).sin() + 0.1 * torch.randn(size, 1, generator=g)
    return x, y


def evaluate(
    model: nn.Module, seed: int, rank: int, size: int, device: torch.device, seconds: float
) -> float:
    """One held-out batch's loss, without gradients and without collectives: `model` is the module
    DDP wraps (DDP's own forward may broadcast buffers, a collective the other ranks are not in)."""
    x, y = (t.to(device) for t in batch_for(seed, -1, rank, size))  # step -1: no step trains on it
    with torch.no_grad():
        loss = nn.functional.mse_loss(model(x), y).item()
    if seconds:
        time.sleep(seconds)
    return loss


def main(argv: list[str] | None = None) -> int:
    global _logged_step
    args = parse_args(argv)
    recording = trainer.setup_flight_recording()
    backend, device = rank_device.pick(args.backend)  # NCCL on the LOCAL_RANK GPU, or gloo
    dist.init_process_group(backend, timeout=timedelta(seconds=args.collective_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    reporter = trainer.ProgressReporter.from_env(rank=rank, world_size=world)
    attempt = int(os.environ.get("RUNWARDEN_ATTEMPT", "0") or 0)

    torch.manual_seed(args.seed)
    ids = [device.index] if device.type == "cuda" else None
    model = nn.parallel.DistributedDataParallel(MLP(args.width, args.dropout).to(device), device_ids=ids)
    reporter.time_collectives(model)  # the gradient all-reduce's wait, per step (nodeagent.trainer.timing)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    saver = (
        trainer.DcpCheckpointer(
            args.ckpt_dir,
            reporter=reporter,
            async_save=not args.sync_save,
            storage_writer=killing_writer(rank, args.test_kill_rank_in_save, attempt),
        )
        if args.ckpt_format == "dcp"
        else None
    )
    if recording is not None:
        recording.record_process_groups()  # after the last new group (the saver's)
    # in-memory snapshots between the commits, at the policy's interval (a relaunch resumes from the
    # newest one every rank's state survives in)
    snapshots = trainer.Snapshotter(reporter=reporter, every=args.snapshot_every)
    start = 0
    found = trainer.resume_point(args.ckpt_dir)
    if found is not None:
        # a step whose shards differ from their recorded digests raises here: the reporter tells the
        # supervisor, which relaunches from the commit before it
        loaded = trainer.load_checkpoint(found, model=model, optimizer=opt, rank=rank, reporter=reporter)
        start = int(loaded.data_state["next_step"])
        if rank == 0 and not isinstance(found, trainer.SnapshotPoint):  # a snapshot is never on storage
            reporter.set_committed(loaded.step)
    reporter.loaded(found.step if found is not None else -1)
    args.out.mkdir(parents=True, exist_ok=True)
    loss_log = (args.out / f"loss-rank{rank}.jsonl").open("a", buffering=1)
    loss_fn = nn.MSELoss()
    for step in range(start, args.steps):
        fault = software_fault_here(args.test_software_fault, step, rank, world, attempt)
        x, y = (t.to(device) for t in batch_for(args.seed, step, rank, args.batch))
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()  # DDP's gradient all-reduce happens in here (timed by the hook)
        opt.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        # Every rank must agree to stop at the same step (the save below is collective): a MAX
        # all-reduce of the flags, timed as wait; a rank stopping for a peer reports a planned stop.
        stop = reporter.stop_agreed(device=device)
        done = step + 1  # steps completed: what the supervisor and a checkpoint saved now count
        reported = float("nan") if fault == "nan" else loss.item()
        loss_log.write(
            json.dumps({"step": step, "loss": loss.item(), "attempt": attempt, "ts": time.time()}) + "\n"
        )
        _logged_step = step
        reporter.report(done, loss=reported)  # step time, compute and wait measured by the reporter
        snapshot_due = snapshots.due(done)  # every rank, every step
        if done % args.ckpt_every == 0 or stop or done == args.steps:
            reporter.report(done, in_checkpoint=True)  # a repeat of the step: its timings, not the save's
            try:
                if saver is not None:  # DCP: the saver tells the reporter of each commit
                    saver.save(done, model=model, optimizer=opt, data_state={"next_step": done})
                    if stop or done == args.steps:
                        saver.wait()  # the last save: committed before this rank exits
                else:
                    commit = trainer.save_checkpoint(
                        args.ckpt_dir,
                        done,
                        model=model,
                        optimizer=opt,
                        data_state={"next_step": done},
                        rank=rank,
                        world_size=world,
                    )
                    if commit is not None:
                        reporter.set_committed(done)
            except (OSError, CheckpointError) as exc:
                # No marker was written: the supervisor resumes from the previous commit. Say why, then
                # fail this attempt (the other ranks would wait in the save's collectives).
                failed = exc.step if isinstance(exc, SaveFailed) else done  # an async save: an earlier step
                reporter.checkpoint_failed(failed, f"{type(exc).__name__}: {exc}")
                print(f"rank {rank}: checkpoint {failed} failed: {exc}", file=sys.stderr, flush=True)
                reporter.close()
                return 1
            reporter.report(done, loss=reported)
        elif snapshot_due:  # host memory only; the copy overlaps the next step's compute
            poison = 0 < args.test_poison_snapshots_from <= done and attempt == 1 and rank == 0
            with poisoned_while_copied(model, snapshots, poison):
                snapshots.take(done, model=model, optimizer=opt, data_state={"next_step": done})
        if stop:
            print(f"rank {rank}: stop requested, committed step {done}, exiting 0", flush=True)
            break
        if rank == 0 and args.eval_every and done % args.eval_every == 0 and done < args.steps:
            # rank 0 alone: the others are already waiting for it in the next step's all-reduce
            with reporter.evaluating():
                eval_loss = evaluate(model.module, args.seed, rank, args.batch, device, args.eval_seconds)
            print(f"rank {rank}: eval loss {eval_loss:.6f} after step {done}", flush=True)
    else:
        reporter.finished()  # the last step: what follows is teardown, not a hang
    reporter.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
