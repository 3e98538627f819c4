"""An agent killed alone (SIGKILL to its PID only: what systemd does under the shipped unit's
KillMode=process when the agent crashes or its watchdog fires) leaves its ranks running; the agent
systemd restarts (same node, same socket, real etcd) keeps them while the node's lease still lives,
stops them before it launches a new attempt, and stops them at once when the lease expired before
it came back (the controller has counted the node lost and may be replacing it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nodeagent.daemon import proctree
from runwarden.v1 import agent_pb2
from tests.nodeagent.helpers import AgentProc, wait_for

GRACE_S = 1.0
SLEEPER = "import time; time.sleep(600)"


def _alive(pid: int) -> bool:
    info = proctree.read_proc(pid)
    return info is not None and info.state not in ("Z", "X")


def _agent(tmp: Path, etcd: str, root: str, ttl_s: float) -> AgentProc:
    return AgentProc(
        tmp,
        etcd=etcd,
        etcd_root=root,
        flags=["--lease-ttl", str(ttl_s), "--allow-exec", sys.executable],
        env={"RUNWARDEN_AGENT_STOP_GRACE_S": str(GRACE_S)},
    )


def _launch(agent: AgentProc, attempt: int) -> int:
    request = agent_pb2.LaunchWorkersRequest(run="r1", attempt=attempt, argv=[sys.executable, "-c", SLEEPER])
    return int(agent.stub.LaunchWorkers(request, timeout=30).pid)


@pytest.mark.slow
def test_a_restart_within_the_lease_keeps_the_ranks_until_the_next_launch(
    etcd, store, tmp_path: Path
) -> None:
    ttl_s = 10.0  # the restart (a python start on a loaded machine) comes well within it
    first = _agent(tmp_path / "agent", etcd.endpoint, store.keys.root, ttl_s)
    key = store.keys.node("n1")
    wait_for(lambda: store.get(key), 10, "the node key")
    rank = _launch(first, 1)
    first.kill()
    first.close()
    assert _alive(rank), "the rank died with its agent"

    second = _agent(tmp_path / "agent", etcd.endpoint, store.keys.root, ttl_s)  # same node, same socket
    try:
        wait_for(
            lambda: "its lease is alive: they keep running" in second.log(),
            10,
            "the restarted agent's verdict",
        )
        assert _alive(rank)
        newer = _launch(second, 2)
        # the launch returned after the earlier agent's rank was stopped (TERM, KILL after the grace)
        assert not _alive(rank), second.log()[-2000:]
        assert _alive(newer)
        assert "r1 attempt 2 launches: stopping 1 process(es) an earlier agent started" in second.log()
    finally:
        second.close()
    assert not _alive(newer)


@pytest.mark.slow
def test_a_restart_after_the_lease_expired_stops_the_ranks(etcd, store, tmp_path: Path) -> None:
    ttl_s = 2.0
    first = _agent(tmp_path / "agent", etcd.endpoint, store.keys.root, ttl_s)
    key = store.keys.node("n1")
    wait_for(lambda: store.get(key), 10, "the node key")
    rank = _launch(first, 1)
    first.kill()
    first.close()
    assert _alive(rank)
    wait_for(lambda: store.get(key) is None, ttl_s + 5, "the lease to expire (the node counted lost)")
    assert _alive(rank), "nothing stops the rank while no agent runs"

    second = _agent(tmp_path / "agent", etcd.endpoint, store.keys.root, ttl_s)
    try:
        wait_for(lambda: not _alive(rank), GRACE_S + 10, "the earlier agent's rank to be stopped")
        assert "the earlier agent's lease expired before this one started" in second.log()
    finally:
        second.close()
