"""A parked group's cost and how fast a dead rank is replaced (BENCHMARKS.md, "the group as a template").

    PYTHONPATH=. .venv/bin/python bench/bench_warm_group.py [--trials 3] [--ranks 1,2,8]

Per local-rank count, alternating, `--trials` of each:
* `forked` (shipped): `python -m nodeagent.warm.leader` imports torch and the default `warm_preload`
  once and forks its ranks; parked = its `ready <pids>`;
* `interpreters` (the way before): one `python -m nodeagent.warm.rank` interpreter per local rank,
  each importing the same modules itself; parked = every rank's `ready`.
For each: start -> parked (s), and the memory the parked processes hold (summed from
/proc/<pid>/smaps_rollup: Pss, what they cost the host; Rss, what `top` adds up).

`replace`: a leader with one parked rank (nodeagent.warm.leader.Leader, in a child process): the rank
is SIGKILLed and `Leader.replace_dead` forks one in its place; seconds until it said ready. Before,
a host whose rank died had to start a new group: `interpreters` with one rank is that cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nodeagent.daemon.config import DEFAULT_WARM_PRELOAD  # noqa: E402
from nodeagent.warm import protocol  # noqa: E402

PRELOAD = ",".join(DEFAULT_WARM_PRELOAD)
REPLACE = """
import os, signal, sys, time
from nodeagent.warm.leader import Leader
r, w = os.pipe()
leader = Leader(1, w, tuple(sys.argv[1].split(",")))
assert leader.start() and leader.wait_parked(leader.ranks, 300)
victim = leader.ranks[0].popen
os.kill(victim.pid, signal.SIGKILL)
while victim.poll() is None:
    time.sleep(0.001)
t0 = time.monotonic()
assert leader.replace_dead()
print(time.monotonic() - t0)
leader.end(0)
"""


def memory(pids: list[int]) -> tuple[float, float]:
    """(Pss, Rss) in MiB summed over `pids`."""
    pss = rss = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "Pss":
                pss += int(value.split()[0])
            elif key == "Rss":
                rss += int(value.split()[0])
    return pss / 1024, rss / 1024


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def forked(ranks: int) -> dict[str, float]:
    r, w = os.pipe()
    t0 = time.monotonic()
    leader = subprocess.Popen(
        [
            *protocol.process_command(
                sys.executable,
                protocol.LEADER_MODULE,
                tuple(PRELOAD.split(",")),
                None,
                "--local-ranks",
                str(ranks),
            ),
            "--ready-fd",
            str(w),
        ],
        pass_fds=(w,),
        stdin=subprocess.PIPE,
        env=env(),
        start_new_session=True,
    )
    os.close(w)
    with os.fdopen(r, "rb") as ready:
        line = ready.readline()
    parked = time.monotonic() - t0
    pids = list(protocol.parse_ready(line, ranks))
    assert pids, line
    pss, rss = memory([leader.pid, *pids])
    assert leader.stdin is not None
    leader.stdin.close()  # EOF: the group closes
    leader.wait(timeout=30)
    return {"parked_s": parked, "pss_mib": pss, "rss_mib": rss}


def interpreters(ranks: int) -> dict[str, float]:
    procs, status = [], []
    t0 = time.monotonic()
    for _ in range(ranks):
        sr, sw = os.pipe()
        cr, cw = os.pipe()
        procs.append(
            (
                subprocess.Popen(
                    protocol.process_command(
                        sys.executable,
                        protocol.RANK_MODULE,
                        tuple(PRELOAD.split(",")),
                        None,
                        "--status-fd",
                        str(sw),
                        "--control-fd",
                        str(cr),
                    ),
                    pass_fds=(sw, cr),
                    stdin=subprocess.DEVNULL,
                    env=env(),
                ),
                cw,
            )
        )
        os.close(sw)
        os.close(cr)
        status.append(os.fdopen(sr, "rb"))
    for f in status:
        assert f.readline().strip() == b"ready"
    parked = time.monotonic() - t0
    pss, rss = memory([p.pid for p, _ in procs])
    for (p, cw), f in zip(procs, status, strict=True):
        os.close(cw)  # EOF on its control pipe: a parked rank exits
        p.wait(timeout=30)
        f.close()
    return {"parked_s": parked, "pss_mib": pss, "rss_mib": rss}


def replace() -> float:
    out = subprocess.run(
        [sys.executable, "-c", REPLACE, PRELOAD], capture_output=True, text=True, env=env(), timeout=300
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--ranks", default="1,2,8")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    counts = [int(n) for n in args.ranks.split(",")]
    rows: dict[str, list[dict[str, float]]] = {}
    replaced: list[float] = []
    load = os.getloadavg()
    for trial in range(args.trials):
        for n in counts:
            for kind, measure in (("forked", forked), ("interpreters", interpreters)):
                got = measure(n)
                rows.setdefault(f"{kind} x{n}", []).append(got)
                print(f"trial {trial + 1} {kind:12s} x{n}: {got}", flush=True)
        replaced.append(replace())
        print(f"trial {trial + 1} replace a dead rank: {replaced[-1]:.3f} s", flush=True)
    summary = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in rows.items()
    }
    summary["replace"] = {
        "median_s": statistics.median(replaced),
        "min_s": min(replaced),
        "max_s": max(replaced),
    }
    print(json.dumps(summary, indent=1))
    print(f"load average at the start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; cores: {os.cpu_count()}")
    if args.out:
        args.out.write_text(
            json.dumps({"summary": summary, "trials": rows, "replace_s": replaced, "load": load})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
