"""The agent-RPC benchmark still works: every kind fanned out to 32 nodes against its aio server, each
call answered, the CPU per call measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_kind_fans_out_and_reports_its_cpu_per_call(tmp_path: Path) -> None:
    out = tmp_path / "rpc.json"
    subprocess.run(
        [sys.executable, "bench/bench_agent_rpc.py", "--hosts", "32", "--repeats", "1", "--out", str(out)],
        cwd=REPO,
        check=True,
        timeout=120,
        capture_output=True,
    )
    results = json.loads(out.read_text())["results"]
    for kind in ("preflight", "launch", "stop", "dumps"):
        assert results[kind]["cpu_us_per_call"] > 0 and results[kind]["wall_s"] > 0, results
