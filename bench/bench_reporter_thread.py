"""The CPU of ProgressReporter's thread (nodeagent.trainer) while a rank trains: it reads the
default group's collective count every 0.1 s and sends a changed count once a second.

    .venv/bin/python bench/bench_reporter_thread.py [--seconds 30]

One process, a 1-rank gloo group, an all_reduce every 50 ms (the count changes all the time, so a
report goes out every flush), the reports to a datagram socket nobody answers (each send waits the
reporter's 0.2 s answer timeout, off the training thread). The thread's CPU is read from
/proc/self/task/<tid>/stat (10 ms clock ticks).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from nodeagent import trainer
from nodeagent.wire import progress_socket_path


def thread_cpu_s(tid: int) -> float:
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=30.0)
    args = p.parse_args()
    if not 1 <= args.seconds <= 3600:
        p.error("--seconds: 1 to 3600")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "agent.sock")
        agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        agent.bind(progress_socket_path(path))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
        reporter = trainer.ProgressReporter(
            run="bench",
            attempt=1,
            rank=0,
            local_rank=0,
            world_size=1,
            agent_socket=path,
            handle_sigterm=False,
        )
        reporter.report(1)
        thread = next(t for t in threading.enumerate() if t.name == "runwarden-progress")
        assert thread.native_id is not None
        cpu0, wall0 = thread_cpu_s(thread.native_id), time.monotonic()
        x = torch.ones(4)
        while time.monotonic() < wall0 + args.seconds:
            dist.all_reduce(x)
            time.sleep(0.05)
        cpu1, wall1 = thread_cpu_s(thread.native_id), time.monotonic()
        reporter.close()
        dist.destroy_process_group()
        agent.close()
    print(
        f"reporter thread: {100 * (cpu1 - cpu0) / (wall1 - wall0):.2f}% of a core over {wall1 - wall0:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
