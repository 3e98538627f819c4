"""A rank killed in the middle of an async DCP save (real torchrun, 2 gloo ranks on CPU, the example
job examples/train.py): the half-written step is never resumed from, the next run resumes from the
previous commit, and every loss equals an uninterrupted run's.

Attempt 1 saves step 20 with async_save; rank 1 (`--test-kill-rank-in-save 1:20`) writes its shard,
tears it to half and SIGKILLs itself before DCP's coordinator hears of it, while its main thread
trains on. Attempt 2 is what a supervisor would launch: the same command, resuming from the newest
commit on disk. The reference is one run of the same seed without faults.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nodeagent.trainer.checkpoint import MARKER, latest_committed, read_commit, step_dir
from nodeagent.trainer.dcp import DCP_METADATA
from tests.nodeagent.helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
STEPS, EVERY, DOOMED = 40, 10, 20


def _torchrun(
    tmp: Path, ckpt: Path, out: Path, attempt: int, *extra: str
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNWARDEN_")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", RUNWARDEN_ATTEMPT=str(attempt))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=0",
            str(ROOT / "examples" / "train.py"),
            *("--steps", str(STEPS), "--ckpt-every", str(EVERY), "--step-sleep", "0", "--dropout", "0.1"),
            *("--ckpt-dir", str(ckpt), "--out", str(out), *extra),
        ],
        env=env,
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _losses(out: Path) -> list[tuple[int, int, float]]:
    """(attempt, step, loss) of every line rank 0 logged, in order."""
    lines = (out / "loss-rank0.jsonl").read_text().splitlines()
    return [(r["attempt"], r["step"], r["loss"]) for r in map(json.loads, lines)]


def test_rank_killed_mid_async_save_resumes_from_the_previous_commit_with_equal_losses(
    tmp_path: Path,
) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    first = _torchrun(tmp_path, ckpt, out, 1, "--test-kill-rank-in-save", f"1:{DOOMED}")
    assert first.returncode != 0, "the run with a rank killed mid-save exited 0"
    doomed = step_dir(ckpt, DOOMED)
    assert (doomed / "__1_0.distcp").exists(), "the victim never began writing its shard"
    assert not (doomed / MARKER).exists() and not (doomed / DCP_METADATA).exists()
    assert read_commit(doomed) is None
    latest = latest_committed(ckpt)
    assert latest is not None and latest.step == DOOMED - EVERY and latest.meta["format"] == "dcp"
    trained_past = max(step for attempt, step, _ in _losses(out) if attempt == 1)
    assert trained_past >= DOOMED  # the save was async: rank 0 trained on while it was in flight

    second = _torchrun(tmp_path, ckpt, out, 2)
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = [step for attempt, step, _ in _losses(out) if attempt == 2]
    assert resumed[0] == DOOMED - EVERY and resumed[-1] == STEPS - 1
    final = latest_committed(ckpt)
    assert final is not None and final.step == STEPS

    ref = _torchrun(tmp_path, tmp_path / "ref-ckpt", tmp_path / "ref-out", 1)
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = {step: loss for _, step, loss in _losses(tmp_path / "ref-out")}
    got = _losses(out)
    assert {step for _, step, _ in got} == set(want)
    for attempt, step, loss in got:  # replayed steps included; same layout (2 ranks): bit for bit
        assert loss == want[step], f"attempt {attempt} step {step}: {loss} vs {want[step]}"
