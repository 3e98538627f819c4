"""Leftovers of the agent's ended attempts: the next preflight fails naming them, the agent kills them.

Real agents and real processes (no torch): a rank that escapes its attempt's tree before the launcher
first sees it (setsid and a double fork, SIGTERM ignored) outlives the attempt, re-parented to the
agent, its subreaper; a crashed agent's ranks outlive it, re-parented to init.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nodeagent.daemon import leftovers, preflight_bridge, proctree
from nodeagent.daemon.launcher import ExitInfo, Worker
from preflight.checks.base import process_name
from preflight.config import PreflightConfig
from preflight.nvml import GpuProcess
from preflight.result import CheckStatus
from preflight.runner import run_preflight
from runwarden.v1 import agent_pb2, common_pb2
from tests.nodeagent.helpers import ROOT, AgentProc, wait_for
from tests.preflight.fake_nvml import FakeGpu, FakeNvml

# The leader forks; the child leaves the session and forks the grandchild (SIGTERM ignored, pid in
# argv[1]) and exits; the leader exits 0 at once, before the launcher's first look at the tree.
ESCAPE = (
    "import os,signal,sys,time\n"
    "if os.fork()==0:\n"
    "  os.setsid()\n"
    "  if os.fork()==0:\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "    open(sys.argv[1]+'.tmp','w').write(str(os.getpid())); os.rename(sys.argv[1]+'.tmp', sys.argv[1])\n"
    "    time.sleep(1000)\n"
    "  os._exit(0)\n"
    "while not os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
)
SLEEPER = "import sys,time\nopen(sys.argv[1],'w').write('up')\ntime.sleep(1000)"


def _alive(pid: int) -> bool:
    info = proctree.read_proc(pid)
    return info is not None and info.state not in ("Z", "X")


def _launch(agent, run: str, attempt: int, code: str, arg: Path) -> int:
    request = agent_pb2.LaunchWorkersRequest(
        run=run, attempt=attempt, argv=[sys.executable, "-c", code, str(arg)], leader_fence=1
    )
    return agent.stub.LaunchWorkers(request).pid


def _preflight(agent) -> tuple[common_pb2.CheckResult, common_pb2.PreflightSummary]:
    items = list(
        agent.stub.RunPreflight(agent_pb2.RunPreflightRequest(mode="quick", only=["processes"]), timeout=60)
    )
    (result,) = [i.result for i in items if i.HasField("result")]
    assert result.name == "processes.leftover_ranks"
    return result, items[-1].summary


def test_a_leftover_rank_of_the_previous_attempt_is_killed_before_the_next_preflight_and_warned(
    agent_factory, tmp_path
):
    agent = agent_factory(flags=["--allow-exec", sys.executable])
    pidfile = tmp_path / "escaped"
    leader = _launch(agent, "r1", 1, ESCAPE, pidfile)
    escaped = int(wait_for(lambda: pidfile.exists() and pidfile.read_text(), 10, "the escaped rank"))

    def ended():
        ws = agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).workers
        return [w for w in ws if w.pid == leader and not w.running]

    wait_for(ended, 20, "attempt 1 to end")
    assert _alive(escaped), "the escaped rank should outlive its attempt (the launcher never saw it)"
    # re-parented to the agent, its subreaper, once the middle process has exited
    wait_for(lambda: proctree.read_proc(escaped).ppid == agent.pid, 10, "the escaped rank's re-parenting")

    t0 = time.monotonic()
    result, summary = _preflight(agent)
    took = time.monotonic() - t0
    # runwarden's own debris, not the node's fault (issue 26: no strike without evidence about the
    # node): killed before the checks ran (SIGTERM ignored, so SIGKILL after the agent's grace), a
    # warning that names it, and the preflight passes
    assert result.status == common_pb2.CHECK_STATUS_WARN and "killed before this preflight" in result.message
    assert any(f"pid={escaped}" in e and "run r1 attempt 1" in e and "SIGKILL" in e for e in result.evidence)
    assert summary.passed
    assert not _alive(escaped) and took >= 2.0
    assert f"pid={escaped}" in agent.log() and "killed with SIGKILL" in agent.log()

    again, summary = _preflight(agent)
    assert again.status == common_pb2.CHECK_STATUS_PASS and summary.passed


def test_the_running_attempt_is_not_a_leftover(agent_factory, tmp_path):
    agent = agent_factory(flags=["--allow-exec", sys.executable])
    up = tmp_path / "up"
    leader = _launch(agent, "r2", 3, SLEEPER, up)
    wait_for(up.exists, 10, "the worker")
    result, summary = _preflight(agent)
    assert result.status == common_pb2.CHECK_STATUS_PASS and summary.passed
    assert _alive(leader)
    agent.stub.StopWorkers(agent_pb2.StopWorkersRequest(run="r2", grace_s=1.0), timeout=30)


def test_a_crashed_agents_ranks_fail_its_successors_preflight_and_are_killed(agent_factory, tmp_path):
    first = agent_factory(node="n7", flags=["--allow-exec", sys.executable])
    up = tmp_path / "up"
    rank = _launch(first, "r3", 2, SLEEPER, up)
    wait_for(up.exists, 10, "the worker")
    first.kill()  # SIGKILL: no stop, the rank is re-parented away from the agent
    assert _alive(rank)
    # Another agent on this host with the same node name (tests, a demo) is not its agent: no claim.
    other = agent_factory(node="n7", flags=["--allow-exec", sys.executable])
    result, summary = _preflight(other)
    assert result.status == common_pb2.CHECK_STATUS_PASS and _alive(rank)
    # Its successor (what systemd restarts: the same config, so the same socket) claims and kills it.
    second = AgentProc(first.tmp, node="n7", flags=["--allow-exec", sys.executable])
    try:
        assert second.socket == first.socket
        result, summary = _preflight(second)
        assert result.status == common_pb2.CHECK_STATUS_WARN and summary.passed
        assert any(f"pid={rank}" in e and "run r3 attempt 2" in e for e in result.evidence)
        assert not _alive(rank)  # the rank obeyed SIGTERM
        assert "ended after SIGTERM" in second.log()
    finally:
        second.close()
        if _alive(rank):
            os.kill(rank, signal.SIGKILL)


@pytest.fixture
def procs(tmp_path):
    started: list[subprocess.Popen[bytes]] = []

    def start(env: dict[str, str] | None = None, *, session: bool = False) -> subprocess.Popen[bytes]:
        # Popen returns once exec has begun, but the kernel sets the new image's environment up after
        # that (/proc/PID/environ reads empty meanwhile): under load a scan could miss the marks. The
        # process says it is up once its own code runs.
        up = tmp_path / f"up-{len(started)}"
        p = subprocess.Popen(
            [sys.executable, "-c", SLEEPER, str(up)],
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
            start_new_session=session,
        )
        started.append(p)
        wait_for(up.exists, 30, "the process to start")
        return p

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


# The agent these processes claim to come from: its own socket path, so that another session's agent
# named n1 on this host (its ranks are marked with its socket) is never this test's.
SOCKET = f"/tmp/test-leftovers-{os.getpid()}.sock"


def _marks(run: str, attempt: int, node: str = "n1") -> dict[str, str]:
    return {
        "RUNWARDEN_NODE": node,
        "RUNWARDEN_RUN": run,
        "RUNWARDEN_ATTEMPT": str(attempt),
        "RUNWARDEN_AGENT_SOCKET": SOCKET,
    }


def _worker(popen, run: str, attempt: int, *, ended: bool) -> Worker:
    w = Worker(run=run, attempt=attempt, pid=popen.pid, started_at=time.time(), popen=popen)
    w.track()
    if ended:
        w.exit = ExitInfo(exit_code=0, signal=None, ended_at=time.time(), detail="exit code 0")
    return w


def test_gpu_memory_of_a_leftover_fails_with_its_attempt_the_running_attempts_does_not_fake_nvml(procs):
    """This test process plays the agent: its children are the agent's tree."""
    leftover = procs(_marks("r", 2), session=True)  # attempt 2 ended; this rank of it did not
    current = procs(_marks("r", 3), session=True)  # attempt 3 runs now
    own = procs()  # a child of the agent's own (preflight's matmul, say)
    wait_for(lambda: all(_alive(p.pid) for p in (leftover, current, own)), 10, "the processes")
    view = leftovers.AgentProcesses(
        node="n1", socket=SOCKET, workers=lambda: [_worker(current, "r", 3, ended=False)]
    )
    gib = 2**30
    fake = FakeNvml(
        gpus=[
            FakeGpu(
                processes=[
                    GpuProcess(pid=current.pid, used_bytes=30 * gib),
                    GpuProcess(pid=own.pid, used_bytes=gib),
                    GpuProcess(pid=leftover.pid, used_bytes=2 * gib),
                ]
            ),
            FakeGpu(processes=[GpuProcess(pid=1, used_bytes=gib)]),  # outside the agent's tree
        ]
    )
    report = run_preflight(
        PreflightConfig(),
        "quick",
        only=["inventory", "processes"],
        specs=preflight_bridge.agent_specs(view, {}),
        nvml_factory=lambda: fake,
    )
    gpu0, gpu1 = [r for r in report.results if r.name == "inventory.gpu_processes"]
    assert gpu0.status is CheckStatus.FAIL and gpu0.value == 1
    name = process_name(leftover.pid)
    said = f"pid={leftover.pid} name={name} from node n1 run r attempt 2 (its environment)"
    assert gpu0.evidence == (said.replace(" from", " used=2048 MiB from"),)
    assert f"pid {leftover.pid}" in gpu0.message
    # a stranger (not the agent's, no attempt known) is flagged too, and never killed
    assert gpu1.status is CheckStatus.FAIL and gpu1.evidence == (
        f"pid=1 name={process_name(1)} used=1024 MiB",
    )
    (left,) = [r for r in report.results if r.name == "processes.leftover_ranks"]
    assert left.status is CheckStatus.FAIL and left.evidence == (said,)

    assert view.clean(0.5) == [f"{said}: ended after SIGTERM"]
    assert not _alive(leftover.pid)  # and reaped by the view (here the test's own Popen child)
    assert current.poll() is None and own.poll() is None


def test_a_process_seen_in_an_ended_attempts_tree_is_a_leftover_a_reused_pid_is_not(procs):
    rank = procs(session=True)  # no markers: a warm rank's environment is the parked group's
    wait_for(lambda: _alive(rank.pid), 10, "the rank")
    worker = _worker(rank, "r", 5, ended=True)
    assert worker.seen == {rank.pid: proctree.read_proc(rank.pid).start_ticks}
    (found,) = leftovers.find("n1", SOCKET, [worker], proctree.all_procs()).values()
    assert found.leftover.pid == rank.pid and found.leftover.origin.attempt == 5
    assert found.leftover.origin.how == leftovers.SEEN_IN_TREE
    worker.seen[rank.pid] += 1  # the same pid, another start time: another process
    assert leftovers.find("n1", SOCKET, [worker], proctree.all_procs()) == {}


def test_a_leftovers_whole_tree_is_killed_term_then_kill(tmp_path) -> None:
    """A leftover rank with a child of its own (a data loader, say), both ignoring SIGTERM."""
    pidfile = tmp_path / "child"
    code = (
        "import os,signal,sys,time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "if os.fork()==0:\n  open(sys.argv[1],'w').write(str(os.getpid()))\n  time.sleep(1000)\n"
        "time.sleep(1000)"
    )
    rank = subprocess.Popen(
        [sys.executable, "-c", code, str(pidfile)],
        env={**os.environ, **_marks("r", 4)},
        start_new_session=True,
    )
    try:
        child = int(wait_for(lambda: pidfile.exists() and pidfile.read_text(), 10, "the rank's child"))
        view = leftovers.AgentProcesses(node="n1", socket=SOCKET, workers=list)
        assert [(o.pid, o.origin.attempt) for o in view.leftovers()] == [(rank.pid, 4), (child, 4)]
        t0 = time.monotonic()
        lines = view.clean(0.5)
        assert time.monotonic() - t0 >= 0.5  # SIGTERM was given its grace first
        assert len(lines) == 2 and all(
            line.endswith("killed with SIGKILL (0.5 s after SIGTERM)") for line in lines
        )
        assert not _alive(rank.pid) and not _alive(child)
    finally:
        if rank.poll() is None:
            rank.kill()
        rank.wait()


def test_a_failing_kill_is_said_not_raised(monkeypatch, procs) -> None:
    rank = procs(_marks("r", 6), session=True)
    wait_for(lambda: _alive(rank.pid), 10, "the rank")
    view = leftovers.AgentProcesses(node="n1", socket=SOCKET, workers=list)
    assert [o.pid for o in view.leftovers()] == [rank.pid]

    def broken(*args: object) -> list[str]:
        raise OSError("no /proc")

    monkeypatch.setattr(leftovers, "kill", broken)
    assert view.clean(0.1) == ["killing the leftovers failed: OSError: no /proc"]


def test_an_attempt_stopped_as_usual_leaves_no_leftover(agent_factory, tmp_path) -> None:
    """No false alarm: a tree the launcher stopped (a grandchild in a session of its own included)."""
    agent = agent_factory(flags=["--allow-exec", sys.executable])
    pidfile = tmp_path / "pids"
    tree = [sys.executable, str(ROOT / "tests/nodeagent/tree.py"), str(pidfile), "obedient"]
    leader = agent.stub.LaunchWorkers(agent_pb2.LaunchWorkersRequest(run="r5", attempt=1, argv=tree)).pid
    wait_for(lambda: pidfile.exists() and len(pidfile.read_text().split()) >= 5, 20, "the tree")
    pids = [int(p) for p in pidfile.read_text().split()]
    agent.stub.StopWorkers(agent_pb2.StopWorkersRequest(run="r5", grace_s=2.0), timeout=30)
    assert leader in pids and not [p for p in pids if _alive(p)]
    result, summary = _preflight(agent)
    assert result.status == common_pb2.CHECK_STATUS_PASS and summary.passed
