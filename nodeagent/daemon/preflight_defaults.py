"""What the agent's preflight checks against when the preflight config leaves a value unset.

The preflight config (`preflight_config`, else preflight's defaults) wins wherever it sets a value;
where it leaves one unset, the agent's own config supplies it:

    inventory.expected_gpu_count   <- local_ranks            one rank per GPU: the GPUs the node must have,
                                                             where GPUs are expected (see below)
    inventory.driver_version       <- expected_driver_version   the versions the node's image was built for
    inventory.cuda_version         <- expected_cuda_version
    storage.checkpoint_path        <- checkpoint_dir         this node's path to the runs' checkpoints

The checkpoint directory comes from the agent's config because nothing else the agent holds names it:
the trainer takes its checkpoint root in its own argv, a launch request carries no path, and the run
spec's `checkpoint_dir` in etcd is not written by the controller. The result `preflight.expected_values`
says where each value came from (preflight.checks.expectations).

`local_ranks` is the GPU count only where another source already expects GPUs here (the scheduler's
allocation, NVIDIA GPUs on the PCI bus, [compute] device = "cuda": preflight.gpus): a CPU cluster
runs local_ranks gloo ranks and has no GPU to count. Where GPUs are expected, the count it gives
is checked, and the checks fail closed.
"""

from __future__ import annotations

import dataclasses

from nodeagent.daemon.config import AgentConfig
from preflight.checks.expectations import EXPECTED
from preflight.config import PreflightConfig
from preflight.gpus import GpuExpectation, expect_gpus


def fill(
    config: PreflightConfig, agent: AgentConfig, gpus: GpuExpectation | None = None
) -> tuple[PreflightConfig, dict[str, str]]:
    """`config` with its unset expected values taken from `agent`, and where each value came from.
    `gpus`: where GPUs are expected (default: read from this host, preflight.gpus)."""
    gpus = expect_gpus(config) if gpus is None else gpus
    filled = {
        ("inventory", "expected_gpu_count"): (agent.local_ranks if gpus.expected else 0, "local_ranks"),
        ("inventory", "driver_version"): (agent.expected_driver_version, "expected_driver_version"),
        ("inventory", "cuda_version"): (agent.expected_cuda_version, "expected_cuda_version"),
        ("storage", "checkpoint_path"): (agent.checkpoint_dir, "checkpoint_dir"),
    }
    origin = f"preflight config {agent.preflight_config}" if agent.preflight_config else "preflight defaults"
    sources: dict[str, str] = {}
    changes: dict[str, dict[str, object]] = {}
    for section, key in EXPECTED:
        value, agent_key = filled.get((section, key), (None, ""))
        if not getattr(getattr(config, section), key) and value:
            changes.setdefault(section, {})[key] = value
            sources[f"{section}.{key}"] = f"agent config {agent_key}"
        else:
            sources[f"{section}.{key}"] = origin
    sections = {name: dataclasses.replace(getattr(config, name), **kw) for name, kw in changes.items()}
    return dataclasses.replace(config, **sections), sources
