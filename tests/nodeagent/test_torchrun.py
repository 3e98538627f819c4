"""The agent's torchrun line: the shared rule (runwarden.launch) filled from the node's own facts."""

from __future__ import annotations

import pytest

from nodeagent.daemon import torchrun
from runwarden.v1 import agent_pb2

FACTS = torchrun.NodeFacts(
    torchrun=("/opt/venv/bin/python", "-m", "torch.distributed.run"),
    local_ranks=4,
    torch_host="10.0.0.11",
    rdzv_port=29411,
    collective_ifname="eth1",
)


def request(**torchrun_fields: object) -> agent_pb2.LaunchWorkersRequest:
    fields: dict = {"command": ["/repo/train.py", "--steps", "9"], "rdzv_endpoint": "10.0.0.11:29411"}
    fields.update(torchrun_fields)
    return agent_pb2.LaunchWorkersRequest(
        run="demo", attempt=3, nnodes=2, node_rank=0, torchrun=agent_pb2.TorchrunLaunch(**fields)
    )


def test_the_line_is_the_nodes_own_prefix_ranks_and_address():
    argv, env = torchrun.build(FACTS, request(is_host=True), "demo-3")
    assert argv == [
        "/opt/venv/bin/python",
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=4",
        "--node-rank=0",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.11:29411",
        "--rdzv-id=demo-3",
        "--rdzv-conf=is_host=true",
        "--local-addr=10.0.0.11",
        "--max-restarts=0",
        "/repo/train.py",
        "--steps",
        "9",
    ]
    assert env == {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"}


def test_a_node_that_does_not_host_dials_the_given_endpoint_and_advertises_itself():
    facts = torchrun.NodeFacts(
        torchrun=("python",), local_ranks=1, torch_host="10.0.0.12", rdzv_port=29412, collective_ifname=""
    )
    req = request(no_python=True, command=["/usr/bin/env", "python", "t.py"])
    req.node_rank = 1
    argv, env = torchrun.build(facts, req, "demo-3")
    assert "--rdzv-endpoint=10.0.0.11:29411" in argv and "--rdzv-conf=is_host=false" in argv
    assert "--local-addr=10.0.0.12" in argv and "--node-rank=1" in argv and "--nproc-per-node=1" in argv
    assert argv[-4:] == ["--no-python", "/usr/bin/env", "python", "t.py"] and env == {}


@pytest.mark.parametrize("endpoint", ["10.0.0.12:29411", "10.0.0.11:29400", "other-host:29411"])
def test_hosting_a_store_at_an_endpoint_not_its_own_is_refused(endpoint):
    with pytest.raises(torchrun.TorchrunRefused, match="stale node record"):
        torchrun.build(FACTS, request(is_host=True, rdzv_endpoint=endpoint), "demo-3")


def test_a_wildcard_advertised_host_has_nothing_to_offer_torch():
    assert torchrun.torch_host("0.0.0.0") == "" and torchrun.torch_host("::") == ""
    assert torchrun.torch_host("10.0.0.11") == "10.0.0.11"
    facts = torchrun.NodeFacts(
        torchrun=("python",), local_ranks=1, torch_host="", rdzv_port=1, collective_ifname=""
    )
    with pytest.raises(torchrun.TorchrunRefused, match="wildcard"):
        torchrun.build(facts, request(), "demo-3")


def test_endpoints_parse_with_ipv6_in_brackets():
    assert torchrun.split_endpoint("[fd00::11]:29400") == ("fd00::11", 29400)
    assert torchrun.split_endpoint("node-1.example:1") == ("node-1.example", 1)
    v6 = torchrun.NodeFacts(
        torchrun=("p",), local_ranks=1, torch_host="fd00::11", rdzv_port=29400, collective_ifname=""
    )
    argv, _ = torchrun.build(v6, request(is_host=True, rdzv_endpoint="[fd00::11]:29400"), "x-1")
    assert "--local-addr=fd00::11" in argv
    for bad in ("fd00::11:29400", "h:", ":1", "h:0", "h:65536"):
        with pytest.raises(ValueError):
            torchrun.split_endpoint(bad)
