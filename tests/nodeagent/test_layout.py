"""nodeagent's folders are its processes, and the imports between them say so.

nodeagent/daemon/ runs in the agent, nodeagent/trainer/ in the training script's ranks, nodeagent/warm/
in both: its leader and rank programs are the parked processes, the rest is the agent's owner of
them and the wire between the two. nodeagent/wire.py is the one module the agent and the ranks share.
The agent never imports torch or the trainer's modules; the ranks never import the agent.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import nodeagent

ROOT = Path(nodeagent.__file__).parent
# The warm modules that run in the parked processes (python -m), not in the agent.
PARKED_PROCESSES = {"nodeagent.warm.leader", "nodeagent.warm.rank"}
WIRE = {"nodeagent.wire", "nodeagent.warm.protocol"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, at module level?) for every import in the file, lazy ones included."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(name, id(node) in top) for name in names]
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _side(module: str) -> str:
    if module in WIRE:
        return "wire"
    if _within(module, "nodeagent.trainer") or module in PARKED_PROCESSES:
        return "ranks"
    if _within(module, "nodeagent.daemon") or _within(module, "nodeagent.warm"):
        return "agent"
    return "package"


def _violations() -> list[str]:
    bad = []
    modules = _modules()
    for module, path in modules.items():
        side = _side(module)
        for name, top_level in _imports(path):
            if not _within(name, "nodeagent") or (
                _within(module, "nodeagent.trainer") and _within(name, "nodeagent.trainer")
            ):
                if side in ("agent", "wire") and top_level and _within(name, "torch"):
                    bad.append(f"{module} imports {name} at module level (the agent never loads torch)")
                continue
            # `from nodeagent.warm.protocol import END` names the module, then a name in it
            target = _side(max((m for m in modules if _within(name, m)), key=len))
            if side == "wire" and target != "wire":
                bad.append(f"{module} (shared by both processes) imports {name}")
            elif side == "ranks" and target == "agent":
                bad.append(f"{module} (runs in a rank) imports the agent's {name}")
            elif side == "agent" and target == "ranks":
                bad.append(f"{module} (runs in the agent) imports the ranks' {name}")
    return bad


def test_each_folder_imports_only_its_own_process_and_the_wire() -> None:
    assert _violations() == []


def test_the_rules_see_a_crossing() -> None:
    assert _side("nodeagent.trainer.dcp") == "ranks"
    assert _side("nodeagent.warm.rank") == "ranks"
    assert _side("nodeagent.daemon.agent") == "agent"
    assert _side("nodeagent.warm.protocol") == "wire"
    assert any(m.startswith("nodeagent.warm.") and _side(m) == "agent" for m in _modules())  # the owner
    assert len(_modules()) > 30  # the walk found the package


def test_the_agents_modules_load_neither_torch_nor_the_trainer() -> None:
    agent_side = sorted(m for m in _modules() if _side(m) in ("agent", "wire"))
    code = (
        "import importlib, sys\n"
        f"for m in {agent_side!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('nodeagent.trainer')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
