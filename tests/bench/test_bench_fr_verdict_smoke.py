"""The flight-recorder verdict benchmark still works: 64 ranks' dumps, the culprit found, CPU reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_verdict_bench_blames_the_culprit_and_reports_its_cpu(tmp_path: Path) -> None:
    out = tmp_path / "fr.json"
    subprocess.run(
        [sys.executable, "bench/bench_fr_verdict.py", "--ranks", "64", "--frames", "2", "--repeats", "1",
         "--out", str(out)],
        cwd=REPO, check=True, timeout=120, capture_output=True,
    )  # fmt: skip
    (result,) = json.loads(out.read_text())["results"].values()
    assert result["parse_s"] > 0 and result["verdict_s"] > 0, result
