"""The README's "Running on a real cluster" configs load with the real loaders (docs that cannot drift)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from controller.live.config import load_controller_config
from nodeagent.daemon.config import from_sources
from testbed.fleet_cluster import write_toml

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Running on a real cluster") :]
    section = section[: section.index("\n## ", 3)]
    return re.findall(r"```toml\n(.*?)```", section, re.S)


def test_the_readme_agent_and_controller_configs_load(tmp_path: Path) -> None:
    agent, controller, *_ = _blocks()
    (tmp_path / "nodeagent.toml").write_text(agent)
    (tmp_path / "controller.toml").write_text(controller)
    a = from_sources(file=tmp_path / "nodeagent.toml", environ={})
    assert a.collective_ifname == "ib0" and a.rdzv_port == 29400 and a.local_ranks == 8
    c = load_controller_config(tmp_path / "controller.toml")
    assert c.run.run == "llama" and c.policy.bandwidth_gate


def test_every_later_readme_snippet_loads_on_top_of_the_controller_config(tmp_path: Path) -> None:
    """The section's later TOML blocks (e.g. the unmodified-script mode) are fragments of the
    controller's config: each, merged into the README's controller config, still loads."""
    _, controller, *fragments = _blocks()
    assert fragments, "the section shows the unmodified-script snippet"
    for i, fragment in enumerate(fragments):
        merged = tomllib.loads(controller)
        for table, keys in tomllib.loads(fragment).items():
            merged.setdefault(table, {}).update(keys)
        path = tmp_path / f"controller-{i}.toml"
        write_toml(path, merged)
        load_controller_config(path)
