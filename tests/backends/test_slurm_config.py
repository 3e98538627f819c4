"""SlurmScheduler's `[slurm]` section and its stop budget (no cluster needed)."""

from __future__ import annotations

import pytest

from controller.backends.base import BackendError
from controller.backends.slurm import DEFAULT_BATCH_SCRIPT, SlurmScheduler
from controller.live.schedulers import build_scheduler
from runwarden.config import ConfigError


def test_from_section_defaults_to_the_shipped_batch_script() -> None:
    scheduler = SlurmScheduler.from_section({"job_name": "runwarden-llm"}, "[slurm]")
    assert scheduler.config.batch_script == DEFAULT_BATCH_SCRIPT
    assert DEFAULT_BATCH_SCRIPT.endswith("deploy/slurm/agents.sbatch")
    assert scheduler.config.request_job_name == "runwarden-llm-more"
    assert scheduler.config.signal_lead_s == 300 and scheduler.config.nodeagent == ("nodeagent",)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"job_nmae": "x"}, "unknown key.*job_nmae"),
        ({"job_name": "run,other"}, "job_name"),
        ({"job_name": "a b"}, "job_name"),
        ({"etcd_endpoints": ["etcd1"]}, "host:port"),
        ({"etcd_endpoints": "etcd1:2379"}, "expected a list"),
        ({"nodeagent": []}, "nodeagent"),
        ({"nodeagent": ["python -m nodeagent.daemon.cli"]}, "whitespace"),
        ({"agent_run_dir": "run"}, "absolute"),
        ({"signal_lead_s": 70000}, "signal_lead_s"),
        ({"allocate_timeout_s": 0}, "must be > 0"),
        ({"batch_script": "/nonexistent/agents.sbatch"}, "no such file"),
        ({"sbatch_args": ["-N", "2"]}, "long-option"),
    ],
)
def test_bad_sections_are_refused(section: dict, message: str) -> None:
    with pytest.raises(BackendError, match=message):
        SlurmScheduler.from_section(section, "[slurm]")


def test_the_live_shell_builds_it_from_its_section_with_the_run_name() -> None:
    scheduler = build_scheduler("slurm", {}, "[slurm]", run="llm")
    assert isinstance(scheduler, SlurmScheduler)
    assert scheduler.config.job_name == "runwarden-llm"
    named = build_scheduler("slurm", {"job_name": "mine"}, "[slurm]", run="llm")
    assert isinstance(named, SlurmScheduler) and named.config.job_name == "mine"
    with pytest.raises(ConfigError, match=r"\[slurm\].*unknown key"):
        build_scheduler("slurm", {"partitoin": "gpu"}, "[slurm]")


def test_check_stop_fits_compares_the_save_with_slurms_notice() -> None:
    scheduler = SlurmScheduler.from_section({"signal_lead_s": 120}, "[slurm]")
    scheduler.check_stop_fits(0.0)
    scheduler.check_stop_fits(119.0)
    with pytest.raises(BackendError, match="signal_lead_s"):
        scheduler.check_stop_fits(150.0)
    graced = SlurmScheduler.from_section({"preempt_grace_s": 60}, "[slurm]")
    graced.check_stop_fits(59.0)
    with pytest.raises(BackendError, match="GraceTime of 60s"):
        graced.check_stop_fits(61.0)
    SlurmScheduler.from_section({"signal_lead_s": 0}, "[slurm]").check_stop_fits(1e6)  # no signal: unchecked


def test_the_slurm_section_in_deploy_readme_loads() -> None:
    """deploy/README.md's example `[slurm]` table is a section SlurmScheduler accepts."""
    import tomllib
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "deploy" / "README.md").read_text()
    block = text.split("    [controller]\n", 1)[1].split("\n\nOther keys", 1)[0]
    raw = tomllib.loads(
        "[controller]\n" + "\n".join(line.removeprefix("    ") for line in block.splitlines())
    )
    assert raw["controller"]["backend"] == "slurm"
    scheduler = SlurmScheduler.from_section(raw["slurm"], "deploy/README.md [slurm]")
    assert scheduler.config.etcd_endpoints == ("etcd1:2379", "etcd2:2379", "etcd3:2379")
    assert scheduler.config.sbatch_args == ("--gres=gpu:8", "--account=ml")
