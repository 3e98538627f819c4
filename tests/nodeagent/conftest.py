"""Fixtures for the node agent's tests (`etcd` and `store` come from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.nodeagent.helpers import AgentProc


@pytest.fixture
def agent_factory(tmp_path: Path) -> Iterator[object]:
    """Start real `nodeagent` processes; each is stopped (SIGTERM, then SIGKILL) at teardown."""
    agents: list[AgentProc] = []

    def make(**kwargs: object) -> AgentProc:
        a = AgentProc(tmp_path / f"agent{len(agents)}", **kwargs)
        agents.append(a)
        return a

    yield make
    for a in agents:
        a.close()
