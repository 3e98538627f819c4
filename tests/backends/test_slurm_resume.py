"""Issue 26: a run stopped with exit 75 ("stopped cleanly, requeue me") resumes when its controller
is started again, as deploy/slurm/runwarden.sbatch's requeue starts it: the real `controller run
--exit-when-done` with backend = "slurm", a real 2-node Slurm cluster on loopback, real etcd, node
agents srun started, a real gloo training run (examples/train.py).

The first controller is stopped the way the batch template's time-limit trap does it (`controllerctl
stop RUN`): a commit, exit 75, the allocation given back, and the stop key left in etcd. The second
`controller run --exit-when-done` (the requeued job) clears that stop, allocates again, resumes from
the stop's commit without blaming anyone, trains to the end and exits 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from runwarden.v1 import events_pb2
from testbed.etcd_server import EtcdServer
from testbed.fleet_cluster import ClusterSpec
from tests.backends.slurm_cluster import SlurmCluster
from tests.backends.test_slurm_controller import _SlurmRun, etcd_module  # noqa: F401 (a fixture)

E = events_pb2
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(420)]
SLURM_NODES = 2


def test_a_run_stopped_with_exit_75_resumes_from_its_commit_when_started_again(
    slurm_cluster_module: SlurmCluster,
    etcd_module: EtcdServer,  # noqa: F811 (the imported fixture)
    tmp_path: Path,
    free_port: int,
) -> None:
    spec = ClusterSpec(
        warm_workers=False,
        run="slurmresume",
        active=2,
        spares=0,
        steps=300,
        ckpt_every=20,
        step_sleep=0.05,
        policy={"hang_timeout_floor_s": 60.0},
    )
    run = _SlurmRun(slurm_cluster_module, etcd_module, tmp_path, free_port, spec)
    try:
        run.start()
        first = run.wait_for(E.EVENT_KIND_CHECKPOINT_COMMIT, 150)
        # what runwarden.sbatch's USR1 trap runs in controller mode
        asked = run.ctl("stop", spec.run, "--reason", "slurm time limit (USR1)")
        assert asked.returncode == 0, asked.stderr
        assert run.wait_exit(120) == 75, run.tail()
        events = run.events()
        stop_commit = max(e.step for e in events if e.kind == E.EVENT_KIND_CHECKPOINT_COMMIT)
        assert first.step <= stop_commit < spec.steps, "the run ended before the stop"
        assert [e.run_detail.outcome for e in events if e.kind == E.EVENT_KIND_RUN_END] == ["stopped"]
        ended_at = events[-1].seq

        run.start()  # the requeued job's `controller run --exit-when-done`
        relaunch = run.wait_for(E.EVENT_KIND_LAUNCH, 150, after_seq=ended_at)
        assert relaunch.launch.resume_step == stop_commit
        assert run.wait_exit(240) == 0, run.tail()
        log = run.log.read_text()
        assert "cleared the stop that ended it (requested by" in log, log[-3000:]
        after = [e for e in run.events() if e.seq > ended_at]
        # The stopped attempt's nodes left with the allocation: the new core's reconcile relaunches
        # without them, as a control-plane fault (no budget, nobody blamed), not a node's fault.
        detections = [e.message for e in after if e.kind == E.EVENT_KIND_DETECTION]
        assert all("nothing quarantined" in m for m in detections), detections
        assert not [e.message for e in after if e.kind == E.EVENT_KIND_ATTRIBUTION]
        restarts = [e.message for e in after if e.kind == E.EVENT_KIND_RESTART]
        assert restarts and all("without consuming the restart budget" in m for m in restarts), restarts
        # A quarantine here can only be a preflight's: this shared host's kernel log carries the Xids
        # other tests inject, which the quick preflight reads; nothing is quarantined for the stop.
        quarantined = [e.message for e in after if e.kind == E.EVENT_KIND_QUARANTINE]
        assert all("preflight" in m for m in quarantined), quarantined
        assert any(e.kind == E.EVENT_KIND_CHECKPOINT_COMMIT and e.step == spec.steps for e in after)
        assert [e.run_detail.outcome for e in after if e.kind == E.EVENT_KIND_RUN_END] == ["completed"]
        run.assert_nothing_left()
    finally:
        run.close()
