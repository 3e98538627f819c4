"""Fixtures for the node agent's tests (`etcd` and `store` come from tests/conftest.py)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.nodeagent.helpers import AgentProc


@pytest.fixture
def agent_factory(tmp_path: Path, etcd_factory: object) -> Iterator[object]:
    """Start real `nodeagent` processes; each is stopped (SIGINT: workers stopped now; then SIGKILL) at teardown.

    It asks for `etcd_factory` only for the order: set up after it, it is torn down before it, so the
    agents stop before the test's etcd (an agent stopping against a dead etcd waits out its revoke and
    watch timeouts)."""
    agents: list[AgentProc] = []

    def make(**kwargs: object) -> AgentProc:
        a = AgentProc(tmp_path / f"agent{len(agents)}", **kwargs)
        agents.append(a)
        return a

    yield make
    for a in agents:
        a.close()


@pytest.fixture(autouse=True)
def _sigterm_handler_restored() -> Iterator[None]:
    """A ProgressReporter made in the test's (main) thread installs its SIGTERM handler: the
    pytest process gets its own back after every test."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)
