"""The local launcher through the real agent: process trees stopped with nothing left in /proc."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import grpc
import pytest

from nodeagent.daemon import proctree
from runwarden.v1 import agent_pb2
from tests.nodeagent.helpers import ROOT, wait_for

TREE = str(ROOT / "tests/nodeagent/tree.py")


def _agent(agent_factory):
    return agent_factory(flags=["--allow-exec", sys.executable])


def _launch(agent, run: str, argv: list[str], attempt: int = 1, env: dict[str, str] | None = None) -> int:
    reply = agent.stub.LaunchWorkers(
        agent_pb2.LaunchWorkersRequest(
            run=run, attempt=attempt, argv=argv, env=env or {"PYTHONPATH": str(ROOT)}, leader_fence=7
        )
    )
    return reply.pid


def _pids(pidfile: Path, count: int) -> list[int]:
    wait_for(lambda: pidfile.exists() and len(pidfile.read_text().split()) >= count, 20, f"{count} pids")
    return [int(p) for p in pidfile.read_text().split()]


def _gone(pids: list[int]) -> bool:
    return not [p for p in pids if os.path.exists(f"/proc/{p}")]


@pytest.mark.parametrize(
    ("mode", "grace", "signal_seen"), [("obedient", 5.0, signal.SIGTERM), ("stubborn", 0.5, signal.SIGKILL)]
)
def test_stop_process_tree_leaves_nothing_in_proc(agent_factory, tmp_path, mode, grace, signal_seen):
    agent = _agent(agent_factory)
    pidfile = tmp_path / "pids"
    leader = _launch(agent, "r1", [sys.executable, TREE, str(pidfile), mode])
    pids = _pids(pidfile, 5)  # leader, 2 children, 2 grandchildren (one escaped with setsid)
    assert leader in pids
    escaped = [p for p in pids if p != leader and (info := proctree.read_proc(p)) and info.session == p]
    assert len(escaped) == 1, "one grandchild should be in a session of its own"
    assert all(os.getpgid(p) == leader for p in pids if p not in escaped)

    t0 = time.monotonic()
    reply = agent.stub.StopWorkers(agent_pb2.StopWorkersRequest(run="r1", grace_s=grace), timeout=30)
    took = time.monotonic() - t0
    assert _gone(pids), f"left behind: {[p for p in pids if os.path.exists(f'/proc/{p}')]}"
    (status,) = reply.stopped
    assert status.pid == leader and not status.running
    assert status.exit.HasField("signal") and status.exit.signal == signal_seen
    assert not status.exit.HasField("exit_code")
    if mode == "stubborn":
        assert took >= grace  # TERM was tried for the grace period first
    # The node status shows the same end; the agent is fine and serving.
    workers = agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).workers
    assert [(w.pid, w.running, w.exit.signal) for w in workers] == [(leader, False, signal_seen)]


def test_exit_code_reported_and_leftovers_cleaned(agent_factory, tmp_path):
    agent = _agent(agent_factory)
    pidfile = tmp_path / "pids"
    # The leader leaves a sleeping child behind and exits 3: the child must not survive it.
    code = (
        "import os,sys,time\nif os.fork()==0:\n  open(sys.argv[1],'w').write(str(os.getpid()))\n"
        "  time.sleep(1000)\ntime.sleep(0.5)\nsys.exit(3)"
    )
    leader = _launch(agent, "r2", [sys.executable, "-c", code, str(pidfile)])
    child = int(wait_for(lambda: pidfile.exists() and pidfile.read_text(), 10, "the child's pid"))

    def ended():
        ws = agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).workers
        return [w for w in ws if w.pid == leader and not w.running]

    (w,) = wait_for(ended, 20, "the worker to end")
    assert w.exit.exit_code == 3 and not w.exit.HasField("signal")
    wait_for(lambda: _gone([child, leader]), 10, "the leftover child to be killed")


def test_workers_survive_the_schedulers_usr1_notice(agent_factory, tmp_path):
    """Slurm signals every process of the job step: a worker and its children start with SIGUSR1
    ignored (the agent turns the notice into a planned stop), and keep the pid the agent reports."""
    agent = _agent(agent_factory)
    pidfile = tmp_path / "pids"
    code = (
        "import os,sys,time\nif os.fork()==0:\n  time.sleep(1000)\n"
        "open(sys.argv[1],'w').write(str(os.getpid()))\ntime.sleep(1000)"
    )
    leader = _launch(agent, "r6", [sys.executable, "-c", code, str(pidfile)])
    assert int(wait_for(lambda: pidfile.exists() and pidfile.read_text(), 10, "the leader's pid")) == leader
    os.killpg(leader, signal.SIGUSR1)  # the leader's process group: the worker and its child
    # ignored by both, so the signal is discarded: no window to wait out before looking
    survivors = [leader, *_children(leader)]
    assert len(survivors) == 2 and all(_ignores_usr1(pid) for pid in survivors), survivors
    ws = agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).workers
    assert [w.running for w in ws if w.pid == leader] == [True]
    assert _children(leader), "the worker's child died of SIGUSR1"
    agent.stub.StopWorkers(agent_pb2.StopWorkersRequest(run="r6", grace_s=2.0), timeout=30)


def _ignores_usr1(pid: int) -> bool:
    """Whether SIGUSR1 is in the process's ignored set (/proc/PID/status SigIgn, a hex mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGUSR1 - 1)))
    return False


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = proctree.read_proc(int(entry))
            if info is not None and info.ppid == pid:
                found.append(int(entry))
    return found


def test_worker_env_has_the_contract(agent_factory, tmp_path):
    agent = _agent(agent_factory)
    out = tmp_path / "env"
    code = "import os,sys,json\njson.dump(dict(os.environ), open(sys.argv[1],'w'))"
    agent.stub.LaunchWorkers(
        agent_pb2.LaunchWorkersRequest(
            run="r3",
            attempt=4,
            argv=[sys.executable, "-c", code, str(out)],
            env={"FOO": "bar"},
            node_rank=1,
            nnodes=2,
            resume_step=120,
        )
    )
    import json

    env = json.loads(wait_for(lambda: out.exists() and out.read_text(), 10, "the env dump"))
    assert env["FOO"] == "bar"
    assert env["RUNWARDEN_RDZV_ID"] == "r3-4" and env["RUNWARDEN_ATTEMPT"] == "4"
    assert env["RUNWARDEN_NODE"] == agent.node and env["RUNWARDEN_RUN"] == "r3"  # a leftover's origin
    assert env["RUNWARDEN_NODE_RANK"] == "1" and env["RUNWARDEN_NNODES"] == "2"
    assert env["RUNWARDEN_RESUME_STEP"] == "120"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert env["RUNWARDEN_STOP_FILE"].endswith("/runs/r3/stop")
    assert env["RUNWARDEN_FR_SOCKET_DIR"].endswith("/runs/r3/attempt-4/fr")
    assert env["RUNWARDEN_NODEAGENT_SOCKET"] == agent.socket and "RUNWARDEN_AGENT_SOCKET" not in env
    assert "NOTIFY_SOCKET" not in env
    # torchrun waits this long for its ranks after a TERM (its own default is 30 s): the agent's KILL
    # after the grace is what ends a stop, never torchrun's shorter wait
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "3600"


def test_a_torchrun_shutdown_timeout_given_by_the_controller_is_kept(tmp_path):
    from nodeagent.daemon.launcher import LaunchSpec, worker_env

    spec = LaunchSpec(
        run="r",
        attempt=1,
        rendezvous_id="r-1",
        argv=("x",),
        env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "90"},
        stop_file=tmp_path / "stop",
        fr_socket_dir=tmp_path / "fr",
    )
    assert worker_env(spec, {})["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "90"


def test_launch_refuses_executables_not_allowed(agent_factory):
    agent = _agent(agent_factory)
    with pytest.raises(grpc.RpcError) as err:
        _launch(agent, "r4", ["/bin/sh", "-c", "true"])
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "allowed_executables" in err.value.details()


def test_stale_fence_and_old_attempt_refused(agent_factory):
    agent = _agent(agent_factory)
    argv = [sys.executable, "-c", "pass"]
    agent.stub.LaunchWorkers(agent_pb2.LaunchWorkersRequest(run="r5", attempt=2, argv=argv, leader_fence=10))
    for attempt, fence in ((3, 9), (1, 10)):
        with pytest.raises(grpc.RpcError) as err:
            agent.stub.LaunchWorkers(
                agent_pb2.LaunchWorkersRequest(run="r5", attempt=attempt, argv=argv, leader_fence=fence)
            )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_launch_with_stop_older_stops_the_older_attempt_first_and_nothing_newer(agent_factory):
    """LaunchWorkersRequest.stop_older (a lost node's relaunch on a survivor): the older attempt's
    workers are stopped as StopWorkers stops them, then the new attempt starts, in one call; without
    it the launch is refused; a stale launch or a retry of the running attempt stops nothing."""
    agent = _agent(agent_factory)
    argv = [sys.executable, "-c", "import time; time.sleep(1000)"]

    def launch(attempt: int, fence: int = 7, stop_older: bool = True) -> agent_pb2.LaunchWorkersResponse:
        return agent.stub.LaunchWorkers(
            agent_pb2.LaunchWorkersRequest(
                run="r7",
                attempt=attempt,
                argv=argv,
                leader_fence=fence,
                stop_older=agent_pb2.StopOlder(grace_s=5.0) if stop_older else None,
            ),
            timeout=30,
        )

    def running() -> list[tuple[int, int]]:
        ws = agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).workers
        return [(w.attempt, w.pid) for w in ws if w.running]

    first = launch(1, stop_older=False)
    with pytest.raises(grpc.RpcError) as err:
        launch(2, stop_older=False)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    second = launch(2)
    (ended,) = second.stopped
    assert (ended.attempt, ended.pid, ended.running) == (1, first.pid, False)
    assert ended.exit.signal == signal.SIGTERM  # stopped as StopWorkers stops it: TERM within the grace
    assert not os.path.exists(f"/proc/{first.pid}")
    assert running() == [(2, second.pid)]
    for attempt, fence in (
        (2, 7),
        (1, 7),
        (3, 6),
    ):  # a retry of the running attempt, an older one, a stale leader
        with pytest.raises(grpc.RpcError) as err:
            launch(attempt, fence)
        assert err.value.code() in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION)
        assert running() == [(2, second.pid)]
    with pytest.raises(grpc.RpcError) as err:  # validated like StopWorkers' bounds
        agent.stub.LaunchWorkers(
            agent_pb2.LaunchWorkersRequest(
                run="r7",
                attempt=3,
                argv=argv,
                leader_fence=7,
                stop_older=agent_pb2.StopOlder(park_within_s=61),
            )
        )
    assert (
        err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "stop_older.park_within_s" in err.value.details()
    )
    assert running() == [(2, second.pid)]
    agent.stub.StopWorkers(agent_pb2.StopWorkersRequest(run="r7", grace_s=2.0), timeout=30)
