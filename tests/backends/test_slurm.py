"""deploy/slurm/ (the standalone batch template and the prolog) against a real 4-node Slurm cluster
on loopback. The scheduler the controller uses (SlurmScheduler, deploy/slurm/agents.sbatch) is
tested in test_slurm_scheduler.py."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from controller.backends.slurm import SlurmConfig, SlurmScheduler
from tests.backends.slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TRAINER = HERE / "trainer.py"
VENV_BIN = Path(sys.executable).parent
TORCHRUN = str(VENV_BIN / "torchrun")
SBATCH_TEMPLATE = REPO / "deploy" / "slurm" / "runwarden.sbatch"


def trainer_events(ckpt: Path) -> list[dict]:
    path = ckpt / "trainer.log"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def submit_template(cluster: SlurmCluster, tmp_path: Path, run: str, ckpt: Path, port: int) -> str:
    env_args = ",".join(
        [
            "ALL",
            f"RUNWARDEN_RUN={run}",
            f"RUNWARDEN_CHECKPOINT_DIR={ckpt}",
            f"RUNWARDEN_TORCHRUN={TORCHRUN}",
            f"RUNWARDEN_RDZV_PORT={port}",
        ]
    )
    out = cluster.cmd(
        "sbatch",
        "--parsable",
        "--nodes=2",
        "--exclusive",
        f"--output={tmp_path}/batch-%j.out",
        f"--export={env_args}",
        str(SBATCH_TEMPLATE),
        sys.executable,
        str(TRAINER),
    )
    return out.strip().split(";")[0]


def test_time_limit_signal_stops_cleanly_then_requeued_run_resumes(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    job = submit_template(slurm_cluster, tmp_path, "tl", ckpt, 29000 + os.getpid() % 20000 + 300)
    try:
        wait_for(lambda: any(e["event"] == "committed" for e in trainer_events(ckpt)), 60, "a first commit")
        # What Slurm does 300 s before the time limit (--signal=B:USR1@300), sent now.
        slurm_cluster.cmd("scancel", "--signal=USR1", "--batch", job)
        stops = wait_for(
            lambda: len(s := [e for e in trainer_events(ckpt) if e["event"] == "stopped"]) == 2 and s,
            60,
            "both ranks to stop",
        )
        stop_step = stops[0]["step"]
        assert {e["step"] for e in stops} == {stop_step}
        assert (ckpt / f"step-{stop_step}" / "COMMITTED").exists()
        # The requeued run: restart count 1 in the rendezvous id, resumes from the stop's commit.
        restarted = wait_for(
            lambda: (
                len(s := [e for e in trainer_events(ckpt) if e["event"] == "started" and e["rdzv"] == "tl-1"])
                == 2
                and s
            ),
            60,
            "the requeued run to start",
        )
        assert {e["restart_count"] for e in restarted} == {"1"}
        assert {e["resume_from"] for e in restarted} == {stop_step}
        batch_log = (tmp_path / f"batch-{job}.out").read_text()
        assert "ranks exited with 0 (stop requested: 1)" in batch_log, batch_log[-2000:]
        assert "requeueing" in batch_log
        # A planned stop quarantines nothing.
        assert not [n for n, (state, _) in slurm_cluster.node_states().items() if "drain" in state]
    finally:
        slurm_cluster.cmd("scancel", job)


def test_requeue_gives_the_next_attempt_a_new_rendezvous_id(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    job = submit_template(slurm_cluster, tmp_path, "rq", ckpt, 29000 + os.getpid() % 20000 + 400)
    try:
        first = wait_for(
            lambda: len(s := [e for e in trainer_events(ckpt) if e["event"] == "started"]) == 2 and s,
            60,
            "start",
        )
        assert {e["rdzv"] for e in first} == {"rq-0"} and {e["restart_count"] for e in first} == {""}
        wait_for(lambda: any(e["event"] == "committed" for e in trainer_events(ckpt)), 60, "a first commit")
        slurm_cluster.cmd("scontrol", "requeue", job)  # what a node failure or an admin does
        again = wait_for(
            lambda: (
                len(s := [e for e in trainer_events(ckpt) if e["event"] == "started" and e["rdzv"] == "rq-1"])
                == 2
                and s
            ),
            60,
            "the requeued attempt",
        )
        assert {e["restart_count"] for e in again} == {"1"}
        committed = [
            e["step"] for e in trainer_events(ckpt) if e["event"] == "committed" and e["t"] < again[0]["t"]
        ]
        assert {e["resume_from"] for e in again} == {max(committed)}
        assert slurm_cluster.job_fields(job)["Restarts"] == "1"
    finally:
        slurm_cluster.cmd("scancel", job)


def test_prolog_drains_a_node_whose_preflight_fails(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    (slurm_cluster.root / "preflight-fails").write_text("node3\n")
    bad = slurm_cluster.cmd(
        "sbatch", "--parsable", "--nodelist=node3", "--output=/dev/null", "--wrap=true"
    ).strip()
    good = slurm_cluster.cmd(
        "sbatch", "--parsable", "--nodelist=node1", "--output=/dev/null", "--wrap=true"
    ).strip()
    try:
        states = slurm_cluster.wait_states({"node3": "drained"}, timeout_s=30)
        _state, reason = states["node3"]
        assert reason.startswith("runwarden: preflight FAIL: gpu_matmul FAIL"), reason
        assert slurm_cluster.wait_job(good, {"COMPLETED"})["ExitCode"] == "0:0"
        # The job that met the bad node did not run there: Slurm put it back in the queue.
        assert slurm_cluster.job_fields(bad)["JobState"] in {"PENDING", "REQUEUED"}
        # runwarden drained it, so runwarden may bring it back (after its burn-in).
        scheduler = SlurmScheduler(SlurmConfig(slurm_conf=str(slurm_cluster.conf)))
        (slurm_cluster.root / "preflight-fails").write_text("")
        assert scheduler.release("node3") is True
        assert slurm_cluster.node_states()["node3"][0] != "drained"
    finally:
        slurm_cluster.cmd("scancel", bad, good)


def test_prolog_lets_the_job_start_when_preflight_cannot_run(slurm_cluster: SlurmCluster) -> None:
    (slurm_cluster.root / "preflight-errors").write_text("node2\n")
    job = slurm_cluster.cmd("sbatch", "--parsable", "--nodelist=node2", "--output=/dev/null", "--wrap=true")
    done = slurm_cluster.wait_job(job.strip(), {"COMPLETED", "FAILED", "REQUEUED"}, timeout_s=90)
    assert done["JobState"] == "COMPLETED" and done["ExitCode"] == "0:0", done
    assert "drain" not in slurm_cluster.node_states()["node2"][0]
