"""The `preflight` CLI as a real process: exit codes 0 / 1 / 2, the JSON report, `baseline`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from preflight.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def preflight(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "preflight", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
        check=False,
    )


def write_config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "preflight.toml"
    path.write_text(body)
    return path


def test_quick_json_passes_on_a_healthy_cpu_host(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path,
        f"[storage]\ncheckpoint_path = '{tmp_path}'\nfree_space_floor_gb = 0.0\n[compute]\nsize_cpu = 128\n",
    )
    # The budget: the quick mode's 15 s is for a GPU host; on CI's 2 loaded cores at nice 10 the
    # matmul's subprocess alone (importing torch) has taken 14.6 s and was killed at the budget.
    proc = preflight("run", "--quick", "--json", "--budget", "90", "--config", str(cfg), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema"] == "runwarden.preflight.report" and doc["mode"] == "quick" and doc["passed"]
    statuses = {r["name"]: r["status"] for r in doc["results"]}
    assert statuses["storage.checkpoint_writable"] == "PASS"
    assert statuses["compute.matmul"] == "PASS"
    if not os.path.exists("/dev/nvidiactl"):
        assert statuses["inventory"] == "SKIP"  # no NVML here: skipped, never passed
    assert doc["budget_s"] == 90 and doc["duration_s"] <= doc["budget_s"]  # speed: bench/bench_preflight.py


def test_a_failing_check_exits_1_with_a_table(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, f"[storage]\ncheckpoint_path = '{tmp_path / 'absent'}'\n")
    proc = preflight("run", "--config", str(cfg), "--only", "storage")
    assert proc.returncode == 1, proc.stderr
    assert "FAIL" in proc.stdout and "does not exist" in proc.stdout and "FAILED" in proc.stdout


@pytest.mark.parametrize("args", [["run", "--config", "/nonexistent.toml"], ["run", "--only", "nope"]])
def test_could_not_run_exits_2(args: list[str]) -> None:
    proc = preflight(*args)
    assert proc.returncode == 2 and proc.stderr.startswith("preflight: ")


def test_bad_config_key_exits_2(tmp_path: Path) -> None:
    proc = preflight("run", "--config", str(write_config(tmp_path, "[storage]\npath = '/x'\n")))
    assert proc.returncode == 2 and "unknown key(s) path" in proc.stderr


@pytest.mark.slow
def test_baseline_writes_floors_into_the_config(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path, "[compute]\nsize_cpu = 128\n[collective]\nsize_bytes_cpu = 65536\niterations = 3\n"
    )
    proc = preflight("baseline", "--config", str(cfg), "--margin", "0.5", timeout=180)
    assert proc.returncode == 0, proc.stderr
    config = load_config(cfg)
    assert config.compute.tflops_floor > 0 and config.collective.busbw_floor_gbps > 0
    assert config.compute.size_cpu == 128  # the rest of the file is kept
    assert "written by `preflight baseline`" in cfg.read_text()
    again = preflight(
        "run", "--full", "--json", "--config", str(cfg), "--only", "compute", "--only", "collective"
    )
    assert again.returncode in (0, 1), again.stderr  # 1 only if this shared CPU got 2x slower meanwhile
    thresholds = {r["name"]: r["threshold"] for r in json.loads(again.stdout)["results"]}
    assert thresholds == {
        "compute.matmul": config.compute.tflops_floor,
        "collective.all_reduce": config.collective.busbw_floor_gbps,
    }


@pytest.mark.slow
def test_the_library_never_imports_torch_into_the_caller(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path, "[compute]\nsize_cpu = 64\n[collective]\nsize_bytes_cpu = 4096\niterations = 1\n"
    )
    code = f"""
import sys
import preflight
config = preflight.load_config({str(cfg)!r})
seen = []
report = preflight.run_preflight(config, "full", on_result=seen.append)
names = {{r.name: r.status.value for r in report.results}}
assert names["compute.matmul"] == "PASS" and names["collective.all_reduce"] == "PASS", names
assert len(seen) == len(report.results)
assert "torch" not in sys.modules, "torch was imported into the caller"
print("ok", report.summary().pass_count)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr
