"""`controller run` with `[controller] backend = "slurm"` against a real Slurm cluster of six nodes
(slurmctld + six slurmds, all on 127.0.0.1: SLURM.md's recipe; Slurm's daemons are what is tested,
so they are not moved into network namespaces) and a real etcd.

The demo's five-fault supervised run, on Slurm: the leader allocates 4 + 2 nodes in one job
through SlurmScheduler, the agents srun started in it register under the Slurm node names, and the
supervisor launches a real 4-node gloo training run (examples/train.py) through them. A rank
crashes, hangs, a node dies (its slurmd, steps, agent and rank SIGKILLed), a rank straggles, a GPU
reports Xid 79: each is detected, blamed on its node, drained in Slurm with runwarden's reason,
replaced by a spare from the allocation (or by the blamed node itself once its burn-in passed)
and resumed from the last commit; rank 0's losses equal an uninterrupted run's. At the stop the
controller gives the allocation back and exits 75 (stopped: requeue).

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
from dataclasses import dataclass
from pathlib import Path

import pytest

from examples.demo import FAULTS, Recovery, recoveries, run_faults
from runwarden.eventlog import LogEntry, read_events
from runwarden.v1 import events_pb2
from testbed.etcd_server import EtcdServer, free_port
from testbed.fleet_cluster import (
    REPO,
    ClusterSpec,
    agent_settings,
    controller_settings,
    controllerctl,
    preflight_settings,
    program,
    start_controller,
    wait_for_event,
    write_toml,
)
from tests.backends.slurm_cluster import SlurmCluster
from tests.e2e.five_faults import (
    assert_losses_equal_an_uninterrupted_run,
    check_event_log_whole,
    check_every_fault_recovered,
    check_resumes_only_from_commits,
)

E = events_pb2
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(240)]
SLURM_NODES = 6  # the five-fault run's shape: 4 active + 2 spares in one allocation


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


# ---- the run's scheduler-side faults: a replacement from the queue, the time-limit notice, a crash loop


@pytest.fixture(scope="module")
def etcd_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for the module's runs: each run keeps its keys under its own root (/rw-<run>)."""
    etcd = EtcdServer(tmp_path_factory.mktemp("etcd"), fast=True).start()
    try:
        yield etcd
    finally:
        etcd.discard()


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
        self.run_dir, self.ckpt, self.loss_dir = (tmp_path / d for d in ("controller", "ckpt", "losses"))
        self.api = f"127.0.0.1:{api_port}"
        self.agents_dir = Path(tempfile.mkdtemp(prefix="rw-agents-", dir="/tmp"))
        self.log = tmp_path / "controller.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.dead: list[str] = []  # nodes killed: started again and resumed by close()
        for d in (self.run_dir, self.ckpt, self.loss_dir):
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
            loss_dir=self.loss_dir,
            api_address=self.api,
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

    def events(self) -> list[LogEntry]:
        return list(read_events(self.event_log).entries)

    def tail(self) -> str:
        return self.log.read_text()[-4000:]

    def wait_for(
        self,
        kind: int,
        timeout_s: float,
        pred: Callable[[LogEntry], bool] | None = None,
        after_seq: int = 0,
    ) -> LogEntry:
        ev = wait_for_event(self.event_log, kind, after_seq, timeout_s, pred)
        assert ev is not None, (f"no event of kind {kind}", self.tail())
        return ev

    def wait_for_event(self, kind: int, after_seq: int, timeout_s: float) -> LogEntry | None:
        return wait_for_event(self.event_log, kind, after_seq, timeout_s)

    def ctl(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return controllerctl(self.api, *args, timeout=timeout)

    def batch_hosts(self) -> set[str]:
        """The hosts of the run's jobs' batch shells (and their srun): Slurm's, not runwarden's."""
        out = self.cluster.cmd(
            "squeue", "--noheader", f"--name={self.job_name},{self.job_name}-more", "--format=%B"
        )
        return {line.strip() for line in out.splitlines() if line.strip()}

    def lose_node(self, node: str) -> None:
        """The host dies: slurmd, its slurmstepd, the agent and the rank (started again by close())."""
        self.dead.append(node)
        self.cluster.kill_node(node)

    def diagnosis(self) -> str:
        """What Slurm, the agents and the controller said: for a run that did not recover."""
        cluster = self.cluster
        parts = [f"--- controller log (tail) ---\n{self.log.read_text()[-6000:]}"]
        for out in sorted(self.tmp.glob(f"{self.job_name}*.out")):
            parts.append(f"--- {out.name} (tail) ---\n{out.read_text(errors='replace')[-3000:]}")
        ctld = cluster.root / "log" / "slurmctld.log"
        if ctld.exists():
            parts.append(f"--- slurmctld.log (tail) ---\n{ctld.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(Exception):
            parts.append(f"--- squeue ---\n{cluster.cmd('squeue', '--noheader', '--format=%i %j %T %N')}")
            parts.append(f"--- sinfo ---\n{cluster.node_states()}")
        for log in sorted(self.agents_dir.glob("*/agent.log")):
            parts.append(
                f"--- {log.parent.name}'s agent.log (tail) ---\n{log.read_text(errors='replace')[-2000:]}"
            )
        parts.append(f"--- agent processes ---\n{_agent_pids(str(self.agents_dir))}")
        return "\n".join(parts)

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


@dataclass
class SlurmFaultedRun:
    run: _SlurmRun
    events: list[LogEntry]
    recoveries: list[Recovery]
    torn_tail: str | None
    log_errors: int
    exit_code: int
    states_at_end: dict[str, tuple[str, str]]  # Slurm's view of every node once the run ended
    jobs_left: str  # squeue's lines for the run's jobs once it ended
    batch_logs: list[Path]
    agent_logs: dict[str, str]  # node -> its agent's log (agents.sbatch: on the node, not through srun)
    agents_left: list[int]


@pytest.fixture(scope="module")
def slurm_faulted(
    slurm_cluster_module: SlurmCluster, etcd_module: EtcdServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SlurmFaultedRun]:
    """The demo's five faults, in order, into one supervised run on Slurm; then a stop."""
    spec = ClusterSpec(warm_workers=False, run="slurm5", policy={"kill_stragglers_mid_run": True})
    tmp = tmp_path_factory.mktemp("slurm5")
    run = _SlurmRun(slurm_cluster_module, etcd_module, tmp, free_port(), spec)
    try:
        run.start()
        first = run.wait_for_event(E.EVENT_KIND_FIRST_STEP, 0, 150)
        assert first is not None, run.tail()
        # steady training before the faults: a checkpoint committed after the first step
        assert run.wait_for_event(E.EVENT_KIND_CHECKPOINT_COMMIT, first.seq, 120) is not None, run.tail()
        # node rank 0 hosts the c10d store: losing it moves the rendezvous to another node. Unless it
        # is the job's batch host: srun runs there, and losing it ends the agents' step on every node
        # (Slurm's doing, seen here in some runs: the run then comes back through the queue, slower
        # than this test waits); the next node rank instead.
        injections = run_faults(
            run,
            list(FAULTS),
            timeout_s=90,
            victim_ranks={"node-lost": 0},
            lose_node=run.lose_node,
            lose_not=run.batch_hosts,
        )
        if not all(i.recovered for i in injections):
            print(run.diagnosis(), flush=True)  # shown with the failing tests' captured output
        run.ctl("stop", spec.run, "--reason", "test finished")
        rc = run.wait_exit(120)
        states = slurm_cluster_module.node_states()
        jobs_left = slurm_cluster_module.cmd(
            "squeue", "--noheader", f"--name={run.job_name},{run.job_name}-more"
        ).strip()
        deadline = time.monotonic() + 15
        while _agent_pids(str(run.agents_dir)) and time.monotonic() < deadline:
            time.sleep(0.2)
        agents_left = _agent_pids(str(run.agents_dir))
        agent_logs = {
            p.parent.name: p.read_text(errors="replace") for p in run.agents_dir.glob("*/agent.log")
        }
    finally:
        # The module's cluster as it was before the module's other runs: the lost node back,
        # runwarden's drains undone.
        run.close()
    read = read_events(run.event_log)
    yield SlurmFaultedRun(
        run=run,
        events=read.entries,
        recoveries=recoveries(read.entries, injections),
        torn_tail=read.torn_tail,
        log_errors=len(read.errors),
        exit_code=rc,
        states_at_end=states,
        jobs_left=jobs_left,
        batch_logs=sorted(tmp.glob(f"{run.job_name}-*.out")),
        agent_logs=agent_logs,
        agents_left=agents_left,
    )


@pytest.mark.timeout(600)
def test_slurm_five_faults_each_detected_blamed_and_recovered(slurm_faulted: SlurmFaultedRun) -> None:
    events = slurm_faulted.events
    launches = [e for e in events if e.kind == E.EVENT_KIND_LAUNCH]
    # The ranks ran on Slurm's nodes, through the agents srun started there.
    assert {n for e in launches for n in e.launch.nodes} <= set(slurm_faulted.run.cluster.node_names)
    check_every_fault_recovered(slurm_faulted.recoveries, events, host_dies=True)
    for r in slurm_faulted.recoveries:
        print(
            f"slurm {r.injection.fault:<10} {r.injection.node}: detected {r.detect_s:5.1f} s, "
            f"training again {r.first_step_s:5.1f} s after the fault"
        )


@pytest.mark.timeout(600)
def test_slurm_quarantine_is_a_runwarden_drain_and_spares_come_from_the_allocation(
    slurm_faulted: SlurmFaultedRun,
) -> None:
    events = slurm_faulted.events
    held = {}  # node -> still quarantined at the end (never released)
    for e in events:
        if e.kind == E.EVENT_KIND_QUARANTINE:
            held[e.quarantine.node] = True
        elif e.kind == E.EVENT_KIND_RELEASE:
            held[e.release.node] = False
    by_fault = {r.injection.fault: r.injection.node for r in slurm_faulted.recoveries}
    # The lost node and the Xid node (held for repair) stayed out: drained with runwarden's reason ...
    assert held.get(by_fault["node-lost"]) and held.get(by_fault["xid"]), held
    for node, still in held.items():
        state, reason = slurm_faulted.states_at_end[node]
        if still:
            assert "drain" in state and reason.startswith("runwarden:"), (node, state, reason)
        else:  # ... a node that passed its burn-in was resumed: runwarden undid its own drain.
            assert "drain" not in state, (node, state, reason)
    # Every replacement was a node of the run's one allocation (a spare, or a blamed node back from
    # its burn-in): no trip through the queue.
    taken = [e for e in events if e.kind == E.EVENT_KIND_SPARE_TAKEN]
    assert taken and all(e.spare.source == "spare" for e in taken), [e.message for e in taken]
    assert len([p for p in slurm_faulted.batch_logs if "-more-" not in p.name]) == 1
    # every node's agent logged on its node (the batch host's srun carries none of it)
    logs = slurm_faulted.agent_logs
    assert set(logs) == set(slurm_faulted.run.cluster.node_names), sorted(logs)
    assert all(f"registered node {node}" in text for node, text in logs.items()), logs
    assert not any("flight recording not started" in text for text in logs.values())
    assert "registered node" not in slurm_faulted.batch_logs[0].read_text()


@pytest.mark.timeout(600)
def test_slurm_run_resumes_from_commits_and_its_log_adds_up(slurm_faulted: SlurmFaultedRun) -> None:
    check_resumes_only_from_commits(slurm_faulted.events)
    check_event_log_whole(
        slurm_faulted.events, slurm_faulted.run.spec.run, slurm_faulted.torn_tail, slurm_faulted.log_errors
    )


@pytest.mark.timeout(600)
def test_slurm_run_stop_exits_75_and_gives_the_allocation_back(slurm_faulted: SlurmFaultedRun) -> None:
    end = [e for e in slurm_faulted.events if e.kind == E.EVENT_KIND_RUN_END]
    assert end and end[-1].run_detail.outcome == "stopped", end
    assert slurm_faulted.exit_code == 75, slurm_faulted.run.tail()
    assert slurm_faulted.jobs_left == "", slurm_faulted.jobs_left
    assert slurm_faulted.agents_left == []


@pytest.mark.timeout(600)
def test_slurm_run_losses_equal_an_uninterrupted_run(slurm_faulted: SlurmFaultedRun, tmp_path: Path) -> None:
    assert_losses_equal_an_uninterrupted_run(slurm_faulted.run, tmp_path)


def test_slurm_run_without_spares_replaces_a_dead_node_from_the_queue(
    slurm_cluster_module: SlurmCluster, etcd_module: EtcdServer, tmp_path: Path, free_port: int
) -> None:
    """2 nodes, no spare: a node dies, the core asks the queue (ALLOCATE), SlurmScheduler submits
    <job>-more, its agent registers, and the run relaunches on it from the last commit."""
    spec = ClusterSpec(
        warm_workers=False,
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
        warm_workers=False,
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
        warm_workers=False,
        run="slurmloop",
        active=2,
        spares=0,
        steps=50,
        policy={"crash_loop_count": 2, "backoff_base_s": 0.2},
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


def test_slurm_allocation_that_ends_under_the_run_is_replaced_from_the_queue(
    slurm_cluster_module: SlurmCluster, etcd_module: EtcdServer, tmp_path: Path, free_port: int
) -> None:
    """The agents' job ends under the run (its batch shell SIGKILLed: Slurm then ends the job and
    TERMs its steps, as when it ends a job for its own reasons): each agent drains on the TERM, the
    attempt ends as a planned stop (nothing blamed, no restart consumed), the core asks the queue
    for the nodes it lost, and the run resumes from its last commit on the queue's job."""
    spec = ClusterSpec(
        warm_workers=False,
        run="slurmend",
        active=2,
        spares=0,
        steps=60,
        ckpt_every=10,
        step_sleep=0.05,
        policy={"hang_timeout_floor_s": 60.0},
    )
    run = _SlurmRun(slurm_cluster_module, etcd_module, tmp_path, free_port, spec)
    try:
        run.start()
        run.wait_for(E.EVENT_KIND_CHECKPOINT_COMMIT, 90)
        (job,) = run.job_ids(run.job_name)
        mark = run.events()[-1].seq
        ended_at = time.monotonic()
        slurm_cluster_module.cmd("scancel", "--batch", "--signal=KILL", job)
        relaunch = run.wait_for(E.EVENT_KIND_LAUNCH, 120, after_seq=mark)
        first = run.wait_for(E.EVENT_KIND_FIRST_STEP, 120, after_seq=relaunch.seq)
        print(
            f"the run's first step {time.monotonic() - ended_at:.1f}s after its job's batch shell was killed"
        )
        rc = run.wait_exit(120)
        assert rc == 0, run.tail()
        events = run.events()
        after = [e for e in events if e.seq > mark]
        assert not [e for e in after if e.kind in (E.EVENT_KIND_DETECTION, E.EVENT_KIND_QUARANTINE)], [
            e.message for e in after
        ]
        (ask,) = [e for e in after if e.kind == E.EVENT_KIND_ALLOCATE and e.seq < relaunch.seq]
        # every node of the relaunch registered after the ask: an agent of the queue's job (Slurm may
        # give it the same node names again, so no SPARE_TAKEN need say so)
        joined = {
            e.node.node
            for e in after
            if e.kind == E.EVENT_KIND_NODE_JOINED and ask.seq < e.seq < relaunch.seq
        }
        assert set(relaunch.launch.nodes) <= joined, (list(relaunch.launch.nodes), joined)
        restarts = [e for e in after if e.kind == E.EVENT_KIND_RESTART]
        assert restarts and all("without consuming" in e.message for e in restarts), [
            e.message for e in restarts
        ]
        commits = [
            e.step for e in events if e.kind == E.EVENT_KIND_CHECKPOINT_COMMIT and e.seq < relaunch.seq
        ]
        assert relaunch.launch.resume_step == max(commits) and first.seq > relaunch.seq
        assert len(list(tmp_path.glob(f"{run.job_name}-more-*.out"))) == 1  # the queue's one job
        run.assert_nothing_left()
    finally:
        run.close()
