"""The peer benchmark still works: one crash under the torchrun peer (no extra install), measured and
cleaned up. The full benchmark (bench/bench_peers.py) and the other peers' installs are not run here."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from bench import bench_peers
from bench.peers.observe import processes_mentioning


@pytest.mark.slow
def test_a_torchrun_crash_trial_is_measured_and_leaves_no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_peers, "WARM_STEP", 11)  # just past the first checkpoint: a shorter trial
    with tempfile.TemporaryDirectory(prefix="bench-peers-smoke-") as tmp:
        trial = bench_peers.run_trial("torchrun", "crash", 0, cap_s=12.0, reference={}, workdir=Path(tmp))
        assert trial.started, trial
        assert trial.last_step_before is not None and trial.last_step_before >= 11
        # torchrun's agent logs the dead rank's exit at once, whatever its restart then does
        assert trial.detect_s is not None and 0 <= trial.detect_s < 5, trial.reactions
        assert trial.outcome in ("recovered", "run ended", "no recovery within cap"), trial
        if trial.outcome == "recovered":
            assert trial.first_new_step_s is not None and trial.steps_redone is not None
            assert trial.losses_equal is True
        assert not processes_mentioning(tmp), "the trial left processes behind"
