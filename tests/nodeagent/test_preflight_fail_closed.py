"""The agent fails closed on a GPU host: a preflight that finds the expected GPUs unreachable makes
the host UNHEALTHY (fatal evidence) and the agent launches nothing; on a CPU host the same checks
SKIP and the node stays READY. The real agent and the real NVML library (pynvml): on this machine
its init genuinely fails (no driver); an NVIDIA GPU on a fake PCI sysfs tree makes GPUs expected."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import pytest

from nodeagent.daemon.preflight_bridge import fail_closed_evidence
from preflight.result import failed
from runwarden.evidence import is_fatal
from runwarden.v1 import agent_pb2, common_pb2
from tests.nodeagent.helpers import ROOT
from tests.preflight.test_fail_closed import fake_bus


def _nvml_inits() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


def _agent_with_bus(agent_factory, tmp_path: Path, gpus: list[str]):  # fixtures
    config = tmp_path / "preflight.toml"
    config.write_text(f'[inventory]\nsysfs_root = "{fake_bus(tmp_path / "sys", gpus)}"\n')
    return agent_factory(flags=["--preflight-config", str(config), "--allow-exec", sys.executable])


def _preflight(
    agent, only: list[str]
) -> tuple[dict[str, common_pb2.CheckResult], common_pb2.PreflightSummary]:
    items = list(agent.stub.RunPreflight(agent_pb2.RunPreflightRequest(mode="quick", only=only), timeout=60))
    return {i.result.name: i.result for i in items if i.HasField("result")}, items[-1].summary


def _launch(agent) -> agent_pb2.LaunchWorkersResponse:
    return agent.stub.LaunchWorkers(
        agent_pb2.LaunchWorkersRequest(
            run="r1",
            attempt=1,
            argv=[sys.executable, "-c", "pass"],
            env={"PYTHONPATH": str(ROOT)},
            leader_fence=1,
        ),
        timeout=30,
    )


@pytest.mark.skipif(_nvml_inits(), reason="NVML initializes here: the test needs a host where it cannot")
def test_nvml_unreachable_on_a_gpu_host_makes_it_unhealthy_and_it_launches_nothing(agent_factory, tmp_path):
    agent = _agent_with_bus(agent_factory, tmp_path, ["0000:3b:00.0"])
    results, summary = _preflight(agent, ["inventory", "errors"])
    inventory = results["inventory"]
    assert inventory.status == common_pb2.CHECK_STATUS_FAIL, inventory
    assert "GPUs expected (1 NVIDIA GPU(s) on the PCI bus)" in inventory.message
    assert not summary.passed and set(summary.failed_checks) == {"inventory", "errors"}
    status = agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest())
    assert status.state == common_pb2.NODE_STATE_UNHEALTHY
    evidence = status.recent_evidence[-1]
    assert evidence.severity == common_pb2.SEVERITY_FATAL and "failed closed" in evidence.detail
    with pytest.raises(grpc.RpcError) as err:
        _launch(agent)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "unhealthy" in err.value.details()
    assert not agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).workers


def test_a_cpu_host_skips_the_same_checks_stays_ready_and_launches(agent_factory, tmp_path):
    if _nvml_inits():
        pytest.skip("NVML initializes here: not a CPU host")
    agent = _agent_with_bus(agent_factory, tmp_path, [])
    results, summary = _preflight(agent, ["inventory", "errors"])
    assert {r.status for r in results.values()} == {common_pb2.CHECK_STATUS_SKIP} and summary.passed
    assert agent.stub.GetNodeStatus(agent_pb2.GetNodeStatusRequest()).state == common_pb2.NODE_STATE_READY
    assert _launch(agent).pid > 0


def test_the_fail_closed_evidence_is_fatal_and_names_the_missing_bus_id():
    missing = failed(
        "inventory.gpu_count",
        "8 NVIDIA GPU(s) on the PCI bus, NVML sees 7: missing 0000:1c:00.0",
        fail_closed=True,
    )
    evidence = fail_closed_evidence("quick", [missing])
    assert is_fatal(evidence) and evidence.pci_bus_id == "0000:1c:00.0"
    assert (
        evidence.kind == common_pb2.EVIDENCE_KIND_PREFLIGHT_FAIL and "inventory.gpu_count" in evidence.detail
    )
