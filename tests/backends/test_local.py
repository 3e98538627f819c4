"""The local backend: one torchrun line per node from the shared builders, launches reported per node."""

from __future__ import annotations

import sys

import pytest

from controller.backends.base import AttemptSpec, Backend
from controller.backends.local import LaunchIncomplete, LocalBackend, LocalConfig
from controller.live.agents import AgentClients, RpcOutcome
from runwarden.v1 import agent_pb2

TORCHRUN = (sys.executable, "-m", "torch.distributed.run")


def spec() -> AttemptSpec:
    return AttemptSpec(
        run="demo",
        attempt=3,
        nodes=("node2", "node5"),
        command=("/repo/examples/train.py", "--steps", "9"),
        env={"PYTHONPATH": "/repo"},
        resume_step=40,
        procs_per_node=2,
        leader_fence=17,
    )


def test_each_node_gets_its_rank_and_the_rank_zero_node_hosts_the_rendezvous() -> None:
    backend = LocalBackend(AgentClients(), LocalConfig(torchrun=TORCHRUN))
    (n0, r0), (n1, r1) = backend.requests(spec(), endpoint="127.0.0.1:29400")
    assert (n0, n1) == ("node2", "node5")
    # The line the live shell has always launched (its own copy is gone): the script runs under torchrun's
    # interpreter, so no --no-python.
    assert list(r0.argv) == [
        *TORCHRUN,
        "--nnodes=2",
        "--nproc-per-node=2",
        "--node-rank=0",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:29400",
        "--rdzv-id=demo-3",
        "--rdzv-conf=is_host=true",
        "--max-restarts=0",
        "/repo/examples/train.py",
        "--steps",
        "9",
    ]
    assert "--node-rank=1" in r1.argv and "--rdzv-conf=is_host=false" in r1.argv
    assert (r0.node_rank, r1.node_rank, r0.nnodes, r0.resume_step, r0.leader_fence) == (0, 1, 2, 40, 17)
    assert r0.run == "demo" and r0.attempt == 3 and r0.rendezvous_id == "demo-3"
    assert r0.env["RUNWARDEN_NODE"] == "node2" and r1.env["RUNWARDEN_NODE"] == "node5"
    assert r0.env["RUNWARDEN_RESUME_STEP"] == "40" and r0.env["PYTHONPATH"] == "/repo"


class ScriptedAgents(AgentClients):
    """Launch answers per node (a narrow double of the agent clients: no RPC is made)."""

    def __init__(self, answers: dict[str, RpcOutcome]) -> None:
        super().__init__()
        self.answers = answers
        self.requests: list[agent_pb2.LaunchWorkersRequest] = []

    def launch(self, node: str, request: agent_pb2.LaunchWorkersRequest, timeout_s: float) -> RpcOutcome:
        self.requests.append(request)
        return self.answers[node]


def test_a_launch_names_each_node_that_did_not_start_and_whether_it_was_temporary() -> None:
    agents = ScriptedAgents(
        {
            "node2": RpcOutcome(node="node2", ok=True),
            "node5": RpcOutcome(
                node="node5", ok=False, code="UNAVAILABLE", error="UNAVAILABLE: gone", tries=4
            ),
        }
    )
    backend = LocalBackend(agents)
    assert isinstance(backend, Backend)
    with pytest.raises(LaunchIncomplete) as err:
        backend.launch(spec())
    (failure,) = err.value.failures
    assert failure.node == "node5" and failure.temporary and "gone" in failure.reason
    assert len(agents.requests) == 2  # node2 was launched all the same


def test_a_launch_on_every_node_returns_its_handle() -> None:
    agents = ScriptedAgents({n: RpcOutcome(node=n, ok=True) for n in ("node2", "node5")})
    handle = LocalBackend(agents).launch(spec())
    assert handle.ref == "local:demo-3" and handle.spec.nodes == ("node2", "node5")
    endpoints = {a for r in agents.requests for a in r.argv if a.startswith("--rdzv-endpoint=")}
    assert len(endpoints) == 1  # every node meets at the same rendezvous
