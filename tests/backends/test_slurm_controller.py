"""`controller run` with `[controller] backend = "slurm"` against a real 4-node Slurm cluster on
loopback and a real etcd: the leader allocates 2 + 1 nodes through SlurmScheduler, the agents srun
started in the allocation register under the Slurm node names, the supervisor launches a real
2-node gloo training run (examples/train.py) through them; a node dies (slurmd, its steps, its
agent and rank SIGKILLed), the supervisor blames it, drains it in Slurm with runwarden's reason and
relaunches on the spare from the last commit; when training completes the controller gives the
allocation back and exits 0 (`--exit-when-done`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from runwarden.eventlog import read_events
from runwarden.testing.etcd_server import EtcdServer
from runwarden.testing.fleet_cluster import (
    REPO,
    ClusterSpec,
    agent_settings,
    controller_settings,
    preflight_settings,
    program,
    wait_for_event,
    write_toml,
)
from runwarden.v1 import events_pb2
from tests.backends.slurm_cluster import SlurmCluster

E = events_pb2
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(240)]


def _agent_pids(mark: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if mark.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def test_controller_run_on_slurm_replaces_a_dead_node_drains_it_and_gives_the_allocation_back(
    slurm_cluster_module: SlurmCluster, tmp_path: Path, free_port: int
) -> None:
    cluster = slurm_cluster_module
    etcd = EtcdServer(tmp_path / "etcd", fast=True).start()
    spec = ClusterSpec(
        run="slurmrun",
        active=2,
        spares=1,
        steps=100,
        ckpt_every=10,
        step_sleep=0.05,
        # A rank that finished its last step may take a while to exit on 2 loaded cores: no hang.
        policy={"hang_timeout_floor_s": 60.0},
    )
    run_dir, ckpt, losses = (tmp_path / d for d in ("controller", "ckpt", "losses"))
    # Short: an agent's flight-recorder sockets live under <dir>/<node>/runs/<run>/attempt-N/fr/.
    agents_dir = Path(tempfile.mkdtemp(prefix="rw-agents-", dir="/tmp"))
    for d in (run_dir, ckpt, losses):
        d.mkdir()
    write_toml(tmp_path / "preflight.toml", preflight_settings(ckpt))
    agent = agent_settings(
        "unused",
        spec,
        listen="127.0.0.1:0",  # every slurmd (so every agent) is on 127.0.0.1: a free port each
        state_dir=tmp_path,
        etcd_endpoints=[etcd.endpoint],
        preflight_config=tmp_path / "preflight.toml",
    )
    for key in ("node", "unix_socket", "run_dir"):  # agents.sbatch gives each node its own
        del agent[key]
    write_toml(tmp_path / "nodeagent.toml", {"": agent})
    settings = controller_settings(
        spec,
        store={"endpoints": [etcd.endpoint]},
        run_dir=run_dir,
        ckpt_dir=ckpt,
        loss_dir=losses,
        api_address=f"127.0.0.1:{free_port}",
        metrics_address="",
    )
    settings["controller"].update(backend="slurm", spares=spec.spares)
    settings["slurm"] = {
        "agent_config": str(tmp_path / "nodeagent.toml"),
        "agent_run_dir": str(agents_dir),
        "nodeagent": program("nodeagent"),
        "output": str(tmp_path / "%x-%j.out"),
        "slurm_conf": str(cluster.conf),
        "allocate_timeout_s": 60,
    }
    write_toml(tmp_path / "controller.toml", settings)
    log = tmp_path / "controller.log"
    victim = ""
    controller: subprocess.Popen[bytes] | None = None
    try:
        t0 = time.monotonic()
        with log.open("ab") as out:
            controller = subprocess.Popen(
                [
                    *program("controller"),
                    "run",
                    "--config",
                    str(tmp_path / "controller.toml"),
                    "--exit-when-done",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,
            )
        first = wait_for_event(run_dir / "events.jsonl", E.EVENT_KIND_CHECKPOINT_COMMIT, 0, 90)
        assert first is not None, log.read_text()[-4000:]
        launch = next(
            e for e in read_events(run_dir / "events.jsonl").events if e.kind == E.EVENT_KIND_LAUNCH
        )
        victim = launch.launch.nodes[1]
        cluster.kill_node(victim)  # the host dies: slurmd, its slurmstepd, the agent and the rank
        killed_at = time.monotonic()
        rc = controller.wait(timeout=150)
        elapsed = time.monotonic() - t0
        print(
            f"controller run on Slurm: exit {rc} after {elapsed:.1f}s ({time.monotonic() - killed_at:.1f}s after the kill)"
        )
        assert rc == 0, log.read_text()[-4000:]
        events = read_events(run_dir / "events.jsonl").events
        launches = [e for e in events if e.kind == E.EVENT_KIND_LAUNCH]
        assert launches, log.read_text()[-4000:]
        # The ranks ran on Slurm's nodes, through the agents srun started there.
        allocated = set(launches[0].launch.nodes)
        assert len(allocated) == 2 and allocated <= set(cluster.node_names)
        # The dead node was blamed and kept out in Slurm (a drain with runwarden's reason); the
        # relaunch took the allocation's spare and resumed from the last commit before it.
        relaunch = launches[-1]
        assert len(launches) >= 2 and victim not in relaunch.launch.nodes, [e.launch.nodes for e in launches]
        assert any(e.kind == E.EVENT_KIND_QUARANTINE and e.quarantine.node == victim for e in events)
        state, reason = cluster.node_states()[victim]
        assert "drain" in state and reason.startswith("runwarden:"), (state, reason)
        commits = [
            e.step for e in events if e.kind == E.EVENT_KIND_CHECKPOINT_COMMIT and e.seq < relaunch.seq
        ]
        assert relaunch.launch.resume_step == max(commits)
        assert any(e.kind == E.EVENT_KIND_RUN_END for e in events)
        # The allocation was the run's job, and finish gave it back: no job, no agent left.
        batch_logs = sorted(tmp_path.glob("runwarden-slurmrun-*.out"))
        assert len(batch_logs) == 1, batch_logs  # one allocation, adopted by nobody else
        left = cluster.cmd("squeue", "--noheader", "--name=runwarden-slurmrun,runwarden-slurmrun-more")
        assert left.strip() == "", left
        deadline = time.monotonic() + 15
        while _agent_pids(str(agents_dir)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _agent_pids(str(agents_dir)) == []
        assert "flight recording not started" not in batch_logs[0].read_text()
    finally:
        if controller is not None and controller.poll() is None:
            controller.kill()
            controller.wait()
        jobs = cluster.cmd("squeue", "--noheader", "--format=%i").split()
        if jobs:
            cluster.cmd("scancel", *jobs)
        etcd.kill()
        shutil.rmtree(agents_dir, ignore_errors=True)
        if victim:  # the module's cluster as it was: the node back, runwarden's drain undone
            cluster.start_node(victim)
            deadline = time.monotonic() + 30
            while "drain" not in cluster.node_states()[victim][0] and time.monotonic() < deadline:
                time.sleep(0.3)  # until slurmd re-registers: RESUME before that is refused
            with contextlib.suppress(RuntimeError):
                cluster.cmd("scontrol", "update", f"NodeName={victim}", "State=RESUME")
            cluster.wait_states({victim: "idle"}, timeout_s=30)
