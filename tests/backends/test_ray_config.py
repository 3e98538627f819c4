"""The `[ray]` section and the agent's command line (no Ray cluster: fast), and a controller host
without the ray package (the backend is imported only when chosen)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from controller.backends.base import BackendError, Scheduler
from controller.live.schedulers import build_scheduler
from runwarden.config import ConfigError


def test_a_controller_without_ray_starts_and_says_what_to_install() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["ray"] = None  # as if the package were not installed
        from controller.live.schedulers import build_scheduler
        from runwarden.config import ConfigError
        print(type(build_scheduler("agents", {}, "[agents]")).__name__)
        try:
            build_scheduler("ray", {}, "[ray]")
        except ConfigError as exc:
            print(exc)
        assert sys.modules["ray"] is None
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.splitlines() == ["StaticFleet", "[ray]: backend 'ray' needs ray: install the ray extra"]


pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")

from controller.backends.ray import RayConfig, RayScheduler, agent_argv, node_name  # noqa: E402


def test_the_section_builds_a_scheduler_without_touching_ray() -> None:
    sched = build_scheduler("ray", {"address": "10.0.0.1:6379", "namespace": "runwarden-llm"}, "[ray]")
    assert isinstance(sched, RayScheduler) and isinstance(sched, Scheduler)
    assert sched.config.bundle == {"CPU": 1.0} and not sched._connected
    sched.check_stop_fits(1e6)  # Ray gives no kill notice: nothing to check
    # the controller's run names the namespace unless the section does
    assert build_scheduler("ray", {}, "[ray]", run="llm").config.namespace == "runwarden-llm"
    assert build_scheduler("ray", {"namespace": "x"}, "[ray]", run="llm").config.namespace == "x"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"adress": "auto"}, r"unknown key\(s\) adress"),
        ({"namespace": "a/b"}, "namespace"),
        ({"bundle": {}}, "bundle: at least one resource"),
        ({"bundle": {"GPU": 0}}, "bundle.GPU: must be a number > 0"),
        ({"bundle": {"node:10.0.0.1": 1}}, "node:\\* is runwarden's"),
        ({"agent_run_dir": "relative"}, "agent_run_dir: must be an absolute path"),
        ({"agent_port": 0}, "agent_port must be within 1..65535"),
        ({"etcd_endpoints": ["no-port"]}, "is not host:port"),
        ({"stop_timeout_s": 0}, "must be > 0"),
        ({"nodeagent": ["python", ""]}, "nodeagent: an argv"),
        ({"address": ""}, "is not a Ray address"),
    ],
)
def test_bad_sections_are_refused(raw: dict[str, object], message: str) -> None:
    with pytest.raises(BackendError, match=message):
        RayScheduler.from_section(raw, "[ray]")
    with pytest.raises(ConfigError, match=message):
        build_scheduler("ray", raw, "[ray]")


def test_node_names_and_the_agent_line() -> None:
    assert node_name("10.1.2.3") == "ray-10.1.2.3"
    assert node_name("fd00::1") == "ray-fd00--1"
    cfg = RayConfig(
        agent_config="/etc/runwarden/nodeagent.toml",
        etcd_endpoints=("10.0.0.9:2379",),
        etcd_root="/rw",
        agent_port=50055,
        metrics_port=9400,
        agent_args=("--lease-ttl", "3"),
    )
    assert agent_argv(cfg, ip="10.1.2.3", python="/venv/bin/python") == [
        "/venv/bin/python", "-m", "nodeagent.daemon.cli",
        "--config", "/etc/runwarden/nodeagent.toml",
        "--node", "ray-10.1.2.3",
        "--listen", "10.1.2.3:50055", "--advertise", "10.1.2.3:50055",
        "--unix-socket", "/run/runwarden/ray-10.1.2.3/agent.sock",
        "--run-dir", "/run/runwarden/ray-10.1.2.3/run",
        "--metrics-listen", "10.1.2.3:9400",
        "--etcd", "10.0.0.9:2379", "--etcd-root", "/rw",
        "--lease-ttl", "3",
    ]  # fmt: skip
    line = agent_argv(RayConfig(nodeagent=("nodeagent",)), ip="fd00::1", python="/x")
    assert (
        line[:1] == ["nodeagent"]
        and "[fd00::1]:50051" in line
        and line[line.index("--metrics-listen") + 1] == ""
    )


def test_the_ray_section_in_deploy_readme_loads() -> None:
    """deploy/README.md's example `[ray]` table is a section RayScheduler accepts."""
    import tomllib
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "deploy" / "README.md").read_text()
    block = text.split("## Ray\n", 1)[1].split("    [controller]\n", 1)[1].split("\n\nOther keys", 1)[0]
    raw = tomllib.loads(
        "[controller]\n" + "\n".join(line.removeprefix("    ") for line in block.splitlines())
    )
    assert raw["controller"]["backend"] == "ray"
    sched = build_scheduler("ray", raw["ray"], "deploy/README.md [ray]", run=raw["controller"]["run"])
    assert isinstance(sched, RayScheduler)
    assert sched.config.namespace == "runwarden-llm" and sched.config.bundle == {"CPU": 96.0, "GPU": 8.0}
