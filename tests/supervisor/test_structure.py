"""The supervisor core's structure: the state changes in one module, and its modules import as a DAG."""

from __future__ import annotations

import ast
from pathlib import Path

SUPERVISOR = Path(__file__).resolve().parents[2] / "controller" / "supervisor"
PACKAGE = "controller.supervisor"
TRANSITIONS = "transitions.py"
RUN = "run.py"  # sets the first state in Run.__init__


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text()) for p in sorted(SUPERVISOR.glob("*.py"))}


def _assigns_run_state(tree: ast.Module) -> list[int]:
    """Lines that assign `<x>.state` where x is the run (`sv`, `self`, `run`): a pool node's
    `node.state` is another thing."""
    lines = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                if (
                    isinstance(el, ast.Attribute)
                    and el.attr in ("state", "_state")
                    and isinstance(el.value, ast.Name)
                    and el.value.id in ("sv", "self", "run")
                ):
                    lines.append(node.lineno)
    return lines


def test_only_the_transitions_module_assigns_the_run_state() -> None:
    outside = {
        f"{name}.py:{line}"
        for name, tree in _modules().items()
        if f"{name}.py" != TRANSITIONS
        for line in _assigns_run_state(tree)
    }
    # Run.__init__ sets the first state, once
    first = [f for f in outside if f.startswith(f"{RUN}:")]
    assert len(first) <= 1, first
    assert not outside - set(first), (
        f"the state changes only in {TRANSITIONS}: {sorted(outside - set(first))}"
    )
    assert _assigns_run_state(_modules()["transitions"]), "transitions.py no longer assigns the state?"


def _imports(name: str, tree: ast.Module, modules: set[str]) -> set[str]:
    out = set()
    for node in ast.walk(tree):  # every import, those under TYPE_CHECKING and in functions too
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                parts = [mod] if mod else [a.name for a in node.names]
            elif mod == PACKAGE:
                parts = [a.name for a in node.names]
            elif mod.startswith(PACKAGE + "."):
                parts = [mod.split(".")[2]]
            else:
                continue
            out.update(p for p in parts if p in modules)
        elif isinstance(node, ast.Import):
            out.update(
                a.name.split(".")[2]
                for a in node.names
                if a.name.startswith(PACKAGE + ".") and a.name.split(".")[2] in modules
            )
    out.discard(name)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return [*path[path.index(w) :], w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_the_supervisor_modules_import_as_a_dag() -> None:
    mods = _modules()
    graph = {name: _imports(name, tree, set(mods)) for name, tree in mods.items()}
    assert graph["table"] and graph["machine"], "the import graph was not read"
    cycle = _cycle(graph)
    assert cycle is None, "import cycle among controller/supervisor modules: " + " -> ".join(cycle or [])


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


# The table chooses the move by state; a rule module reads the run's state only where the check is
# about something a handler just caused, or is a query, never as a second dispatch. Each one here
# says why; a new check fails until it is moved into the table or listed with its reason.
NOT_RULES = {
    "machine": "the machine: it dispatches by state, and its status is a query",
    "run": "the run's data and its queries (in_attempt, holds)",
    "transitions": "the one module that moves the state",
}
STATE_CHECKS_ALLOWED: dict[tuple[str, str], str] = {
    ("control_plane", "resolve"): "the pause's end just chose a state: a held stop follows it",
    ("control_plane", "on_store_listed"): "a replayed NodeLost may have just paused the run (a mass expiry)",
    ("control_plane", "_follow_up"): "the state the listing just led to takes the stored stop, if live",
    ("stops", "deliver_pending_stop"): "called right after a move: only an attempt that now runs takes it",
    (
        "burn_in",
        "record",
    ): "reached from many columns and soak's callback: a release may fill a preflight slot",
    ("running", "on_progress"): "the step rules may have just ended the attempt (a straggler killed)",
    # prepare.py is being reworked elsewhere (issue 27): moving this guard waits for that
    (
        "prepare",
        "maybe_launch",
    ): "a guard reached through fill_slots from several rules: launch only while preparing",
}


def _reads_run_state(expr: ast.expr) -> bool:
    return (
        isinstance(expr, ast.Attribute)
        and expr.attr in ("state", "_state")
        and isinstance(expr.value, ast.Name)
        and expr.value.id in ("sv", "self", "run")
    )


def _state_checks(tree: ast.Module) -> dict[str, list[int]]:
    """Comparisons of the run's state (`sv.state is X`, `in`, `==`...), by enclosing function."""
    found: dict[str, list[int]] = {}

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            func = node.name
        if isinstance(node, ast.Compare) and any(_reads_run_state(e) for e in [node.left, *node.comparators]):
            found.setdefault(func, []).append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, "<module>")
    return found


def test_the_run_state_is_checked_only_where_a_reason_is_written() -> None:
    checks = {
        (name, func): lines
        for name, tree in _modules().items()
        if name not in NOT_RULES
        for func, lines in _state_checks(tree).items()
    }
    unexplained = sorted(
        f"{name}.py:{lines[0]} in {func}"
        for (name, func), lines in checks.items()
        if (name, func) not in STATE_CHECKS_ALLOWED
    )
    assert not unexplained, (
        "a state check inside a handler is a second dispatch beside the table: name a per-state handler "
        f"in table.py, or list it in STATE_CHECKS_ALLOWED with why: {unexplained}"
    )
    stale = sorted(f"{n}.{f}" for n, f in STATE_CHECKS_ALLOWED if (n, f) not in checks)
    assert not stale, f"allowed state checks that no longer exist: {stale}"


def test_the_state_check_scan_finds_a_check() -> None:
    tree = ast.parse("def h(sv):\n    if sv.state is RunState.RUNNING:\n        pass\n    node.state is X\n")
    assert _state_checks(tree) == {"h": [2]}
