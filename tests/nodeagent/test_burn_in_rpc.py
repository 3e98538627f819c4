"""RunPreflight(mode="burn_in") through the real agent and the real preflight library, every stage on
its CPU path (no GPU here: the NVML counters and DCGM say SKIP with why), and the mode's validation."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from nodeagent.daemon.validate import ValidationError, preflight_request
from runwarden.v1 import agent_pb2, common_pb2

STAGES = ["matmul", "memory", "dcgm", "allreduce", "storage"]


def test_burn_in_streams_each_stage_in_order_then_a_summary(agent_factory, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    config = tmp_path / "preflight.toml"
    config.write_text(
        "[compute]\ndevice = 'cpu'\n"
        "[collective]\nsize_bytes_cpu = 262144\n"
        "[dcgm]\ndcgmi = '/nonexistent/dcgmi'\n"
        f"[storage]\ncheckpoint_path = '{ckpt}'\nfree_space_floor_gb = 0.001\nthroughput_mb = 2\n"
        "[burn_in]\nmatmul_duration_s_cpu = 0.3\nmatmul_size_cpu = 64\nmemory_mb_cpu = 2\n"
        "allreduce_duration_s_cpu = 0.3\nallreduce_min_ratio = 0.05\nstage_slack_s = 60.0\n"
    )
    agent = agent_factory(flags=["--preflight-config", str(config)])
    items = list(agent.stub.RunPreflight(agent_pb2.RunPreflightRequest(mode="burn_in"), timeout=180))
    results = [i.result for i in items if i.HasField("result")]
    assert items[-1].HasField("summary") and all(i.HasField("result") for i in items[:-1])
    stages = [r.name.split(".")[1] for r in results if r.name.startswith("burn_in.")]
    assert list(dict.fromkeys(stages)) == STAGES  # every stage, each streamed together, in order
    # and the agent's quick preflight units, as its next launch runs them (leftovers included)
    quick = {r.name.split(".")[0] for r in results if not r.name.startswith("burn_in.")}
    assert {"inventory", "errors", "processes", "preflight"} <= quick, quick
    by_name = {r.name: r for r in results}
    for stage in ("matmul", "memory", "allreduce"):
        assert by_name[f"burn_in.{stage}"].status == common_pb2.CHECK_STATUS_PASS, by_name[f"burn_in.{stage}"]
    assert by_name["burn_in.dcgm.diag"].status == common_pb2.CHECK_STATUS_SKIP
    assert by_name["burn_in.storage.throughput"].status == common_pb2.CHECK_STATUS_PASS
    summary = items[-1].summary
    assert summary.mode == "burn_in" and summary.passed and summary.fail_count == 0
    assert summary.pass_count + summary.skip_count + summary.warn_count == len(results)


def test_burn_in_mode_and_its_longer_budget_are_accepted_others_refused() -> None:
    preflight_request(agent_pb2.RunPreflightRequest(mode="burn_in", budget_s=3600))
    preflight_request(agent_pb2.RunPreflightRequest(mode="full", budget_s=600))
    with pytest.raises(ValidationError, match="'quick', 'full' or 'burn_in'"):
        preflight_request(agent_pb2.RunPreflightRequest(mode="burnin"))
    with pytest.raises(ValidationError, match="budget_s"):
        preflight_request(agent_pb2.RunPreflightRequest(mode="quick", budget_s=3600))


def test_an_unknown_burn_in_stage_is_invalid_argument(agent_factory) -> None:
    agent = agent_factory()
    with pytest.raises(grpc.RpcError) as err:
        list(
            agent.stub.RunPreflight(
                agent_pb2.RunPreflightRequest(mode="burn_in", only=["gpu_burn"]), timeout=60
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "gpu_burn" in err.value.details()


def test_a_preflight_asked_while_another_runs_waits_for_it_instead_of_being_refused(
    agent_factory, tmp_path: Path
) -> None:
    """A spare's check still running when the run's relaunch asks the spare for its preflight: a
    refusal left the spare out of the attempt (and a run with no other spare waiting for nodes)."""
    import threading

    from tests.nodeagent.helpers import wait_for

    config = tmp_path / "preflight.toml"
    config.write_text(
        "[compute]\ndevice = 'cpu'\n[dcgm]\ndcgmi = '/nonexistent/dcgmi'\n"
        "[burn_in]\nmatmul_duration_s_cpu = 3.0\nmatmul_size_cpu = 64\nstage_slack_s = 60.0\n"
    )
    agent = agent_factory(flags=["--preflight-config", str(config)])
    first: list[agent_pb2.RunPreflightResponse] = []
    busy = threading.Thread(
        target=lambda: first.extend(
            agent.stub.RunPreflight(
                agent_pb2.RunPreflightRequest(mode="burn_in", only=["matmul"]), timeout=120
            )
        )
    )
    busy.start()
    try:
        status = agent_pb2.GetNodeStatusRequest()
        wait_for(
            lambda: agent.stub.GetNodeStatus(status).state == common_pb2.NODE_STATE_PREFLIGHT, 60, "busy"
        )
        items = list(
            agent.stub.RunPreflight(
                agent_pb2.RunPreflightRequest(mode="quick", only=["inventory"]), timeout=60
            )
        )
    finally:
        busy.join(120)
    assert first and first[-1].HasField("summary"), "the first preflight did not finish"
    assert items[-1].HasField("summary") and items[-1].summary.mode == "quick"
