"""The commit protocol under a crash at each point: latest_committed never returns a half-written step."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from nodeagent.trainer import checkpoint
from tests.nodeagent.helpers import PYTHON, ROOT


@pytest.mark.parametrize(
    ("point", "expected"),
    [("mid_file", 1), ("after_files", 1), ("marker_tmp", 1), ("after_commit", 2), ("none", 2)],
)
def test_crash_between_write_and_marker_keeps_previous_commit(tmp_path, point, expected):
    proc = subprocess.run(
        [PYTHON, str(ROOT / "tests/nodeagent/ckpt_crash.py"), str(tmp_path), point],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == (0 if point == "none" else -signal.SIGKILL), proc.stderr
    assert checkpoint.step_dir(tmp_path, 2).is_dir()  # the newer directory exists in every case
    latest = checkpoint.latest_committed(tmp_path)
    assert latest is not None and latest.step == expected
    assert dict(latest.files) == ({"model.bin": 10_000, "optim.bin": 5_000})


def test_marker_that_lies_about_files_is_not_committed(tmp_path):
    w = checkpoint.CheckpointWriter(tmp_path, 1)
    w.write_bytes("a.bin", b"x" * 10)
    w.commit()
    w = checkpoint.CheckpointWriter(tmp_path, 2)
    w.write_bytes("a.bin", b"y" * 10)
    w.commit()
    (checkpoint.step_dir(tmp_path, 2) / "a.bin").write_bytes(b"short")  # truncated after the commit
    assert checkpoint.latest_committed(tmp_path).step == 1
    marker = checkpoint.step_dir(tmp_path, 1) / checkpoint.MARKER
    marker.write_text(json.dumps({"step": 7, "files": {}}))  # a marker for another step
    assert checkpoint.latest_committed(tmp_path) is None
    assert checkpoint.latest_committed(tmp_path / "missing") is None


def test_resaving_a_step_uncommits_it_first(tmp_path):
    w = checkpoint.CheckpointWriter(tmp_path, 3)
    w.write_bytes("a.bin", b"x")
    w.commit()
    checkpoint.CheckpointWriter(tmp_path, 3)  # a new save of the same step has begun
    assert checkpoint.latest_committed(tmp_path) is None


def test_bad_names_refused(tmp_path):
    w = checkpoint.CheckpointWriter(tmp_path, 1)
    for name in ("../x", "COMMITTED", ".hidden", ""):
        with pytest.raises(checkpoint.CheckpointError), w.open(name):
            pass
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.step_dir(tmp_path, -1)
