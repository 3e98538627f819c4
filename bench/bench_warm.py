"""Warm workers vs cold torchrun: launch -> first step of the same 2-node job (BENCHMARKS.md, "warm workers").

    PYTHONPATH=. .venv/bin/python bench/bench_warm.py [--trials 5] [--local-ranks 2] [--gap 6]

Two pairs of real agents on distinct loopback hosts (no etcd: the launches are sent straight to
the agents, as the controller's local backend does, both nodes at once): one pair with
`warm_workers = false` (torchrun on every node, torchrun starts the ranks), one with
`warm_workers = true` (the ranks parked with torch imported). The launches alternate cold, warm,
cold, ... `--trials` of each; each is examples/train.py from scratch (a fresh checkpoint and output
directory) for a few steps with gloo, `--local-ranks` ranks per node, and runs to its end. Between
launches the machine idles `--gap` s (both kinds alike), which is also when a warm pair parks its
fresh group; a warm launch's answer says how long it still waited for its group.

launch -> first step: from just before the two LaunchWorkers calls to the moment every rank's loss
log has its first line (the first step done, after rendezvous, gloo init and DDP's broadcast), polled
every 5 ms. Also: the RSS of a parked rank and of a parked leader (VmRSS), and their CPU use while
parked (utime+stime over `--idle` s). Results go to --out as JSON; the medians are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runwarden.v1 import agent_pb2  # noqa: E402
from tests.nodeagent.helpers import AgentProc, wait_for  # noqa: E402
from tests.nodeagent.test_warm_workers import agent_flags, parked_ranks  # noqa: E402

PAIRS = {"cold": ("127.0.0.31", "127.0.0.32"), "warm": ("127.0.0.33", "127.0.0.34")}
PORTS = {"cold": 29711, "warm": 29713}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_pair(kind: str, tmp: Path, local_ranks: int) -> list[AgentProc]:
    agents = []
    for i, host in enumerate(PAIRS[kind]):
        flags = agent_flags(host, warm_on=kind == "warm", local_ranks=local_ranks)
        if i == 0:
            flags += ["--rdzv-port", str(PORTS[kind])]
        agents.append(AgentProc(tmp / f"{kind}{i}", node=f"{kind}{i}", flags=flags))
    return agents


def one_launch(kind: str, agents: list[AgentProc], attempt: int, tmp: Path, ranks: int) -> dict:
    work = tmp / f"{kind}-{attempt}"
    command = [
        str(ROOT / "examples" / "train.py"),
        "--steps",
        "6",
        "--ckpt-dir",
        str(work / "ckpt"),
        "--ckpt-every",
        "1000",
        "--out",
        str(work / "out"),
        "--step-sleep",
        "0.05",
    ]
    replies: list[agent_pb2.LaunchWorkersResponse | None] = [None] * len(agents)

    def send(node_rank: int) -> None:
        replies[node_rank] = agents[node_rank].stub.LaunchWorkers(
            agent_pb2.LaunchWorkersRequest(
                run="bench",
                attempt=attempt,
                env={"PYTHONPATH": str(ROOT)},
                nnodes=len(agents),
                node_rank=node_rank,
                resume_step=-1,  # from scratch (the field's default, 0, names a commit)
                torchrun=agent_pb2.TorchrunLaunch(
                    command=command,
                    rdzv_endpoint=f"{PAIRS[kind][0]}:{PORTS[kind]}",
                    is_host=node_rank == 0,
                ),
            ),
            timeout=120,
        )

    logs = [work / "out" / f"loss-rank{r}.jsonl" for r in range(ranks)]
    started = time.perf_counter()
    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(agents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = started + 180
    while not all(p.exists() and p.stat().st_size > 0 for p in logs):
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{kind} attempt {attempt}: no first step within 180 s")
        if int(time.perf_counter() * 200) % 20 == 0 and any(
            w.attempt == attempt and w.HasField("exit")
            for a in agents
            for w in a.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).workers
        ):
            raise RuntimeError(f"{kind} attempt {attempt}: a node's workers ended before the first step")
        time.sleep(0.005)
    first_step_s = time.perf_counter() - started
    exits = []
    for agent in agents:
        w = wait_for(
            lambda a=agent: next(
                (
                    w
                    for w in a.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).workers
                    if w.attempt == attempt and w.HasField("exit")
                ),
                None,
            ),
            120,
            f"{kind} attempt {attempt} to end",
            interval_s=0.1,
        )
        exits.append(w.exit.exit_code)
    paths = [r.launch_path for r in replies if r is not None]
    if exits != [0] * len(agents) or paths != [kind] * len(agents):
        raise RuntimeError(
            f"{kind} attempt {attempt}: exits {exits}, paths {[(r.launch_path, r.launch_detail) for r in replies if r]}"
        )
    return {
        "kind": kind,
        "attempt": attempt,
        "launch_to_first_step_s": round(first_step_s, 3),
        "launch_detail": [r.launch_detail for r in replies if r is not None],
    }


def parked_cost(agents: list[AgentProc], idle_s: float) -> dict:
    for agent in agents:  # parked = torch imported and "ready" said (the agent logs it)
        wait_for(lambda a=agent: "rank(s) parked in" in a.log(), 120, f"{agent.node}'s parked group")
    ranks = [p for a in agents for p in parked_ranks(a)]
    leaders = {int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) for p in ranks}
    before = {p: cpu_s(p) for p in (*ranks, *leaders)}
    time.sleep(idle_s)
    return {
        "parked_rank_rss_mb": [round(rss_mb(p), 1) for p in ranks],
        "parked_leader_rss_mb": [round(rss_mb(p), 1) for p in sorted(leaders)],
        "idle_cpu_pct_of_a_core_all_parked": round(
            100 * sum(cpu_s(p) - before[p] for p in before) / idle_s, 2
        ),
        "idle_window_s": idle_s,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--local-ranks", type=int, default=2)
    p.add_argument("--gap", type=float, default=6.0, help="idle seconds between launches")
    p.add_argument("--idle", type=float, default=5.0, help="window of the parked CPU measurement")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bench_warm.json")
    args = p.parse_args()
    if args.trials < 1 or not 1 <= args.local_ranks <= 8:
        p.error("--trials >= 1, --local-ranks 1..8")
    tmp = Path(tempfile.mkdtemp(prefix="bench-warm-"))
    pairs = {kind: start_pair(kind, tmp, args.local_ranks) for kind in ("cold", "warm")}
    ranks = 2 * args.local_ranks
    rows: list[dict] = []
    try:
        cost = parked_cost(pairs["warm"], args.idle)
        for trial in range(1, args.trials + 1):
            for kind in ("cold", "warm"):
                time.sleep(args.gap)
                row = one_launch(kind, pairs[kind], trial, tmp, ranks)
                rows.append(row)
                print(
                    f"{kind} #{trial}: {row['launch_to_first_step_s']:.2f} s  {row['launch_detail']}",
                    flush=True,
                )
    finally:
        for agents in pairs.values():
            for agent in agents:
                agent.close()
    med = {
        kind: statistics.median(r["launch_to_first_step_s"] for r in rows if r["kind"] == kind)
        for kind in ("cold", "warm")
    }
    result = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "nproc": os.cpu_count(),
        "loadavg_at_end": Path("/proc/loadavg").read_text().split()[:3],
        "nodes": 2,
        "local_ranks": args.local_ranks,
        "trials_per_kind": args.trials,
        "gap_s": args.gap,
        "median_launch_to_first_step_s": med,
        "range_launch_to_first_step_s": {
            kind: [
                min(r["launch_to_first_step_s"] for r in rows if r["kind"] == kind),
                max(r["launch_to_first_step_s"] for r in rows if r["kind"] == kind),
            ]
            for kind in ("cold", "warm")
        },
        "ratio_warm_over_cold": round(med["warm"] / med["cold"], 3),
        "parked": cost,
        "launches": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "launches"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
