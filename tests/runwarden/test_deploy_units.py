"""The shipped systemd units: `systemd-analyze verify` finds nothing to say about them, and the agent's
unit signals the agent alone (KillMode=process), so a crashed or watchdog-killed agent restarts
without taking its ranks down (tests/nodeagent/test_agent_restart.py runs the same semantics: the
agent's PID killed alone)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "deploy" / "systemd"


def _service_section(unit: Path) -> dict[str, str]:
    """The [Service] keys (the last assignment wins, as in systemd)."""
    section, keys = "", {}
    for raw in unit.read_text().splitlines():
        line = raw.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            keys[key.strip()] = value.strip()
    return keys


def test_the_agent_unit_restarts_the_agent_alone() -> None:
    keys = _service_section(UNITS / "nodeagent.service")
    assert keys["KillMode"] == "process"
    assert keys["Restart"] == "always"
    assert keys["Type"] == "notify" and keys["WatchdogSec"]


@pytest.mark.parametrize("name", ["nodeagent.service", "controller.service"])
def test_systemd_analyze_verify_says_nothing(name: str, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("skipped: no systemd-analyze (Debian package `systemd`)")
    unit = UNITS / name
    program = _service_section(unit)["ExecStart"].split()[0]
    # verify insists that ExecStart's program exists: the copy points at a stand-in, nothing else changes
    stand_in = tmp_path / Path(program).name
    stand_in.write_text("#!/bin/sh\n")
    stand_in.chmod(0o755)
    copy = tmp_path / name
    copy.write_text(unit.read_text().replace(program, str(stand_in)))
    out = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60)
    # verify exits 0 on a key it ignores (a typo, a bad value): its silence is the check
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


def test_the_verify_check_can_fail(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("skipped: no systemd-analyze (Debian package `systemd`)")
    bad = tmp_path / "bad.service"
    bad.write_text("[Service]\nExecStart=/bin/true\nKillMode=procss\n")
    out = subprocess.run([analyze, "verify", str(bad)], capture_output=True, text=True, timeout=60)
    assert "kill mode" in (out.stdout + out.stderr).lower()
