"""One rank of tests/nodeagent/test_collective_progress.py: a plain gloo rank whose ProgressReporter
sends the default group's collective count to the test's stand-in for the agent's socket.

    python collective_job.py AGENT_SOCKET DIR      (2 ranks, via tests/nodeagent/helpers.run_gloo_ranks)

Both ranks report step 1 and enter the first ENTERED_TOGETHER collectives together. Then rank 0
enters the next all_reduce at once; rank 1 only HOLD_S after the test has created DIR/go (it has
seen both ranks' counts apart). Each rank writes the wall time
at which it entered that all_reduce to DIR/entered<rank>, then reports step 2 and closes its reporter.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from nodeagent import trainer

ENTERED_TOGETHER = 2  # an all_reduce and a barrier
HOLD_S = 1.5
GO_TIMEOUT_S = 30.0


def main() -> int:
    agent_socket, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    reporter = trainer.ProgressReporter.from_env(
        agent_socket=agent_socket, flush_interval_s=0.02, handle_sigterm=False
    )
    reporter.report(1, step_time_s=0.1)
    dist.all_reduce(torch.ones(1))
    dist.barrier()
    left = time.monotonic()
    if rank == 1:  # the late rank: its peer waits in the next all_reduce meanwhile
        go = out / "go"
        while not go.exists():
            if time.monotonic() > left + GO_TIMEOUT_S:
                print("rank 1: the test never said go", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.01)
        # HOLD_S after the go, not after the barrier: the test saw rank 0's report before the go,
        # so rank 0's dated entry is HOLD_S before this rank's however slowly the machine runs
        time.sleep(HOLD_S)
    (out / f"entered{rank}").write_text(repr(time.time()))
    dist.all_reduce(torch.ones(1))
    reporter.report(2, step_time_s=0.1)
    reporter.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
