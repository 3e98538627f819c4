"""`controller run` with `[controller] backend = "slurm"` against a real 4-node Slurm cluster on
loopback and a real etcd: the leader allocates 2 + 1 nodes through SlurmScheduler, the agents srun
started in the allocation register under the Slurm node names, the supervisor launches a real
2-node gloo training run (examples/train.py) through them; a node dies (slurmd, its steps, its
agent and rank SIGKILLed), the supervisor blames it, drains it in Slurm with runwarden's reason and
relaunches on the spare from the last commit; when training completes the controller gives the
allocation back and exits 0 (`--exit-when-done`).

The module's other runs share the cluster and one etcd (each run under its own etcd root): with no
spare a dead node is replaced from the queue (`<job_name>-more`); Slurm's time-limit notice
(SIGUSR1 to the steps) is a planned stop at a commit and a resume on the queue's nodes; a crash
loop exits 3 (do not requeue) with a page, leaving no job and no agent."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
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
    start_controller,
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
        controller = start_controller(tmp_path / "controller.toml", log, "--exit-when-done")
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


# ---- the run's scheduler-side faults: a replacement from the queue, the time-limit notice, a crash loop


@pytest.fixture(scope="module")
def etcd_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for the module's runs: each run keeps its keys under its own root (/rw-<run>)."""
    etcd = EtcdServer(tmp_path_factory.mktemp("etcd"), fast=True).start()
    try:
        yield etcd
    finally:
        etcd.kill()


class _SlurmRun:
    """One `controller run --exit-when-done` with backend = "slurm" on the module's cluster: its
    config under `tmp_path`, its agents' run dirs under a short /tmp path, its keys under /rw-<run>."""

    def __init__(
        self,
        cluster: SlurmCluster,
        etcd: EtcdServer,
        tmp_path: Path,
        api_port: int,
        spec: ClusterSpec,
        *,
        command: list[str] | None = None,
        paging: dict[str, object] | None = None,
    ) -> None:
        self.cluster, self.tmp, self.spec = cluster, tmp_path, spec
        self.job_name = f"runwarden-{spec.run}"
        self.run_dir, self.ckpt, losses = (tmp_path / d for d in ("controller", "ckpt", "losses"))
        self.agents_dir = Path(tempfile.mkdtemp(prefix="rw-agents-", dir="/tmp"))
        self.log = tmp_path / "controller.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.dead: list[str] = []  # nodes killed: started again and resumed by close()
        for d in (self.run_dir, self.ckpt, losses):
            d.mkdir()
        root = f"/rw-{spec.run}"
        write_toml(tmp_path / "preflight.toml", preflight_settings(self.ckpt))
        agent = agent_settings(
            "unused",
            spec,
            listen="127.0.0.1:0",
            state_dir=tmp_path,
            etcd_endpoints=[etcd.endpoint],
            preflight_config=tmp_path / "preflight.toml",
        )
        for key in ("node", "unix_socket", "run_dir"):  # agents.sbatch gives each node its own
            del agent[key]
        agent["etcd_root"] = root
        write_toml(tmp_path / "nodeagent.toml", {"": agent})
        settings = controller_settings(
            spec,
            store={"endpoints": [etcd.endpoint], "root": root},
            run_dir=self.run_dir,
            ckpt_dir=self.ckpt,
            loss_dir=losses,
            api_address=f"127.0.0.1:{api_port}",
            metrics_address="",
        )
        settings["controller"].update(backend="slurm", spares=spec.spares)
        if command is not None:
            settings["controller"]["command"] = command
        if paging is not None:
            settings["paging"] = paging
        settings["slurm"] = {
            "agent_config": str(tmp_path / "nodeagent.toml"),
            "agent_run_dir": str(self.agents_dir),
            "nodeagent": program("nodeagent"),
            "output": str(tmp_path / "%x-%j.out"),
            "slurm_conf": str(cluster.conf),
            "allocate_timeout_s": 60,
        }
        write_toml(tmp_path / "controller.toml", settings)

    def start(self) -> _SlurmRun:
        self.proc = start_controller(self.tmp / "controller.toml", self.log, "--exit-when-done")
        return self

    @property
    def event_log(self) -> Path:
        return self.run_dir / "events.jsonl"

    def events(self) -> list[events_pb2.Event]:
        return list(read_events(self.event_log).events)

    def tail(self) -> str:
        return self.log.read_text()[-4000:]

    def wait_for(
        self,
        kind: int,
        timeout_s: float,
        pred: Callable[[events_pb2.Event], bool] | None = None,
        after_seq: int = 0,
    ) -> events_pb2.Event:
        ev = wait_for_event(self.event_log, kind, after_seq, timeout_s, pred)
        assert ev is not None, (f"no event of kind {kind}", self.tail())
        return ev

    def wait_exit(self, timeout_s: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout_s)

    def job_ids(self, name: str) -> list[str]:
        return self.cluster.cmd("squeue", "--noheader", "--format=%i", f"--name={name}").split()

    def assert_nothing_left(self) -> None:
        """finish gave every job back (no job of the run in squeue) and every agent left."""
        left = self.cluster.cmd("squeue", "--noheader", f"--name={self.job_name},{self.job_name}-more")
        assert left.strip() == "", left
        deadline = time.monotonic() + 15
        while _agent_pids(str(self.agents_dir)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _agent_pids(str(self.agents_dir)) == []

    def close(self) -> None:
        """The module's cluster as it was: no job, the killed nodes back, runwarden's drains undone."""
        cluster = self.cluster
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        jobs = cluster.cmd("squeue", "--noheader", "--format=%i").split()
        if jobs:
            cluster.cmd("scancel", *jobs)
        shutil.rmtree(self.agents_dir, ignore_errors=True)
        for node in self.dead:
            cluster.start_node(node)
            deadline = time.monotonic() + 30
            while cluster.node_states()[node][0].startswith("down") and time.monotonic() < deadline:
                time.sleep(0.3)  # until slurmd re-registers: RESUME before that is refused
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            states = cluster.node_states()
            for node, (state, reason) in states.items():
                if "drain" in state and reason.startswith("runwarden:"):
                    with contextlib.suppress(RuntimeError):
                        cluster.cmd("scontrol", "update", f"NodeName={node}", "State=RESUME")
            if all(s == "idle" for s, _ in states.values()):
                return
            time.sleep(0.3)
        raise AssertionError(f"the cluster is not idle again: {cluster.node_states()}")


def test_slurm_run_without_spares_replaces_a_dead_node_from_the_queue(
    slurm_cluster_module: SlurmCluster, etcd_module: EtcdServer, tmp_path: Path, free_port: int
) -> None:
    """2 nodes, no spare: a node dies, the core asks the queue (ALLOCATE), SlurmScheduler submits
    <job>-more, its agent registers, and the run relaunches on it from the last commit."""
    spec = ClusterSpec(
        run="slurmq",
        active=2,
        spares=0,
        steps=50,
        ckpt_every=10,
        step_sleep=0.05,
        policy={"hang_timeout_floor_s": 60.0},
    )
    run = _SlurmRun(slurm_cluster_module, etcd_module, tmp_path, free_port, spec)
    try:
        t0 = time.monotonic()
        run.start()
        run.wait_for(E.EVENT_KIND_CHECKPOINT_COMMIT, 90)
        launch = next(e for e in run.events() if e.kind == E.EVENT_KIND_LAUNCH)
        victim = launch.launch.nodes[1]
        run.dead.append(victim)
        slurm_cluster_module.kill_node(victim)
        killed_at = time.monotonic()
        taken = run.wait_for(E.EVENT_KIND_SPARE_TAKEN, 60, lambda e: e.spare.replaces == victim)
        joined_at = time.monotonic()
        rc = run.wait_exit(90)
        print(
            f"slurm queue replacement: exit {rc} after {time.monotonic() - t0:.1f}s; the queue's node"
            f" took the slot {joined_at - killed_at:.1f}s after the kill"
        )
        assert rc == 0, run.tail()
        events = run.events()
        # The core asked the queue once the dead node left it short, and Slurm ran the ask as
        # the run's second job (<job_name>-more), whose agent took the dead node's slot.
        asks = [e for e in events if e.kind == E.EVENT_KIND_ALLOCATE]
        assert asks and all(e.seq < taken.seq for e in asks), [e.message for e in asks]
        assert taken.spare.source == "queue", taken
        assert any(e.kind == E.EVENT_KIND_QUARANTINE and e.quarantine.node == victim for e in events)
        more_logs = sorted(tmp_path.glob(f"{run.job_name}-more-*.out"))
        assert len(more_logs) == 1, more_logs
        assert taken.spare.node not in launch.launch.nodes and taken.spare.node != victim
        relaunch = next(e for e in events if e.kind == E.EVENT_KIND_LAUNCH and e.seq > taken.seq)
        assert taken.spare.node in relaunch.launch.nodes and victim not in relaunch.launch.nodes
        commits = [
            e.step for e in events if e.kind == E.EVENT_KIND_CHECKPOINT_COMMIT and e.seq < relaunch.seq
        ]
        assert relaunch.launch.resume_step == max(commits)
        # ... and trained on it to the end.
        assert any(e.kind == E.EVENT_KIND_CHECKPOINT_COMMIT and e.step == spec.steps for e in events)
        end = [e for e in events if e.kind == E.EVENT_KIND_RUN_END]
        assert end and end[-1].run_detail.outcome == "completed", end
        run.assert_nothing_left()
    finally:
        run.close()


def test_slurm_time_limit_notice_stops_cleanly_at_a_commit_and_resumes_on_nodes_from_the_queue(
    slurm_cluster_module: SlurmCluster, etcd_module: EtcdServer, tmp_path: Path, free_port: int
) -> None:
    """Slurm's time-limit notice (`scancel --signal=USR1`, what --signal=USR1@N sends the steps):
    every agent of the allocation drains, the attempt ends in a planned stop (a commit, every rank
    exits 0, nothing detected or quarantined), and the run resumes from that commit on the nodes
    the queue brings (the drained ones take no placement)."""
    spec = ClusterSpec(
        run="slurmsig",
        active=2,
        spares=0,
        steps=80,
        ckpt_every=1000,
        step_sleep=0.05,
        policy={"hang_timeout_floor_s": 60.0},
    )
    run = _SlurmRun(slurm_cluster_module, etcd_module, tmp_path, free_port, spec)
    try:
        t0 = time.monotonic()
        run.start()
        first = run.wait_for(E.EVENT_KIND_FIRST_STEP, 90)
        launch = next(e for e in run.events() if e.kind == E.EVENT_KIND_LAUNCH)
        (job,) = run.job_ids(run.job_name)
        # ckpt_every is past the end: the stop's commit is the attempt's only one.
        signalled = time.time()
        slurm_cluster_module.cmd("scancel", "--signal=USR1", job)
        commit = run.wait_for(E.EVENT_KIND_CHECKPOINT_COMMIT, 60, after_seq=first.seq)
        assert commit.step < spec.steps, "the run ended before the notice: nothing was stopped"
        committed_in = commit.ts - signalled
        ended = run.wait_for(
            E.EVENT_KIND_EXIT, 60, lambda e: e.attempt == launch.attempt and not e.exit.node, first.seq
        )
        stopped_in = ended.ts - signalled
        relaunch = run.wait_for(E.EVENT_KIND_LAUNCH, 90, after_seq=ended.seq)
        rc = run.wait_exit(90)
        print(
            f"slurm time-limit notice: committed step {commit.step} {committed_in:.2f}s after USR1, the"
            f" attempt stopped {stopped_in:.2f}s after it; resumed on {list(relaunch.launch.nodes)};"
            f" exit {rc} after {time.monotonic() - t0:.1f}s"
        )
        assert rc == 0, run.tail()
        events = run.events()
        # Both agents said DRAINING (the core logs each as a stop request, not a failure) ...
        drains = [e for e in events if e.kind == E.EVENT_KIND_STOP_REQUEST and "SIGUSR1" in e.message]
        assert {n for n in launch.launch.nodes if any(n in e.message for e in drains)} == set(
            launch.launch.nodes
        )
        # ... the attempt's end was planned: every rank exited 0 after the commit, nothing blamed.
        exits = [e for e in events if e.kind == E.EVENT_KIND_EXIT and e.attempt == launch.attempt]
        assert ended.exit.classification == "planned_stop", [e.message for e in exits]
        assert all(e.exit.status.exit_code == 0 for e in exits if e.exit.node), [e.message for e in exits]
        for kind in (E.EVENT_KIND_DETECTION, E.EVENT_KIND_QUARANTINE, E.EVENT_KIND_ATTRIBUTION):
            assert not [e.message for e in events if e.kind == kind], kind
        states = slurm_cluster_module.node_states()
        assert not [n for n, (s, _) in states.items() if "drain" in s], states
        # The drained nodes were out; the queue's two took their ranks, from the stop's commit.
        assert not set(relaunch.launch.nodes) & set(launch.launch.nodes), relaunch.launch.nodes
        taken = [e for e in events if e.kind == E.EVENT_KIND_SPARE_TAKEN]
        assert {e.spare.node for e in taken} == set(relaunch.launch.nodes) and all(
            e.spare.source == "queue" for e in taken
        ), [e.message for e in taken]
        assert relaunch.launch.resume_step == commit.step
        end = [e for e in events if e.kind == E.EVENT_KIND_RUN_END]
        assert end and end[-1].run_detail.outcome == "completed", end
        assert len(sorted(tmp_path.glob(f"{run.job_name}-more-*.out"))) == 1
        run.assert_nothing_left()
    finally:
        run.close()


def test_slurm_crash_loop_exits_3_pages_and_gives_everything_back(
    slurm_cluster_module: SlurmCluster, etcd_module: EtcdServer, tmp_path: Path, free_port: int
) -> None:
    """A trainer bug (every rank exits 1 at step 3, every attempt): no node is to blame, the second
    identical failure is a crash loop, the controller pages (the PAGE event and the [paging]
    command) and `--exit-when-done` exits 3 (do not requeue) after finish cancelled the jobs."""
    spec = ClusterSpec(
        run="slurmloop", active=2, spares=0, steps=50, policy={"crash_loop_count": 2, "backoff_base_s": 0.2}
    )
    pages = tmp_path / "pages.txt"
    pager = tmp_path / "pager.sh"
    pager.write_text(f'#!/bin/bash\necho "$1" >> {pages}\n')
    pager.chmod(0o755)
    command = [str(REPO / "tests" / "backends" / "crash_trainer.py"), "--fail-at", "3"]
    run = _SlurmRun(
        slurm_cluster_module,
        etcd_module,
        tmp_path,
        free_port,
        spec,
        command=command,
        paging={"command": [str(pager)]},
    )
    try:
        t0 = time.monotonic()
        run.start()
        rc = run.wait_exit(120)
        print(f"slurm crash loop: exit {rc} after {time.monotonic() - t0:.1f}s")
        assert rc == 3, run.tail()
        events = run.events()
        launches = [e for e in events if e.kind == E.EVENT_KIND_LAUNCH]
        assert len(launches) == 2, [e.message for e in launches]
        page = [e for e in events if e.kind == E.EVENT_KIND_PAGE]
        assert len(page) == 1 and "crash loop" in page[0].page.reason, [e.message for e in page]
        end = [e for e in events if e.kind == E.EVENT_KIND_RUN_END]
        assert len(end) == 1 and end[0].run_detail.outcome == "crash_loop", end
        assert not [e for e in events if e.kind == E.EVENT_KIND_QUARANTINE]
        assert "crash loop" in pages.read_text()
        run.assert_nothing_left()
    finally:
        run.close()
