"""The README's "Running on a real cluster" configs load with the real loaders (docs that cannot drift)."""

from __future__ import annotations

import re
from pathlib import Path

from controller.live.config import load_controller_config
from nodeagent.config import from_sources

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Running on a real cluster") :]
    section = section[: section.index("\n## ", 3)]
    return re.findall(r"```toml\n(.*?)```", section, re.S)


def test_the_readme_agent_and_controller_configs_load(tmp_path: Path) -> None:
    agent, controller = _blocks()
    (tmp_path / "nodeagent.toml").write_text(agent)
    (tmp_path / "controller.toml").write_text(controller)
    a = from_sources(file=tmp_path / "nodeagent.toml", environ={})
    assert a.collective_ifname == "ib0" and a.rdzv_port == 29400 and a.local_ranks == 8
    c = load_controller_config(tmp_path / "controller.toml")
    assert c.run.run == "llama" and c.policy.bandwidth_gate
