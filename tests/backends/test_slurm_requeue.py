"""Issue 26: exit 75 (controller/backends/base.py's "stopped cleanly, requeue me") is honoured by the
shipped batch template. deploy/slurm/runwarden.sbatch with RUNWARDEN_MODE=controller on a real 4-node
Slurm cluster on loopback; the controller and controllerctl are stand-ins (shell scripts on PATH) that
keep the real one's exit code contract: the real `controller run --exit-when-done` needs etcd and
agents, and its resume after the requeue is tests/live/test_resume_after_stop.py's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.backends.slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "runwarden.sbatch"

# Stands in for `controller run --exit-when-done`: records each start with its restart count; the first
# start supervises until the run is asked to stop (controllerctl's mark), then exits 75 (stopped,
# requeue me); a requeued start exits with $SECOND_RC (0: completed). $FIRST_RC set: the first start
# exits with it at once.
CONTROLLER = """#!/bin/bash
echo "start ${SLURM_RESTART_COUNT:-0} $*" >> "$DIR/starts"
if [[ ${SLURM_RESTART_COUNT:-0} == 0 ]]; then
  [[ -n ${FIRST_RC:-} ]] && exit "$FIRST_RC"
  while [[ ! -e $DIR/stop-asked ]]; do sleep 0.1; done
  exit 75
fi
exit "${SECOND_RC:-0}"
"""
CONTROLLERCTL = """#!/bin/bash
echo "$*" >> "$DIR/ctl-calls"
touch "$DIR/stop-asked"
"""


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def submit(cluster: SlurmCluster, tmp_path: Path, **env: str) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("controller", CONTROLLER), ("controllerctl", CONTROLLERCTL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    exports = {
        "RUNWARDEN_MODE": "controller",
        "RUNWARDEN_RUN": "llm",
        "RUNWARDEN_CONTROLLER": "127.0.0.1:50050",
        "DIR": str(tmp_path),
        "PATH": f"{bin_dir}:/usr/bin:/bin:/usr/sbin:/sbin",
        **env,
    }
    out = cluster.cmd(
        "sbatch",
        "--parsable",
        "--nodes=1",
        f"--output={tmp_path}/batch-%j.out",
        "--export=" + ",".join(["ALL", *(f"{k}={v}" for k, v in exports.items())]),
        str(TEMPLATE),
        "controller",
        "run",
        "--config",
        "c.toml",
        "--exit-when-done",
    )
    return out.strip().split(";")[0]


def test_the_time_limit_stops_the_run_and_exit_75_requeues_the_controller(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    job = submit(slurm_cluster, tmp_path)
    try:
        wait_for(lambda: lines(tmp_path / "starts"), 30, "the controller to start")
        # What Slurm does 300 s before the time limit (--signal=B:USR1@300), sent now.
        slurm_cluster.cmd("scancel", "--signal=USR1", "--batch", job)
        starts = wait_for(lambda: len(s := lines(tmp_path / "starts")) == 2 and s, 60, "the requeued start")
        assert starts == [
            "start 0 run --config c.toml --exit-when-done",
            "start 1 run --config c.toml --exit-when-done",
        ]
        assert lines(tmp_path / "ctl-calls") == [
            "--controller 127.0.0.1:50050 stop llm --reason slurm time limit (USR1)"
        ]
        done = slurm_cluster.wait_job(job, {"COMPLETED", "FAILED"}, timeout_s=60)
        assert done["JobState"] == "COMPLETED" and done["ExitCode"] == "0:0" and done["Restarts"] == "1", done
        log = (tmp_path / f"batch-{job}.out").read_text()
        assert "the controller exited with 75 (stop requested: 1)" in log and "requeueing" in log, log
    finally:
        slurm_cluster.cmd("scancel", job)


@pytest.mark.parametrize("rc", ["3", "0"], ids=["failed-do-not-requeue", "completed"])
def test_exit_3_or_0_ends_the_job_without_a_requeue(
    slurm_cluster: SlurmCluster, tmp_path: Path, rc: str
) -> None:
    job = submit(slurm_cluster, tmp_path, FIRST_RC=rc)
    try:
        done = slurm_cluster.wait_job(job, {"COMPLETED", "FAILED"}, timeout_s=60)
        assert done["ExitCode"] == f"{rc}:0" and done["Restarts"] == "0", done
        assert lines(tmp_path / "starts") == ["start 0 run --config c.toml --exit-when-done"]
        assert not lines(tmp_path / "ctl-calls")
    finally:
        slurm_cluster.cmd("scancel", job)


def test_controller_mode_without_the_controller_address_refuses_to_start(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    job = submit(slurm_cluster, tmp_path, RUNWARDEN_CONTROLLER="")
    try:
        done = slurm_cluster.wait_job(job, {"COMPLETED", "FAILED"}, timeout_s=60)
        assert done["ExitCode"] == "2:0" and not lines(tmp_path / "starts"), done
    finally:
        slurm_cluster.cmd("scancel", job)
