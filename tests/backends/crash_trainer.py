"""A trainer with a deterministic bug: every attempt trains from scratch and every rank exits 1 once
it completed step ``--fail-at`` (the same failure at the same step each time, no node to blame:
a crash loop). Run under torchrun: gloo on CPU, progress through the agent like a real job.

    torchrun --nproc-per-node=2 tests/backends/crash_trainer.py --fail-at 3
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from nodeagent import trainer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fail-at", type=int, default=3, help="exit 1 after completing this many steps")
    p.add_argument("--step-sleep", type=float, default=0.05)
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    reporter = trainer.ProgressReporter.from_env(rank=rank, world_size=world)
    reporter.loaded(-1)
    t = torch.ones(4)
    for step in range(args.fail_at):
        started = time.perf_counter()
        time.sleep(args.step_sleep)
        dist.all_reduce(t)
        reporter.report(step + 1, step_time_s=time.perf_counter() - started)
    print(f"rank {rank}: the bug at step {args.fail_at}: exit 1", file=sys.stderr, flush=True)
    reporter.close()  # flushes the last report: the failure is seen at step --fail-at
    return 1


if __name__ == "__main__":
    sys.exit(main())
