"""The agent's preflight fills unset expected values from the agent's config and says so."""

from __future__ import annotations

import dataclasses

import pytest

from nodeagent.daemon.config import AgentConfig
from nodeagent.daemon.preflight_defaults import fill
from preflight.config import PreflightConfig
from preflight.gpus import NOT_EXPECTED, GpuExpectation
from runwarden.config import ConfigError
from runwarden.v1 import agent_pb2, common_pb2


def _agent_config(**kw: object) -> AgentConfig:
    return AgentConfig(node="n1", listen="", unix_socket="/tmp/x.sock", **kw)


def test_unset_values_come_from_the_agent_config_set_ones_stay() -> None:
    agent = _agent_config(
        local_ranks=8,
        expected_driver_version="550.127.05",
        expected_cuda_version="12.4",
        checkpoint_dir="/mnt/ckpt",
        preflight_config="/etc/runwarden/preflight.toml",
    )
    base = PreflightConfig()
    base = dataclasses.replace(base, inventory=dataclasses.replace(base.inventory, cuda_version="12.6"))
    on_the_bus = GpuExpectation(reasons=("8 NVIDIA GPU(s) on the PCI bus",))
    config, sources = fill(base, agent, on_the_bus)
    assert config.inventory.expected_gpu_count == 8 and config.inventory.driver_version == "550.127.05"
    assert config.inventory.cuda_version == "12.6"  # the preflight config's own value wins
    assert config.storage.checkpoint_path == "/mnt/ckpt"
    assert sources["inventory.expected_gpu_count"] == "agent config local_ranks"
    assert sources["storage.checkpoint_path"] == "agent config checkpoint_dir"
    assert sources["inventory.cuda_version"] == "preflight config /etc/runwarden/preflight.toml"
    assert sources["compute.tflops_floor"] == "preflight config /etc/runwarden/preflight.toml"


def test_local_ranks_is_no_gpu_count_where_nothing_expects_gpus() -> None:
    """A CPU cluster runs local_ranks gloo ranks: with no GPU on the bus, no allocation and no
    device = "cuda", local_ranks does not make the node expect GPUs (its checks SKIP, not FAIL)."""
    config, sources = fill(PreflightConfig(), _agent_config(local_ranks=2), NOT_EXPECTED)
    assert config.inventory.expected_gpu_count == 0
    assert sources["inventory.expected_gpu_count"] == "preflight defaults"


def test_nothing_configured_changes_nothing() -> None:
    config, sources = fill(PreflightConfig(), _agent_config())
    assert config == PreflightConfig() and set(sources.values()) == {"preflight defaults"}


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("checkpoint_dir", "relative/ckpt"),
        ("expected_driver_version", "550 beta"),
        ("expected_cuda_version", "x"),
    ],
)
def test_bad_values_are_config_errors(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=key):
        _agent_config(**{key: value})


def test_the_agents_storage_check_uses_its_checkpoint_dir_and_says_so(agent_factory, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    agent = agent_factory(env={"RUNWARDEN_AGENT_CHECKPOINT_DIR": str(ckpt)})
    items = list(
        agent.stub.RunPreflight(
            agent_pb2.RunPreflightRequest(mode="quick", only=["storage", "expectations"]), timeout=60
        )
    )
    results = {i.result.name: i.result for i in items if i.HasField("result")}
    writable = results["storage.checkpoint_writable"]
    assert writable.status == common_pb2.CHECK_STATUS_PASS and str(ckpt) in writable.message
    expected = results["preflight.expected_values"]
    assert f"storage.checkpoint_path = {str(ckpt)!r} (agent config checkpoint_dir)" in expected.evidence
    assert "inventory.expected_gpu_count = 0 (unset: not checked)" in expected.evidence
