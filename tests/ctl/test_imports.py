"""Import contract of `controllerctl`: it never imports the live controller, and `status` stays light.

controllerctl is the operator's tool; it talks to the controller through the gRPC API only, so no
module of controller/ctl may import controller.live (the daemon). The optional subcommands
(attribute, certs, chaos, simulate) are imported only when named on the command line (main.py's
docstring): `controllerctl status` must not pay for them.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import controller.ctl
from controller.ctl.main import OPTIONAL_SUBCOMMANDS

CTL_DIR = Path(controller.ctl.__file__).parent
FORBIDDEN = "controller.live"


def _imported_names(tree: ast.AST) -> list[str]:
    """Every module an import statement names, with `from X import Y` also giving X.Y (`from controller import live`)."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _forbidden(name: str) -> bool:
    return name == FORBIDDEN or name.startswith(FORBIDDEN + ".")


CTL_MODULES = sorted(CTL_DIR.glob("*.py"))


@pytest.mark.parametrize("path", CTL_MODULES, ids=[p.stem for p in CTL_MODULES])
def test_no_ctl_module_imports_the_live_controller(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    bad = [n for n in _imported_names(tree) if _forbidden(n)]
    assert not bad, f"{path.name} imports {bad}: controllerctl must reach the controller through the API only"


def test_the_walker_sees_every_spelling() -> None:
    for source in (
        "import controller.live",
        "import controller.live.loop as x",
        "from controller import live",
        "from controller.live.view import LiveView",
        "def f():\n    from controller import live\n",
    ):
        assert any(_forbidden(n) for n in _imported_names(ast.parse(source))), source
    assert not any(_forbidden(n) for n in _imported_names(ast.parse("from controller import livestock")))


def test_the_ctl_package_has_modules_to_check() -> None:
    assert {"main", "status", "events", "goodput"} <= {p.stem for p in CTL_MODULES}


_STATUS_PROBE = """
import json, sys
from controller.ctl.main import main
code = main(["--controller", "127.0.0.1:1", "--timeout", "0.5", "status"])
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def test_status_imports_no_optional_subcommand() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _STATUS_PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=CTL_DIR.parent.parent,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["code"] == 3  # nobody listens on port 1: unreachable, after parsing and connecting
    loaded = set(result["modules"])
    optional = {module for module, _help in OPTIONAL_SUBCOMMANDS.values()}
    assert not optional & loaded, f"status imported optional subcommands: {sorted(optional & loaded)}"
    assert not any(_forbidden(m) for m in loaded)
    # what the optional modules would have pulled in: the simulator and the supervisor core
    assert not any(m.startswith(("controller.sim", "controller.supervisor")) for m in loaded)
