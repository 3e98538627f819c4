"""The local backend: a structured launch per node, the rendezvous at node rank 0's reported address."""

from __future__ import annotations

import pytest

from controller.backends.agents import AgentClients, RpcOutcome
from controller.backends.base import AttemptSpec, Backend, BackendError
from controller.backends.local import LaunchIncomplete, LocalBackend, Rendezvous
from runwarden.v1 import agent_pb2

# What the nodes' records say: each agent reserved its own port on its own address.
RECORDS = {
    "node2": Rendezvous(host="10.0.0.12", port=29412),
    "node5": Rendezvous(host="10.0.0.15", port=29415),
}


def spec(nodes: tuple[str, ...] = ("node2", "node5")) -> AttemptSpec:
    return AttemptSpec(
        run="demo",
        attempt=3,
        nodes=nodes,
        command=("/repo/examples/train.py", "--steps", "9"),
        env={"PYTHONPATH": "/repo"},
        resume_step=40,
        procs_per_node=2,
        leader_fence=17,
        launched_at=1_765_000_000.5,
    )


def test_each_node_gets_its_rank_and_the_rank_zero_node_hosts_the_rendezvous() -> None:
    backend = LocalBackend(AgentClients(), RECORDS.get)
    (n0, r0), (n1, r1) = backend.requests(spec(), endpoint=backend.endpoint(spec()))
    assert (n0, n1) == ("node2", "node5")
    # Only what is per attempt: the agent builds the line (its prefix, its ranks, its address).
    assert not r0.argv and r0.HasField("torchrun")
    assert list(r0.torchrun.command) == ["/repo/examples/train.py", "--steps", "9"]
    assert r0.torchrun.rdzv_endpoint == r1.torchrun.rdzv_endpoint == "10.0.0.12:29412"
    assert r0.torchrun.is_host and not r1.torchrun.is_host
    assert not r0.torchrun.no_python  # the script runs under the agent's torchrun interpreter
    assert (r0.node_rank, r1.node_rank, r0.nnodes, r0.resume_step, r0.leader_fence) == (0, 1, 2, 40, 17)
    assert r0.run == "demo" and r0.attempt == 3 and r0.rendezvous_id == "demo-3"
    assert r0.env["RUNWARDEN_NODE"] == "node2" and r1.env["RUNWARDEN_NODE"] == "node5"
    assert r0.env["RUNWARDEN_RESUME_STEP"] == "40" and r0.env["PYTHONPATH"] == "/repo"


def test_each_node_is_told_of_eight_peers_after_it_not_the_whole_attempt() -> None:
    """The peers a node asks when its own lease cannot be renewed: the 8 after it in the attempt's
    order, wrapping; every node asked by 8 others. All of them made a 2,048-node launch 4.2 million
    addresses."""
    nodes = tuple(f"n{i:04d}" for i in range(2048))
    agents = AgentClients()
    for i, n in enumerate(nodes):
        agents.set_address(n, f"10.0.{i // 256}.{i % 256}:50051")
    backend = LocalBackend(agents, lambda n: Rendezvous(host="10.0.0.1", port=29400))
    reqs = backend.requests(spec(nodes), endpoint="10.0.0.1:29400")
    told = {n: list(r.torchrun.peers) for n, r in reqs}
    assert told["n0000"] == [f"10.0.0.{i}:50051" for i in range(1, 9)]
    assert told["n2047"] == [f"10.0.0.{i}:50051" for i in range(0, 8)]
    asked: dict[str, int] = {}
    for peers in told.values():
        assert len(peers) == len(set(peers)) == 8
        for p in peers:
            asked[p] = asked.get(p, 0) + 1
    assert set(asked.values()) == {8}
    assert {r.launched_at for _, r in reqs} == {1_765_000_000.5}  # the controller's clock, for stale stops
    (_, r0), (_, r1) = backend.requests(spec(nodes[:2]), endpoint="10.0.0.1:29400")
    assert list(r0.torchrun.peers) == ["10.0.0.1:50051"] and list(r1.torchrun.peers) == ["10.0.0.0:50051"]
    agents.close()


def test_a_spare_replacing_node_rank_0_brings_its_own_rendezvous() -> None:
    backend = LocalBackend(AgentClients(), RECORDS.get)
    assert backend.endpoint(spec(("node5", "node2"))) == "10.0.0.15:29415"
    v6 = LocalBackend(AgentClients(), {"n": Rendezvous(host="fd00::1", port=29400)}.get)
    assert v6.endpoint(spec(("n",))) == "[fd00::1]:29400"


def test_no_reported_rendezvous_for_node_rank_0_launches_nothing() -> None:
    agents = ScriptedAgents({})
    backend = LocalBackend(agents, {"node5": RECORDS["node5"]}.get)
    with pytest.raises(BackendError, match="node rank 0 \\(node2\\) reported no rendezvous"):
        backend.launch(spec())
    assert agents.requests == []


class ScriptedAgents(AgentClients):
    """Launch answers per node (a narrow double of the agent clients: no RPC is made)."""

    def __init__(self, answers: dict[str, RpcOutcome]) -> None:
        super().__init__()
        self.answers = answers
        self.requests: list[agent_pb2.LaunchWorkersRequest] = []

    async def launch_async(
        self, node: str, request: agent_pb2.LaunchWorkersRequest, timeout_s: float
    ) -> tuple[RpcOutcome, agent_pb2.LaunchWorkersResponse | None]:
        self.requests.append(request)
        out = self.answers[node]
        path = "warm" if node == "node2" else "cold"
        resp = agent_pb2.LaunchWorkersResponse(pid=7, launch_path=path, launch_detail=f"{node} {path}")
        return out, resp if out.ok else None


def test_a_launch_names_each_node_that_did_not_start_and_whether_it_was_temporary() -> None:
    agents = ScriptedAgents(
        {
            "node2": RpcOutcome(node="node2", ok=True),
            "node5": RpcOutcome(
                node="node5", ok=False, code="UNAVAILABLE", error="UNAVAILABLE: gone", tries=4
            ),
        }
    )
    backend = LocalBackend(agents, RECORDS.get)
    assert isinstance(backend, Backend)
    with pytest.raises(LaunchIncomplete) as err:
        backend.launch(spec())
    (failure,) = err.value.failures
    assert failure.node == "node5" and failure.temporary and "gone" in failure.reason
    assert len(agents.requests) == 2  # node2 was launched all the same


def test_a_launch_on_every_node_returns_its_handle() -> None:
    agents = ScriptedAgents({n: RpcOutcome(node=n, ok=True) for n in ("node2", "node5")})
    handle = LocalBackend(agents, RECORDS.get).launch(spec())
    assert handle.ref == "local:demo-3" and handle.spec.nodes == ("node2", "node5")
    assert [(s.node, s.path, s.detail) for s in handle.started] == [
        ("node2", "warm", "node2 warm"),
        ("node5", "cold", "node5 cold"),
    ]  # each agent's own word on how it started its ranks, for the event log
    endpoints = {r.torchrun.rdzv_endpoint for r in agents.requests}
    assert endpoints == {"10.0.0.12:29412"}  # every node meets at node rank 0's rendezvous
