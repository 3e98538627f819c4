"""Wall time of `preflight run --quick` and `--full` on this host (the CLI as a process; median of N runs).

    .venv/bin/python bench/bench_preflight.py [--runs 5] [--modes quick full]

The config written for the run points the storage checks at a temporary directory (so they run
for real); every other key is the default. On a CPU-only host NVML and DCGM checks are SKIP and
the compute/collective checks run their CPU paths (torch CPU matmul, gloo all-reduce, 2 ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def one_run(mode: str, config: Path) -> tuple[float, dict[str, Any]]:  # the report as JSON
    cmd = [sys.executable, "-m", "preflight", "run", f"--{mode}", "--json", "--config", str(config)]
    started = time.perf_counter()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, cwd=ROOT, check=False, env=dict(os.environ, PYTHONPATH=str(ROOT))
    )
    wall = time.perf_counter() - started
    if proc.returncode not in (0, 1):
        raise SystemExit(f"preflight could not run (exit {proc.returncode}): {proc.stderr.strip()}")
    return wall, json.loads(proc.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=["quick", "full"], choices=["quick", "full"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-preflight-") as tmp:
        config = Path(tmp) / "preflight.toml"
        config.write_text(f"[storage]\ncheckpoint_path = '{tmp}'\nfree_space_floor_gb = 1.0\n")
        print(
            f"host cpus={os.cpu_count()} python={sys.version.split()[0]}; config: storage at a tmp dir, "
            "else defaults"
        )
        for mode in args.modes:
            walls, inside = [], []
            for _ in range(args.runs):
                wall, report = one_run(mode, config)
                walls.append(wall)
                inside.append(float(report["duration_s"]))
            counts = report["counts"]
            results: list[dict[str, Any]] = report["results"]
            slowest = sorted(results, key=lambda r: -float(r["duration_s"]))[:3]
            slow_text = ", ".join(f"{r['name']} {float(r['duration_s']):.2f}s" for r in slowest)
            print(
                f"preflight run --{mode}: wall median {statistics.median(walls):.2f} s "
                f"(min {min(walls):.2f}, max {max(walls):.2f}, n={len(walls)}); "
                f"runner median {statistics.median(inside):.2f} s; last counts {counts}; "
                f"slowest: {slow_text}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
