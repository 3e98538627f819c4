"""A hang's verdict at fleet width (issue 31): the controller's CPU to parse and analyse every rank's
flight-recorder dump, from the agents' answers to the verdict.

    PYTHONPATH=. flock /tmp/runwarden-heavy.lock .venv/bin/python bench/bench_fr_verdict.py \
        --ranks 16384 --repeats 5 --tree <a checkout of the code before> --out bench/results/bench_fr_verdict.json

The input is what the executor hands `verdict_from_rank_dumps` after a dump collection: one
`RankDump` per rank, torch's JSON format (as the agents collect it over the rank's worker socket),
`--entries` entries a dump (the ring buffer's tail: the light fleet keeps 8), every rank waiting in
collective S but one culprit whose process is stopped (no dump), as lightfleet's hang gives them.
`--frames` adds that many stack frames an entry (the pickle format carries them; JSON does not).
Each tree (this checkout, and every `--tree`) runs in its own process, the trees interleaved per
repeat so that the machine's noise falls on all alike; CPU seconds of that process (user + system)
for the whole call, and for the parse alone. Medians over `--repeats`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ONE = """
import json, sys, time
from controller.supervisor.flight_recorder import dumps_from_rank_dumps, verdict_from_rank_dumps
from runwarden.v1 import agent_pb2
ranks, entries, frames, culprit = (int(a) for a in sys.argv[1:5])
step = 100
stack = [{"name": f"f{i}", "filename": "/opt/train.py", "line": 10 + i} for i in range(frames)]
def dump(rank):
    if rank == culprit:
        return agent_pb2.RankDump(rank=rank, ok=False, error="no dump: its process is stopped", process_state="T")
    last = step + 1
    es = [{"record_id": seq - 1, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": seq,
           "p2p_seq_id": 0, "op_id": seq, "is_p2p": False, "profiling_name": "nccl:all_reduce",
           "input_sizes": [[1048576]], "input_dtypes": ["Float"], "output_sizes": [[1048576]],
           "output_dtypes": ["Float"], "state": "completed" if seq <= step else "scheduled",
           "retired": seq <= step, "timeout_ms": 600000, "time_created_ns": 1765000000000000000 + seq,
           "frames": stack} for seq in range(last - entries + 1, last + 1)]
    data = json.dumps({"version": "2.10", "pg_config": {}, "entries": es}).encode()
    return agent_pb2.RankDump(rank=rank, ok=True, format="json", data=data)
answers = [dump(r) for r in range(ranks)]
rank_to_node = {r: f"n{r // 8:05d}" for r in range(ranks)}
t = time.process_time()
dumps_from_rank_dumps(answers)
parse_s = time.process_time() - t
t = time.process_time()
v = verdict_from_rank_dumps(answers, rank_to_node)
verdict_s = time.process_time() - t
assert [s.ranks for s in v.suspects][:1] == [(culprit,)], v.suspects[:1]
print(json.dumps({"parse_s": parse_s, "verdict_s": verdict_s}))
"""  # fmt: skip


def once(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [str(args.ranks), str(args.entries), str(args.frames), str(args.ranks // 3)]
    out = subprocess.run(
        [sys.executable, "-c", ONE, *argv], cwd=tree, env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=16384)
    p.add_argument("--entries", type=int, default=8, help="entries a dump")
    p.add_argument("--frames", type=int, default=0, help="stack frames an entry")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tree", action="append", default=[], help="another checkout to run beside this one")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    trees = [REPO, *(Path(t).resolve() for t in args.tree)]
    runs: dict[str, list[dict[str, float]]] = {str(t): [] for t in trees}
    for _ in range(args.repeats):
        for tree in trees:
            runs[str(tree)].append(once(tree, args))
    results = {
        tree: {
            "parse_s": statistics.median(r["parse_s"] for r in rows),
            "verdict_s": statistics.median(r["verdict_s"] for r in rows),
            "runs": rows,
        }
        for tree, rows in runs.items()
    }
    this = results[str(REPO)]
    for tree, res in results.items():
        ratio = res["verdict_s"] / this["verdict_s"] if this["verdict_s"] else float("nan")
        print(
            f"{tree}: verdict {res['verdict_s']:.3f} s CPU (parse {res['parse_s']:.3f} s) for {args.ranks} ranks, "
            f"{args.entries} entries, {args.frames} frames; {ratio:.2f}x this checkout's"
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "command": sys.argv,
                    "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                    "load_before": list(os.getloadavg()),
                    "ranks": args.ranks,
                    "entries": args.entries,
                    "frames": args.frames,
                    "results": results,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
