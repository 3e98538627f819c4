"""A structured launch through a real agent on its own loopback address: the agent builds torchrun's
line from its own config (prefix, ranks, advertised host, interface) and reports its rendezvous."""

from __future__ import annotations

import json
import shlex
import sys

import grpc
import pytest

from runwarden.v1 import agent_pb2, store_pb2
from tests.nodeagent.helpers import ROOT, wait_for

# Stands in for torchrun: writes the argv and the interface variables it was started with.
DUMP = (
    "import json, os, sys; "
    "json.dump({'argv': sys.argv[1:], 'gloo': os.environ.get('GLOO_SOCKET_IFNAME'), "
    "'nccl': os.environ.get('NCCL_SOCKET_IFNAME'), 'run': os.environ.get('RUNWARDEN_RUN')}, "
    "open(os.environ['DUMP_TO'], 'w'))"
)


def _agent(agent_factory, etcd, store, *flags: str):
    return agent_factory(
        etcd=etcd.endpoint,
        etcd_root=store.keys.root,
        flags=[
            "--listen",
            "127.0.0.11:0",
            "--allow-exec",
            sys.executable,
            "--torchrun",
            shlex.join([sys.executable, "-c", DUMP]),
            "--local-ranks",
            "3",
            "--collective-ifname",
            "lo",
            *flags,
        ],
    )


def _record(store) -> store_pb2.NodeRecord:
    kv = wait_for(lambda: store.get(store.keys.node("n1")), 10, "the node record")
    return store_pb2.NodeRecord.FromString(kv.value)


def test_the_agent_reports_its_rendezvous_and_builds_its_own_line(agent_factory, etcd, store, tmp_path):
    agent = _agent(agent_factory, etcd, store, "--rdzv-port", "29411")
    rec = _record(store)
    assert rec.address.startswith("127.0.0.11:") and rec.torch_host == "127.0.0.11"
    assert rec.rdzv_port == 29411 and rec.local_ranks == 3
    out = tmp_path / "line.json"
    agent.stub.LaunchWorkers(
        agent_pb2.LaunchWorkersRequest(
            run="r1",
            attempt=2,
            rendezvous_id="r1-2",
            env={"DUMP_TO": str(out), "PYTHONPATH": str(ROOT)},
            nnodes=2,
            node_rank=0,
            torchrun=agent_pb2.TorchrunLaunch(
                command=["train.py", "--steps", "3"], rdzv_endpoint="127.0.0.11:29411", is_host=True
            ),
        ),
        timeout=10,
    )
    got = json.loads(wait_for(lambda: out.exists() and out.read_text(), 20, "the line").strip())
    assert got["argv"] == [
        "--nnodes=2",
        "--nproc-per-node=3",
        "--node-rank=0",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.11:29411",
        "--rdzv-id=r1-2",
        "--rdzv-conf=is_host=true",
        "--local-addr=127.0.0.11",
        "--max-restarts=0",
        "train.py",
        "--steps",
        "3",
    ]
    assert (got["gloo"], got["nccl"], got["run"]) == ("lo", "lo", "r1")


def test_a_picked_port_is_reported_and_a_stale_endpoint_refused(agent_factory, etcd, store):
    agent = _agent(agent_factory, etcd, store)  # rdzv_port 0: picked at start-up
    rec = _record(store)
    assert 0 < rec.rdzv_port <= 65535 and rec.torch_host == "127.0.0.11"
    stale = f"127.0.0.11:{rec.rdzv_port % 60000 + 1}"
    with pytest.raises(grpc.RpcError) as err:
        agent.stub.LaunchWorkers(
            agent_pb2.LaunchWorkersRequest(
                run="r1",
                attempt=1,
                nnodes=1,
                torchrun=agent_pb2.TorchrunLaunch(command=["t.py"], rdzv_endpoint=stale, is_host=True),
            ),
            timeout=10,
        )
    assert (
        err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "stale node record" in err.value.details()
    )
    assert not agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).workers  # nothing was started


def test_a_torchrun_prefix_that_is_not_allowed_is_refused(agent_factory, etcd, store):
    agent = agent_factory(
        etcd=etcd.endpoint, etcd_root=store.keys.root, flags=["--torchrun", "/bin/sh -c true"]
    )
    rec = _record(store)
    with pytest.raises(grpc.RpcError) as err:
        agent.stub.LaunchWorkers(
            agent_pb2.LaunchWorkersRequest(
                run="r1",
                attempt=1,
                nnodes=1,
                torchrun=agent_pb2.TorchrunLaunch(
                    command=["t.py"], rdzv_endpoint=f"127.0.0.1:{rec.rdzv_port}", is_host=True
                ),
            ),
            timeout=10,
        )
    assert (
        err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "allowed_executables" in err.value.details()
    )
