"""The Slurm backend and deploy/slurm/ against a real 4-node Slurm cluster on loopback."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from controller.backends.base import AttemptSpec, AttemptState, AttemptStatus, BackendError
from controller.backends.slurm import SlurmBackend, SlurmConfig
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


def make_backend(cluster: SlurmCluster, tmp_path: Path) -> SlurmBackend:
    return SlurmBackend(
        SlurmConfig(
            slurm_conf=str(cluster.conf),
            job_name="rw-test",
            exclusive=False,
            command_timeout_s=20,
            allocate_timeout_s=30,
            rdzv_port=int(os.environ.get("RW_TEST_RDZV_PORT", "0")) or 29000 + os.getpid() % 20000,
            torchrun=(TORCHRUN,),
            log_dir=str(tmp_path),
        )
    )


def trainer_spec(run: str, attempt: int, nodes: tuple[str, ...], ckpt: Path, **env: str) -> AttemptSpec:
    return AttemptSpec(
        run=run,
        attempt=attempt,
        nodes=nodes,
        command=(sys.executable, str(TRAINER)),
        env={"RUNWARDEN_CHECKPOINT_DIR": str(ckpt), "PYTHONPATH": str(REPO), **env},
    )


def wait_finished(backend: SlurmBackend, handle, timeout_s: float) -> AttemptStatus:
    return wait_for(
        lambda: (s := backend.status(handle)).state.finished and s, timeout_s, f"{handle.ref} to finish", 0.3
    )


def test_attempt_runs_on_two_of_four_nodes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    backend = make_backend(slurm_cluster, tmp_path)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    try:
        alloc = backend.allocate(2, 2)
        assert sorted(alloc.nodes) == ["node1", "node2", "node3", "node4"]
        handle = backend.launch(trainer_spec("llm", 0, alloc.nodes[:2], ckpt, TRAINER_STEPS="8"))
        status = wait_finished(backend, handle, 60)
        assert status.state is AttemptState.SUCCEEDED, (status, (tmp_path / "llm-0.log").read_text())
        assert status.exit_code == 0 and status.failed_nodes == ()
        started = [e for e in trainer_events(ckpt) if e["event"] == "started"]
        assert sorted(e["node"] for e in started) == sorted(alloc.nodes[:2])
        assert {e["rdzv"] for e in started} == {"llm-0"}
        assert {e["world"] for e in started} == {2}
        assert (ckpt / "step-5" / "COMMITTED").exists()
    finally:
        backend.close()


def test_node_failure_is_detected_drained_and_replaced_by_a_spare(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    backend = make_backend(slurm_cluster, tmp_path)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    try:
        alloc = backend.allocate(2, 2)
        active, spares = ("node1", "node2"), tuple(n for n in alloc.nodes if n not in ("node1", "node2"))
        first = backend.launch(trainer_spec("llm", 0, active, ckpt))
        wait_for(lambda: any(e["event"] == "committed" for e in trainer_events(ckpt)), 60, "a first commit")

        slurm_cluster.kill_node("node2")  # the host dies: slurmd, slurmstepd and the rank
        t0 = time.monotonic()
        seen = wait_for(
            lambda: (s := backend.status(first)).failed_nodes and s, 40, "node2 reported dead", 0.5
        )
        detected_s = time.monotonic() - t0
        print(f"node failure detected through Slurm after {detected_s:.1f}s: {seen.detail}")
        assert seen.failed_nodes == ("node2",)

        stopped = backend.stop(first, grace_s=3)
        assert stopped.state is AttemptState.STOPPED
        backend.quarantine("node2", "node lost: slurmd not responding at step 12")
        state, reason = slurm_cluster.node_states()["node2"]
        assert "drain" in state and reason.startswith("runwarden: node lost"), (state, reason)
        resume = max(e["step"] for e in trainer_events(ckpt) if e["event"] == "committed")

        second = backend.launch(trainer_spec("llm", 1, ("node1", spares[0]), ckpt))
        wait_for(
            lambda: [e for e in trainer_events(ckpt) if e["event"] == "started" and e["rdzv"] == "llm-1"],
            60,
            "attempt 1 to start",
        )
        (ckpt / "STOP").touch()
        done = wait_finished(backend, second, 60)
        assert done.state is AttemptState.SUCCEEDED, (tmp_path / "llm-1.log").read_text()[-2000:]
        started = [e for e in trainer_events(ckpt) if e["event"] == "started" and e["rdzv"] == "llm-1"]
        assert sorted(e["node"] for e in started) == sorted(["node1", spares[0]])
        assert {e["resume_from"] for e in started} == {resume}
    finally:
        backend.close()


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
        backend = make_backend(slurm_cluster, tmp_path)
        (slurm_cluster.root / "preflight-fails").write_text("")
        assert backend.release("node3") is True
        assert slurm_cluster.node_states()["node3"][0] != "drained"
    finally:
        slurm_cluster.cmd("scancel", bad, good)


def test_release_resumes_only_runwarden_drains(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    backend = make_backend(slurm_cluster, tmp_path)
    slurm_cluster.cmd(
        "scontrol", "update", "NodeName=node4", "State=DRAIN", "Reason=fan replaced, ticket 4711"
    )
    backend.quarantine("node1", "xid 79 (GPU fell off the bus)\nat step 1200")
    backend.quarantine("node4", "straggler")  # must not overwrite the operator's reason
    states = slurm_cluster.wait_states({"node1": "drained", "node4": "drained"})
    assert states["node1"][1] == "runwarden: xid 79 (GPU fell off the bus) at step 1200"
    assert states["node4"][1] == "fan replaced, ticket 4711"

    assert backend.release("node4") is False
    assert backend.release("node1") is True
    states = slurm_cluster.wait_states({"node1": "idle", "node4": "drained"})
    assert states["node4"][1] == "fan replaced, ticket 4711"
    assert backend.release("node2") is True  # not drained: nothing to do


def test_prolog_lets_the_job_start_when_preflight_cannot_run(slurm_cluster: SlurmCluster) -> None:
    (slurm_cluster.root / "preflight-errors").write_text("node2\n")
    job = slurm_cluster.cmd("sbatch", "--parsable", "--nodelist=node2", "--output=/dev/null", "--wrap=true")
    done = slurm_cluster.wait_job(job.strip(), {"COMPLETED", "FAILED", "REQUEUED"}, timeout_s=90)
    assert done["JobState"] == "COMPLETED" and done["ExitCode"] == "0:0", done
    assert "drain" not in slurm_cluster.node_states()["node2"][0]


def test_an_existing_allocation_is_used_and_left_running(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The controller inside a batch job: SlurmConfig(job_id=$SLURM_JOB_ID)."""
    outer = slurm_cluster.cmd(
        "sbatch", "--parsable", "--nodes=3", "--no-kill", "--output=/dev/null", "--wrap=exec sleep 300"
    ).strip()
    backend = SlurmBackend(
        SlurmConfig(
            slurm_conf=str(slurm_cluster.conf), job_id=outer, torchrun=(TORCHRUN,), log_dir=str(tmp_path)
        )
    )
    try:
        alloc = backend.allocate(2, 1)
        assert alloc.id == outer and len(alloc.nodes) == 3
        with pytest.raises(BackendError, match="has 3 nodes, need 3\\+1"):
            backend.allocate(3, 1)
        outside = next(n for n in slurm_cluster.node_names if n not in alloc.nodes)
        with pytest.raises(BackendError, match="not in allocation"):
            backend.launch(trainer_spec("x", 0, (outside,), tmp_path))
        backend.close()
        assert slurm_cluster.job_fields(outer)["JobState"] == "RUNNING"  # not ours to cancel
    finally:
        slurm_cluster.cmd("scancel", outer)
