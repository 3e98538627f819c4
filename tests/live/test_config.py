"""The controller's config file: validated once, unknown keys and sections refused with their name."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.live.config import load_controller_config
from runwarden.config import ConfigError

GOOD = """
[store]
endpoints = ["127.0.0.1:2379"]
[controller]
run = "llm"
nodes = 4
command = ["train.py"]
run_dir = "/tmp/rw"
[controller.env]
OMP_NUM_THREADS = "1"
[policy]
hang_timeout_floor_s = 20
burn_in_passes = 2
"""


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "controller.toml"
    p.write_text(text)
    return p


def test_a_good_file_loads_with_env_and_flag_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUNWARDEN_ETCD_ENDPOINTS", "10.0.0.1:2379,10.0.0.2:2379")
    cfg = load_controller_config(_write(tmp_path, GOOD), {"controller.api_address": "127.0.0.1:9999"})
    assert cfg.run.run == "llm" and cfg.run.nodes == 4 and cfg.run.command == ("train.py",)
    assert cfg.run.env == {"OMP_NUM_THREADS": "1"} and cfg.run.api_address == "127.0.0.1:9999"
    assert cfg.store.endpoints == ("10.0.0.1:2379", "10.0.0.2:2379")
    assert cfg.policy.hang_timeout_floor_s == 20.0 and cfg.policy.burn_in_passes == 2
    assert cfg.api_tls is None and cfg.agent_tls is None


@pytest.mark.parametrize(
    ("patch", "match"),
    [
        ("[nonsense]\na = 1\n", r"unknown section\(s\) nonsense"),
        ("[policy]\nhang_timeout = 3\n", r"\[policy\]: unknown key\(s\) hang_timeout"),
        ("[policy]\nburn_in_passes = 0\n", r"burn_in_passes"),
        ("[controller]\nnodes = 0\n", r"nodes"),
        ("[store]\nendpoints = ['nohost']\n", r"\[store\]"),
    ],
)
def test_bad_values_are_named(tmp_path: Path, patch: str, match: str) -> None:
    text = GOOD
    for section in ("[policy]", "[controller]", "[store]"):
        if patch.startswith(section):
            # replace that section's table with the patch's (TOML forbids a table twice)
            head, _, rest = text.partition(section)
            tail = rest.split("\n[", 1)
            keep = ("\n[" + tail[1]) if len(tail) > 1 else ""
            body = patch[len(section) :]
            if section == "[controller]":
                body = '\nrun = "llm"\ncommand = ["t"]\nrun_dir = "/tmp"\n' + body
            text = head + section + body + keep
            break
    else:
        text = GOOD + patch
    with pytest.raises(ConfigError, match=match):
        load_controller_config(_write(tmp_path, text))


def test_missing_required_keys_are_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="controller"):
        load_controller_config(_write(tmp_path, "[store]\nendpoints = ['127.0.0.1:2379']\n"))
