"""A 3-rank gloo job launched through the agent, the way torchrun would be: this leader spawns the ranks.

    python fr_job.py WORKDIR STEPS
Every rank sets up flight recording from the launcher's environment (RUNWARDEN_FR_SOCKET_DIR),
runs STEPS all-reduces, reports progress; then rank 1 spins in Python holding the GIL (the hang)
while ranks 0 and 2 wait in the next all-reduce. `WORKDIR/ready<R>` holds each rank's pid.
"""

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

WORLD = 3


def rank_main(work: Path, rank: int, steps: int) -> None:
    from nodeagent.trainer import ProgressReporter, setup_flight_recording

    rec = setup_flight_recording()  # None where the socket cannot be made (FR_JOB_NO_SOCKET_OK=1 expects it)
    if os.environ.get("FR_JOB_NO_SOCKET_OK") != "1":
        assert rec is not None, "RUNWARDEN_FR_SOCKET_DIR and RANK must be set by the launcher"
    import torch
    import torch.distributed as dist

    store = dist.FileStore(str(work / "filestore"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    if rec is not None:
        rec.record_process_groups()
    reporter = ProgressReporter.from_env(flush_interval_s=0.1)
    for step in range(steps):
        dist.all_reduce(torch.ones(8))
        reporter.report(step)
    reporter.flush()
    (work / f"ready{rank}").write_text(str(os.getpid()))
    if rank == 1:
        while True:  # the culprit: busy in Python, holding the GIL
            pass
    dist.all_reduce(torch.ones(8))  # the victims wait here for rank 1
    while True:
        time.sleep(1)


def main() -> None:
    work, steps = Path(sys.argv[1]), int(sys.argv[2])
    if len(sys.argv) > 3:
        rank_main(work, int(sys.argv[3]), steps)
        return
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(work), str(steps), str(r)],
            env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(WORLD)},
        )
        for r in range(WORLD)
    ]
    for p in procs:
        p.wait()


if __name__ == "__main__":
    main()
