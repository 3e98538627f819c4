"""The layout and typing rules the codebase holds itself to (issue 14), checked rather than claimed."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
IGNORE = re.compile(r"#\s*type:\s*ignore(\[[^\]]*\])?(?P<rest>.*)$")
SUPERVISOR_MODULE_MAX_LINES = 600
SUPERVISOR_CLASS_MAX_LINES = 400


def _python_files(*roots: str) -> list[Path]:
    return sorted(p for root in roots for p in (REPO / root).rglob("*.py") if "_pb2" not in p.name)


def _mypy_roots() -> list[str]:
    return list(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]["files"])


def _ignores(path: Path) -> list[tuple[int, str]]:
    return [
        (n, m.group("rest").strip())
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if (m := IGNORE.search(line))
    ]


def test_every_type_ignore_in_the_checked_packages_says_why() -> None:
    bare = [
        f"{p.relative_to(REPO)}:{n}"
        for p in _python_files(*_mypy_roots())
        for n, rest in _ignores(p)
        if not rest.startswith("#")
    ]
    assert not bare, f"an ignore comment needs its reason beside it (`type: ignore[code]  # why`): {bare}"


def test_no_type_ignore_where_mypy_does_not_look() -> None:
    """tests/, bench/, examples/ and scripts/ are not type-checked: an ignore there hides nothing."""
    unchecked = [
        f"{p.relative_to(REPO)}:{n}"
        for p in _python_files("tests", "bench", "examples", "scripts")
        if ".peer-venv" not in p.parts
        for n, _ in _ignores(p)
    ]
    assert not unchecked, f"remove these (mypy does not check these folders): {unchecked}"


def test_controller_holds_only_package_folders() -> None:
    root = REPO / "controller"
    loose = sorted(
        p.name
        for p in root.iterdir()
        if p.name not in ("__init__.py", "__pycache__") and not (p.is_dir() and (p / "__init__.py").exists())
    )
    assert not loose, f"controller/ holds only package folders and __init__.py, found {loose}"


def test_supervisor_modules_and_classes_stay_small() -> None:
    too_big = []
    for path in _python_files("controller/supervisor"):
        text = path.read_text()
        if (lines := len(text.splitlines())) > SUPERVISOR_MODULE_MAX_LINES:
            too_big.append(f"{path.name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > SUPERVISOR_CLASS_MAX_LINES:
                    too_big.append(f"{path.name}: class {node.name} {length} lines")
    assert not too_big, f"split these (modules <= 600 lines, classes <= 400): {too_big}"
