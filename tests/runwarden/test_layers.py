"""The import layers, declared as data and checked against every import of every package module.

`LAYERS` lists the units (packages, or sub-packages of controller/) in tiers from the top. A module
may import modules of its own unit and of any unit in a lower tier; never a unit of a higher tier
(a back-arrow) nor one of its own tier (units of a tier are independent: controllerctl never
imports the live controller). `NEVER` adds the pairs the tiers alone would allow. Every import
counts: module-level, function-level, under `if TYPE_CHECKING:`, relative, and
`importlib.import_module("literal")`. Separately, no two modules may import each other, directly or
through others (a cycle between modules, not only between packages).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("controller", "lightfleet", "nodeagent", "preflight", "runwarden", "testbed")

# From the top. A unit may import itself and any unit of a lower tier, never one of its own tier.
LAYERS: tuple[tuple[str, ...], ...] = (
    # the test clusters harness (starts every process, may import anything) and the light agents'
    # load generator (a fleet of simulated nodes: the real agent's request rules, no torch)
    ("testbed", "lightfleet"),
    # the processes: controllerctl, the controller daemon, the node agent (its daemon, the parked
    # warm ranks and the training script's side; nodeagent's inner order is not declared here)
    ("controller.ctl", "controller.live", "nodeagent"),
    # the daemon's gRPC service and scheduler backends (with the agents' clients); controllerctl's simulator
    ("controller.api", "controller.backends", "controller.sim"),
    # the sans-IO supervisor core, goodput accounting, the claims the runs of one fleet share
    ("controller.supervisor", "controller.goodput", "controller.fleet"),
    ("preflight",),  # the node checks, run by the agent
    ("runwarden",),  # the shared core: protos, store, keys, event log, config; imports none of the above
)

# (importer, imported, why): pairs the tiers alone would allow.
NEVER: tuple[tuple[str, str, str], ...] = (
    (
        "nodeagent",
        "controller",
        "the node side and the controller meet only through runwarden (protos, store keys)",
    ),
    (
        "lightfleet",
        "controller",
        "a light agent is a node: it meets the controller only through runwarden, as the real agent does",
    ),
    (
        "controller",
        "preflight",
        "preflight runs on the node; the controller sees its results through the agent",
    ),
)

# Package __init__ modules that only hold sub-packages: no unit, and they import nothing.
CONTAINERS = frozenset({"controller"})


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int


def module_names(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of `packages` under `root` by dotted name (a package by its own name)."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(name: str, modules: Mapping[str, object]) -> str | None:
    """The module a dotted name lands in: itself, or the longest module prefix (`pkg.mod.Class`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _is_import_module(call: ast.Call) -> bool:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name == "import_module" and bool(call.args)


def imports_of(
    module: str, source: str, modules: Mapping[str, object], *, is_package: bool = False
) -> list[Import]:
    """The modules of `modules` that `module`'s source imports, wherever the import statement is.

    `from pkg import sub` imports the module pkg.sub when there is one, else (a name defined in
    pkg's __init__) pkg itself; `import a.b.c` imports a.b.c. The parent packages every import runs
    first are not counted: they would put every package __init__ that imports its children in a cycle.
    """
    found: list[Import] = []

    def add(name: str, line: int) -> None:
        target = _resolve(name, modules)
        if target is not None and target != module:
            found.append(Import(module, target, line))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source_module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source_module = node.module or ""
            for alias in node.names:
                submodule = f"{source_module}.{alias.name}"
                add(submodule if submodule in modules else source_module, node.lineno)
        elif isinstance(node, ast.Call) and _is_import_module(node):
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                add(first.value, node.lineno)
    return found


def unit_of(module: str) -> str | None:
    units = [u for tier in LAYERS for u in tier if module == u or module.startswith(u + ".")]
    return max(units, key=len) if units else None


def _tier_of(unit: str) -> int:
    return next(i for i, tier in enumerate(LAYERS) if unit in tier)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(imports: Iterable[Import], paths: Mapping[str, Path] | None = None) -> list[str]:
    """Each import against the layer order, said as `file:line: a imports b (why not)`."""
    bad: list[str] = []
    for imp in imports:
        where = (
            f"{paths[imp.importer].relative_to(REPO)}:{imp.line}" if paths else f"{imp.importer}:{imp.line}"
        )
        said = f"{where}: {imp.importer} imports {imp.imported}"
        src, dst = unit_of(imp.importer), unit_of(imp.imported)
        if imp.importer in CONTAINERS:
            bad.append(f"{said} (a container package imports nothing)")
            continue
        if src is None or dst is None:
            bad.append(f"{said} (a module outside every declared unit: add its package to LAYERS)")
            continue
        for importer, imported, why in NEVER:
            if _under(imp.importer, importer) and _under(imp.imported, imported):
                bad.append(f"{said} ({why})")
        if src == dst:
            continue
        if _tier_of(src) > _tier_of(dst):
            bad.append(f"{said} (a back-arrow: {src} is below {dst})")
        elif _tier_of(src) == _tier_of(dst):
            bad.append(f"{said} ({src} and {dst} are in one tier: they never import each other)")
    return bad


def cycles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(edges.get(start, ())))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, todo = work[-1]
            if todo:
                nxt = todo.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(edges.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


MODULES = module_names(REPO, PACKAGES)


def _all_imports() -> list[Import]:
    return [
        imp
        for name, path in MODULES.items()
        for imp in imports_of(
            name, path.read_text(encoding="utf-8"), MODULES, is_package=path.name == "__init__.py"
        )
    ]


IMPORTS = _all_imports()


def test_every_import_follows_the_layer_order() -> None:
    bad = violations(IMPORTS, MODULES)
    assert not bad, "imports against the layer order (tests/runwarden/test_layers.py):\n" + "\n".join(bad)


def test_no_import_cycle_between_modules() -> None:
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for imp in IMPORTS:
        edges[imp.importer].add(imp.imported)
    assert not cycles(edges), f"modules that import each other, directly or through others: {cycles(edges)}"


def test_every_module_has_a_unit_and_every_unit_has_modules() -> None:
    homeless = sorted(m for m in MODULES if unit_of(m) is None and m not in CONTAINERS)
    assert not homeless, f"declare these modules' packages in LAYERS: {homeless}"
    empty = sorted(u for tier in LAYERS for u in tier if u not in MODULES)
    assert not empty, f"LAYERS names units with no module (renamed or removed?): {empty}"
    units = [u for tier in LAYERS for u in tier]
    assert len(units) == len(set(units)), "a unit is declared twice"


def test_the_graph_is_the_real_one() -> None:
    """The walk found the imports everyone knows are there (an empty graph passes every rule)."""
    pairs = {(unit_of(i.importer), unit_of(i.imported)) for i in IMPORTS}
    assert {
        ("controller.live", "controller.supervisor"),
        ("controller.live", "controller.backends"),
        ("controller.live", "controller.fleet"),
        ("controller.api", "controller.fleet"),
        ("nodeagent", "preflight"),
        ("testbed", "nodeagent"),
    } <= pairs


FAKE_MODULES = dict.fromkeys(["a", "a.b", "a.b.c", "a.d", "e"], Path())


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import a.b", "a.b"),
        ("import a.b.c as x", "a.b.c"),
        ("from a import b", "a.b"),
        ("from a import name_in_init", "a"),
        ("from a.b.c import Thing", "a.b.c"),
        ("from a.b.c.Thing import attr", "a.b.c"),
        ("def f():\n    from a.b import c\n", "a.b.c"),
        ("class K:\n    def m(self):\n        import a.d\n", "a.d"),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a.d import T\n", "a.d"),
        ("try:\n    import a.d\nexcept ImportError:\n    pass\n", "a.d"),
        ("import importlib\nimportlib.import_module('a.b.c')", "a.b.c"),
        ("from importlib import import_module\nimport_module('a.d')", "a.d"),
        ("from . import d", "a.d"),  # in module e.x below: a sibling
        ("from .d import T", "a.d"),
        ("from .. import a", "a"),
    ],
)
def test_the_walker_sees_every_spelling(source: str, expected: str) -> None:
    module, is_package = ("a.b", True) if source.startswith("from ..") else ("a.x", False)
    found = {i.imported for i in imports_of(module, source, FAKE_MODULES, is_package=is_package)}
    assert expected in found, (source, found)


def test_the_walker_ignores_what_is_not_an_import_of_a_package_module() -> None:
    for source in ("import os", "from ae import b", "import_module(name)", "x = 'a.b'"):
        assert not imports_of("a.x", source, FAKE_MODULES), source


@pytest.mark.parametrize(
    ("importer", "imported", "complaint"),
    [
        ("runwarden.eventlog", "controller.live.loop", "back-arrow"),
        ("controller.supervisor.machine", "controller.live.loop", "back-arrow"),
        ("controller.backends.local", "controller.live.loop", "back-arrow"),
        ("controller.api.store_view", "controller.live.loop", "back-arrow"),
        ("runwarden.store", "testbed.fleet", "back-arrow"),
        ("preflight.checks", "nodeagent.daemon.agent", "back-arrow"),
        ("controller.ctl.main", "controller.live.loop", "one tier"),
        ("controller.supervisor.machine", "controller.goodput.report", "one tier"),
        ("nodeagent.daemon.agent", "controller.supervisor.machine", "runwarden"),
        ("controller.live.main", "preflight.checks", "on the node"),
        ("controller", "runwarden", "container"),
        ("scripts.gen_proto", "runwarden", "outside every declared unit"),
    ],
)
def test_the_rules_refuse_a_wrong_arrow(importer: str, imported: str, complaint: str) -> None:
    (said,) = violations([Import(importer, imported, 1)])
    assert complaint in said


def test_the_rules_allow_a_downward_arrow() -> None:
    for importer, imported in [
        ("testbed.fleet", "nodeagent.daemon.agent"),
        ("controller.live.loop", "controller.api.service"),
        ("controller.live.executor", "controller.fleet.claims"),
        ("controller.ctl.main", "controller.sim.engine"),
        ("controller.supervisor.machine", "controller.supervisor.table"),
        ("nodeagent.daemon.agent", "preflight.checks"),
    ]:
        assert not violations([Import(importer, imported, 1)]), (importer, imported)


def test_cycles_are_found_between_modules() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert sorted(cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}})) == [["a", "b"], ["c", "d"]]
