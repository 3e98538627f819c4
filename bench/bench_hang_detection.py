"""Hang detection at long steps: the collective rule (the default) vs the step rule alone, one run.

    flock /tmp/runwarden-heavy.lock .venv/bin/python bench/bench_hang_detection.py \
        [--step-sleep 5,20] [--hangs 3] --out bench/results/bench_hang_detection.json

For each step length (`--step-sleep`: examples/train.py's sleep per step, so a step takes that plus a
few ms of compute) and each policy, one `examples/cluster.LocalCluster` (etcd, 6 agents, the
controller, ranks under the agents' warm workers, gloo on CPU) runs examples/train.py and gets
`--hangs` hangs (`controllerctl chaos NODE stop-rank`: SIGSTOP, the demo's injection), each once the
run recovered from the one before. The policies alternate per step length:

* `collective` — the shipped defaults: the collective rule (collective_hang_s 5 s) with the step
  rule, max(10 s, 3 x median step), as the backstop;
* `step-only` — collective_hang_s = 0: the step rule alone (runwarden before the collective rule).

With `--soak-s S` (0: none), also a soak at the shipped defaults with no fault: a 16M-parameter
model (`--width 4096`, SGD with momentum, lr 0.005: 128 MB of state per rank), 1 s steps, a synchronous save
every 5 steps (the ranks wait in it for seconds), and an evaluation on rank 0 alone every 10 steps
that takes 8 s (inside `reporter.evaluating()`; its peers wait in the next step's collectives): the
detections it logs (the goal: none), the commits and the steps it took.

Per hang, from the event log: fault -> DETECTION (`detect_s`), the detection's own latency (from
when the evidence began: the leaders' entry into the collective the hung rank never entered, or
the step's last advance: `latency_s`), which rule fired, whether the stopped rank's node was blamed,
and fault -> the first new step. Medians per (step, policy) are printed and go to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.cluster import ClusterSpec, LocalCluster  # noqa: E402
from examples.demo import recoveries, run_faults  # noqa: E402
from runwarden.v1 import events_pb2  # noqa: E402

E = events_pb2
POLICIES: dict[str, dict[str, object]] = {
    "collective": {},
    "step-only": {"collective_hang_s": 0.0},
}


def one_cluster(step_sleep: float, policy: str, hangs: int) -> list[dict[str, Any]]:
    # many hangs on six nodes: without this "failed twice in a week stays out" empties the pool
    spec = ClusterSpec(
        run="bench",
        step_sleep=step_sleep,
        ckpt_every=5,
        policy={"hold_after_failures": 1000, **POLICIES[policy]},
    )
    timeout_s = 120.0 + 4 * step_sleep
    with tempfile.TemporaryDirectory(prefix=f"bench-hang-{policy}-") as tmp:
        cluster = LocalCluster(Path(tmp) / "c", spec)
        try:
            cluster.start()
            if cluster.wait_for_event(E.EVENT_KIND_FIRST_STEP, 0, 240) is None:
                raise SystemExit(f"{policy}: the run did not start")
            time.sleep(3 * step_sleep + 2)  # a few steps: the step rule learns the step time
            injections = run_faults(cluster, ["hang"] * hangs, timeout_s)
        finally:
            cluster.stop()
        events = cluster.events()
    rows = []
    for r in recoveries(events, injections):
        detect, blame = r.detection, r.attribution
        message = detect.message if detect else ""
        rows.append(
            {
                "step_sleep_s": step_sleep,
                "policy": policy,
                "node": r.injection.node,
                "recovered": r.injection.recovered,
                "detect_s": r.detect_s if detect else None,
                "latency_s": detect.detection.latency_s if detect else None,
                "rule": "collective" if "did not enter collective" in message else "step" if message else "",
                "blamed_right": bool(blame and blame.attribution.suspects[0].node == r.injection.node),
                "first_new_step_s": r.first_step_s if r.first_step else None,
                "detection": message[:300],
            }
        )
    return rows


def soak(seconds: float) -> dict[str, Any]:
    spec = ClusterSpec(
        run="soak",
        step_sleep=1.0,
        ckpt_every=5,
        # lr 0.005: at the default 0.05 this width diverges to NaN by step 21 (the loss rules' business)
        train_args=(
            "--width",
            "4096",
            "--lr",
            "0.005",
            "--sync-save",
            "--eval-every",
            "10",
            "--eval-seconds",
            "8",
        ),
    )
    with tempfile.TemporaryDirectory(prefix="bench-hang-soak-") as tmp:
        cluster = LocalCluster(Path(tmp) / "c", spec)
        try:
            cluster.start()
            if cluster.wait_for_event(E.EVENT_KIND_FIRST_STEP, 0, 300) is None:
                raise SystemExit("soak: the run did not start")
            started = time.time()
            time.sleep(seconds)
        finally:
            cluster.stop()
        events = [e for e in cluster.events() if e.ts >= started]
    detections = [e for e in events if e.kind == E.EVENT_KIND_DETECTION]
    commits = [e for e in events if e.kind == E.EVENT_KIND_CHECKPOINT_COMMIT]
    steps = [e.step for e in events if e.step > 0]
    return {
        "soak_s": seconds,
        "detections": len(detections),
        "detection_messages": [e.message[:300] for e in detections],
        "commits": len(commits),
        "save_s_median": med([e.checkpoint.save_duration_s for e in commits]),
        "steps": (max(steps) - min(steps)) if steps else 0,
        "evaluations": ((max(steps) // 10) - (min(steps) // 10)) if steps else 0,
    }


def med(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return round(statistics.median(kept), 2) if kept else None


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for step in sorted({r["step_sleep_s"] for r in rows}):
        for policy in POLICIES:
            mine = [r for r in rows if r["step_sleep_s"] == step and r["policy"] == policy]
            if not mine:
                continue
            out.append(
                {
                    "step_sleep_s": step,
                    "policy": policy,
                    "hangs": len(mine),
                    "detect_s_median": med([r["detect_s"] for r in mine]),
                    "detect_s_max": max(
                        (r["detect_s"] for r in mine if r["detect_s"] is not None), default=None
                    ),
                    "latency_s_median": med([r["latency_s"] for r in mine]),
                    "first_new_step_s_median": med([r["first_new_step_s"] for r in mine]),
                    "rules": sorted({r["rule"] for r in mine}),
                    "blamed_right": sum(r["blamed_right"] for r in mine),
                }
            )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step-sleep", default="5", help="comma-separated seconds per step (default 5; '': none)")
    p.add_argument("--hangs", type=int, default=3, help="hangs per cluster (default 3)")
    p.add_argument("--soak-s", type=float, default=0.0, help="a fault-free soak this long (default 0: none)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    steps = [float(x) for x in args.step_sleep.split(",") if x.strip()]
    if any(not 0 <= s < 600 for s in steps) or args.hangs < 1 or not 0 <= args.soak_s < 86400:
        p.error("--step-sleep: seconds in [0, 600); --hangs: at least 1; --soak-s: seconds in [0, 86400)")
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for i, step in enumerate(steps):
        order = list(POLICIES) if i % 2 == 0 else list(reversed(POLICIES))
        for policy in order:
            rows += one_cluster(step, policy, args.hangs)
    summary = summarize(rows)
    for s in summary:
        print(json.dumps(s))
    soaked = soak(args.soak_s) if args.soak_s > 0 else None
    if soaked is not None:
        print(json.dumps(soaked))
    result = {
        "command": " ".join(sys.argv),
        "loadavg_before": load_before,
        "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
        "wall_s": round(time.monotonic() - t0, 1),
        "summary": summary,
        "soak": soaked,
        "rows": rows,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
