"""runwarden.store's modules depend on each other one way: no import cycle, not even a typing-only one."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import runwarden.store

PACKAGE = "runwarden.store"
PACKAGE_DIR = Path(runwarden.store.__file__).parent
# Each module may import only modules to its left.
ORDER = ["types", "config", "lease", "watch", "election", "client"]


def _imports_within_package(module: str) -> set[str]:
    """Every module of the package that ``module`` imports, anywhere (TYPE_CHECKING blocks included)."""
    tree = ast.parse((PACKAGE_DIR / f"{module}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}: use absolute imports"
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith(PACKAGE + "."):
                found.add(name[len(PACKAGE) + 1 :].split(".")[0])
            elif name == PACKAGE:
                found.add("__init__")
    return found & (set(ORDER) | {"__init__"})


def test_every_module_is_listed() -> None:
    on_disk = {p.stem for p in PACKAGE_DIR.glob("*.py")} - {"__init__"}
    assert on_disk == set(ORDER)


def test_imports_flow_one_way() -> None:
    for position, module in enumerate(ORDER):
        imported = _imports_within_package(module)
        assert "__init__" not in imported, f"{module} imports the package itself"
        later = imported - set(ORDER[:position])
        assert not later, f"{module} imports {sorted(later)}, which come after it in {ORDER}"


def test_graph_is_acyclic() -> None:
    graph = {module: _imports_within_package(module) for module in ORDER}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join((*path, module))}"
        if module in done:
            return
        for dependency in graph[module]:
            visit(dependency, (*path, module))
        done.add(module)

    for module in ORDER:
        visit(module, ())


def test_each_module_imports_alone_in_dependency_order() -> None:
    """A fresh interpreter imports each module with only its predecessors loaded, and nothing later."""
    script = f"""
import sys
order = {ORDER!r}
for position, module in enumerate(order):
    __import__("{PACKAGE}." + module)
    loaded = {{m.rsplit(".", 1)[-1] for m in sys.modules if m.startswith("{PACKAGE}.")}}
    later = loaded - set(order[: position + 1])
    assert not later, f"importing {{module}} loaded {{sorted(later)}}"
"""
    # Importing a submodule runs the package's __init__ first; stub it so only the submodules load.
    stub = f"""
import sys, types
package = types.ModuleType("{PACKAGE}")
package.__path__ = [{str(PACKAGE_DIR)!r}]
sys.modules["{PACKAGE}"] = package
"""
    subprocess.run([sys.executable, "-c", stub + script], check=True, timeout=60)


def test_package_re_exports_the_public_names() -> None:
    from runwarden.store import client, config, election, lease, types, watch

    assert runwarden.store.Store is client.Store
    assert runwarden.store.StoreConfig is config.StoreConfig
    assert runwarden.store.Leadership is election.Leadership
    assert runwarden.store.LeaseKeeper is lease.LeaseKeeper
    assert runwarden.store.Watch is watch.Watch
    assert runwarden.store.StoreError is types.StoreError
    for name in runwarden.store.__all__:
        assert hasattr(runwarden.store, name), name
