"""RunPreflight through the real agent and the real preflight library (no GPU here: NVML checks SKIP)."""

from __future__ import annotations

import grpc
import pytest

from runwarden.v1 import agent_pb2, common_pb2, store_pb2
from tests.nodeagent.helpers import wait_for


def test_run_preflight_streams_results_then_summary_into_node_record(etcd, store, agent_factory):
    agent = agent_factory(etcd=etcd.endpoint, etcd_root=store.keys.root)
    items = list(
        agent.stub.RunPreflight(
            agent_pb2.RunPreflightRequest(mode="quick", only=["inventory", "xid"]), timeout=120
        )
    )
    results = [i.result for i in items if i.HasField("result")]
    assert items[-1].HasField("summary") and all(i.HasField("result") for i in items[:-1])
    assert results and any(r.name.startswith("inventory") for r in results)
    assert any(r.name == "errors.xid" for r in results)
    summary = items[-1].summary
    assert summary.mode == "quick"
    assert summary.pass_count + summary.warn_count + summary.fail_count + summary.skip_count == len(results)
    assert summary.passed == (summary.fail_count == 0)
    assert agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).last_preflight == summary

    def recorded():
        record = store_pb2.NodeRecord.FromString(store.get(store.keys.node("n1")).value)
        return record.last_preflight == summary and record.state == common_pb2.NODE_STATE_READY

    wait_for(recorded, 5, "the summary in the node record")


def test_run_preflight_unknown_check_is_invalid_argument(agent_factory):
    agent = agent_factory()
    with pytest.raises(grpc.RpcError) as err:
        list(
            agent.stub.RunPreflight(agent_pb2.RunPreflightRequest(mode="quick", only=["nosuch"]), timeout=60)
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nosuch" in err.value.details()
