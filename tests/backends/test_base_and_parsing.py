"""The backend contract's values and the Slurm output parsers (no cluster needed)."""

from __future__ import annotations

import pytest

from controller.backends.base import AttemptSpec, BackendError, Scheduler, attempt_env, torchrun_argv
from controller.backends.slurm import SlurmScheduler, reason_text
from controller.backends.slurm_cli import parse_sbatch_parsable, parse_sinfo_nodes, parse_squeue_jobs


def spec(**overrides: object) -> AttemptSpec:
    values: dict = {"run": "llm", "attempt": 4, "nodes": ("n1", "n2"), "command": ("python", "train.py")}
    values.update(overrides)
    return AttemptSpec(**values)


def test_rendezvous_id_is_run_and_attempt_and_torchrun_never_restarts_in_place() -> None:
    s = spec(procs_per_node=8)
    argv = torchrun_argv(s, endpoint="10.0.0.1:29500")
    assert s.rendezvous_id == "llm-4"
    assert argv[:8] == [
        "torchrun",
        "--nnodes=2",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.1:29500",
        "--rdzv-id=llm-4",
        "--max-restarts=0",
        "--no-python",
    ]
    assert argv[-2:] == ["python", "train.py"]
    env = attempt_env(spec(env={"A": "1"}))
    assert env["A"] == "1" and env["RUNWARDEN_RENDEZVOUS_ID"] == "llm-4"
    assert "RUNWARDEN_NODE" not in env


def test_a_backend_that_places_each_node_itself_gives_its_rank_and_host() -> None:
    s = spec(procs_per_node=2)
    argv = torchrun_argv(
        s, endpoint="h:1", torchrun=("python", "-m", "torch.distributed.run"), node_rank=1, no_python=False
    )
    assert "--node-rank=1" in argv and "--rdzv-conf=is_host=false" in argv and "--no-python" not in argv
    assert "--rdzv-conf=is_host=true" in torchrun_argv(s, endpoint="h:1", node_rank=0)
    assert argv[-2:] == ["python", "train.py"] and argv[:3] == ["python", "-m", "torch.distributed.run"]
    assert attempt_env(s, node="n2")["RUNWARDEN_NODE"] == "n2"


@pytest.mark.parametrize(
    "bad",
    [
        {"run": "bad/run"},
        {"run": ""},
        {"attempt": -1},
        {"nodes": ()},
        {"nodes": ("n1", "n1")},
        {"nodes": ("n1;rm -rf /",)},
        {"command": ()},
        {"command": ("a\0b",)},
        {"env": {"1BAD": "x"}},
        {"resume_step": -2},
    ],
)
def test_attempt_spec_rejects_bad_values(bad: dict) -> None:
    with pytest.raises(BackendError):
        spec(**bad)


def test_a_scheduler_with_a_stricter_name_rule_applies_it_to_its_own_config() -> None:
    from controller.backends.kubernetes import KubernetesConfig

    s = spec(run="Big_Run")  # a valid runwarden name: the local backend launches it
    assert s.rendezvous_id == "Big_Run-4"
    with pytest.raises(BackendError, match="bad run name 'Big_Run'"):
        KubernetesConfig(run="Big_Run", image="runwarden:test")  # it names JobSets: a DNS-1123 label


def test_attempt_spec_env_is_frozen() -> None:
    s = spec(env={"A": "1"})
    with pytest.raises(TypeError):
        s.env["A"] = "2"


def _conforms(slurm: SlurmScheduler) -> list[Scheduler]:
    return [slurm]  # mypy checks it against the Protocol here


def test_schedulers_implement_the_protocol() -> None:
    for cls in (SlurmScheduler,):
        missing = [
            m
            for m in ("allocate", "request_nodes", "quarantine", "release", "check_stop_fits", "finish")
            if not callable(getattr(cls, m, None))
        ]
        assert not missing and isinstance(cls.name, str), (cls, missing)


def test_sinfo_parsing_keeps_reasons_with_separators() -> None:
    text = (
        "node1|127.0.0.1|mixed|none\n"
        "node2|127.0.0.1|mixed*|none\n"
        "node3|10.0.0.3|drained|runwarden: xid 79 | step 12\n"
        "node4|10.0.0.4|down|Not responding\n"
        "node3|10.0.0.3|drained|runwarden: xid 79 | step 12\n"  # a second partition
    )
    nodes = parse_sinfo_nodes(text)
    assert list(nodes) == ["node1", "node2", "node3", "node4"]
    assert nodes["node3"].reason == "runwarden: xid 79 | step 12" and nodes["node3"].drained
    assert nodes["node2"].state == "mixed*" and not nodes["node2"].drained
    assert nodes["node4"].reason == "Not responding"


@pytest.mark.parametrize("line", ["node1|127.0.0.1|mixed", "node1|x|MIXED|none", "n;1|x|idle|none"])
def test_sinfo_parsing_rejects_unexpected_lines(line: str) -> None:
    with pytest.raises(BackendError):
        parse_sinfo_nodes(line)


def test_sbatch_parsable_and_reason_text() -> None:
    assert parse_sbatch_parsable("1234\n") == "1234"
    assert parse_sbatch_parsable("1234;cluster\n") == "1234"
    with pytest.raises(BackendError):
        parse_sbatch_parsable("Submitted batch job 1234")
    assert reason_text("xid 79\n  at step\t9") == "runwarden: xid 79 at step 9"
    assert len(reason_text("x" * 1000)) == 200


def test_squeue_jobs_parsing() -> None:
    jobs = parse_squeue_jobs("12|runwarden-llm|RUNNING|node[1-3]\n13|runwarden-llm-more|PENDING|\n")
    assert [(j.id, j.name, j.state, j.nodelist) for j in jobs] == [
        ("12", "runwarden-llm", "RUNNING", "node[1-3]"),
        ("13", "runwarden-llm-more", "PENDING", ""),
    ]
    for line in ("12|x|RUNNING", "x|y|RUNNING|n1", "12|x|running|n1"):
        with pytest.raises(BackendError):
            parse_squeue_jobs(line)
