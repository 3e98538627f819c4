"""deploy/prometheus/alerts.yaml: promtool checks it and runs its unit tests (each alert fires on its
condition and stays silent on a healthy series), and every series it reads is one that the
controller or an agent really exports."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from controller.goodput.metrics import WindowedRatesCollector
from controller.live.metrics import ControlPlaneCollector
from nodeagent.daemon.metrics import AgentMetrics
from runwarden.eventlog import encode_entry
from runwarden.v1 import common_pb2, controller_pb2

from .test_goodput_outputs import long_run

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")
# Skipped only off CI: scripts/setup.sh installs promtool, so in CI a missing one is a failure.
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None and not os.environ.get("CI"),
    reason="promtool not installed (scripts/setup.sh installs it: Debian's prometheus package)",
)


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None, (
        "promtool is not installed: run scripts/setup.sh (Debian's prometheus package)"
    )
    return subprocess.run([PROMTOOL, *args], cwd=RULES, capture_output=True, text=True, timeout=60)


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    done = _promtool("check", "rules", "alerts.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 8 rules found" in done.stdout


@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    done = _promtool("test", "rules", "alerts_test.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


class _View:
    def leader(self) -> tuple[str, int]:
        return "controller-a", 7

    def node_infos(self) -> list[controller_pb2.NodeInfo]:
        return [
            controller_pb2.NodeInfo(node="n0", alive=True, pool_state=common_pb2.POOL_STATE_SPARE),
            controller_pb2.NodeInfo(node="n1", alive=True, pool_state=common_pb2.POOL_STATE_ASSIGNED),
            controller_pb2.NodeInfo(node="n2", alive=False, pool_state=common_pb2.POOL_STATE_SPARE),
            controller_pb2.NodeInfo(node="n3", alive=True, pool_state=99),
        ]


def _exported(tmp_path: Path) -> str:
    log = tmp_path / "events.jsonl"
    b = long_run()
    log.write_bytes(b"".join(encode_entry(e) for e in b.events))
    registry = CollectorRegistry()
    registry.register(WindowedRatesCollector(log, clock=lambda: b.events[-1].ts))
    registry.register(
        ControlPlaneCollector(
            _View(), run="llm", identity="controller-a", spares_wanted=1, is_leader=lambda: True
        )
    )
    return generate_latest(registry).decode() + generate_latest(AgentMetrics().registry).decode()


def test_every_series_the_rules_read_is_exported(tmp_path: Path) -> None:
    text = _exported(tmp_path)
    exported = set(re.findall(r"^(runwarden_\w+)", text, flags=re.M))
    used = set(re.findall(r"\b(runwarden_\w+)", (RULES / "alerts.yaml").read_text()))
    assert used and used <= exported, used - exported
    # the control plane's own series, as the rules read them
    assert 'runwarden_pool_nodes{state="spare"} 1.0' in text  # n2's lease is gone: no spare
    assert 'runwarden_controller_leader_present{run="llm"} 1.0' in text
    assert 'runwarden_controller_is_leader{identity="controller-a",run="llm"} 1.0' in text
    assert 'runwarden_pool_spares_wanted{run="llm"} 1.0' in text


def test_etcd_down_leaves_the_pool_unknown() -> None:
    from controller.api.view import ViewUnavailable

    class Down(_View):
        def leader(self) -> tuple[str, int]:
            raise ViewUnavailable("etcd: unreachable")

    registry = CollectorRegistry()
    registry.register(
        ControlPlaneCollector(Down(), run="llm", identity="b", spares_wanted=0, is_leader=lambda: False)
    )
    text = generate_latest(registry).decode()
    assert (
        "runwarden_controller_etcd_up 0.0" in text
        and 'runwarden_controller_is_leader{identity="b",run="llm"} 0.0' in text
    )
    assert "runwarden_pool_nodes{" not in text and "runwarden_controller_leader_present{" not in text
