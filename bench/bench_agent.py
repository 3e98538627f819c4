"""Benchmarks of the node agent (BENCHMARKS.md, section "nodeagent").

    PYTHONPATH=. .venv/bin/python bench/bench_agent.py [--cpu-window 30] [--repeats 5]

1. Idle agent RSS: a real `nodeagent` registered in a private etcd, idle for a few seconds;
   VmRSS from /proc, and whether any torch library is mapped (it must not be).
2. Agent CPU at a 1 Hz progress interval with 8 real rank processes reporting 100 steps/s each
   (default trainer flush interval, 1 s; one unix datagram each): utime+stime of the agent over
   the window, % of one core.
3. Cost of one `ProgressReporter.report()` call in the rank, with its flusher thread talking to
   a live agent: median over batches of 1,000 calls.
Each is repeated `--repeats` times (1 and 2 share agents); the medians are printed as markdown.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from testbed.etcd_server import EtcdServer  # noqa: E402
from tests.nodeagent.helpers import AgentProc  # noqa: E402

RANK_SCRIPT = """
import sys, time
from nodeagent.trainer import ProgressReporter
r = ProgressReporter.from_env()
end = time.monotonic() + float(sys.argv[1])
step = 0
while time.monotonic() < end:
    r.report(step, step_time_s=0.01, compute_s=0.008, wait_s=0.002)
    step += 1
    time.sleep(0.01)
r.close()
"""


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def torch_mapped(pid: int) -> bool:
    return "torch" in Path(f"/proc/{pid}/maps").read_text()


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_agent_run(tmp: Path, etcd: EtcdServer, window_s: float) -> tuple[float, bool, float]:
    agent = AgentProc(tmp, node="bench", etcd=etcd.endpoint, flags=["--progress-interval", "1"])
    try:
        time.sleep(3)
        rss, torch_in = rss_mb(agent.pid), torch_mapped(agent.pid)
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "RUNWARDEN_RUN": "bench",
            "RUNWARDEN_ATTEMPT": "1",
            "RUNWARDEN_NODEAGENT_SOCKET": agent.socket,
            "WORLD_SIZE": "8",
        }
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", RANK_SCRIPT, str(window_s + 8)],
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            )
            for r in range(8)
        ]
        time.sleep(5)  # ranks imported and reporting
        c0, t0 = cpu_s(agent.pid), time.monotonic()
        time.sleep(window_s)
        cpu_pct = 100 * (cpu_s(agent.pid) - c0) / (time.monotonic() - t0)
        for p in ranks:
            p.wait(timeout=60)
        return rss, torch_in, cpu_pct
    finally:
        agent.close()


def report_cost_us(tmp: Path, etcd: EtcdServer, repeats: int) -> list[float]:
    from nodeagent.trainer import ProgressReporter

    agent = AgentProc(tmp, node="bench2", etcd=etcd.endpoint)
    try:
        reporter = ProgressReporter(
            run="bench", attempt=1, rank=0, local_rank=0, world_size=1, agent_socket=agent.socket
        )
        medians = []
        for _ in range(repeats):
            per_call = []
            for batch in range(200):
                t0 = time.perf_counter_ns()
                for step in range(1000):
                    reporter.report(step, step_time_s=0.1, compute_s=0.08, wait_s=0.02)
                per_call.append((time.perf_counter_ns() - t0) / 1000 / 1000)
                if batch % 10 == 0:
                    time.sleep(0.01)  # let the flusher run, as between real steps
            medians.append(statistics.median(per_call))
        reporter.close()
        return medians
    finally:
        agent.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-window", type=float, default=30.0)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as d:
        tmp = Path(d)
        etcd = EtcdServer(tmp / "etcd", fast=True).start()
        try:
            runs = [one_agent_run(tmp / f"a{i}", etcd, args.cpu_window) for i in range(args.repeats)]
            costs = report_cost_us(tmp / "cost", etcd, args.repeats)
        finally:
            etcd.discard()
    rss = [r[0] for r in runs]
    cpu = [r[2] for r in runs]
    print("| metric | goal | median | runs |\n|---|---|---|---|")
    print(
        f"| idle agent RSS (MB) | <= 80 | {statistics.median(rss):.1f} | {', '.join(f'{x:.1f}' for x in rss)} |"
    )
    print(f"| torch mapped in the agent | no | {'yes' if any(r[1] for r in runs) else 'no'} | |")
    print(
        f"| agent CPU, 1 Hz interval, 8 ranks (% of a core) | <= 1 | {statistics.median(cpu):.2f} | "
        f"{', '.join(f'{x:.2f}' for x in cpu)} |"
    )
    print(
        f"| one report() call (us) | <= 20 | {statistics.median(costs):.2f} | "
        f"{', '.join(f'{x:.2f}' for x in costs)} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
