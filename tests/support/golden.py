"""Golden scripts in etcd raft's datadriven style, shared by the supervisor's scenarios and the warm
group's scripts: blocks separated by a blank line, each a command (comments above it kept), `----`,
and the output the runner gave. A test runs the file and compares; an env var rewrites it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def run_script(text: str, run: Callable[[str], list[str]]) -> str:
    """The script's text with every block's output replaced by what `run(command)` gives now."""
    out: list[str] = []
    for block in text.split("\n\n"):
        lines = block.strip("\n").splitlines()
        commands = [ln for ln in lines if not ln.startswith("#")]
        if not commands:
            continue
        out += [*[ln for ln in lines if ln.startswith("#")], commands[0], "----", *run(commands[0]), ""]
    return "\n".join(out)


def check_golden(path: Path, run: Callable[[str], list[str]], rewrite_env: str) -> None:
    """Fail when `path` differs from what its commands give now; rewrite it when `rewrite_env` is set."""
    text = path.read_text()
    got = run_script(text, run)
    if os.environ.get(rewrite_env):
        path.write_text(got)
        return
    assert got == text, f"{path.name} differs from its golden output ({rewrite_env}=1 to regenerate)"
