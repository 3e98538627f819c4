"""Issue 32: runwarden installed from its built wheel on the two kinds of host, each in a clean
virtualenv that scripts/test_compat.sh makes:

* an agent host: this interpreter's virtualenv, the wheel with its ``[torch]`` extra and a torch at
  one end of the supported range;
* a controller host: ``$RUNWARDEN_TESTBED_CONTROLLER_BIN``, the wheel alone, without torch.

The live tests that script runs next (tests/e2e/test_live_controller.py, the unmodified script) drive
agents from the first and a controller and controllerctl from the second. In the main suite there is
no such install: skipped there, with that reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.fleet_cluster import ENV_CONTROLLER_BIN

CONTROLLER_BIN = os.environ.get(ENV_CONTROLLER_BIN, "")
pytestmark = pytest.mark.skipif(
    not CONTROLLER_BIN, reason="scripts/test_compat.sh runs it against the wheel's installs"
)
REPO = Path(__file__).resolve().parents[2]


def _run(argv: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def _where(python: Path, modules: str, cwd: Path) -> dict[str, str]:
    out = _run(
        [
            str(python),
            "-c",
            f"import importlib, json; print(json.dumps({{m: importlib.import_module(m).__file__ "
            f"for m in {modules.split()!r}}}))",
        ],
        cwd,
    )
    assert out.returncode == 0, out.stderr
    found: dict[str, str] = json.loads(out.stdout)
    return found


def test_each_host_runs_runwarden_from_its_own_install_and_the_controller_host_has_no_torch(
    tmp_path: Path,
) -> None:
    agent_python = Path(sys.executable)
    controller_python = Path(CONTROLLER_BIN) / "python"
    agent = _where(agent_python, "runwarden nodeagent nodeagent.trainer preflight torch", tmp_path)
    controller = _where(controller_python, "runwarden controller controller.live.main", tmp_path)
    for name, path in {**agent, **controller}.items():
        assert "site-packages" in path and not path.startswith(str(REPO)), (name, path)
    no_torch = _run([str(controller_python), "-c", "import torch"], tmp_path)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    # what the programs read at run time came with the wheel
    data = _run(
        [
            str(agent_python),
            "-c",
            "import importlib.resources as r; print(r.files('preflight').joinpath('defaults.toml').is_file())",
        ],
        tmp_path,
    )
    assert data.stdout.strip() == "True", data.stderr


def test_the_torch_here_is_inside_the_supported_range() -> None:
    import torch

    from nodeagent.trainer.torch_api import SUPPORTED, parse_version, supported

    assert supported(parse_version(torch.__version__)), (torch.__version__, SUPPORTED)


def test_the_programs_of_both_hosts_start_and_answer(tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent
    for program in (bin_dir / "nodeagent", bin_dir / "preflight"):
        out = _run([str(program), "--help"], tmp_path)
        assert out.returncode == 0 and "usage:" in out.stdout, out.stderr
    for program in (Path(CONTROLLER_BIN) / "controller", Path(CONTROLLER_BIN) / "controllerctl"):
        out = _run([str(program), "--help"], tmp_path)
        assert out.returncode == 0 and "usage:" in out.stdout, out.stderr
    # preflight's compute check runs the known-answer matmul on this torch (the CPU: no GPU expected)
    config = tmp_path / "preflight.toml"
    config.write_text('[compute]\ndevice = "cpu"\n')
    report = _run(
        [str(bin_dir / "preflight"), "run", "--only", "compute", "--json", "--config", str(config)], tmp_path
    )
    assert report.returncode == 0, report.stdout + report.stderr
    results = json.loads(report.stdout)
    assert results["passed"] and [r["name"] for r in results["results"]] == ["compute.matmul"], results
    assert results["results"][0]["status"] == "PASS" and "exact result" in results["results"][0]["message"]
